"""torch.library ops of the FP8 kernels, with fake impls: torch.compile and CUDA graphs see one opaque
node per op.

`torch.ops.fusedpar.fp8_quantize(x, group)` -> (e4m3 q, fp32 scales); `fp8_scaled_mm(qx, x_scale, qw,
w_scale, w_tile_n, w_tile_k, x_group, bias, out_dtype)` -> C; `fp8_linear(x, qw, w_scale, w_tile_n,
w_tile_k, x_group, bias)` quantises x and runs the GEMM in one node, C in x's dtype.
"""

from __future__ import annotations

import torch

from fusedpar.kernels.fp8.launch import (
    _launch_mm,
    _launch_quantize,
    check_mm_args,
    check_quantize_args,
    quantize_shapes,
)
from fusedpar.kernels.fp8.reference import E4M3


def _new_quantized(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    q_shape, s_shape = quantize_shapes(x, group)
    return (torch.empty(q_shape, dtype=E4M3, device=x.device),
            torch.empty(s_shape, dtype=torch.float32, device=x.device))


@torch.library.custom_op("fusedpar::fp8_quantize", mutates_args=())
def _fp8_quantize_op(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 [M, ceil(K / group)]): dynamic scales per token and group."""
    check_quantize_args(x, group)
    q, scale = _new_quantized(x, group)
    _launch_quantize(x, group, q, scale)
    return q, scale


@_fp8_quantize_op.register_fake
def _fp8_quantize_fake(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    check_quantize_args(x, group)
    return _new_quantized(x, group)


@torch.library.custom_op("fusedpar::fp8_scaled_mm", mutates_args=())
def _fp8_scaled_mm_op(qx: torch.Tensor, x_scale: torch.Tensor, qw: torch.Tensor, w_scale: torch.Tensor,
                      w_tile_n: int, w_tile_k: int, x_group: int, bias: torch.Tensor | None,
                      out_dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty((qx.shape[0], qw.shape[0]), dtype=out_dtype, device=qx.device)
    return _launch_mm(qx, x_scale, qw, w_scale, (w_tile_n, w_tile_k), x_group, bias, out, fresh_out=True)


@_fp8_scaled_mm_op.register_fake
def _fp8_scaled_mm_fake(qx, x_scale, qw, w_scale, w_tile_n, w_tile_k, x_group, bias, out_dtype):
    check_mm_args(qx, x_scale, qw, w_scale, (w_tile_n, w_tile_k), x_group, bias, out_dtype)
    return qx.new_empty((qx.shape[0], qw.shape[0]), dtype=out_dtype)


def _check_linear(x: torch.Tensor, qw: torch.Tensor, w_scale: torch.Tensor, w_tile: tuple[int, int], x_group: int,
                  bias: torch.Tensor | None) -> None:
    check_quantize_args(x, x_group)
    if qw.dim() != 2:
        raise ValueError(f"fusedpar fp8 scaled_mm: qw must be [N, K] (2-D), got {tuple(qw.shape)}")
    _, s_shape = quantize_shapes(x, x_group)
    x_scale = torch.empty(s_shape, dtype=torch.float32, device="meta")
    check_mm_args(x.new_empty(x.shape, dtype=E4M3, device="meta"), x_scale, qw, w_scale, w_tile, x_group, bias,
                  x.dtype)


@torch.library.custom_op("fusedpar::fp8_linear", mutates_args=())
def _fp8_linear_op(x: torch.Tensor, qw: torch.Tensor, w_scale: torch.Tensor, w_tile_n: int, w_tile_k: int,
                   x_group: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] quantised per token (group), @ (qw * w_scale)^T (+ bias), in x's dtype. The launchers check
    x, then the GEMM's operands (no meta tensors built per call, as the fake impl does)."""
    check_quantize_args(x, x_group)
    q, scale = _new_quantized(x, x_group)
    _launch_quantize(x, x_group, q, scale)
    out = torch.empty((x.shape[0], qw.shape[0]), dtype=x.dtype, device=x.device)
    return _launch_mm(q, scale, qw, w_scale, (w_tile_n, w_tile_k), x_group, bias, out, fresh_out=True)


@_fp8_linear_op.register_fake
def _fp8_linear_fake(x, qw, w_scale, w_tile_n, w_tile_k, x_group, bias):
    _check_linear(x, qw, w_scale, (w_tile_n, w_tile_k), x_group, bias)
    return x.new_empty((x.shape[0], qw.shape[0]))
