"""FP8 (e4m3) weights and activations: the scale schemes of real checkpoints, their plain-PyTorch
reference (reference.py), the math every FP8 kernel and layer is tested against, and the Triton
kernels of the FP8 linear layer.

Kernels (kernels.py, launched by launch.py, registered as torch.library ops with fake impls by ops.py:
torch.compile and CUDA graphs see one opaque node)
    fp8_quantize(x, group): dynamic activation quantisation, one fp32 scale per token and group of
        `group` input columns (group >= K: per token), scale = max(amax, 1e-12) / 448, round to
        nearest even: the reference's quantize_activation bit for bit.
    fp8_scaled_mm(qx, x_scale, qw, w_scale, w_tile, x_group): C[M, N] = (qx * x_scale) @ (qw * w_scale)^T
        with fp32 accumulation on e4m3 tensor cores (the persistent loop of fusedpar.kernels.gemm). A
        weight scale covers a w_tile = (rows, columns) tile: (N, K) per tensor, (1, K) per output
        channel (the scales factor out of the K sum: applied once to the accumulator), (128, 128) blocks
        with 1 x 128 activation groups (applied per K step inside the loop).
    fp8_matmul(x, qw, w_scale, scheme) / fp8_matmul_tiles(x, qw, w_scale, w_tile, x_group): both in one
        op, output in x's dtype: the kernel counterparts of fp8_linear / fp8_linear_tiles.
    FP8Operands: the scales (and output dtype) the fused communication kernels take beside their e4m3
        operands (fusedpar.kernels.gemm_all_reduce, fusedpar.kernels.ulysses); check_fp8_operands checks them,
        quantize_for quantises a fused kernel's activations once and builds them, fp8_product is the GEMM
        of its plain paths.
Constraints: e4m3 qx / qw, fp32 scales of the tile grid's shape, fp16 / bf16 / fp32 activations and
outputs; a weight tile or activation group narrower than K must be a multiple of 32 columns (16 under
the interpreter); qw may be any strided view (a TP shard, a shift view) but a block-scaled view must start
on a scale-block boundary of the weight it is cut from. Violations raise one error listing them all.
CPU: under TRITON_INTERPRET=1 the kernels run on the interpreter (it loads, converts and multiplies
e4m3).
"""

from __future__ import annotations

import torch

from fusedpar.kernels.fp8 import ops as _ops  # noqa: F401  (registers torch.ops.fusedpar.fp8_*)
from fusedpar.kernels.fp8.launch import (
    ACT_DTYPES,
    MIN_BLOCK_K,
    NO_FP8_SCALES,
    FP8Operands,
    check_block_view,
    check_fp8_operands,
    mm_block_k,
    pick_fp8_config,
)
from fusedpar.kernels.fp8.reference import (
    E4M3,
    E4M3_MAX,
    FP8Scheme,
    dequantize,
    fp8_linear,
    fp8_linear_tiles,
    quantize_activation,
    quantize_weight,
)

__all__ = [
    "E4M3",
    "E4M3_MAX",
    "MIN_BLOCK_K",
    "NO_FP8_SCALES",
    "FP8Operands",
    "FP8Scheme",
    "check_block_view",
    "check_fp8_operands",
    "dequantize",
    "fp8_linear",
    "fp8_linear_tiles",
    "fp8_matmul",
    "fp8_matmul_tiles",
    "fp8_product",
    "fp8_quantize",
    "fp8_scaled_mm",
    "kernel_takes",
    "mm_block_k",
    "pick_fp8_config",
    "quantize_activation",
    "quantize_for",
    "quantize_weight",
]


def kernel_takes(x: torch.Tensor, qw: torch.Tensor, w_tile: tuple[int, int], x_group: int) -> bool:
    """Whether fp8_matmul_tiles takes these operands: an fp16 / bf16 / fp32 x, an e4m3 [N, K] weight, and
    a weight tile and activation group that each span K or are a multiple of the kernel's smallest K step
    (not, e.g., one scale per input column)."""
    k = qw.shape[-1]
    return (x.dtype in ACT_DTYPES and qw.dtype == E4M3 and qw.dim() == 2 and k > 0
            and mm_block_k(k, w_tile[1], x_group, 128) is not None)


