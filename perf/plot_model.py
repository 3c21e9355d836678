"""Bar chart of the model benchmark (perf/results/model.json), laid out like Figure 9 of the Shift
Parallelism paper: TTFT, TPOT and combined throughput per mode, each bar labelled with its
speedup over plain TP (higher is better for all three labels).

    python perf/plot_model.py [--results perf/results/model.json] [--out perf/results/model_bars.png]

Needs matplotlib (not a fusedpar dependency: `pip install matplotlib`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _plot

MODES = ("plain TP", "plain SP", "fusedpar")
PANELS = (("model_ttft", "TTFT (ms), lower is better", "fused_ms"),
          ("model_tpot", "TPOT at batch 1 (ms), lower is better", "fused_ms"),
          ("model_throughput", "combined throughput (tokens/s), higher is better", "tokens_per_s"))


def load(path: Path) -> dict[str, dict[str, dict]]:
    """bench -> mode -> record."""
    out: dict[str, dict[str, dict]] = {}
    for r in json.loads(path.read_text()):
        mode = next((m for m in MODES if r["case"].startswith(m + " ")), None)
        if mode is not None:
            out.setdefault(r["bench"], {})[mode] = r
    return out


def main() -> int:
    args, plt = _plot.args_and_pyplot(__doc__, "perf/results/model.json", "perf/results/model_bars.png", "plot_model")
    if plt is None:
        return 1
    data = load(Path(args.results))
    if not data:
        print(f"plot_model: no model_* records in {args.results}", file=sys.stderr)
        return 1
    fig, axes = plt.subplots(1, len(PANELS), figsize=(13, 3.8))
    colors = {"plain TP": "#8c8c8c", "plain SP": "#5b8fd6", "fusedpar": "#d65b5b"}
    any_rec = None
    for ax, (bench, title, key) in zip(axes, PANELS, strict=True):
        recs = data.get(bench, {})
        modes = [m for m in MODES if m in recs]
        vals = [recs[m].get(key) if key != "fused_ms" else recs[m]["fused_ms"] for m in modes]
        bars = ax.bar(modes, vals, color=[colors[m] for m in modes])
        for b, m in zip(bars, modes, strict=True):
            ax.annotate(f"{recs[m]['speedup']:.2f}x", (b.get_x() + b.get_width() / 2, b.get_height()),
                        ha="center", va="bottom", fontsize=9)
        ax.set_title(title, fontsize=10)
        ax.margins(y=0.15)
        any_rec = any_rec or (recs[modes[0]] if modes else None)
    if any_rec is not None:
        fig.suptitle(f"{any_rec.get('model', '')} shape, {any_rec.get('layers', '')} layers, bf16, "
                     f"{any_rec['world']}x {any_rec['gpu']}: fusedpar shift vs plain TP / plain SP "
                     "(labels: speedup vs plain TP)", fontsize=10)
    return _plot.save(fig, args.out)


if __name__ == "__main__":
    sys.exit(main())
