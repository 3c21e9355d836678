"""What one worker runs: the deployment, validated, and every decision derived from it.

`deployment_info(vllm_config)` extracts the numbers config.check_deployment needs; `Deployment.of`
builds the frozen `Deployment` of a worker once, from vLLM's config and the fusedpar section:
the checks (every problem named, the engine fails to start), this rank's place in the layout, its
weight shards and heads, the dtype, whether base steps run on the fused kernels and as CUDA graphs
(fusedpar.layers.kernel_choice, the rule the HF adapter follows too), the shift policy and the row
buckets of base steps. Nothing in it changes while the engine runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fusedpar.layers import DecoderConfig
from fusedpar.layers.kernel_choice import choose_cuda_graphs, choose_fused_kernels
from fusedpar.layers.step_plan import StepModeRule, padded_token_count
from fusedpar.layouts import HeadPlacement, ModelDims, ParallelLayout, RankCoords, StepMode, WeightShardMap

from .base_runner import bucket_for, row_buckets
from .config import DeploymentInfo, FusedparConfigError, FusedparVllmConfig, check_deployment, fp8_checkpoint
from .step import Step

if TYPE_CHECKING:
    from fusedpar.integrations.hf.fp8 import FP8Format


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
        quantization_config=_quantization_config(mc.hf_config),
        kv_cache_dtype=str(vllm_config.cache_config.cache_dtype),
        lora=vllm_config.lora_config is not None,
        speculative=vllm_config.speculative_config is not None,
        compilation_mode=mode_name,
        full_cudagraphs=full,
        max_cudagraph_capture_size=cc.max_cudagraph_capture_size,
    )


def _quantization_config(hf_config) -> dict | None:
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None or isinstance(qc, dict):
        return qc
    return qc.to_dict() if callable(getattr(qc, "to_dict", None)) else dict(vars(qc))


@dataclass(frozen=True)
class Deployment:
    """One worker's deployment (see the module docstring).

    rank: this worker's rank in vLLM's TP group (= the shift group, = the torch.distributed world);
    coords: its (sp, tp) in the base layout; shards / placement: its weight shards and heads in both
    modes; max_tokens: vLLM's max_num_batched_tokens (the largest step); buckets: the rows per rank
    a base step pads to when base steps run as CUDA graphs, else (); fp8: the FP8 format of the
    projection weights (fusedpar.integrations.hf.fp8.FP8Format), None for an unquantized model.
    """

    cfg: FusedparVllmConfig
    layout: ParallelLayout
    rank: int
    coords: RankCoords
    dims: ModelDims
    shards: WeightShardMap
    hidden_size: int
    device: torch.device
    dtype: torch.dtype
    use_fused: bool
    use_graphs: bool
    policy: StepModeRule
    max_tokens: int
    buckets: tuple[int, ...]
    fp8: FP8Format | None = None

    @classmethod
    def of(cls, vllm_config, cfg: FusedparVllmConfig) -> Deployment:
        """Check the deployment (FusedparConfigError naming every problem; RuntimeError when vLLM's
        process groups are not the ones fusedpar expects) and take its decisions."""
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
        dims = ModelDims(info.num_attention_heads, info.num_key_value_heads, info.head_dim, info.intermediate_size)
        is_cuda = current_platform.is_cuda_alike()
        device = torch.device("cuda", torch.cuda.current_device()) if is_cuda else torch.device("cpu")
        dtype = vllm_config.model_config.dtype
        fp8, _ = fp8_checkpoint(info)  # check_deployment refused any problem
        use_fused = layout.sp > 1 and fp8 is None and choose_fused_kernels(
            None if cfg.fused_kernels == "auto" else cfg.fused_kernels, device=device, dtype=dtype,
            subject="the engine", half_only=True, name="fused_kernels",
            refuse=lambda why: FusedparConfigError("fusedpar: fused_kernels=true is not possible: " + "; ".join(why)))
        use_graphs = choose_cuda_graphs(None, use_fused=use_fused, blockers=_graph_blockers(vllm_config, layout))
        policy = StepModeRule(cfg.threshold(P, base_graphs=use_graphs,
                                           capture_size=info.max_cudagraph_capture_size or 0))
        max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        rows = _base_rows(policy.threshold, max_tokens, layout.sp)
        # with base graphs a base step pads to a row bucket (base_runner.row_buckets)
        buckets = row_buckets(rows.start, rows.stop - 1) if use_graphs and len(rows) else ()
        return cls(cfg=cfg, layout=layout, rank=rank, coords=layout.coords(rank), dims=dims,
                   shards=layout.weight_shards(dims), hidden_size=vllm_config.model_config.hf_text_config.hidden_size,
                   device=device, dtype=dtype, use_fused=use_fused, use_graphs=use_graphs, policy=policy,
                   max_tokens=max_tokens, buckets=buckets, fp8=fp8)

    @property
    def placement(self) -> HeadPlacement:
        """The q / kv heads of every rank in both modes."""
        return self.shards.placement

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def plan_step(self, num_tokens: int, *, can_skip_compiled: bool, counted: bool) -> Step:
        """The step of `num_tokens` tokens: its mode from the shift policy (shift for an empty step, and
        where vLLM's compiled model cannot be bypassed, can_skip_compiled False: shift is always exact)
        and, in base mode, its rows per rank."""
        sp = self.layout.sp
        mode = self.policy.mode(num_tokens, sp) if num_tokens > 0 else StepMode.SHIFT
        if mode is StepMode.SHIFT or not can_skip_compiled:
            return Step.shift(num_tokens, counted)
        m = -(-num_tokens // sp)
        return Step.base(num_tokens, bucket_for(m, self.buckets) if self.buckets else m, sp, counted)

    def base_rows(self) -> range:
        """Rows per rank (m) of every base step: n in (threshold, max_tokens] tokens, m = ceil(n / SP)."""
        return _base_rows(self.policy.threshold, self.max_tokens, self.layout.sp)

    def decoder_config(self) -> DecoderConfig:
        """The shapes of one decoder layer (what the fused communicator sizes its stages for)."""
        d = self.dims
        return DecoderConfig(hidden_size=self.hidden_size, num_q_heads=d.num_q_heads, num_kv_heads=d.num_kv_heads,
                             head_dim=d.head_dim, intermediate_size=d.intermediate_size)

    def fused_max_tokens(self) -> int:
        """The most tokens (SP x rows per rank) of a base step, padding included."""
        if self.buckets:
            return self.buckets[-1] * self.layout.sp
        return padded_token_count(self.max_tokens, self.layout.sp)

    def base_shard_bytes(self, num_layers: int) -> int:
        """Bytes of this rank's base shards of the four projections over `num_layers` decoder layers."""
        itemsize = 1 if self.fp8 is not None else self.dtype.itemsize  # e4m3 weights
        return self.shards.base_bytes(self.rank, self.hidden_size, itemsize) * num_layers


def _base_rows(threshold: int, max_tokens: int, sp: int) -> range:
    return range(-(-(threshold + 1) // sp), -(-max_tokens // sp) + 1)


def _graph_blockers(vllm_config, layout: ParallelLayout) -> list[str]:
    """What keeps base steps from running as CUDA graphs besides the fused kernels: base TP > 1 (its
    all-reduces may take NCCL), and vLLM itself not allowed graphs (enforce_eager, cudagraph_mode NONE)."""
    why = []
    if layout.tp != 1:
        why.append(f"base TP={layout.tp}")
    if vllm_config.model_config.enforce_eager:
        why.append("enforce_eager")
    if getattr(vllm_config.compilation_config.cudagraph_mode, "name", "NONE") == "NONE":
        why.append("cudagraph_mode NONE")
    return why