def fp8_quantize(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (fp16 / bf16 / fp32, any strides) -> (e4m3 [M, K], fp32 scales [M, ceil(K / group)]);
    group >= K gives one scale per token ([M, 1])."""
    return torch.ops.fusedpar.fp8_quantize(x, group)


def fp8_scaled_mm(qx: torch.Tensor, x_scale: torch.Tensor, qw: torch.Tensor, w_scale: torch.Tensor,
                  w_tile: tuple[int, int], x_group: int, bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(qx * x_scale) @ (qw * w_scale)^T (+ bias) -> [M, N] of out_dtype; qx's element (m, k) has scale
    x_scale[m, k // x_group], qw's (n, k) has w_scale[n // w_tile[0], k // w_tile[1]]."""
    return torch.ops.fusedpar.fp8_scaled_mm(qx, x_scale, qw, w_scale, int(w_tile[0]), int(w_tile[1]), int(x_group),
                                            bias, out_dtype)


def fp8_matmul_tiles(x: torch.Tensor, qw: torch.Tensor, w_scale: torch.Tensor, w_tile: tuple[int, int],
                     x_group: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp8_linear_tiles on the kernels: x [..., K] quantised per token and group of x_group columns, times
    (qw * w_scale)^T (+ bias) -> [..., N] in x's dtype."""
    if x.dim() < 1 or qw.dim() != 2 or x.shape[-1] != qw.shape[1]:
        raise ValueError(f"fp8_matmul: x {tuple(x.shape)} and weight {tuple(qw.shape)} need [..., K] and [N, K]")
    y = torch.ops.fusedpar.fp8_linear(x.reshape(-1, x.shape[-1]), qw, w_scale, int(w_tile[0]), int(w_tile[1]),
                                      int(x_group), bias)
    return y.reshape(*x.shape[:-1], qw.shape[0])


def fp8_matmul(x: torch.Tensor, qw: torch.Tensor, w_scale: torch.Tensor, scheme: FP8Scheme,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp8_linear on the kernels: x [..., K] @ (qw * w_scale)^T (+ bias) with x quantised per token (group)
    as the scheme says; the result in x's dtype."""
    if qw.dim() != 2:
        raise ValueError(f"fp8_matmul: weight {tuple(qw.shape)} must be [N, K]")
    return fp8_matmul_tiles(x, qw, w_scale, scheme.weight_tile(tuple(qw.shape)), scheme.activation_tile(qw.shape[1]),
                            bias)


def quantize_for(op: str, x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None,
                 w_tile: tuple[int, int] | None, group: int | None = None) -> tuple[torch.Tensor, FP8Operands] | None:
    """A fused kernel's FP8 entry: None for a plain weight (no scales, not e4m3); else x [M, K] quantised once
    (fp8_quantize: one scale per token and group of `group` columns, default w_tile[1], per token where that
    spans K) and the FP8Operands of the scaled GEMM with w's scales, products in x's dtype."""
    if w_scale is None and w_tile is None and w.dtype != E4M3:
        return None
    if w_scale is None or w_tile is None or x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"{op}: an e4m3 weight needs 2-D x and w and both w_scale and w_tile (its scales and the "
                         f"tile one scale covers), got x {tuple(x.shape)}, w {tuple(w.shape)}, "
                         f"w_scale={'given' if w_scale is not None else None}, w_tile={w_tile}")
    group = min(int(w_tile[1] if group is None else group), max(x.shape[1], 1))
    qx, x_scale = fp8_quantize(x, group)
    return qx, FP8Operands(x_scale, w_scale, (int(w_tile[0]), int(w_tile[1])), group, x.dtype)


def fp8_product(qx: torch.Tensor, w: torch.Tensor, fp8: FP8Operands) -> torch.Tensor:
    """The scaled GEMM of quantize_for's operands without communication (the fused kernels' plain paths)."""
    return fp8_scaled_mm(qx, fp8.x_scale, w, fp8.w_scale, fp8.w_tile, fp8.x_group, out_dtype=fp8.out_dtype)
