"""The plots of perf/report.py, drawn from the benchmark records (matplotlib, Agg backend).

    speedup_vs_tokens.png   fused-vs-baseline speedup against tokens, one panel per op benchmark
    layer_ms_vs_tokens.png  decoder-layer ms against tokens per mode (steady state and eager step)
    model_bars.png          TTFT, TPOT and throughput of the model benchmark per mode

matplotlib is not a fusedpar dependency: `draw` returns None where it is missing. PNGs are written
without a timestamp or software tag, so the same records and matplotlib give the same bytes.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

SPEEDUP_PANELS = ("gemm", "gemm_fp8", "qkv_all_to_all", "all_to_all_o_proj", "gemm_all_reduce", "one_shot_all_reduce",
                  "attention")
LAYER_MODES = ("plain TP", "plain SP", "fused base", "fused shift", "fused policy")
MODEL_MODES = ("plain TP", "plain SP", "fusedpar")
MODEL_PANELS = (("model_ttft", "TTFT (ms), lower is better", "fused_ms"),
                ("model_tpot", "TPOT at batch 1 (ms), lower is better", "fused_ms"),
                ("model_throughput", "combined throughput (tokens/s), higher is better", "tokens_per_s"))
FILES = ("speedup_vs_tokens.png", "layer_ms_vs_tokens.png", "model_bars.png")


def speedup_series(records: dict[str, list[dict]]) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """bench -> case -> sorted [(tokens, speedup)] from the op benchmarks' records, sweeps left out."""
    series: dict = defaultdict(lambda: defaultdict(list))
    for stem in SPEEDUP_PANELS:
        for r in records.get(stem, []):
            if r.get("sweep") or "error" in r:
                continue
            case = r.get("case", "")
            if stem == "attention":
                kind = r["bench"].removeprefix("attention_")
                if kind == "decode":  # eager and CUDA-graph timings are separate lines
                    case = "decode graph" if r.get("timing") == "cuda graph" else "decode eager"
                else:  # prefill: one sequence or four of equal length, eager or CUDA graph
                    graph = " graph" if r.get("timing") == "cuda graph" else ""
                    case = f"prefill {case.split()[1].split('x')[0]} seq{graph}"
            elif stem == "one_shot_all_reduce":
                case = case.split()[-1]  # eager / graph
            series[stem][case].append((float(r["tokens"]), float(r["speedup"])))
    return {b: {c: sorted(v) for c, v in sorted(cases.items())} for b, cases in series.items()}


def _layer_steady_ms(mode: str, tokens: int, r: dict[str, float], policy_mode: str | None) -> float | None:
    """One mode's steady-state ms at one size from a record's all_modes_ms (None: not measured)."""
    if mode == "fused policy":
        return _layer_steady_ms(f"fused {policy_mode}", tokens, r, None) if policy_mode else None
    if tokens > 64:  # shift-mode prefill sizes (<= the threshold) also ran as PrefillGraphs replays
        return r.get(f"{mode} replay pipelined", r.get(f"{mode} layer pipelined"))
    times = [v for k, v in r.items() if k.startswith(f"{mode} replay pipelined")]
    return min(times) if times else None


def layer_series(records: list[dict]) -> dict[str, dict[str, dict[str, dict[int, float]]]]:
    """model -> {"steady": mode -> {tokens: ms}, "eager": mode -> {tokens: ms}} from layer.json."""
    out: dict = defaultdict(lambda: {"steady": defaultdict(dict), "eager": defaultdict(dict)})
    policy_mode: dict[tuple[str, int], str] = {}
    for rec in records:  # the steady-state policy records name the mode: "... pipelined (base)"
        if rec["bench"] == "layer_shift_policy" and rec["case"].endswith(")"):
            policy_mode[(rec["case"].split()[0], int(rec["tokens"]))] = rec["case"].rsplit("(", 1)[1].rstrip(")")
    for rec in records:
        model, n, r = rec["case"].split()[0], int(rec["tokens"]), rec.get("all_modes_ms", {})
        for mode in LAYER_MODES:
            ms = _layer_steady_ms(mode, n, r, policy_mode.get((model, n)))
            if ms is not None:
                out[model]["steady"][mode][n] = float(ms)
            if mode in r:
                out[model]["eager"][mode][n] = float(r[mode])
    return out


