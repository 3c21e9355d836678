"""What the DP classes take from vLLM's scheduler internals, per vLLM release they run on: one entry per release in
`INTERNALS`, one function per internal that differs between them. Nothing else in the DP classes names a vLLM
version; `dp_engine.dp_version_problem` refuses a release without an entry.

The internals, as vLLM's `Scheduler` (vllm/v1/core/sched/scheduler.py) and `KVCacheManager`
(vllm/v1/core/kv_cache_manager.py) of each release define them:

  waiting queues    the scheduler's queues of waiting requests: `waiting` and, beside it, 0.32's
                    `kv_holding_waiting` (waiting requests that hold KV blocks) or 0.26's `skipped_waiting`
                    (requests an earlier step skipped, or blocked): `waiting_requests`.
  pool arguments    the KVCacheManager keywords the scheduler builds its manager with beyond the ones every release
                    takes: 0.32's `use_eagle=self.use_eagle_block_drop, num_prefill_lookahead=...`, 0.26's
                    `use_eagle=self.use_eagle`: `pool_arguments`.
  leaving a class   how one step's scheduling loop leaves the other class's requests out (`leave_out`):
    out             "hooks" (0.32): the loop asks `_reserve_prefill_lookahead` how many tokens a running request gets
                    (0: skipped for the step) and `_handle_blocked_waiting_request` whether a waiting request goes
                    on (False: skipped and re-queued at the head of the waiting queue); DPScheduler overrides both.
                    "gate" (0.26): the loop has no such per-request question; it skips a running request whose
                    `next_decode_eligible_step` is past the step (vLLM's cadence gate for pipeline-parallel async
                    scheduling, which a DP layout refuses, so the gate is otherwise always open), and takes waiting
                    requests from `waiting` and `skipped_waiting` alone. For the step, the other class's running
                    requests get a closed gate and its waiting requests leave both queues; afterwards each gate is
                    as it was and the waiting requests are at the head of `skipped_waiting`, in their order, where
                    vLLM 0.26 re-queues a request its loop skipped (`excluded`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

HOOKS, GATE = "hooks", "gate"


@dataclass(frozen=True)
class VllmInternals:
    """The internals of one vLLM release that the DP classes use (module docstring).

    release: "major.minor"; waiting_queues: the Scheduler attributes holding waiting requests; pool_arguments:
    KVCacheManager keyword -> the Scheduler attribute that gives it, beyond the keywords every release takes;
    leave_out: HOOKS or GATE; names: what the DP classes need of this release, as the version refusal names them."""

    release: str
    waiting_queues: tuple[str, ...]
    pool_arguments: tuple[tuple[str, str], ...]
    leave_out: str
    names: tuple[str, ...]


INTERNALS: dict[str, VllmInternals] = {
    "0.32": VllmInternals(
        release="0.32",
        waiting_queues=("waiting", "kv_holding_waiting"),
        pool_arguments=(("use_eagle", "use_eagle_block_drop"), ("num_prefill_lookahead", "num_prefill_lookahead")),
        leave_out=HOOKS,
        names=("Scheduler._reserve_prefill_lookahead", "Scheduler._handle_blocked_waiting_request",
               "Scheduler.kv_holding_waiting", "Scheduler.use_eagle_block_drop",
               "KVCacheManager(num_prefill_lookahead=...)"),
    ),
    "0.26": VllmInternals(
        release="0.26",
        waiting_queues=("waiting", "skipped_waiting"),
        pool_arguments=(("use_eagle", "use_eagle"),),
        leave_out=GATE,
        names=("Request.next_decode_eligible_step", "Scheduler.skipped_waiting", "Scheduler.use_eagle"),
    ),
}


def release_of(vllm_version: str) -> str | None:
    """"major.minor" of a vLLM version string ("0.32.1+cpu" -> "0.32"); None when it has no two numeric parts."""
    parts = vllm_version.split("+", 1)[0].split(".")
    if len(parts) < 2 or not all(p.isdigit() for p in parts[:2]):
        return None
    return f"{int(parts[0])}.{int(parts[1])}"


def internals_of(vllm_version: str) -> VllmInternals | None:
    """The entry of `vllm_version`'s release; None for a release the DP classes are not written against."""
    return INTERNALS.get(release_of(vllm_version) or "")


def running() -> VllmInternals:
    """The entry of the installed vLLM (RuntimeError naming it when there is none: the engine config check refuses
    such an engine before any DP class is built)."""
    import vllm

    found = internals_of(vllm.__version__)
    if found is None:
        raise RuntimeError(f"fusedpar DP: vLLM {vllm.__version__} has no entry in dp_compat.INTERNALS")
    return found


def waiting_requests(internals: VllmInternals, scheduler) -> Iterator:
    """Every waiting request of `scheduler`, over its release's waiting queues."""
    return itertools.chain.from_iterable(getattr(scheduler, name) for name in internals.waiting_queues)


def pool_arguments(internals: VllmInternals, scheduler) -> dict:
    """The release's KVCacheManager keywords beyond the shared ones, with `scheduler`'s values."""
    return {arg: getattr(scheduler, attr) for arg, attr in internals.pool_arguments}


@contextmanager
def excluded(internals: VllmInternals, scheduler, in_step: Callable[[object], bool]):
    """For the `with` body (one call of vLLM's Scheduler.schedule), vLLM's scheduling loop sees only the requests
    for which `in_step` answers True (module docstring, "leaving a class out"). With HOOKS nothing to do: the
    scheduler's overrides answer the loop's questions."""
    if internals.leave_out == HOOKS:
        yield
        return
    if internals.leave_out != GATE:
        raise ValueError(f"unknown leave_out {internals.leave_out!r}")
    closed = scheduler.current_step + 2  # schedule() counts the step first: the gate stays shut for this step
    gates = [(request, request.next_decode_eligible_step) for request in scheduler.running if not in_step(request)]
    for request, _ in gates:
        request.next_decode_eligible_step = closed
    held = []
    for name in reversed(internals.waiting_queues):  # skipped_waiting's first: vLLM takes it first
        queue = getattr(scheduler, name)
        out = [r for r in queue if not in_step(r)]
        if out:
            queue.remove_requests(out)
            held += out
    try:
        yield
    finally:
        for request, gate in gates:
            request.next_decode_eligible_step = gate
        skipped = getattr(scheduler, internals.waiting_queues[-1])
        for request in reversed(held):
            skipped.prepend_request(request)
