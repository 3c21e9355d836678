"""Layer time vs tokens per mode, log-log, from perf/results/layer.json (perf/bench_layer.py).

    python perf/plot_layer.py [--results perf/results/layer.json] [--out perf/results/layer_ms_vs_tokens.png]

Two rows of panels, one column per model. Top, the steady state of a deep model, one line per mode:
prefill sizes (> 64 tokens) are the decoder layer alone with 8 calls back to back ("layer
pipelined"), decode sizes the CUDA-graph replay 8 times back to back ("replay pipelined"; plain TP
takes the faster of NCCL and torch's one-shot all-reduce; plain SP and fused base decode eagerly, so
they have no decode points there); at shift-mode prefill sizes (64 < tokens <= the threshold) plain
TP and fused shift are their PrefillGraphs replays, 8 back to back, where the run has them; fused
policy is the ShiftPolicy's mode at each size. Bottom, the
eager one-layer step (planning, metadata upload and output all-gather included, host launch cost
included) for every mode. Every record of one bench run carries all modes' times (all_modes_ms).
Needs matplotlib (`pip install matplotlib`).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _plot

MODES = ("plain TP", "plain SP", "fused base", "fused shift", "fused policy")


def steady_ms(mode: str, tokens: int, r: dict[str, float], policy_mode: str | None) -> float | None:
    """One mode's steady-state ms at one size from a record's all_modes_ms (None: not measured)."""
    if mode == "fused policy":
        return steady_ms(f"fused {policy_mode}", tokens, r, None) if policy_mode else None
    if tokens > 64:  # shift-mode prefill sizes (<= the threshold) also ran as PrefillGraphs replays
        return r.get(f"{mode} replay pipelined", r.get(f"{mode} layer pipelined"))
    times = [r[k] for k in (f"{mode} replay pipelined", f"{mode} replay pipelined symm_mem") if k in r]
    return min(times) if times else None


def load(path: Path) -> dict[str, dict[str, dict[str, dict[int, float]]]]:
    """model -> {"steady": mode -> {tokens: ms}, "eager": mode -> {tokens: ms}}."""
    out: dict = defaultdict(lambda: {"steady": defaultdict(dict), "eager": defaultdict(dict)})
    records = json.loads(path.read_text())
    policy_mode: dict[tuple[str, int], str] = {}
    for rec in records:  # the steady-state policy records name the mode: "... pipelined (base)"
        if rec["bench"] == "layer_shift_policy" and rec["case"].endswith(")"):
            policy_mode[(rec["case"].split()[0], int(rec["tokens"]))] = rec["case"].rsplit("(", 1)[1].rstrip(")")
    for rec in records:
        model, n, r = rec["case"].split()[0], int(rec["tokens"]), rec.get("all_modes_ms", {})
        for mode in MODES:
            ms = steady_ms(mode, n, r, policy_mode.get((model, n)))
            if ms is not None:
                out[model]["steady"][mode][n] = float(ms)
            if mode in r:
                out[model]["eager"][mode][n] = float(r[mode])
    return out


def main() -> int:
    args, plt = _plot.args_and_pyplot(__doc__, "perf/results/layer.json", "perf/results/layer_ms_vs_tokens.png",
                                      "plot_layer")
    if plt is None:
        return 1
    models = load(Path(args.results))
    if not models:
        print(f"plot_layer: no layer records in {args.results}", file=sys.stderr)
        return 1
    fig, axes = plt.subplots(2, len(models), figsize=(7.5 * len(models), 10), squeeze=False)
    titles = {"steady": "steady state: pipelined layer calls or graph replays",
              "eager": "eager one-layer step (host launch included)"}
    for col, (model, kinds) in enumerate(sorted(models.items())):
        for row, kind in enumerate(("steady", "eager")):
            ax = axes[row][col]
            for mode in MODES:
                pts = sorted(kinds[kind].get(mode, {}).items())
                if pts:
                    xs, ys = zip(*pts, strict=True)
                    ax.plot(xs, ys, "--" if mode == "fused policy" else "-", marker="o", ms=3, label=mode)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("tokens per step (decode <= 64: sequences; prefill: one sequence)")
            ax.set_ylabel("ms per layer (max over ranks)")
            ax.set_title(f"{model}, 4x H200, bf16: {titles[kind]}", fontsize=9)
            ax.grid(True, which="both", lw=0.3)
            ax.legend(fontsize=8)
    return _plot.save(fig, args.out)


if __name__ == "__main__":
    sys.exit(main())
