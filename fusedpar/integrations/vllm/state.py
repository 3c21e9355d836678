"""The per-worker state of the plugin: what one worker's pieces are, and how a step runs through them.

One `WorkerState` per vLLM worker process (per engine config), created by the first linear
layer that fusedpar takes over, i.e. during model construction, after vLLM initialised its own
process groups and before any weight is loaded. It wires together
  - deployment.Deployment: the deployment, validated (config.check_deployment: every problem named,
    engine start fails), and every decision derived from it (layout, shards, dtype, fused kernels,
    base graphs, shift policy, row buckets); frozen;
  - comms.BaseComms: fusedpar's ParallelContext (the SP, base-TP, shift and DP groups, built here,
    collectively: every rank constructs the same layers in the same order, so every rank gets here
    together) and the base-mode communicators; nothing else holds process groups;
  - hooks.ModelHooks: the linear layers taken over, the hooks on the model and the base runner;
  - `step` (step.Step): the facts of the running step, replaced as a whole when a step begins and
    ends; the layers and the base runner read it;
  - counters.StepCounter: the counts `stats(llm)` returns.

How a step runs (hooks installed on the model as vLLM builds it, see hooks.ModelHooks):

  root model forward pre-hook (outside vLLM's compiled region) -> `begin_step`
      n = rows of input_ids / inputs_embeds (vLLM's scheduled, possibly graph-padded, token
      count: identical on every rank, so every rank takes the same decision without talking);
      mode = StepModeRule(threshold).mode(n, SP) (Deployment.step);
      base -> forward_context.skip_compiled = True: vLLM's own switch that makes the
              @support_torch_compile decoder model call `self.forward` for this step, which for
              the step is the BaseRunner's (base_runner.py: scatter the rows over SP, the layers
              eagerly or as replayed CUDA graphs, final norm, all-gather); vLLM's custom ops
              dispatch to their eager kernels for the step (base_step.py).
  linear layers (layers.py): base = base-shard GEMM on the local rows + Ulysses exchange in
      qkv_proj / o_proj, base-TP all-reduce in o_proj / down_proj; shift = vLLM's TP=P math on
      views of the base shard with vLLM's own all-reduce.
  root model forward hook -> `end_step`: checks that a base step really ran the base path, restores
      the decoder model's forward and vLLM's custom-op dispatch, and counts the step; the root's
      compute_logits (per instance) counts the steps vLLM replays as full graphs (counters.StepCounter).

The first base step (vLLM's memory-profiling run, at max_num_batched_tokens) builds the fused
communicator, compiles its kernels for every row count a base step can have and, where base
steps run as CUDA graphs, captures them (comms.BaseComms; so vLLM's memory profile sees their
memory). Before it, that step traces vLLM's compiled shift path at its size (shift_trace.py).

Why this is compile-safe: vLLM compiles the decoder model once (DYNAMO_TRACE_ONCE on CPU,
VLLM_COMPILE on CUDA) and drops dynamo's guards, so any Python branch on the token count inside
the compiled region would be baked in. Here the compiled region only ever runs shift steps:
every fusedpar layer takes the shift path whenever torch.compiler.is_compiling() (so the traced
graph is vLLM's TP=P model), and base steps never enter it (skip_compiled). vLLM's full CUDA
graphs, which replay without any Python, are only allowed up to the threshold (checked at start;
a capture above it fails loudly); base steps have their own graphs (base_runner.BaseGraphs).
STOCK_TORCH_COMPILE (which would compile the root hooks too) is rejected.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
from collections.abc import Iterator

from fusedpar.layouts import StepMode

from .comms import BaseComms
from .config import FusedparVllmConfig
from .counters import ClassLedger, StepCounter, snapshot, summary
from .deployment import Deployment
from .hooks import ModelHooks
from .shift_trace import before_first_trace, shift_trace_pending
from .step import IDLE, Step, capturing

__all__ = ["StepCounter", "WorkerState", "add_worker_methods", "state_for"]

logger = logging.getLogger("vllm.fusedpar")


class WorkerState:
    """One worker's pieces, wired together: see the module docstring."""

    def __init__(self, vllm_config, cfg: FusedparVllmConfig):
        self.deployment = dep = Deployment.of(vllm_config, cfg)  # raises before any process group is built
        self.counter = StepCounter()
        self.model = ModelHooks(self)
        self.comms = BaseComms(dep, self.model)  # collective: SP / TP / shift / DP groups
        self.step: Step = IDLE
        # layout "dp{P}" (policies "dp", "priority", "load", "auto"): what this rank served per class, and whether the
        # next model forward is the DP step the worker announced (dp_worker.DPWorker.execute_model ->
        # expect_dp_step) and the logits call after it is that step's (the last forward was a DP step: its
        # rows' logits, dp_runner.DPVocab)
        self.classes = ClassLedger() if dep.cfg.dp_size else None
        self._dp_next = False
        self.dp_logits = False
        atexit.register(self.log_summary)
        lay = dep.layout
        logger.info(
            "fusedpar: rank %d = (sp %d, tp %d) of base SP=%d x TP=%d, shift TP=%d; shift_threshold=%d; "
            "base mode runs eager (skip_compiled) on vLLM's eager kernels, shift mode runs vLLM's compiled/graph "
            "path; fused kernels: %s",
            dep.rank, dep.coords.sp, dep.coords.tp, lay.sp, lay.tp, lay.replica_size, dep.policy.threshold,
            dep.use_fused)

    # ---- per step -----------------------------------------------------------------------------
    def begin_step(self, num_tokens: int, compile_shift=None) -> None:
        """Decide the mode of a step of `num_tokens` tokens and set the step up for it.

        compile_shift: a callable that runs the decoder model on this step's inputs through vLLM's
        compiled path (shift_trace.before_first_trace); called at most once, before the compiled path
        has been traced.
        """
        from vllm.forward_context import get_forward_context, is_forward_context_available

        dep, model = self.deployment, self.model
        fc = get_forward_context() if is_forward_context_available() else None
        self.dp_logits, dp_next, self._dp_next = False, self._dp_next, False
        if dp_next:
            if fc is None:
                raise RuntimeError("fusedpar DP: a DP step without vLLM's forward context")
            fc.skip_compiled = True  # vLLM runs the decoder model's eager forward: the DP runner's
            model.enter_dp()
            self.step = Step.dp_step(num_tokens)
            self.dp_logits = True
            return
        in_capture = capturing(dep.is_cuda)
        # profile / warm-up runs carry no attention metadata, graph captures run on a capturing
        # stream: neither is a step of the workload, so neither is counted
        step = dep.plan_step(num_tokens, can_skip_compiled=fc is not None,
                        counted=fc is not None and bool(fc.attn_metadata) and not in_capture)
        if fc is not None and not in_capture and shift_trace_pending(model.decoder_model, dep.policy.threshold):
            before_first_trace(fc, model.decoder_model, dep.policy.threshold, step.mode, num_tokens, compile_shift)
        if step.is_base:
            from vllm.config import CUDAGraphMode

            if fc.cudagraph_runtime_mode == CUDAGraphMode.FULL:
                raise RuntimeError(
                    f"fusedpar: vLLM runs a full CUDA graph for a {num_tokens}-token step, above "
                    f"shift_threshold={dep.policy.threshold}; graphs cannot switch modes. Limit capture sizes with "
                    f"--compilation-config '{{\"max_cudagraph_capture_size\": {dep.policy.threshold}}}'"
                )
            fc.skip_compiled = True  # vLLM runs the decoder model's eager forward for this step
            if not in_capture:
                self.comms.fused()  # built (and compiled) before the step, not inside it
        model.enter(step.mode)
        self.step = step

    def end_step(self) -> None:
        step, self.step = self.step, IDLE
        ran = self.model.leave()
        if step.dp:
            if not ran:
                raise RuntimeError("fusedpar DP: a DP step did not run the DP runner (the compiled model ran "
                                   "instead); refusing to return possibly wrong results")
            self.counter.model_step(StepMode.SHIFT, step.num_tokens, 0, counted=False)  # pairs its logits call
            return
        logger.debug("fusedpar step: %s, %d tokens (counted: %s)", step.mode, step.num_tokens, step.counted)
        if step.is_base and not ran:
            raise RuntimeError(
                "fusedpar: a base-mode step did not run the base path (the compiled model ran instead); "
                "refusing to return possibly wrong results"
            )
        if not capturing(self.deployment.is_cuda):
            self.counter.model_step(step.mode, step.num_tokens, step.padding, step.counted)

    @contextlib.contextmanager
    def running(self, step: Step) -> Iterator[Step]:
        """Run the layers under `step` for the duration of the block (not a step of vLLM's: the
        base-graph capture), then under the step that ran before."""
        outer, self.step = self.step, step
        try:
            yield step
        finally:
            self.step = outer

    def expect_dp_step(self) -> None:
        """The worker's announcement that its next model forward is a DP step of its own requests."""
        if self.classes is None:
            raise RuntimeError("fusedpar DP: a DP step in an engine without a DP layout")
        self._dp_next = True

    # ---- reporting ----------------------------------------------------------------------------
    def snapshot(self) -> dict:
        snap = snapshot(self.deployment, self.model, self.counter)
        if self.classes is not None:
            snap.update(self.classes.stats())
        return snap

    def reset_stats(self) -> None:
        self.counter.reset()
        if self.classes is not None:
            self.classes.reset()

    def summary(self) -> str:
        line = summary(self.deployment, self.counter)
        if self.classes is not None:
            line += self.classes.summary()
        return line

    def log_summary(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: logging may be half torn down
            logger.info("%s", self.summary())


# The WorkerState lives on the engine's VllmConfig (one per worker process and engine), not in a
# module global: the layers find it through get_current_vllm_config() while the model is built,
# the RPC methods through worker.vllm_config.
_STATE_ATTR = "_fusedpar_worker_state"


def _state_of(vllm_config) -> WorkerState | None:
    return getattr(vllm_config, _STATE_ATTR, None)


def _worker_stats(worker) -> dict:
    return _require_state(worker).snapshot()


def _worker_reset_stats(worker) -> None:
    _require_state(worker).reset_stats()


def _require_state(worker) -> WorkerState:
    state = _state_of(getattr(worker, "vllm_config", None))
    if state is None:
        raise RuntimeError("fusedpar: this worker's engine does not run fusedpar (no \"fusedpar\" additional_config)")
    return state


def add_worker_methods() -> None:
    """Give vLLM's worker class two RPC methods, `fusedpar_stats` and `fusedpar_reset_stats`.

    `LLM.collective_rpc(name)` looks the name up on the worker; a callable instead of a name
    would need VLLM_ALLOW_INSECURE_SERIALIZATION. Only called in workers running fusedpar, and
    only adds attributes (nothing of vLLM's is replaced).
    """
    from vllm.v1.worker.worker_base import WorkerBase

    WorkerBase.fusedpar_stats = _worker_stats
    WorkerBase.fusedpar_reset_stats = _worker_reset_stats


def state_for(vllm_config, cfg: FusedparVllmConfig) -> WorkerState:
    """The WorkerState of this engine config, created (validated, groups built) on first use."""
    state = _state_of(vllm_config)
    if state is None:
        state = WorkerState(vllm_config, cfg)
        object.__setattr__(vllm_config, _STATE_ATTR, state)
        add_worker_methods()
    return state
