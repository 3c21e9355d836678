"""SwiGLU activation of a blocked gate_up GEMM output, in one Triton pass.

The gate_up GEMM of a decoder layer writes [rows, blocks * 2 * I] as per-block [gate | up]
chunks (blocks = 1 in shift mode, SP in base mode: the base shard stacks the shift views'
rows, fusedpar.layouts.shards). The activation is

    act[r, b * I + j] = silu(gu[r, b, 0, j]) * gu[r, b, 1, j]       (gu viewed as [rows, blocks, 2, I])

with torch's roundings: silu in fp32 rounded to the dtype, then the product rounded again
(F.silu(gate) * up). In plain PyTorch that is two kernels and a [rows, blocks * I] temporary;
here one program per (row, column tile) reads gate and up once and writes act once.

_silu_mul_kernel (@triton.jit) -> silu_mul launcher (checks, tiling, allocation); silu_mul_reference
(fusedpar.kernels.reference.blocked_swiglu: the plain path, CPU and tests).
Computing the same thing inside the down projection's GEMM operand load instead (no act tensor)
was slower on the decode path (fusedpar.kernels.gemm_all_reduce docstring).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedpar.kernels import reference
from fusedpar.kernels._host import INTERPRETED, SUPPORTED_DTYPES, cdiv, next_pow2


@triton.jit
def _silu_mul_kernel(gu_ptr, act_ptr, K, I, stride_gm, stride_gk, stride_am, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < K
    # act column c of block b = c // I reads gate column b * 2I + c % I and up column + I
    gcol = (cols // I) * (2 * I) + cols % I
    g = tl.load(gu_ptr + row * stride_gm + gcol * stride_gk, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * stride_gm + (gcol + I) * stride_gk, mask=mask, other=0.0)
    # torch's roundings: silu in fp32 (x / (1 + exp(-x)), as its CUDA kernel) rounded, then the product
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(act_ptr.dtype.element_ty)
    tl.store(act_ptr + row * stride_am + cols, (s.to(tl.float32) * u.to(tl.float32)).to(act_ptr.dtype.element_ty),
             mask=mask)


def _check(gu: torch.Tensor, block: int) -> int:
    """Validate and return K = the activation width."""
    if gu.dim() != 2:
        raise ValueError(f"silu_mul: gate_up must be 2-D [rows, blocks * 2 * I], got {tuple(gu.shape)}")
    if gu.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"silu_mul: dtype must be one of {SUPPORTED_DTYPES}, got {gu.dtype}")
    if block < 1 or gu.shape[1] % (2 * block):
        raise ValueError(f"silu_mul: gate_up width {gu.shape[1]} is not a multiple of 2 * block ({2 * block}): "
                         "expected per-block [gate | up] chunks of `block` columns each")
    return gu.shape[1] // 2


def silu_mul_reference(gu: torch.Tensor, block: int) -> torch.Tensor:
    """The plain-PyTorch definition (fusedpar.kernels.reference.blocked_swiglu, the layers' CPU path)."""
    _check(gu, block)
    return reference.blocked_swiglu(gu, block)


def silu_mul(gu: torch.Tensor, block: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU of a blocked gate_up output in one pass (module docstring).

    gu: [rows, blocks * 2 * block], any strides (CUDA, or CPU under TRITON_INTERPRET=1).
    out: optional [rows, blocks * block] destination with contiguous columns; else a new tensor.
    """
    k = _check(gu, block)
    if gu.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError("silu_mul on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 before "
                           "fusedpar.kernels.swiglu is first imported (or use silu_mul_reference)")
    act = out if out is not None else torch.empty((gu.shape[0], k), dtype=gu.dtype, device=gu.device)
    if act.shape != (gu.shape[0], k) or act.dtype != gu.dtype or act.device != gu.device or \
            (k > 1 and act.stride(1) != 1):
        raise ValueError(f"silu_mul: out must be [{gu.shape[0]}, {k}] {gu.dtype} on {gu.device} with contiguous "
                         f"columns, got {tuple(act.shape)} {act.dtype} {act.device} strides {act.stride()}")
    if gu.shape[0] == 0 or k == 0:
        return act
    tile = min(1024, next_pow2(k))
    _silu_mul_kernel[(gu.shape[0], cdiv(k, tile))](
        gu, act, k, block, gu.stride(0), gu.stride(1), act.stride(0), BLOCK=tile, num_warps=4 if tile >= 512 else 1,
    )
    return act
