"""vLLM linear layers that hold fusedpar's base shard and run both modes (PluggableLayer OOT).

`register_layers()` registers three out-of-tree replacements with vLLM (>= 0.16):
QKVParallelLinear, MergedColumnParallelLinear and RowParallelLinear. vLLM instantiates them in
place of its own classes; each one decides in its constructor whether to take over:

- fusedpar not configured for this engine, a layer outside a decoder layer's
  self_attn.qkv_proj / self_attn.o_proj / mlp.gate_up_proj / mlp.down_proj, or disable_tp:
  the instance turns back into vLLM's own class (`self.__class__ = <vLLM class>`) and is
  constructed by it: nothing changes.
- otherwise vLLM's constructor runs as for TP = P (vLLM's own shapes, head counts and
  attributes, which the attention module reads), then the weight is replaced by this rank's
  *base* shard (fusedpar.layouts.WeightShardMap, TP = P / SP) with a weight loader that copies
  each global segment of the checkpoint tensors into it. The shift (TP = P) weight is a
  `narrow` view of the base shard, taken in forward: zero extra bytes.

Modes (the worker's current step.Step says which; under torch.compile the shift path is traced):

  qkv_proj   base: [m, d] @ base qkv -> [m, SP blocks] -> seq->head all-to-all -> [n_pad, blk]
                   -> first n rows: q|k|v of this rank's TP=P heads for every token, exactly
                   what vLLM's TP=P attention expects (rotary with the full positions, the
                   attention backend and its KV cache run unchanged, same heads in both modes).
             shift: F.linear with the view (block s of the base rows).
  o_proj     base: attn [n, q*hd] -> zero-pad to n_pad -> head->seq all-to-all -> [m, SP*q*hd]
                   -> @ base o -> all-reduce over the base TP group -> [m, d].
             shift: F.linear with the column view, vLLM's tensor_model_parallel_all_reduce.
  gate_up    base: [m, d] @ base gate_up -> [m, SP x (gate c | up c)], the blocked layout the MLP's
                   SiluAndMul takes in base steps (base_step.py) -> [m, SP x c].
             shift: F.linear with the view ([gate | up] of chunk r, vLLM's TP=P layout).
  down_proj  base: [m, I/TP] @ base down -> all-reduce over the base TP group.
             shift: F.linear with the column view, vLLM's all-reduce (custom all-reduce kept).

The base qkv / o / down stages are fusedpar's communicator stages (fusedpar.layers.comm):
FusedComm's fused kernels on CUDA with bf16/fp16, PlainComm's cuBLAS + torch.distributed elsewhere.

Weights are kept unpacked (vLLM's CPU backend would repack the full weight into a oneDNN
handle and drop it, which would break the views): every GEMM here is torch.nn.functional.linear,
which is also what vLLM's unquantized CUDA path calls.

FP8 checkpoints (Deployment.fp8, see config.fp8_checkpoint): the base shard is held as e4m3 with its
fp32 scales beside it under the checkpoint's scale name (`weight_scale` or `weight_scale_inv`), cut
with the weight: block scales by blocks, per-channel and per-tensor scales as one scale per output row
(a merged qkv / gate_up keeps each source tensor's own scale on its rows; exact). The loaders copy every
base segment of the checkpoint's weights and scales. Base mode runs fusedpar's FP8 linear layer
(fusedpar.layers.fp8_weights.FP8Weight, dynamic activation scales) through the same stages. Activations
are quantised per token over the columns a TP = P rank holds in both modes: o / down keep their per-row
scales once per column group of the shift width (block scales: per block of block_in columns, which never
straddles a rank), so base and shift steps compute the same FP8 model, vLLM's TP = P one. Shift
mode runs vLLM's own FP8 kernel over views of the shard and its scales where that kernel reads a
plain [K, N] weight and per-row scales (vLLM's torch._scaled_mm channel-wise kernel, what its CPU
build picks without AMX), and fusedpar's FP8 linear layer over the same views where vLLM's kernel
would repack the weight (its AMX kernels, block FP8): zero extra weight bytes either way.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch.nn import Parameter
from vllm.config import get_current_vllm_config_or_none
from vllm.distributed import tensor_model_parallel_all_reduce
from vllm.model_executor.custom_op import PluggableLayer, op_registry_oot
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)
from vllm.model_executor.utils import set_weight_attrs

from fusedpar.kernels.fp8 import E4M3
from fusedpar.layers.fp8_weights import FP8Weight, fp8_shift_view, linear
from fusedpar.layouts import StepMode
from fusedpar.layouts.scale_blocks import source_sizes

from .config import parse_additional_config
from .state import WorkerState, state_for

_PREFIX = re.compile(r"^(?P<layer>(?:.*\.)?layers\.\d+)\.(?P<kind>self_attn\.qkv_proj|self_attn\.o_proj|"
                     r"mlp\.gate_up_proj|mlp\.down_proj)$")
_KIND = {"self_attn.qkv_proj": "qkv", "self_attn.o_proj": "o", "mlp.gate_up_proj": "gate_up", "mlp.down_proj": "down"}


class _KeepUnpackedWeights(UnquantizedLinearMethod):
    """vLLM's unquantized method minus the post-load repacking (the base shard must stay a tensor)."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        return None


