"""What an engine's executor hands to its scheduler. vLLM's engine core builds both in its own process from the same
VllmConfig object, the executor first (vllm/v1/engine/core.py: the executor, its workers and KV cache, then the
scheduler), and gives the scheduler no handle on the executor: the executor leaves here, under that object, what
the scheduler needs (dp_executor.DPExecutor: itself, the timed cost of KV moves), and the scheduler takes it when
it is built (dp_scheduler.DPScheduler)."""

from __future__ import annotations

import weakref

_HANDOFF: dict[int, dict] = {}  # id of an engine's VllmConfig -> what its executor left


def leave(vllm_config, key: str, value, *, weak: bool = False) -> None:
    """Leave `value` under `key` for the scheduler of the engine of `vllm_config`; weak: held by a weak reference
    (the executor, which the engine owns)."""
    ref = weakref.ref(value) if weak else (lambda: value)
    _HANDOFF.setdefault(id(vllm_config), {})[key] = ref


def take(vllm_config, key: str, what: str):
    """What the executor of the engine of `vllm_config` left under `key`; RuntimeError naming `what` when it left
    nothing (the engine's executor is not fusedpar's DPExecutor, or it has gone)."""
    ref = _HANDOFF.get(id(vllm_config), {}).get(key)
    value = ref() if ref is not None else None
    if value is None:
        raise RuntimeError(f"fusedpar DP: the engine's executor left no {what} for its scheduler (its executor is not "
                           "fusedpar's DPExecutor, or it has shut down)")
    return value
