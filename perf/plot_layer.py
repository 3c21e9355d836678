"""Layer step time vs tokens per mode, log-log, from perf/results/layer.json (perf/bench_layer.py).

    python perf/plot_layer.py [--results perf/results/layer.json] [--out perf/results/layer_ms_vs_tokens.png]

One panel per model, one line per mode (plain TP, plain SP, fused base, fused shift, fused policy,
and the CUDA-graph decode runs where measured); every record of one bench run carries all modes'
times (all_modes_ms). Needs matplotlib (`pip install matplotlib`).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _plot


def load(path: Path) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """model -> mode -> sorted [(tokens, ms)] (the model is the first word of a record's case)."""
    series: dict[str, dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for r in json.loads(path.read_text()):
        model = r["case"].split()[0]
        for mode, ms in r.get("all_modes_ms", {}).items():
            series[model][mode][int(r["tokens"])] = float(ms)
    return {model: {m: sorted(v.items()) for m, v in modes.items()} for model, modes in series.items()}


def main() -> int:
    args, plt = _plot.args_and_pyplot(__doc__, "perf/results/layer.json", "perf/results/layer_ms_vs_tokens.png",
                                      "plot_layer")
    if plt is None:
        return 1
    models = load(Path(args.results))
    if not models:
        print(f"plot_layer: no layer records in {args.results}", file=sys.stderr)
        return 1
    fig, axes = plt.subplots(1, len(models), figsize=(7.5 * len(models), 5), squeeze=False)
    for ax, (model, series) in zip(axes[0], sorted(models.items()), strict=True):
        for mode, pts in series.items():
            xs, ys = zip(*pts, strict=True)
            style = "--" if ("graph" in mode or "replay" in mode) else "-"
            ax.plot(xs, ys, style, marker="o", ms=3, label=mode)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per step (decode: sequences; prefill: one sequence)")
        ax.set_ylabel("ms per layer step (max over ranks)")
        ax.set_title(f"one {model} decoder layer, 4x H200, bf16 (perf/bench_layer.py)")
        ax.grid(True, which="both", lw=0.3)
        ax.legend(fontsize=7)
    return _plot.save(fig, args.out)


if __name__ == "__main__":
    sys.exit(main())