class _KeepFP8Shards(UnquantizedLinearMethod):
    """The FP8 counterpart: no post-load repacking or requantizing; builds the layer's FP8 views instead."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        layer._fp_fp8_views()


class _VllmFP8Operands:
    """What vLLM's FP8 kernel reads off a layer (by its parameter names): the shift view as [K, N] and its
    per-row scales, views of the base shard."""

    def __init__(self, names, w: FP8Weight):
        weight, scale, *rest = names
        setattr(self, weight, w.q.t())
        setattr(self, scale, w.scale)
        for name in rest:
            setattr(self, name, None)  # dynamic activation scales


def _vllm_kwargs(took, kwargs: dict) -> dict:
    """vLLM's constructor arguments for a layer fusedpar takes over: without the quantization config for
    block FP8, whose vLLM kernels (AMX on CPU) repack the weight and never run on the shift views."""
    fp8 = took[0].deployment.fp8
    if fp8 is not None and fp8.scheme.weight == "block":
        return {**kwargs, "quant_config": None}
    return kwargs


def _take_over(prefix: str, kwargs: dict) -> tuple[WorkerState, str, str] | None:
    """(state, kind, layer prefix) if fusedpar runs this engine and this is one of its layers."""
    vllm_config = get_current_vllm_config_or_none()
    if vllm_config is None:
        return None
    cfg = parse_additional_config(vllm_config.additional_config)  # raises on a bad section
    if cfg is None:
        return None
    state = state_for(vllm_config, cfg)  # the deployment check (raises) runs at the first linear layer
    match = _PREFIX.match(prefix or "")
    if match is None or kwargs.get("disable_tp"):
        return None  # not a decoder-layer projection: vLLM's own class
    return state, _KIND[match.group("kind")], match.group("layer")


class _FusedparLinear:
    """Shared part of the three layers (mixed in before the vLLM class)."""

    _fp: WorkerState
    _fp_kind: str

    def _fp_adopt(self, state: WorkerState, kind: str, layer_prefix: str) -> None:
        if self.skip_bias_add and self.bias is not None:
            raise RuntimeError(f"fusedpar: {self.prefix}: skip_bias_add with a bias is not supported")
        self._fp, self._fp_kind = state, kind
        dep = state.deployment
        shard = dep.shards.shard(dep.rank, kind)
        self._fp_shard = shard
        self._fp_view = shard.shift  # (lo, hi) along shard.torch_dim
        state.model.adopt(self, kind, layer_prefix)
        dim = shard.torch_dim
        old = self.weight
        shape = list(old.shape)
        shape[dim] = shard.size
        hi_lo = self._fp_view[1] - self._fp_view[0]
        if old.shape[dim] != hi_lo:
            raise RuntimeError(f"fusedpar: {self.prefix}: vLLM's TP={dep.layout.replica_size} shard has "
                               f"{old.shape[dim]} rows/columns, fusedpar's shift view {hi_lo}")
        fp8 = self._fp_fp8 = dep.fp8
        self.weight = self._fp_param(torch.empty(shape, dtype=old.dtype if fp8 is None else E4M3, device=old.device),
                                     input_dim=1, output_dim=0)
        del old
        if getattr(self, "bias", None) is not None and dim == 0:
            b = self.bias
            self.bias = self._fp_param(torch.empty(shard.size, dtype=b.dtype, device=b.device), output_dim=0)
        if fp8 is None:
            self.quant_method = _KeepUnpackedWeights()
            return
        # vLLM's FP8 kernel for the shift views: its torch._scaled_mm channel-wise kernel reads the weight as
        # [K, N] and per-row scales; the others repack the weight (None: fusedpar's FP8 layer over the views)
        kernel = getattr(getattr(self, "scheme", None) or self.quant_method, "fp8_linear", None)  # compressed-tensors
        self._fp_vllm_kernel = kernel if type(kernel).__name__ == "ChannelWiseTorchFP8ScaledMMLinearKernel" else None
        # per-row scales; o / down repeat them over column groups of the shift width: a base step then
        # quantises its activations per token over the columns each TP = P rank quantises in a shift step
        tile = fp8.scheme.block if fp8.scheme.weight == "block" else (1, shape[1] if dim == 0 else hi_lo)
        self._fp_tile = tile
        scale = torch.empty([-(-n // t) for n, t in zip(shape, tile, strict=True)], dtype=torch.float32,
                            device=self.weight.device)
        for name in ("weight_scale", "weight_scale_inv", "input_scale"):
            if name in self._parameters:
                del self._parameters[name]
        self.register_parameter(fp8.scale_name, self._fp_param(scale))
        self.quant_method = _KeepFP8Shards()

    @property
    def _fp_scale(self) -> Parameter:
        return getattr(self, self._fp_fp8.scale_name)

    def _fp_fp8_views(self) -> None:
        """The base shard as FP8Weight and its shift view (views of the parameters), once loaded."""
        self._fp_base8 = FP8Weight(self.weight.data, self._fp_scale.data, self._fp_tile)
        self._fp_shift8 = fp8_shift_view(self._fp_base8, self._fp_shard)
        if self._fp_vllm_kernel is not None:
            self._fp_vllm_operands = _VllmFP8Operands(self._fp_vllm_kernel.layer_param_names, self._fp_shift8)

    def _fp_shift_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The shift-mode GEMM on the views of the base shard: F.linear, or for FP8 vLLM's FP8 kernel
        (fusedpar's FP8 layer where vLLM's kernel cannot run on views)."""
        if self._fp_fp8 is None:
            return F.linear(x, self._fp_weight(StepMode.SHIFT), bias)
        if self._fp_vllm_kernel is not None:
            return self._fp_vllm_kernel.apply_weights(self._fp_vllm_operands, x, bias)
        return self._fp_shift8.linear(x, bias)

    def _fp_base_weight(self) -> torch.Tensor | FP8Weight:
        return self.weight if self._fp_fp8 is None else self._fp_base8

    def _fp_source_shape(self, source: str) -> tuple[int, int]:
        """[out, in] of the whole checkpoint weight `source` (q, k, v, o, gate, up, down)."""
        dep = self._fp.deployment
        size, hidden = source_sizes(dep.dims)[source], dep.hidden_size
        return (size, hidden) if self._fp_shard.torch_dim == 0 else (hidden, size)

    def _fp_copy_scales(self, loaded: torch.Tensor, source: str) -> None:
        """Copy the scales of every base segment of global weight `source` from its checkpoint scales."""
        from fusedpar.integrations.hf.fp8 import fp8_segment

        shard, fmt = self._fp_shard, self._fp_fp8
        dim, full = shard.torch_dim, self._fp_source_shape(source)
        dst, pos, hit = self._fp_scale.data, 0, False
        for seg in shard.base:
            if seg.source == source:
                seg_shape = list(full)
                seg_shape[dim] = seg.size
                piece = fp8_segment(torch.empty(seg_shape, dtype=E4M3, device="meta"), loaded, fmt, full, dim,
                                    seg.start, f"fusedpar: {self.prefix}: checkpoint {source} scales")
                if fmt.scheme.weight != "block":
                    piece = piece.unit_tiles(0)  # one scale per output row (exact)
                if fmt.scheme.weight != "block" and dim == 1:  # every row's scale, in each column group
                    dst.copy_(piece.scale.expand(-1, dst.shape[1]))
                else:
                    dst.narrow(dim, pos // self._fp_tile[dim], piece.scale.shape[dim]).copy_(piece.scale)
                hit = True
            pos += seg.size
        if not hit:
            raise ValueError(f"fusedpar: {self.prefix}: no base segment of {source!r}")

    def _fp_split_scales(self, loaded: torch.Tensor, sources: tuple[str, ...]) -> None:
        """Scales of several sources stored as one tensor (a merged qkv / gate_up on disk), split by source:
        one value per source (per tensor), or rows (blocks of rows) in the sources' order."""
        if loaded.numel() == len(sources):
            parts = loaded.reshape(-1).split(1)
        else:
            rows = [-(-self._fp_source_shape(s)[0] // self._fp_tile[0]) for s in sources]
            parts = loaded.reshape(sum(rows), -1).split(rows, dim=0)
        for source, part in zip(sources, parts, strict=True):
            self._fp_copy_scales(part, source)

    def _fp_param(self, data: torch.Tensor, **attrs) -> Parameter:
        p = Parameter(data, requires_grad=False)
        set_weight_attrs(p, {"weight_loader": self._fp_load, **attrs})
        return p

    def _fp_copy_segments(self, param: Parameter, loaded: torch.Tensor, source: str) -> None:
        """Copy every base segment of global weight `source` from the checkpoint tensor `loaded` (its scales
        for the FP8 scale parameter)."""
        if self._fp_fp8 is not None and param is self._fp_scale:
            self._fp_copy_scales(loaded, source)
            return
        shard = self._fp_shard
        dim = shard.torch_dim if param.dim() > 1 else 0
        pos, hit = 0, False
        for seg in shard.base:
            if seg.source == source:
                if loaded.shape[dim] < seg.stop:
                    raise ValueError(f"fusedpar: {self.prefix}: checkpoint {source} has {loaded.shape[dim]} "
                                     f"rows/columns along dim {dim}, the shard needs [{seg.start}, {seg.stop})")
                param.data.narrow(dim, pos, seg.size).copy_(loaded.narrow(dim, seg.start, seg.size))
                hit = True
            pos += seg.size
        if not hit:
            raise ValueError(f"fusedpar: {self.prefix}: no base segment of {source!r}")

    def _fp_weight(self, mode: StepMode) -> torch.Tensor:
        if mode is StepMode.BASE:
            return self.weight
        lo, hi = self._fp_view
        return self.weight.narrow(self._fp_shard.torch_dim, lo, hi - lo)

    def _fp_bias(self, mode: StepMode) -> torch.Tensor | None:
        if self.bias is None or mode is StepMode.BASE or self._fp_shard.torch_dim != 0:
            return self.bias
        lo, hi = self._fp_view
        return self.bias.narrow(0, lo, hi - lo)

    def _fp_base_active(self) -> bool:
        # Under torch.compile this is constant False: the compiled graph is always the shift path.
        return not torch.compiler.is_compiling() and self._fp.step.is_base

    def _fp_return(self, out: torch.Tensor):
        # skip_bias_add with a bias is rejected in _fp_adopt: the returned bias is always None
        return (out, None) if self.return_bias else out

    def extra_repr(self) -> str:
        lo, hi = self._fp_view
        return (f"fusedpar {self._fp_kind}: base shard {tuple(self.weight.shape)}, shift view [{lo}:{hi}] "
                f"along dim {self._fp_shard.torch_dim}")


class FusedparQKVParallelLinear(_FusedparLinear, QKVParallelLinear):
    def __init__(self, *args, **kwargs):
        took = _take_over(kwargs.get("prefix", ""), kwargs)
        if took is None:
            self.__class__ = QKVParallelLinear
            QKVParallelLinear.__init__(self, *args, **kwargs)
            return
        super().__init__(*args, **_vllm_kwargs(took, kwargs))
        dep = took[0].deployment
        mine = (self.total_num_heads, self.total_num_kv_heads, self.head_size, self.v_head_size)
        dims = dep.dims
        if mine != (dims.num_q_heads, dims.num_kv_heads, dims.head_dim, dims.head_dim):
            raise RuntimeError(f"fusedpar: {self.prefix} has heads {self.total_num_heads}/{self.total_num_kv_heads} x "
                               f"{self.head_size} (v {self.v_head_size}), the config {dep.dims}")
        # The KV cache vLLM allocates for this rank holds the kv heads of its own TP=P sharding
        # (QKVParallelLinear: rank // replicas when kv heads are replicated); fusedpar's placement
        # must name the same heads in both modes, or base-mode steps would fill the wrong cache.
        r = self.tp_rank
        vllm_kv = ((r // self.num_kv_head_replicas,) if self.num_kv_head_replicas > 1
                   else tuple(range(r * self.num_kv_heads, (r + 1) * self.num_kv_heads)))
        place = dep.placement
        mine_q = tuple(range(r * self.num_heads, (r + 1) * self.num_heads))
        for mode in StepMode:
            if place.kv_heads(dep.rank, mode) != vllm_kv or place.q_heads(dep.rank, mode) != mine_q:
                raise RuntimeError(f"fusedpar: rank {r} {mode} heads q {place.q_heads(dep.rank, mode)} kv "
                                   f"{place.kv_heads(dep.rank, mode)} differ from vLLM's q {mine_q} kv {vllm_kv}")
        self._fp_adopt(*took)

    def _fp_load(self, param, loaded_weight, loaded_shard_id=None):
        if loaded_shard_id is None and self._fp_fp8 is not None and param is self._fp_scale:
            self._fp_split_scales(loaded_weight, ("q", "k", "v"))
            return
        if loaded_shard_id is None:  # fused q|k|v on disk
            d = self.head_size
            sizes = [self.total_num_heads * d, self.total_num_kv_heads * d, self.total_num_kv_heads * d]
            for sid, part in zip("qkv", loaded_weight.split(sizes, dim=0), strict=True):
                self._fp_copy_segments(param, part, sid)
            return
        if loaded_shard_id not in ("q", "k", "v"):
            raise ValueError(f"fusedpar: {self.prefix}: shard id {loaded_shard_id!r} (expected q, k or v)")
        self._fp_copy_segments(param, loaded_weight, loaded_shard_id)

    def forward(self, input_):
        if self._fp_base_active():
            return self._fp_return(self._fp_forward_base(input_))
        return self._fp_return(self._fp_shift_linear(input_, self._fp_bias(StepMode.SHIFT)))

    def _fp_forward_base(self, x: torch.Tensor) -> torch.Tensor:
        step = self._fp.step
        if x.shape[0] != step.local_rows:
            raise RuntimeError(f"fusedpar: {self.prefix} got {x.shape[0]} rows in base mode, "
                               f"expected {step.local_rows}")
        out = self._fp.comms.comm(x).qkv(x, self._fp_base_weight(), StepMode.BASE, self.bias)  # [n_pad, blk]
        return out[: step.num_tokens]  # padding rows never reach rotary, attention or the KV cache


class FusedparMergedColumnParallelLinear(_FusedparLinear, MergedColumnParallelLinear):
    def __init__(self, *args, **kwargs):
        took = _take_over(kwargs.get("prefix", ""), kwargs)
        if took is None or took[1] != "gate_up":
            self.__class__ = MergedColumnParallelLinear
            MergedColumnParallelLinear.__init__(self, *args, **kwargs)
            return
        super().__init__(*args, **_vllm_kwargs(took, kwargs))
        dims = took[0].deployment.dims
        if list(self.output_sizes) != [dims.intermediate_size] * 2:
            raise RuntimeError(f"fusedpar: {self.prefix} has output sizes {self.output_sizes}, expected "
                               f"[{dims.intermediate_size}] * 2 (gate, up)")
        self._fp_adopt(*took)

    def _fp_load(self, param, loaded_weight, loaded_shard_id=None):
        if loaded_shard_id is None or isinstance(loaded_shard_id, tuple):
            ids = (0, 1) if loaded_shard_id is None else loaded_shard_id
            if self._fp_fp8 is not None and param is self._fp_scale:
                self._fp_split_scales(loaded_weight, tuple(("gate", "up")[i] for i in ids))
                return
            parts = loaded_weight.split([self.output_sizes[i] for i in ids], dim=0)
            for i, part in zip(ids, parts, strict=True):
                self._fp_copy_segments(param, part, ("gate", "up")[i])
            return
        self._fp_copy_segments(param, loaded_weight, ("gate", "up")[loaded_shard_id])

    def forward(self, input_):
        if self._fp_base_active():
            # [m, SP blocks of (gate c | up c)]: the MLP's SiluAndMul takes this blocked layout in base
            # steps (base_step.BaseKernels), so no reordering copy
            return self._fp_return(linear(input_, self._fp_base_weight(), self.bias))
        return self._fp_return(self._fp_shift_linear(input_, self._fp_bias(StepMode.SHIFT)))


class FusedparRowParallelLinear(_FusedparLinear, RowParallelLinear):
    def __init__(self, *args, **kwargs):
        took = _take_over(kwargs.get("prefix", ""), kwargs)
        if took is None or took[1] not in ("o", "down"):
            self.__class__ = RowParallelLinear
            RowParallelLinear.__init__(self, *args, **kwargs)
            return
        super().__init__(*args, **_vllm_kwargs(took, kwargs))
        if not self.input_is_parallel or not self.reduce_results:
            raise RuntimeError(f"fusedpar: {self.prefix}: row-parallel layers must take parallel inputs and "
                               "reduce their results")
        self._fp_adopt(*took)

    def _fp_load(self, param, loaded_weight, loaded_shard_id=None):
        if param.dim() == 1:  # the bias of a row-parallel layer is replicated
            param.data.copy_(loaded_weight)
            return
        self._fp_copy_segments(param, loaded_weight, self._fp_kind)

    def forward(self, input_):
        add_bias = self.bias is not None
        if self._fp_base_active():
            step = self._fp.step
            comm = self._fp.comms.comm(input_)
            if self._fp_kind == "o":
                n = input_.shape[0]
                if n != step.num_tokens:
                    raise RuntimeError(f"fusedpar: {self.prefix} got {n} rows, the step has {step.num_tokens}")
                attn = F.pad(input_, (0, 0, 0, step.padded_tokens - n))  # zero padding rows
                out = comm.o_proj(attn, self._fp_base_weight(), StepMode.BASE)  # all-to-all + GEMM + TP all-reduce
            else:
                out = comm.row_parallel(input_, self._fp_base_weight(), StepMode.BASE)
            if add_bias:
                out = out + self.bias  # once, after the reduction
            return self._fp_return(out)
        bias_ = self.bias if add_bias and self.tp_rank == 0 else None
        out = self._fp_shift_linear(input_, bias_)
        if self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)  # vLLM's own (custom / shm) all-reduce
        return self._fp_return(out)


_OOT = {
    "QKVParallelLinear": FusedparQKVParallelLinear,
    "MergedColumnParallelLinear": FusedparMergedColumnParallelLinear,
    "RowParallelLinear": FusedparRowParallelLinear,
}


def register_layers() -> None:
    """Register the three classes with vLLM's PluggableLayer registry (idempotent)."""
    for name, cls in _OOT.items():
        existing = op_registry_oot.get(name)
        if existing is cls:
            continue
        if existing is not None:
            raise RuntimeError(f"fusedpar: another plugin already replaced vLLM's {name} with {existing}")
        PluggableLayer.register_oot(cls, name=name)
