"""The executor of an engine with a "dp{P}" layout (policies "dp", "priority", "load", "auto").

vLLM's MultiprocExecutor broadcasts each step to all ranks and reads the answer of one
(`output_rank`), which in TP is everyone's answer. In a DP step every rank answers for its own
requests, so `DPExecutor` collects every rank's answer to `execute_model`, then, where a rank ran a
forward and holds its sampling state (vLLM's model runner answers None), broadcasts `sample_tokens`
and collects every answer again (a rank without pending state answers an empty output), and returns
one ModelRunnerOutput: the ranks' outputs concatenated. The engine then never calls
`sample_tokens` itself (the merged output is not None). `Scheduler.update_from_output` looks results
up by request id, and the ranks' request sets are disjoint. A TP step (the scheduler's tag says so)
is vLLM's: every rank answers for the same requests, vLLM reads one.

Structured outputs (grammar bitmasks) and logprobs are not merged in this version: a DP step whose
outputs carry them is an error naming it.

A worker that dies: vLLM's worker monitor (MultiprocExecutor.start_worker_monitor) marks the executor
failed and shuts it down, which first waits for the other workers to exit (up to
VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS, then SIGTERM and SIGKILL) and only then cancels the output
queues a waiting call reads; until then the engine waits, and the error it finally gets ("cancelled",
"Executor failed.") names no worker. `DPExecutor` watches the same process sentinels: the moment a
worker dies it records which (`DeadWorker`) and cancels the output queues, so a call waiting on them
(every rank's answer in a DP step, vLLM's one answer in a TP step) or any later call raises
`WorkerDiedError` naming the dead worker at once; vLLM's monitor still shuts the other workers down. A worker that
dies while a step moving KV between the classes is in flight is named as dying during that KV move.

A worker that stalls (alive, not answering) during a KV move: the other ranks' move fails within its bound
(dp_move.guarded), and the output rank's failure reaches the executor, which raises it as `KVMoveError` naming the
stalled peer, marks itself failed and shuts down (vLLM's shutdown: the stalled worker gets SIGTERM, then SIGKILL).

Policy "auto" with live moves charges each change of its answer the time the moves it makes would take: once
its workers are up, the executor times scratch KV moves of two sizes on them (dp_move.time_moves) and leaves
the fitted cost (dp_move.MoveCost) for the engine's scheduler, built next in the same process (dp_handoff.py),
beside itself (the scheduler of policy "auto" without step_times measures its curves through it).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing.connection
import threading
import weakref
from concurrent.futures import Future
from dataclasses import dataclass

from vllm import envs
from vllm.v1.executor.multiproc_executor import MultiprocExecutor
from vllm.v1.outputs import ModelRunnerOutput

from .config import parse_additional_config
from .dp_handoff import leave
from .dp_move import MOVE_PROBE_BYTES, KVMoveError, MoveCost
from .dp_scheduler import TAG, TP_STEP, moves_priced

logger = logging.getLogger("vllm.fusedpar")


# the fields of vLLM's ModelRunnerOutput a DP step merges, and those it drops (one rank's runner statistics); every
# other field, whichever vLLM release defines it, must be unset in every rank's output
_MERGED = ("req_ids", "req_id_to_index", "sampled_token_ids", "prompt_logprobs_dict", "num_nans_in_logits")
_DROPPED = ("cudagraph_stats",)


def _is_set(value) -> bool:
    return value is not None and not (isinstance(value, (dict, list, tuple)) and not value)


def merge_outputs(outputs: list) -> ModelRunnerOutput:
    """One ModelRunnerOutput of the ranks' outputs for disjoint request sets, in rank order."""
    req_ids: list[str] = []
    sampled: list[list[int]] = []
    prompt_logprobs: dict = {}
    nans: dict[str, int] = {}
    for rank, out in enumerate(outputs):
        if not isinstance(out, ModelRunnerOutput):
            raise RuntimeError(f"fusedpar DP: rank {rank} answered {type(out).__name__}, not a ModelRunnerOutput")
        unsupported = [f.name for f in dataclasses.fields(out)
                       if f.name not in _MERGED + _DROPPED and _is_set(getattr(out, f.name))]
        if unsupported:
            raise RuntimeError(f"fusedpar DP: rank {rank}'s output carries {unsupported}, which DP steps do not merge "
                               "in this version")
        overlap = set(out.req_ids) & set(req_ids)
        if overlap:
            raise RuntimeError(f"fusedpar DP: requests {sorted(overlap)} ran on more than one rank")
        req_ids += out.req_ids
        sampled += out.sampled_token_ids
        prompt_logprobs.update(out.prompt_logprobs_dict)
        nans.update(out.num_nans_in_logits or {})
    if len(sampled) != len(req_ids):
        raise RuntimeError(f"fusedpar DP: {len(req_ids)} requests with {len(sampled)} sampled token lists")
    return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
                             sampled_token_ids=sampled, prompt_logprobs_dict=prompt_logprobs,
                             num_nans_in_logits=nans or None)


