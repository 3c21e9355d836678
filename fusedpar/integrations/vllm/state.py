"""Per-worker state of the plugin: layout, process groups, mode of the current step, stats.

One `WorkerState` per vLLM worker process (per engine config), created by the first linear
layer that fusedpar takes over, i.e. during model construction, after vLLM initialised its own
process groups and before any weight is loaded. Creating it
  1. validates the deployment (config.check_deployment: every problem named, engine start fails),
  2. builds fusedpar's ParallelContext (the SP, base-TP, shift and DP groups; collective: every
     rank constructs the same layers in the same order, so every rank gets here together).
Nothing else holds process groups.

How a step runs (hooks installed on the model as vLLM builds it, see `watch_for_root`):

  root model forward pre-hook (outside vLLM's compiled region)
      n = rows of input_ids / inputs_embeds (vLLM's scheduled, possibly graph-padded, token
      count: identical on every rank, so every rank takes the same decision without talking);
      mode = ShiftPolicy(threshold).mode(n, SP);
      base -> forward_context.skip_compiled = True: vLLM's own switch that makes the
              @support_torch_compile decoder model call `self.forward` for this step, which for
              the step is the BaseRunner's (base_runner.py: scatter the rows over SP, the layers
              eagerly or as replayed CUDA graphs, final norm, all-gather); vLLM's custom ops
              dispatch to their eager kernels for the step (base_step.py).
  linear layers (layers.py): base = base-shard GEMM on the local rows + Ulysses exchange in
      qkv_proj / o_proj, base-TP all-reduce in o_proj / down_proj; shift = vLLM's TP=P math on
      views of the base shard with vLLM's own all-reduce.
  root model forward hook: checks that a base step really ran the base path, restores the
      decoder model's forward and vLLM's custom-op dispatch, and counts the step; the root's
      compute_logits (per instance) counts the steps vLLM replays as full graphs (StepCounter).

The first base step (vLLM's memory-profiling run, at max_num_batched_tokens) builds the fused
communicator, compiles its kernels for every row count a base step can have and, where base
steps run as CUDA graphs, captures them (so vLLM's memory profile sees their memory).

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
import inspect
import logging

import torch

from fusedpar.collectives import ParallelContext
from fusedpar.layers.comm import PlainComm, select
from fusedpar.layers.policy import ShiftPolicy, padded_token_count
from fusedpar.layouts import ModelDims

from .base_runner import bucket_for, row_buckets
from .config import SUPPORTED_ARCHITECTURES, DeploymentInfo, FusedparConfigError, FusedparVllmConfig, check_deployment

logger = logging.getLogger("vllm.fusedpar")

STAT_KEYS = ("base_steps", "shift_steps", "base_tokens", "shift_tokens", "base_padding_tokens")


def deployment_info(vllm_config) -> DeploymentInfo:
    """The numbers of a VllmConfig that check_deployment needs."""
    from vllm.config import CompilationMode

    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.compilation_config
    hf = mc.hf_text_config
    h = hf.num_attention_heads
    mode = cc.mode
    mode_name = mode.name if isinstance(mode, CompilationMode) else str(mode)
    cg = cc.cudagraph_mode
    full = bool(cg is not None and cg.has_full_cudagraphs()) and bool(cc.cudagraph_capture_sizes)
    impl = getattr(mc, "model_impl", "auto")
    return DeploymentInfo(
        tensor_parallel_size=pc.tensor_parallel_size,
        pipeline_parallel_size=pc.pipeline_parallel_size,
        data_parallel_size=pc.data_parallel_size,
        decode_context_parallel_size=getattr(pc, "decode_context_parallel_size", 1) or 1,
        prefill_context_parallel_size=getattr(pc, "prefill_context_parallel_size", 1) or 1,
        architectures=tuple(mc.architectures or ()),
        model_impl=str(getattr(impl, "value", impl)),  # a str or vLLM's ModelImpl enum
        num_attention_heads=h,
        num_key_value_heads=getattr(hf, "num_key_value_heads", None) or h,
        head_dim=mc.get_head_size(),
        intermediate_size=getattr(hf, "intermediate_size", 0) or 0,
        quantization=mc.quantization,
        lora=vllm_config.lora_config is not None,
        speculative=vllm_config.speculative_config is not None,
        compilation_mode=mode_name,
        full_cudagraphs=full,
        max_cudagraph_capture_size=cc.max_cudagraph_capture_size,
    )


class StepCounter:
    """The stats of the workload's steps.

    A step the model runs is counted at its end (`model_step`). A step vLLM replays as a full CUDA
    graph (decode batches up to its capture size: always shift) runs no Python of the model; the
    sampler's logits call that follows every step sees it: a logits call with no model step since the last one
    is such a replay, of `rows` tokens (one per sequence). Model steps that are not the workload's
    (profile, warm-up: `counted` False) still pair with their logits call; graph captures pair with
    none and are not model steps here. Replays count once the engine serves (after its first
    counted step), so vLLM's warm-up sampler calls are not steps.
    """

    def __init__(self):
        self.stats = dict.fromkeys(STAT_KEYS, 0)
        self._pending = False  # a model step whose logits call has not come yet
        self._serving = False

    def model_step(self, mode: str, tokens: int, padding: int, counted: bool) -> None:
        self._pending = True
        if counted:
            self._serving = True
            self.stats[f"{mode}_steps"] += 1
            self.stats[f"{mode}_tokens"] += tokens
            if mode == "base":
                self.stats["base_padding_tokens"] += padding

    def logits(self, rows: int) -> None:
        if self._pending:
            self._pending = False
        elif self._serving:
            self.stats["shift_steps"] += 1
            self.stats["shift_tokens"] += rows

    def reset(self) -> None:
        self.stats = dict.fromkeys(STAT_KEYS, 0)


class WorkerState:
    """Everything fusedpar keeps in one worker: see the module docstring."""

    def __init__(self, vllm_config, cfg: FusedparVllmConfig):
        import torch.distributed as dist
        from vllm.distributed import get_tensor_model_parallel_rank
        from vllm.platforms import current_platform

        info = deployment_info(vllm_config)
        layout = check_deployment(cfg, info)  # raises FusedparConfigError before anything else
        P = layout.replica_size
        if not dist.is_initialized() or dist.get_world_size() != P:
            raise RuntimeError(f"fusedpar: expected a torch.distributed world of tensor_parallel_size={P} ranks "
                               f"(DP = PP = 1), found {dist.get_world_size() if dist.is_initialized() else 0}")
        rank = get_tensor_model_parallel_rank()
        if dist.get_rank() != rank:  # vLLM's TP group is the world in natural order: the shift group
            raise RuntimeError(f"fusedpar: torch.distributed rank {dist.get_rank()} != vLLM TP rank {rank}")
        self.vllm_config, self.cfg, self.layout, self.rank = vllm_config, cfg, layout, rank
        self.coords = layout.coords(rank)
        self.dims = ModelDims(info.num_attention_heads, info.num_key_value_heads, info.head_dim,
                              info.intermediate_size)
        self.shards = layout.weight_shards(self.dims)
        self.placement = self.shards.placement
        self.is_cuda = current_platform.is_cuda_alike()
        device = torch.device("cuda", torch.cuda.current_device()) if self.is_cuda else torch.device("cpu")
        self.ctx = ParallelContext(layout, device=device)  # collective: SP / TP / shift / DP groups
        self.dtype = vllm_config.model_config.dtype
        self.use_fused = self._fused_decision()
        self.use_graphs = self._graphs_decision()
        self.policy = ShiftPolicy(cfg.threshold(P, base_graphs=self.use_graphs,
                                                capture_size=info.max_cudagraph_capture_size or 0))
        max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        rows = self.base_rows(max_tokens)
        # with base graphs a base step pads to a row bucket (base_runner.row_buckets)
        self.buckets = row_buckets(rows.start, rows.stop - 1) if self.use_graphs and len(rows) else ()
        self._fused = None  # FusedComm, built collectively at the first base step (CUDA only)
        self.plain = PlainComm(self.ctx)  # base-mode stages on cuBLAS + torch.distributed
        # per step
        self.mode = "shift"
        self.num_tokens = 0
        self.padded_tokens = 0
        self._counted = False
        # model wiring
        self.layer_prefix: str | None = None  # "model.layers.0" of the first layer taken over
        self.layers_taken: dict[str, int] = {}
        self.modules: list = []  # the linear layers taken over (their weights are the base shards)
        self.root = self.decoder_model = None
        self.base_kernels = None  # base_step.BaseKernels, once the model is built
        self.runner = None  # base_runner.BaseRunner, once the model is built
        self._watchers: list = []
        self.steps = StepCounter()
        atexit.register(self.log_summary)
        logger.info(
            "fusedpar: rank %d = (sp %d, tp %d) of base SP=%d x TP=%d, shift TP=%d; shift_threshold=%d; "
            "base mode runs eager (skip_compiled) on vLLM's eager kernels, shift mode runs vLLM's compiled/graph "
            "path; fused kernels: %s",
            rank, self.coords.sp, self.coords.tp, layout.sp, layout.tp, P, self.policy.threshold, self.use_fused)

    # ---- kernels ------------------------------------------------------------------------------
    def _fused_decision(self) -> bool:
        want = self.cfg.fused_kernels
        if want is False or self.layout.sp == 1:
            return False
        why = []
        if not self.is_cuda:
            why.append("the engine does not run on CUDA")
        if self.dtype not in (torch.bfloat16, torch.float16):
            why.append(f"dtype {self.dtype} (fused kernels: bf16 / fp16)")
        if want is True and why:
            raise FusedparConfigError("fusedpar: fused_kernels=true is not possible: " + "; ".join(why))
        return not why

    def _graphs_decision(self) -> bool:
        """Base steps as CUDA graphs: fused kernels (no NCCL call inside a graph), base TP = 1, and
        vLLM itself allowed to use graphs (not enforce_eager, cudagraph_mode not NONE)."""
        if not self.use_fused or self.layout.tp != 1 or self.vllm_config.model_config.enforce_eager:
            return False
        mode = self.vllm_config.compilation_config.cudagraph_mode
        return getattr(mode, "name", "NONE") != "NONE"

    def comm(self, x: torch.Tensor):
        """The communicator of the base-mode stages on x: FusedComm where it takes x, else PlainComm."""
        return select(x, self.fused(), self.plain)

    def fused(self):
        """fusedpar.layers.comm.FusedComm for the base mode (None: plain torch collectives only)."""
        if not self.use_fused:
            return None
        if self._fused is None:
            from fusedpar.kernels.ulysses import UlyssesOptions
            from fusedpar.layers import DecoderConfig
            from fusedpar.layers.comm import FusedComm, FusedOptions

            hf = self.vllm_config.model_config.hf_text_config
            cfg = DecoderConfig(hidden_size=hf.hidden_size, num_q_heads=self.dims.num_q_heads,
                                num_kv_heads=self.dims.num_kv_heads, head_dim=self.dims.head_dim,
                                intermediate_size=self.dims.intermediate_size)
            max_tokens = padded_token_count(self.vllm_config.scheduler_config.max_num_batched_tokens, self.layout.sp)
            if self.buckets:
                max_tokens = self.buckets[-1] * self.layout.sp
            # The fused o kernel (one launch) at every size: no NCCL call inside a base graph, and eager
            # base steps are bound by host time where the routing table's GPU times tie
            options = FusedOptions(ulysses=UlyssesOptions(o_proj_fused_rows=((1, None),)))
            self._fused = FusedComm(self.ctx, cfg, max_tokens=max_tokens, dtype=self.dtype, options=options)
            if self.buckets:
                self._capture_graphs(cfg)  # an eager pass per bucket first: compiles what the graphs replay
            else:
                self._warm_up(max_tokens)
        return self._fused

    def _capture_graphs(self, cfg) -> None:
        from .base_runner import BaseGraphs

        place = self.placement
        hd = cfg.head_dim
        from vllm.platforms import current_platform

        reserved = torch.cuda.memory_reserved(self.ctx.device)
        graphs = BaseGraphs(self.runner, self.buckets, hidden_size=cfg.hidden_size, q_width=place.q_heads_per_rank * hd,
                            kv_width=place.kv_heads_per_rank * hd, dtype=self.dtype, device=self.ctx.device,
                            pool=current_platform.get_global_graph_pool())
        seconds = graphs.capture_all()
        self.runner.graphs = graphs
        grown = (torch.cuda.memory_reserved(self.ctx.device) - reserved) / 2**30
        logger.info("fusedpar: base steps captured as CUDA graphs for %d row buckets (%d..%d rows per rank, "
                    "%d graphs each) in %.1f s; reserved memory +%.2f GiB (vLLM's graph pool, shared with its "
                    "own graphs)", len(self.buckets), self.buckets[0], self.buckets[-1], len(self.runner.attns) + 1,
                    seconds, grown)

    def base_rows(self, max_tokens: int) -> range:
        """Rows per rank (m) of every base step: n in (threshold, max_tokens] tokens, m = ceil(n / SP)."""
        sp = self.layout.sp
        return range(-(-(self.policy.threshold + 1) // sp), -(-max_tokens // sp) + 1)

    def _warm_up(self, max_tokens: int) -> None:
        from .base_step import warm_up_fused

        first = {}
        for mod in self.modules:  # the first layer's projections
            first.setdefault(mod._fp_kind, mod)
        rows = self.buckets or self.base_rows(max_tokens)
        seconds = warm_up_fused(self._fused, rows, first["qkv"], first["o"], first["down"])
        logger.info("fusedpar: base-mode kernels compiled for %d row counts (%d..%d rows per rank) in %.1f s",
                    len(rows), rows[0], rows[-1], seconds)

    # ---- per step -----------------------------------------------------------------------------
    def begin_step(self, num_tokens: int, compile_shift=None) -> None:
        """Decide the mode of a step of `num_tokens` tokens and set the step up for it.

        compile_shift: a callable that runs the decoder model on this step's inputs through vLLM's
        compiled path (see `_first_compile`); called at most once, before the compiled path has
        been traced.
        """
        from vllm.forward_context import get_forward_context, is_forward_context_available

        fc = get_forward_context() if is_forward_context_available() else None
        mode = self.policy.mode(num_tokens, self.layout.sp) if num_tokens > 0 else "shift"
        if mode == "base" and fc is None:
            # without a forward context the compiled model cannot be bypassed: shift is always exact
            mode = "shift"
        if fc is not None and self._shift_trace_pending():
            self._first_compile(fc, mode, num_tokens, compile_shift)
        if mode == "base":
            from vllm.config import CUDAGraphMode

            if fc.cudagraph_runtime_mode == CUDAGraphMode.FULL:
                raise RuntimeError(
                    f"fusedpar: vLLM runs a full CUDA graph for a {num_tokens}-token step, above "
                    f"shift_threshold={self.policy.threshold}; graphs cannot switch modes. Limit capture sizes with "
                    f"--compilation-config '{{\"max_cudagraph_capture_size\": {self.policy.threshold}}}'"
                )
            fc.skip_compiled = True  # vLLM runs the decoder model's eager forward for this step
            if self.use_fused and self._fused is None and not self._is_capturing():
                self.fused()  # build and compile before the step, not inside it
        if self.base_kernels is not None:
            self.base_kernels.end()
            if mode == "base":
                self.base_kernels.begin()
        self.mode = mode
        self.num_tokens = num_tokens
        if mode == "base":
            m = -(-num_tokens // self.layout.sp)
            self.padded_tokens = (bucket_for(m, self.buckets) if self.buckets else m) * self.layout.sp
        else:
            self.padded_tokens = num_tokens
        if self.runner is not None:
            self.runner.ran = False
            if mode == "base":  # vLLM calls decoder_model.forward when the step skips the compiled graph
                self.decoder_model.forward = self.runner.forward
        # profile / warm-up runs carry no attention metadata, graph captures run on a capturing
        # stream: neither is a step of the workload, so neither is counted
        self._counted = self._is_workload_step(fc)

    # The compiled (shift) path must be traced at a token count that torch does not specialize on.
    # vLLM marks the token dimension dynamic and traces the decoder model once, at its first compiled
    # call, with dynamo's guards dropped. A dimension of size 0 or 1 is specialized (a constant) even
    # when marked dynamic, so a trace taken at a one-token step is a graph for exactly one token, and
    # with no guard left it is replayed for every later shift step: a multi-token shift step then
    # writes past buffers sized for one row. Plain vLLM traces at its profile run (max_num_batched_tokens
    # tokens); with fusedpar that run is a base step, which bypasses the compiled model, so without
    # `_first_compile` the first compiled call would be the first shift step the workload happens to
    # send, often a one-token decode.
    MIN_TRACE_TOKENS = 2

    def _shift_trace_pending(self) -> bool:
        """Whether vLLM will compile the decoder model for shift steps and has not traced it yet
        (threshold 0: every step is a base step, nothing runs the compiled model)."""
        m = self.decoder_model
        return (self.policy.threshold > 0 and m is not None and not getattr(m, "do_not_compile", True)
                and not self._decoder_compiled())

    def _first_compile(self, fc, mode: str, num_tokens: int, compile_shift) -> None:
        """Before the compiled path is traced: a base step traces it first, on its own inputs (the
        profile run: the size and the inputs plain vLLM traces with); a shift step too small to trace
        at runs vLLM's eager model instead, and the trace waits for a step that can take it."""
        if self._is_capturing():
            return
        if mode == "base" and compile_shift is not None and num_tokens >= self.MIN_TRACE_TOKENS:
            logger.info("fusedpar: tracing vLLM's compiled model (shift mode) at this %d-token base step, "
                        "before running it in base mode", num_tokens)
            compile_shift()  # the layers are in shift mode: vLLM's TP = P model, output dropped
            if self._shift_trace_pending():
                raise RuntimeError("fusedpar: running the decoder model through vLLM's compiled path did not "
                                   "compile it; the shift path would be traced later at an arbitrary size")
        elif mode == "shift" and num_tokens < self.MIN_TRACE_TOKENS:
            fc.skip_compiled = True  # vLLM's own eager model: the same shift math, nothing traced

    def _is_capturing(self) -> bool:
        return self.is_cuda and torch.cuda.is_current_stream_capturing()

    def _is_workload_step(self, fc) -> bool:
        return fc is not None and bool(fc.attn_metadata) and not self._is_capturing()

    def end_step(self) -> None:
        mode, self.mode = self.mode, "shift"
        if self.base_kernels is not None:
            self.base_kernels.end()
        ran = False
        if self.runner is not None:
            self.decoder_model.__dict__.pop("forward", None)  # the class's forward again
            ran, self.runner.ran = self.runner.ran, False
        logger.debug("fusedpar step: %s, %d tokens (counted: %s)", mode, self.num_tokens, self._counted)
        if mode == "base" and not ran:
            raise RuntimeError(
                "fusedpar: a base-mode step did not run the base path (the compiled model ran instead); "
                "refusing to return possibly wrong results"
            )
        if not self._is_capturing():
            self.steps.model_step(mode, self.num_tokens, self.padded_tokens - self.num_tokens, self._counted)
        self._counted = False

    @property
    def local_rows(self) -> int:
        return self.padded_tokens // self.layout.sp

    # ---- hooks --------------------------------------------------------------------------------
    def watch_for_root(self, layer_prefix: str) -> None:
        """Remember the first decoder layer and install the per-model hooks as soon as the model that
        holds it is assembled (before any forward: the first step already honours the threshold).

        Layers cannot see their parents while the model is being built. A module-registration hook
        sees the root assign its decoder model (`self.model = LlamaModel(...)`), whose layers are
        complete by then; `layer_prefix` ("model.layers.0") names that assignment. A forward pre-hook
        guards the other way round: a model that runs before its hooks were installed (vLLM built it
        some other way, e.g. its Transformers backend) is an error, not a silent shift-only engine.
        """
        if self.layer_prefix is not None:
            return
        self.layer_prefix = layer_prefix
        from torch.nn.modules.module import register_module_forward_pre_hook, register_module_module_registration_hook

        self._watchers = [register_module_module_registration_hook(self._on_register),
                          register_module_forward_pre_hook(self._unhooked_call)]

    def _holds_first_layer(self, module, path: str) -> bool:
        try:
            target = module.get_submodule(f"{path}.self_attn.qkv_proj" if path else "self_attn.qkv_proj")
        except AttributeError:
            return False
        return getattr(target, "_fp", None) is self

    def _on_register(self, parent, name, child):
        first, _, rest = self.layer_prefix.partition(".")
        if self.root is None and name == first and rest and self._holds_first_layer(child, rest):
            self._stop_watching()
            self.install_model_hooks(parent, child)
        return None

    def _unhooked_call(self, module, args):
        if self.root is None and self._holds_first_layer(module, self.layer_prefix):
            self._stop_watching()
            raise FusedparConfigError(
                f"fusedpar: vLLM runs this model as {type(module).__name__}, which fusedpar did not see being "
                f"assembled; fusedpar hooks into vLLM's own {', '.join(SUPPORTED_ARCHITECTURES)} (model_impl 'auto' "
                "or 'vllm')")
        return None

    def _stop_watching(self) -> None:
        for handle in self._watchers:
            handle.remove()
        self._watchers = []

    def install_model_hooks(self, root, inner) -> None:
        """Hooks on `root` (the causal LM) and its decoder model `inner` (root.<first part of layer_prefix>)."""
        if type(root).__name__ not in SUPPORTED_ARCHITECTURES:  # e.g. vLLM's Transformers backend
            raise FusedparConfigError(
                f"fusedpar: vLLM runs this model as {type(root).__name__}; fusedpar hooks into vLLM's own "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} (model_impl 'auto' or 'vllm')")
        model_path, _, rest = self.layer_prefix.partition(".")
        layers_path, _, idx = rest.rpartition(".")
        layers = inner.get_submodule(layers_path)
        if int(idx) != 0 or len(layers) == 0:
            raise RuntimeError(f"fusedpar: expected {self.layer_prefix} to be the first decoder layer")
        norm = getattr(inner, "norm", None)
        if norm is None:
            raise RuntimeError(f"fusedpar: {type(inner).__name__} has no final norm to gather the sequence at")
        n_taken = dict(self.layers_taken)
        expected = len(layers)
        if any(v != expected for v in n_taken.values()) or len(n_taken) != 4:
            raise RuntimeError(f"fusedpar: took over {n_taken} linear layers; expected 4 kinds x {expected} layers")
        acts, attns = [], []
        for layer in layers:
            mlp = getattr(layer, "mlp", None)
            act = getattr(mlp, "act_fn", None)
            if act is None or getattr(getattr(mlp, "gate_up_proj", None), "_fp", None) is not self:
                raise RuntimeError(f"fusedpar: {type(layer).__name__} has no mlp.act_fn after fusedpar's gate_up_proj")
            attn = getattr(getattr(layer, "self_attn", None), "attn", None)
            if attn is None:
                raise RuntimeError(f"fusedpar: {type(layer).__name__} has no self_attn.attn (vLLM's Attention)")
            acts.append(act)
            attns.append(attn)
        from .base_runner import BaseRunner
        from .base_step import BaseKernels

        self.base_kernels = BaseKernels(inner, acts, self.layout.sp, cuda=self.is_cuda)
        self.runner = BaseRunner(self, inner, layers, norm, attns)
        self.root, self.decoder_model = root, inner
        root.register_forward_pre_hook(self._root_pre, with_kwargs=True)
        root.register_forward_hook(self._root_post)
        logits = root.compute_logits

        def compute_logits(hidden_states, *args, **kwargs):  # every step's logits, replayed steps' too
            # the sampler passes hidden_states[logits_indices], a tensor of its own; prompt logprobs pass
            # slices (views) of a step's hidden states, several per step: not steps
            if hidden_states._base is None:
                self.steps.logits(int(hidden_states.shape[0]))
            return logits(hidden_states, *args, **kwargs)

        root.compute_logits = compute_logits
        logger.info("fusedpar: hooks on %s (mode per step); base steps run %s.forward as fusedpar's base runner "
                    "over %s.%s and switch %s", type(root).__name__, model_path, model_path, layers_path,
                    self.base_kernels.describe())

    def _root_pre(self, module, args, kwargs):
        inputs = inspect.signature(module.forward).bind(*args, **kwargs).arguments
        x = next((inputs.get(k) for k in ("input_ids", "inputs_embeds", "positions") if inputs.get(k) is not None),
                 None)

        def compile_shift():  # the root's own call of its decoder model (vLLM's llama.py / qwen2.py / qwen3.py)
            self.decoder_model(inputs.get("input_ids"), inputs.get("positions"), inputs.get("intermediate_tensors"),
                               inputs.get("inputs_embeds"))

        self.begin_step(int(x.shape[0]) if x is not None else 0, compile_shift)
        return None

    def _root_post(self, module, args, output):
        self.end_step()
        return None

    # ---- reporting ----------------------------------------------------------------------------
    def snapshot(self) -> dict:
        return {
            "rank": self.rank,
            "sequence_parallel_size": self.layout.sp,
            "base_tensor_parallel_size": self.layout.tp,
            "tensor_parallel_size": self.layout.replica_size,
            "shift_threshold": self.policy.threshold,
            "fused_kernels": self.use_fused,
            "base_graph_buckets": len(self.runner.graphs.sets) if self.runner and self.runner.graphs else 0,
            # whether vLLM runs the decoder model compiled (then shift steps use the compiled graph)
            "shift_compiled": self._decoder_compiled(),
            # bytes behind the four sharded projections of every decoder layer (biases excluded):
            # exactly the base shards, the shift weights being views of them
            "weight_bytes": sum(m.weight.untyped_storage().nbytes() for m in self.modules),
            "base_shard_bytes": self._base_shard_bytes(),
            **self.steps.stats,
        }

    def _base_shard_bytes(self) -> int:
        hf = self.vllm_config.model_config.hf_text_config
        per_layer = self.shards.base_bytes(self.rank, hf.hidden_size, self.dtype.itemsize)
        return per_layer * self.layers_taken.get("qkv", 0)

    def _decoder_compiled(self) -> bool:
        m = self.decoder_model
        if m is None or getattr(m, "do_not_compile", True):
            return False
        return bool(getattr(m, "compiled", False) or getattr(m, "aot_compiled_fn", None) is not None)

    def reset_stats(self) -> None:
        self.steps.reset()

    def summary(self) -> str:
        s = self.steps.stats
        lay = self.layout
        return (f"fusedpar rank {self.rank} (SP={lay.sp} x TP={lay.tp} <-> TP={lay.replica_size}, "
                f"threshold {self.policy.threshold}): base {s['base_steps']} steps / {s['base_tokens']} tokens "
                f"(+{s['base_padding_tokens']} padding), shift {s['shift_steps']} steps / {s['shift_tokens']} tokens")

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
