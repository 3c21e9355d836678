"""Plot fused-vs-baseline speedup against tokens from the benchmark records in perf/results/.

    python perf/plot_results.py [--results perf/results] [--out perf/results/speedup_vs_tokens.png]

One panel per benchmark (gemm, qkv_all_to_all, all_to_all_o_proj, gemm_all_reduce,
one_shot_all_reduce, attention), one line per case; the dashed line is 1.0 (the plain path).
Needs matplotlib (not a fusedpar dependency: `pip install matplotlib`).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _plot

PANELS = ("gemm", "qkv_all_to_all", "all_to_all_o_proj", "gemm_all_reduce", "one_shot_all_reduce", "attention")


def load(results: Path) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """bench -> case -> sorted [(tokens, speedup)], sweep records left out."""
    series: dict[str, dict[str, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(results.glob("*.json")):
        records = json.loads(path.read_text())
        if not isinstance(records, list):
            continue  # e.g. gemm_tune.json, a sweep table
        for r in records:
            if r.get("sweep") or "speedup" not in r:
                continue
            bench = "attention" if r["bench"].startswith("attention") else r["bench"]
            case = r.get("case", "")
            if bench == "attention":
                kind = r["bench"].removeprefix("attention_")
                # prefill: one sequence or four of equal length; decode: batch size = tokens
                if kind == "decode":  # eager and CUDA-graph timings are separate lines
                    case = "decode graph" if r.get("timing") == "cuda graph" else "decode eager"
                else:
                    case = f"prefill {case.split()[-1].split('x')[0]} seq"
            elif bench == "gemm_all_reduce":
                case = f"{case.split()[0]} {r.get('mode', case.split()[-1])}"
            elif bench == "one_shot_all_reduce":
                case = case.split()[-1]  # eager / graph
            series[bench][case].append((float(r["tokens"]), float(r["speedup"])))
    return {b: {c: sorted(v) for c, v in cases.items()} for b, cases in series.items()}


def main() -> int:
    args, plt = _plot.args_and_pyplot(__doc__, "perf/results", "perf/results/speedup_vs_tokens.png", "plot_results")
    if plt is None:
        return 1
    series = load(Path(args.results))
    panels = [b for b in PANELS if b in series]
    if not panels:
        print(f"plot_results: no benchmark records in {args.results}", file=sys.stderr)
        return 1
    cols = 3
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    for ax, bench in zip(axes.flat, panels, strict=False):
        for case, pts in series[bench].items():
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o", ms=3, label=case)
        ax.axhline(1.0, color="k", ls="--", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(bench)
        ax.set_xlabel("tokens (rows per rank)" if bench != "one_shot_all_reduce" else "tokens (bytes / 16 KiB)")
        ax.set_ylabel("speedup vs plain")
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle("fusedpar fused kernels vs plain baselines, 4x H200, bf16 (perf/results/*.json)")
    return _plot.save(fig, args.out)


if __name__ == "__main__":
    sys.exit(main())