def moves_in_words(tag) -> str:
    """The KV moves of a step's tag (dp_scheduler.DPTag; None: a step without one) in words, "" if it moves none."""
    moves = getattr(tag, "moves", None)
    if not moves:
        return ""
    where = "into the TP/SP class" if tag.mode == TP_STEP else "to DP ranks"
    return f"requests {[m.request_id for m in moves]} {where}"


@dataclass(frozen=True)
class DeadWorker:
    """A worker process that died: its rank, vLLM's name for its process, its pid and exit code (-N: signal N)."""

    rank: int
    name: str
    pid: int
    exitcode: int | None

    def __str__(self) -> str:
        return f"rank {self.rank} ({self.name}, pid {self.pid}, exit code {self.exitcode})"


class WorkerDiedError(RuntimeError):
    """A worker process of the engine died; the message names it (DeadWorker)."""


def dead_workers(handles, sentinels=None) -> list[DeadWorker]:
    """The workers among vLLM's process handles whose process has ended: those whose sentinel is among
    `sentinels` (ready sentinels: the process has ended, though it may not be reaped yet), else those no longer
    alive. Each is joined for a second, so that its exit code is known."""
    if sentinels is not None:
        ended = [(rank, h) for rank, h in enumerate(handles) if h.proc.sentinel in sentinels]
    else:
        ended = [(rank, h) for rank, h in enumerate(handles) if not h.proc.is_alive()]
    for _, h in ended:
        h.proc.join(1)
    return [DeadWorker(rank, h.proc.name, h.proc.pid, h.proc.exitcode) for rank, h in ended]


def _watch(executor_ref, handles) -> None:
    """Wait for the first worker process to end; unless the executor is being shut down (not for a failure),
    record the dead ones and cancel the executor's output queues, which wakes any call waiting on them. vLLM's
    own monitor, woken by the same death, marks the executor failed before it starts shutting it down."""
    died = multiprocessing.connection.wait([h.proc.sentinel for h in handles])
    executor = executor_ref()
    if executor is None or (getattr(executor, "shutting_down", False) and not executor.is_failed):
        return
    executor.dead = tuple(dead_workers(handles, died))
    for mq in list(getattr(executor, "response_mqs", None) or ()):
        mq.shutdown()


class _NamedFailure(Future):
    """A pending result of vLLM's whose failure is raised as the executor's error for it (WorkerDiedError once a
    worker died)."""

    def __init__(self, inner: Future, executor: DPExecutor, method: str):
        super().__init__()
        self._inner, self._executor, self._method = inner, executor, method

    def done(self) -> bool:
        return self._inner.done()

    def result(self, timeout=None):
        try:
            return self._inner.result(timeout)
        except Exception as e:
            raise self._executor.failure(self._method, e) from e


