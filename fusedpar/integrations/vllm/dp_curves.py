"""The step-time curves of policy "auto", measured in the engine at start-up when the section gives none.

When the scheduler of such an engine is built (vLLM's engine core has built the executor, its workers and the KV
cache, and serves nothing yet), `measure_curves` runs prefill steps of a few sizes in each class through the
executor, as the engine core runs a step, with requests of the scheduler's own that it places by hand
(dp_scheduler.DPScheduler._measure_curves):

    "dp{P}": a step of n tokens is P requests of ceil(n / P) prompt tokens, one on each DP rank (a DP step);
    "tp{P}": a step of n tokens is one request of n prompt tokens in the TP/SP class (a base / shift step);

n runs over `points(budget)` (1, a few sizes in between and the engine's token budget, so that every step is one
prefill step), each point one untimed step and then `iters` timed ones: the wall time of the step that runs them
(scheduling, the forward on every rank, sampling, the scheduler's update), the median. These are the curves of
the section's step_times (layout name -> (tokens, seconds) points). Every measurement request asks for one token and
finishes in its step; the workers' stats are reset afterwards, so `stats(llm)` counts the workload alone.
The measurement is bounded: a point that has not run within `limit_s` seconds of the start, a step that does not
finish its requests, or any error raised on the way is a CurveMeasurementError naming the class and the point,
what was measured until then, and the way out (step_times in the section).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable

logger = logging.getLogger("vllm.fusedpar")

MEASURE_LIMIT_S = 120.0  # seconds the whole measurement may take
MEASURE_ITERS = 2


class CurveMeasurementError(RuntimeError):
    """The step-time curves of policy "auto" could not be measured at engine start-up."""


def points(budget: int) -> tuple[int, ...]:
    """The step sizes measured per class: 1, 16 and 64 tokens, and the engine's token budget, those within it."""
    return tuple(sorted({n for n in (1, 16, 64) if n < budget} | {max(1, budget)}))


def measure_curves(run_step: Callable[[str, int, int], float], size: int, budget: int, *, iters: int = MEASURE_ITERS,
                   limit_s: float = MEASURE_LIMIT_S, clock: Callable[[], float] = time.perf_counter,
                   log: Callable[..., None] = logger.info) -> dict[str, list[tuple[int, float]]]:
    """The curves {"dp{P}": [(tokens, seconds), ...], "tp{P}": [...]} of `size` = P ranks over points(budget);
    run_step(layout, tokens, index) runs one prefill step of `tokens` tokens of that layout's class through the
    engine's executor and returns its seconds (index: a number unique to the step). CurveMeasurementError (module
    docstring) when a step fails or the measurement outlasts limit_s."""
    sizes = points(budget)
    layouts = (f"dp{size}", f"tp{size}")
    curves: dict[str, list[tuple[int, float]]] = {name: [] for name in layouts}
    total, done, start = len(layouts) * len(sizes), 0, clock()
    index = 0
    for name in layouts:
        for n in sizes:
            times = []
            for i in range(iters + 1):
                if clock() - start > limit_s:
                    raise CurveMeasurementError(_failure(name, n, curves, f"the measurement took more than "
                                                                          f"{limit_s:g} s"))
                try:
                    seconds = run_step(name, n, index)
                except Exception as e:
                    raise CurveMeasurementError(_failure(name, n, curves, f"{type(e).__name__}: {e}")) from e
                index += 1
                if i:  # the first step of a point warms it up
                    times.append(seconds)
            curves[name].append((n, statistics.median(times)))
            done += 1
            log("fusedpar auto: measuring step times at start-up: %s, %d tokens: %.4f s (%d of %d points)", name, n,
                curves[name][-1][1], done, total)
    return curves


def _failure(name: str, tokens: int, curves: dict, why: str) -> str:
    got = {k: v for k, v in curves.items() if v}
    return (f"fusedpar auto: measuring the step-time curves at engine start-up failed at {name}, {tokens} tokens "
            f"({why}); measured so far: {got or 'nothing'}. Give the curves in the section's step_times to skip the "
            "measurement")
