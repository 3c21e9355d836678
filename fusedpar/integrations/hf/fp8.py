"""FP8 checkpoints in the Hugging Face adapter: which formats run, and their weights as FP8Weight.

Two checkpoint formats carry e4m3 projection weights with dynamic activation scales, the schemes of
fusedpar.kernels.fp8:
- transformers' fine-grained FP8 (`quant_method: "fp8"`, Qwen3 / DeepSeek "-FP8" checkpoints): a
  `weight_scale_inv` beside each weight, one fp32 scale per `weight_block_size` block, or one per
  tensor without a block size; activations scaled per token and group of block_in columns;
- compressed-tensors FP8 (`quant_method: "compressed-tensors"`, llm-compressor's "FP8-dynamic" and
  block recipes): a `weight_scale` per output channel, per tensor or per block, activations scaled
  per token (or per group for block weights).
Only the seven projection weights of the decoder layers are FP8; embeddings, norms and lm_head stay in
the model's dtype. Static activation scales, FP8 KV caches, other bit widths and other quantization
methods are refused by name. A scale is the dequantisation multiplier in both formats (the name
"weight_scale_inv" notwithstanding), as fusedpar.kernels.fp8 stores it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedpar.kernels.fp8 import E4M3, FP8Scheme
from fusedpar.layers.fp8_weights import FP8Weight

__all__ = ["FP8_WEIGHTS", "FP8Format", "fp8_format", "fp8_segment", "scale_key", "to_fp8_weight"]

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_WEIGHTS = ("q", "k", "v", "o", "gate", "up", "down")  # the core names of the weights FP8 checkpoints quantise


@dataclass(frozen=True)
class FP8Format:
    """How a checkpoint stores its FP8 projection weights: the scale scheme and the scale tensor's name
    beside each `<module>.weight`."""

    scheme: FP8Scheme
    scale_name: str  # "weight_scale_inv" (fine-grained FP8) or "weight_scale" (compressed-tensors)


def scale_key(weight_key: str, fmt: FP8Format) -> str:
    """The checkpoint key of a projection weight's scales: `...q_proj.weight` -> `...q_proj.<scale_name>`."""
    return weight_key.removesuffix("weight") + fmt.scale_name


def _as_dict(qc) -> dict:
    if isinstance(qc, dict):
        return qc
    to_dict = getattr(qc, "to_dict", None)
    return to_dict() if callable(to_dict) else dict(vars(qc))


def _fine_grained(qc: dict) -> tuple[FP8Format | None, list[str]]:
    problems = []
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        problems.append(f"FP8 activation_scheme={qc.get('activation_scheme')!r} (only dynamic activation scales)")
    if qc.get("scale_fmt", "float") not in (None, "float"):
        problems.append(f"FP8 scale_fmt={qc.get('scale_fmt')!r} (only float32 scales)")
    converted = [m for m in qc.get("modules_to_not_convert") or () if any(p in m for p in _PROJECTIONS)]
    if converted:
        problems.append(f"FP8 checkpoints that keep projection weights unquantized (modules_to_not_convert="
                        f"{converted})")
    block = qc.get("weight_block_size")
    if block is None:
        scheme = FP8Scheme("tensor")
    elif (isinstance(block, list | tuple) and len(block) == 2
          and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)):
        scheme = FP8Scheme("block", (block[0], block[1]))
    else:
        problems.append(f"FP8 weight_block_size={block!r} (want [block_out, block_in], two ints >= 1)")
        scheme = None
    if problems or scheme is None:
        return None, problems
    return FP8Format(scheme, "weight_scale_inv"), []