class DPExecutor(MultiprocExecutor):
    """vLLM's MultiprocExecutor that merges every rank's output in a DP step and names a worker that died (module
    docstring)."""

    dead: tuple[DeadWorker, ...] = ()  # the workers the watcher found dead (set once, by its thread)
    moving: str = ""  # the KV moves of the last step handed to the workers, in words ("" if none)

    def _init_executor(self) -> None:
        super()._init_executor()
        leave(self.vllm_config, "executor", self, weak=True)
        if moves_priced(parse_additional_config(self.vllm_config.additional_config)):
            seconds = self.collective_rpc("fusedpar_kv_move_seconds", args=(MOVE_PROBE_BYTES,))[0]
            cost = MoveCost.fit(MOVE_PROBE_BYTES, seconds)
            leave(self.vllm_config, "move_cost", cost)
            logger.info("fusedpar DP: a KV move between the classes costs %.3f ms per request + %.3f ms per MiB "
                        "(timed at start-up)", 1e3 * cost.latency, 1e3 * cost.per_byte * (1 << 20))

    def start_worker_monitor(self, inline=False) -> None:
        threading.Thread(target=_watch, args=(weakref.ref(self), list(self.workers)), daemon=True,
                         name="FusedparWorkerWatch").start()
        super().start_worker_monitor(inline=inline)

    def failure(self, method: str, error: Exception) -> Exception:
        """The error for `error` raised by a call of `method`: WorkerDiedError naming every dead worker when one
        died, else `error` itself."""
        dead = self.dead or dead_workers(getattr(self, "workers", None) or ())
        during = f" during a KV move ({self.moving})" if self.moving else ""
        if not dead:
            if KVMoveError.PREFIX not in str(error):
                return error
            self._fail()  # a peer stalled in a move: the TP group's collectives are out of step for good
            return KVMoveError(f"fusedpar: {method} failed{during}; the engine cannot go on and shuts down "
                               f"({type(error).__name__}: {error})")
        return WorkerDiedError(f"fusedpar: worker {', '.join(map(str, dead))} died{during}; {method} cannot complete "
                               f"and the engine cannot go on ({type(error).__name__}: {error})")

    def _fail(self) -> None:
        """Mark the executor failed and shut it down behind the caller's error, as vLLM's monitor does for a dead
        worker (a stalled worker ends by SIGKILL after vLLM's grace period)."""
        if getattr(self, "is_failed", False):
            return
        self.is_failed = True

        def stop() -> None:
            self.shutdown()
            callback = getattr(self, "failure_callback", None)
            if callback is not None:
                self.failure_callback = None
                callback()

        threading.Thread(target=stop, daemon=True, name="FusedparMoveFailed").start()

    def collective_rpc(self, method, *args, non_block: bool = False, **kwargs):
        name = method if isinstance(method, str) else getattr(method, "__name__", "a collective RPC")
        try:
            out = super().collective_rpc(method, *args, non_block=non_block, **kwargs)
        except Exception as e:
            failure = self.failure(name, e)
            if failure is e:
                raise
            raise failure from e
        return _NamedFailure(out, self, name) if non_block else out

    def execute_model(self, scheduler_output, non_block: bool = False):
        tag = getattr(scheduler_output, TAG, None)
        self.moving = moves_in_words(tag)
        if tag is None or tag.mode == TP_STEP:
            return super().execute_model(scheduler_output, non_block=non_block)
        if scheduler_output.has_structured_output_requests:
            raise RuntimeError("fusedpar DP: structured outputs (grammar bitmasks) in a DP step are not supported in "
                               "this version")
        timeout = envs.VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS
        outputs = self.collective_rpc("execute_model", args=(scheduler_output,), timeout=timeout)
        if any(out is None for out in outputs):
            sampled = self.collective_rpc("sample_tokens", args=(None,), timeout=timeout)
            outputs = [s if out is None else out for out, s in zip(outputs, sampled, strict=True)]
        merged = merge_outputs(outputs)
        if not non_block:
            return merged
        future: Future = Future()
        future.set_result(merged)
        return future