def _gpu_label(recs: list[dict]) -> str:
    worlds = sorted({r["world"] for r in recs})
    gpus = sorted({r["gpu"] for r in recs})
    return f"{'/'.join(map(str, worlds))}x {', '.join(gpus)}"


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _save(plt, fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def _draw_speedup(plt, records, path: Path) -> bool:
    series = speedup_series(records)
    panels = [b for b in SPEEDUP_PANELS if b in series]
    if not panels:
        return False
    cols = 3
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    for ax, bench in zip(axes.flat, panels, strict=False):
        for case, pts in series[bench].items():
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o", ms=3, label=case)
        ax.axhline(1.0, color="k", ls="--", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{bench} ({_gpu_label(records[bench])})", fontsize=9)
        ax.set_xlabel("tokens (rows per rank)" if bench != "one_shot_all_reduce" else "tokens (bytes / 16 KiB)")
        ax.set_ylabel("speedup vs baseline")
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fp8 = " (gemm_fp8: e4m3)" if "gemm_fp8" in panels else ""
    fig.suptitle(f"fusedpar fused kernels vs plain baselines, bf16{fp8} (perf/results/*.json)")
    _save(plt, fig, path)
    return True


def _draw_layer(plt, records: list[dict], path: Path) -> bool:
    models = layer_series(records)
    if not models:
        return False
    fig, axes = plt.subplots(2, len(models), figsize=(7.5 * len(models), 10), squeeze=False)
    titles = {"steady": "steady state: pipelined layer calls or graph replays",
              "eager": "eager one-layer step (host launch included)"}
    gpu = _gpu_label(records)
    for col, (model, kinds) in enumerate(sorted(models.items())):
        for row, kind in enumerate(("steady", "eager")):
            ax = axes[row][col]
            for mode in LAYER_MODES:
                pts = sorted(kinds[kind].get(mode, {}).items())
                if pts:
                    xs, ys = zip(*pts, strict=True)
                    ax.plot(xs, ys, "--" if mode == "fused policy" else "-", marker="o", ms=3, label=mode)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("tokens per step (decode <= 64: sequences; prefill: one sequence)")
            ax.set_ylabel("ms per layer (max over ranks)")
            ax.set_title(f"{model}, {gpu}, bf16: {titles[kind]}", fontsize=9)
            ax.grid(True, which="both", lw=0.3)
            ax.legend(fontsize=8)
    _save(plt, fig, path)
    return True


def _draw_model(plt, records: list[dict], path: Path) -> bool:
    data: dict[str, dict[str, dict]] = {}
    for r in records:
        mode = next((m for m in MODEL_MODES if r["case"].startswith(m + " ")), None)
        if mode is not None:
            data.setdefault(r["bench"], {})[mode] = r
    if not data:
        return False
    fig, axes = plt.subplots(1, len(MODEL_PANELS), figsize=(13, 3.8))
    colors = {"plain TP": "#8c8c8c", "plain SP": "#5b8fd6", "fusedpar": "#d65b5b"}
    for ax, (bench, title, key) in zip(axes, MODEL_PANELS, strict=True):
        recs = data.get(bench, {})
        modes = [m for m in MODEL_MODES if m in recs]
        bars = ax.bar(modes, [recs[m][key] for m in modes], color=[colors[m] for m in modes])
        for b, m in zip(bars, modes, strict=True):
            ax.annotate(f"{recs[m]['speedup']:.2f}x", (b.get_x() + b.get_width() / 2, b.get_height()),
                        ha="center", va="bottom", fontsize=9)
        ax.set_title(title, fontsize=10)
        ax.margins(y=0.15)
    r = records[0]
    fig.suptitle(f"{r.get('model', '')} shape, {r.get('layers', '')} layers, bf16, {_gpu_label(records)}: "
                 "fusedpar shift vs plain TP / plain SP (labels: speedup vs plain TP)", fontsize=10)
    _save(plt, fig, path)
    return True


def draw(records: dict[str, list[dict]], out_dir: Path) -> list[Path] | None:
    """Write the plots of `records` (file stem -> records) into out_dir; the files written, or None
    without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return None
    written = []
    jobs = ((FILES[0], lambda p: _draw_speedup(plt, records, p)),
            (FILES[1], lambda p: _draw_layer(plt, records.get("layer", []), p)),
            (FILES[2], lambda p: _draw_model(plt, records.get("model", []), p)))
    for name, job in jobs:
        if job(out_dir / name):
            written.append(out_dir / name)
    return written