def _compressed_tensors(qc: dict) -> tuple[FP8Format | None, list[str]]:
    groups = qc.get("config_groups") or {}
    problems = []
    if qc.get("kv_cache_scheme") is not None:
        problems.append("an FP8 KV cache (compressed-tensors kv_cache_scheme)")
    if len(groups) != 1:
        return None, [*problems, f"compressed-tensors with {len(groups)} config_groups (one FP8 group over every "
                                 "Linear is supported)"]
    group = next(iter(groups.values()))
    w, a = group.get("weights") or {}, group.get("input_activations")
    strategy = w.get("strategy")
    if (w.get("type"), w.get("num_bits")) != ("float", 8):
        problems.append(f"compressed-tensors weights of type {w.get('type')!r} with {w.get('num_bits')} bits "
                        "(only float 8-bit, e4m3)")
    if w.get("dynamic") or not w.get("symmetric", True):
        problems.append("compressed-tensors weights with dynamic or asymmetric scales")
    scheme = None
    if strategy == "channel":
        scheme = FP8Scheme("channel")
    elif strategy == "tensor":
        scheme = FP8Scheme("tensor")
    elif strategy == "block":
        block = w.get("block_structure") or []
        if len(block) == 2 and all(isinstance(b, int) and b >= 1 for b in block):
            scheme = FP8Scheme("block", (block[0], block[1]))
        else:
            problems.append(f"compressed-tensors block_structure={block!r} (want [block_out, block_in])")
    else:
        problems.append(f"compressed-tensors weight strategy {strategy!r} (supported: channel, tensor, block)")
    if a is None:
        problems.append("compressed-tensors FP8 weights without activation quantization (weight-only FP8)")
    else:
        want = ("group", scheme.block[1]) if scheme is not None and scheme.weight == "block" else ("token", None)
        got = (a.get("strategy"), a.get("group_size") if want[0] == "group" else None)
        if (a.get("type"), a.get("num_bits")) != ("float", 8) or not a.get("dynamic"):
            problems.append(f"compressed-tensors activations of type {a.get('type')!r}, {a.get('num_bits')} bits, "
                            f"dynamic={a.get('dynamic')} (only dynamic float 8-bit activation scales)")
        elif got != want:
            problems.append(f"compressed-tensors activation strategy {got[0]!r}"
                            + (f" with group_size {got[1]}" if got[1] is not None else "")
                            + f" for {strategy} weights (want {want[0]!r}"
                            + (f" with group_size {want[1]})" if want[1] is not None else ")"))
    if problems or scheme is None:
        return None, problems
    return FP8Format(scheme, "weight_scale"), []


def fp8_format(quantization_config) -> tuple[FP8Format | None, list[str]]:
    """The FP8 format a config's quantization_config describes, or the reasons it is not one fusedpar runs.

    (None, []) for no quantization_config, and for a model transformers has already dequantized
    (`dequantize: true`: its weights are plain tensors)."""
    if quantization_config is None:
        return None, []
    qc = _as_dict(quantization_config)
    method = qc.get("quant_method")
    method = getattr(method, "value", method)
    if method == "fp8":
        return (None, []) if qc.get("dequantize") else _fine_grained(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    return None, [f"quantized weights (quantization_config quant_method={method!r}; supported: 'fp8' with dynamic "
                  "activations, 'compressed-tensors' FP8)"]


def to_fp8_weight(q: torch.Tensor, scale: torch.Tensor, fmt: FP8Format, full_shape: tuple[int, int],
                  what: str) -> FP8Weight:
    """FP8Weight of the whole weight `q` [N, K] and its checkpoint scales (any shape holding the scheme's
    ceil(N / tile_out) x ceil(K / tile_in) values: [] or [1] per tensor, [N, 1] per channel)."""
    tile = fmt.scheme.weight_tile(full_shape)
    want = tuple(-(-s // t) for s, t in zip(full_shape, tile, strict=True))
    problems = []
    if q.dtype != E4M3:
        problems.append(f"weight dtype {q.dtype} (want {E4M3})")
    if scale.numel() != want[0] * want[1] or not scale.is_floating_point():
        problems.append(f"scales {scale.dtype} {tuple(scale.shape)} (want {want[0] * want[1]} floats, "
                        f"{want[0]} x {want[1]} for {fmt.scheme.weight} scales of a {full_shape} weight)")
    if problems:
        raise ValueError(f"{what}: " + "; ".join(problems))
    return FP8Weight(q, scale.reshape(want).to(torch.float32), tile)


def fp8_segment(q: torch.Tensor, scale: torch.Tensor, fmt: FP8Format, full_shape: tuple[int, int], dim: int,
                start: int, what: str) -> FP8Weight:
    """FP8Weight of rows (dim 0) or columns (dim 1) [start, start + q.shape[dim]) of a weight of full_shape,
    read as `q`, with the scales of the tiles it covers (taken from the whole weight's `scale`); the
    segment must cut between scale tiles (FP8Weight.narrow says where it does not)."""
    whole = to_fp8_weight(torch.empty(full_shape, dtype=q.dtype, device="meta"), scale, fmt, full_shape, what)
    try:
        part = whole.narrow(dim, start, q.shape[dim])
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    return FP8Weight(q, part.scale, part.tile)
