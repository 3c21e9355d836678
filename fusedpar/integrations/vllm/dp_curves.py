"""The step-time curves of policy "auto", measured in the engine at start-up when the section gives none.

When the scheduler of such an engine is built (vLLM's engine core has built the executor, its workers and the KV
cache, and serves nothing yet), `measure_curves` runs prefill steps of a few sizes and then decode steps of a few
batch sizes in each class through the executor, as the engine core runs a step, with requests of the scheduler's own
that it places by hand (dp_scheduler.DPScheduler._measure_curves):

    "dp{P}": a prefill step of n tokens is P requests of ceil(n / P) prompt tokens, one on each DP rank (a DP step);
             a decode step of B sequences is B requests decoding one token each, request i on DP rank i % P;
    "tp{P}": a prefill step of n tokens is one request of n prompt tokens in the TP/SP class (a base / shift step);
             a decode step of B sequences is B requests of the TP/SP class decoding one token each;

n runs over `points(budget)` (1, a few sizes in between and the engine's token budget, so that every step is one
prefill step) and B over `decode_points(size, max_batch)` (1, P, a few multiples of P in between and the largest
batch the engine runs in one step, max_batch). Each point is one untimed step and then `iters` timed ones: the wall
time of the step that runs them (scheduling, the forward on every rank, sampling, the scheduler's update), the
median. A prefill point's requests ask for one token and finish in their step; a decode point's requests prefill a
short prompt together in one step (untimed) and then decode one token each in the timed step, asking for two tokens
and finishing in it. The prefill curves are those of the section's step_times (layout name -> (tokens, seconds)
points), the decode curves those of its decode_step_times (layout name -> (sequences, seconds) points). The workers'
stats are reset afterwards, so `stats(llm)` counts the workload alone.
The measurement is bounded: a point that has not run within `limit_s` seconds of the start (one limit for the prefill
and decode points together), a step that does not finish its requests, or any error raised on the way is a
CurveMeasurementError naming the class and the point, what was measured until then, and the way out (step_times and
decode_step_times in the section).
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


def decode_points(size: int, max_batch: int) -> tuple[int, ...]:
    """The decode batch sizes measured per class: 1, P, 4P and 16P sequences, and max_batch, those within it."""
    return tuple(sorted({b for b in (1, size, 4 * size, 16 * size) if b < max_batch} | {max(1, max_batch)}))


def measure_curves(run_step: Callable[[str, int, int], float], size: int, budget: int, *,
                   run_decode: Callable[[str, int, int], float] | None = None, max_batch: int = 1,
                   iters: int = MEASURE_ITERS, limit_s: float = MEASURE_LIMIT_S,
                   clock: Callable[[], float] = time.perf_counter,
                   log: Callable[..., None] = logger.info) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """The curves of `size` = P ranks: {"step_times": {"dp{P}": [(tokens, seconds), ...], "tp{P}": [...]}} over
    points(budget) and, with run_decode, "decode_step_times": {"dp{P}": [(sequences, seconds), ...], "tp{P}": [...]}
    over decode_points(size, max_batch), measured after the prefill curves within the same limit_s.
    run_step(layout, tokens, index) runs one prefill step of `tokens` tokens of that layout's class through the
    engine's executor and returns its seconds (index: a number unique to the step); run_decode(layout, sequences,
    index) likewise one decode step of that many sequences. CurveMeasurementError (module docstring) when a step
    fails or the measurement outlasts limit_s."""
    layouts = (f"dp{size}", f"tp{size}")
    plan = [("step_times", run_step, points(budget), "step times", "tokens")]  # (key, run, sizes, what, unit)
    if run_decode is not None:
        plan.append(("decode_step_times", run_decode, decode_points(size, max_batch), "decode step times",
                     "sequences"))
    measured: dict[str, dict[str, list[tuple[int, float]]]] = {key: {n: [] for n in layouts} for key, *_ in plan}
    total, done, start = sum(len(layouts) * len(sizes) for _, _, sizes, _, _ in plan), 0, clock()
    index = 0
    for key, run, sizes, what, unit in plan:
        curves = measured[key]
        for name in layouts:
            for n in sizes:
                times = []
                for i in range(iters + 1):
                    if clock() - start > limit_s:
                        raise CurveMeasurementError(_failure(key, name, n, unit, measured,
                                                             f"the measurement took more than {limit_s:g} s"))
                    try:
                        seconds = run(name, n, index)
                    except Exception as e:
                        raise CurveMeasurementError(_failure(key, name, n, unit, measured,
                                                             f"{type(e).__name__}: {e}")) from e
                    index += 1
                    if i:  # the first step of a point warms it up
                        times.append(seconds)
                curves[name].append((n, statistics.median(times)))
                done += 1
                log("fusedpar auto: measuring %s at start-up: %s, %d %s: %.4f s (%d of %d points)", what, name, n,
                    unit, curves[name][-1][1], done, total)
    return measured


def _failure(key: str, name: str, count: int, unit: str, measured: dict, why: str) -> str:
    what = "" if key == "step_times" else " decode"
    got = {k: v for k, v in measured.get("step_times", {}).items() if v}
    decode = {k: v for k, v in measured.get("decode_step_times", {}).items() if v}
    so_far = f"{got or 'nothing'}" + (f"; decode steps: {decode}" if decode else "")
    return (f"fusedpar auto: measuring the step-time curves at engine start-up failed at {name}{what}, {count} "
            f"{unit} ({why}); measured so far: {so_far}. Give the curves in the section's step_times and "
            "decode_step_times to skip the measurement")
