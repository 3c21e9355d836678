"""Per-policy metrics of a serving run, its benchmark record, the console table and the timeline plot.

TTFT = first token's time - arrival; TPOT = (last token's time - first token's time) / (output - 1)
(requests of one output token have none). Percentiles interpolate linearly between order statistics.
Throughput per load phase: output tokens whose step ended inside the trace's phases of that kind
(low, burst) over their total duration; "drain" is the time after the last arrival. Peak throughput:
the most output tokens in one window of peak_window seconds, over the window: on a trace the policy
keeps up with, that is the offered load, not its capacity. Saturated throughput (serve_bench
--saturate): output tokens of N requests that all arrive at t = 0, over the time to finish them.
"""

from __future__ import annotations

import math
from pathlib import Path

from _serve.loop import RunResult
from _serve.trace import Phase, Request


def percentile(values: list[float], p: float) -> float | None:
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def summarize(res: RunResult, requests: list[Request], phases: list[Phase], peak_window: float) -> dict:
    """The metrics of one policy's run (numbers in ms, tokens/s, seconds)."""
    out: dict = {}
    for label, reqs in (("", requests), ("prio_", [r for r in requests if r.priority == 0])):
        ttft = [res.first_t[r.rid] - r.arrival for r in reqs if r.rid in res.first_t]
        tpot = [(res.done_t[r.rid] - res.first_t[r.rid]) / (r.output_len - 1) for r in reqs
                if r.output_len > 1 and r.rid in res.done_t]
        if label and not reqs:
            continue
        for name, xs in (("ttft", ttft), ("tpot", tpot)):
            out[f"{label}{name}_p50_ms"] = _ms(percentile(xs, 50))
            out[f"{label}{name}_p99_ms"] = _ms(percentile(xs, 99))
        out[f"{label}requests"] = len(reqs)
    last_arrival = phases[-1].end if phases else 0.0
    windows: dict[str, list[tuple[float, float]]] = {"low": [], "burst": [], "drain": []}
    for ph in phases:
        windows[ph.kind].append((ph.start, ph.end))
    windows["drain"].append((last_arrival, max(res.end, last_arrival)))
    for kind, spans in windows.items():
        dur = sum(b - a for a, b in spans)
        toks = sum(n for t, n in res.emitted if any(a < t <= b for a, b in spans))
        out[f"throughput_{kind}_tok_s"] = toks / dur if dur > 0 else None
    buckets: dict[int, int] = {}
    for t, n in res.emitted:
        key = int(t // peak_window)
        buckets[key] = buckets.get(key, 0) + n
    out["peak_throughput_tok_s"] = max(buckets.values(), default=0) / peak_window
    out["output_tokens"] = sum(n for _, n in res.emitted)
    out["makespan_s"] = res.end
    out["throughput_tok_s"] = out["output_tokens"] / res.end if res.end > 0 else None
    out["served"] = _served(res, requests)
    out["steps"] = dict(sorted(res.steps.items()))
    out["switches"] = dict(sorted(res.switches.items()))
    out["switches_total"] = sum(res.switches.values())
    out["switch_s"] = res.switch_s
    out["swap_s"] = res.swap_s
    out["graph_capture_s"] = res.graph_s
    out["kv_bytes_received_rank0"] = res.kv_bytes_received
    out["time_in_layout_s"] = {}
    for a, b, lay in res.layout_spans:
        out["time_in_layout_s"][lay] = out["time_in_layout_s"].get(lay, 0.0) + (b - a)
    out["wall_s"] = res.wall_s
    return out


def summarize_saturated(res: RunResult, requests: list[Request]) -> dict:
    """The saturated run's metrics: saturated_tok_s, and per layout its steps and switches."""
    toks = sum(n for _, n in res.emitted)
    first = [res.first_t[r.rid] for r in requests if r.rid in res.first_t]  # arrivals at 0: TTFTs
    return {"saturated_tok_s": toks / res.end if res.end > 0 else None,
            "saturated": {"requests": len(requests), "served": _served(res, requests), "output_tokens": toks,
                          "makespan_s": res.end, "steps": dict(sorted(res.steps.items())),
                          "switches": dict(sorted(res.switches.items())), "ttft_p50_ms": _ms(percentile(first, 50))}}


def _served(res: RunResult, requests: list[Request]) -> int:
    """Requests finished with every output token."""
    return sum(1 for r in requests if r.rid in res.done_t and len(res.outputs.get(r.rid, ())) == r.output_len)


def print_table(rows: list[tuple[str, dict]], log=print) -> None:
    def f(x, fmt="{:.1f}"):
        return "-" if x is None else fmt.format(x)

    log(f"{'policy':<26}{'TTFT p50':>10}{'p99':>10}{'TPOT p50':>10}{'p99':>9}{'prio TTFT p99':>15}"
        f"{'tok/s low':>11}{'burst':>9}{'peak':>9}{'saturated':>10}{'switches':>9}{'switch s':>9}  steps per layout")
    for name, m in rows:
        log(f"{name:<26}{f(m['ttft_p50_ms']):>10}{f(m['ttft_p99_ms']):>10}{f(m['tpot_p50_ms']):>10}"
            f"{f(m['tpot_p99_ms']):>9}{f(m.get('prio_ttft_p99_ms')):>15}{f(m['throughput_low_tok_s']):>11}"
            f"{f(m['throughput_burst_tok_s']):>9}{f(m['peak_throughput_tok_s']):>9}{f(m.get('saturated_tok_s')):>10}"
            f"{m['switches_total']:>9}"
            f"{m['switch_s'] + m['swap_s']:>9.3f}  {m['steps']}")


def plot(results: list[RunResult], requests: list[Request], path: Path, title: str, log=print) -> bool:
    """One panel per policy: offered load (arrivals/s per second), the layout in use (shaded) and each
    request's TTFT at its arrival. False (with a message) where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no timeline plot (pip install matplotlib)")
        return False
    from matplotlib.patches import Patch

    colors = {"tp": "#f2d7d5", "sp": "#d5e8f2", "dp": "#dff2d5"}
    fig, axes = plt.subplots(len(results), 1, figsize=(11, 2.6 * len(results)), squeeze=False, sharex=True)
    end = max(r.end for r in results)
    width = max(end / 80, 0.05)  # offered-load bins, s
    counts = [0] * (int(end / width) + 1)
    for r in requests:
        counts[min(int(r.arrival / width), len(counts) - 1)] += 1
    for ax, res in zip(axes[:, 0], results, strict=True):
        for a, b, lay in res.layout_spans:
            ax.axvspan(a, b, color=colors.get(lay, "#eeeeee"), lw=0)
        ax.step([i * width for i in range(len(counts))], [c / width for c in counts], where="post", color="k",
                lw=0.8)
        ax.set_ylabel("offered req/s")
        ax2 = ax.twinx()
        xs = [r.arrival for r in requests if r.rid in res.first_t]
        ys = [res.first_t[r.rid] - r.arrival for r in requests if r.rid in res.first_t]
        ax2.scatter(xs, ys, s=4, color="#c0392b")
        ax2.set_ylabel("TTFT s (dots, at arrival)")
        ax.set_title(res.policy, fontsize=9)
        ax.legend(handles=[Patch(color=c, label=f"layout {k}") for k, c in colors.items()], fontsize=7,
                  loc="upper left")
    axes[-1, 0].set_xlabel("time (s, virtual clock)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
    log(f"wrote the timeline plot {path}")
    return True
