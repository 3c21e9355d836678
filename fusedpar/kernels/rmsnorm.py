"""RMSNorm (optionally fused with the residual add before it) in one Triton pass.

The decoder layer's norms in plain PyTorch are a chain of ~8 kernels (cast to fp32, square,
mean, add eps, rsqrt, scale, cast back, weight multiply), each a full pass over the hidden
states, and at decode sizes each a launch-bound tiny kernel. One program per row does it in one
read and one write, with exactly the reference's rounding points:

    rms_norm(x, w):            y = w * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype)
    add_rms_norm(x, d, w):     s = (x + d) in dtype (one rounding, as torch's add); y = rms_norm(s, w)
                               returns (s, y): the new residual stream and the normed input

_rms_norm_kernel (@triton.jit) -> rms_norm / add_rms_norm launchers (shape/dtype checks, block
size, allocation); rms_norm_reference (fusedpar.kernels.reference.rms_norm) for tests and the CPU
path. Rows of any count, hidden size up to 65536 (one row per program, masked to the next power
of two). Under TRITON_INTERPRET=1 the kernel runs on CPU tensors (tests use fp16/fp32, like the
rest of the suite).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedpar.kernels import reference
from fusedpar.kernels._host import SUPPORTED_DTYPES, has_internal_overlap, next_pow2, overlaps_other_view

MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_kernel(x_ptr, d_ptr, w_ptr, s_ptr, y_ptr, n_cols, stride_x, stride_d, stride_s, stride_y, eps,
                     HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        dl = tl.load(d_ptr + row * stride_d + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + dl.to(tl.float32)).to(y_ptr.dtype.element_ty)  # torch's add: one rounding
        tl.store(s_ptr + row * stride_s + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * rstd).to(y_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = (normed.to(tl.float32) * w.to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * stride_y + cols, y, mask=mask)


def _check(x: torch.Tensor, w: torch.Tensor, delta: torch.Tensor | None) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"rms_norm: x must be 2-D [rows, hidden] with contiguous rows, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    if x.dtype not in SUPPORTED_DTYPES or w.dtype != x.dtype:
        raise TypeError(f"rms_norm: x and weight must share a dtype in {SUPPORTED_DTYPES}, got {x.dtype} / {w.dtype}")
    if w.shape != (x.shape[1],):
        raise ValueError(f"rms_norm: weight must be [{x.shape[1]}], got {tuple(w.shape)}")
    if w.stride(0) != 1 and x.shape[1] > 1:  # the kernel reads the weight as w_ptr + column
        raise ValueError(f"rms_norm: weight must be contiguous (stride 1), got stride {w.stride(0)}; "
                         "pass weight.contiguous()")
    if not 1 <= x.shape[1] <= MAX_HIDDEN:
        raise ValueError(f"rms_norm: hidden size {x.shape[1]} outside [1, {MAX_HIDDEN}]")
    if delta is not None and (delta.shape != x.shape or delta.dtype != x.dtype or delta.stride(1) != 1):
        raise ValueError(f"add_rms_norm: delta must match x {tuple(x.shape)} {x.dtype} with contiguous rows, got "
                         f"{tuple(delta.shape)} {delta.dtype} strides {delta.stride()}")
    if w.device != x.device or (delta is not None and delta.device != x.device):
        raise ValueError("rms_norm: x, delta and weight must be on one device")


def _check_out(x: torch.Tensor, out: torch.Tensor) -> None:
    # The kernel stores y_ptr + row * stride + column: the columns must be contiguous, and a program
    # reads its whole row of x before it stores, so out may be x itself but no other view of it
    # (a shifted row would be overwritten before another program reads it).
    if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device or \
            (x.shape[1] > 1 and out.stride(1) != 1):
        raise ValueError(f"rms_norm: out must be {tuple(x.shape)} {x.dtype} on {x.device} with contiguous columns, "
                         f"got {tuple(out.shape)} {out.dtype} {out.device} strides {out.stride()}")
    if has_internal_overlap(out):
        raise ValueError(f"rms_norm: out has rows sharing memory (strides {out.stride()}); pass a fresh tensor")
    if overlaps_other_view(out, x):
        raise ValueError("rms_norm: out overlaps x without being x itself (in place); pass out=x or a separate "
                         "tensor")


def _launch(x, delta, w, eps, s, y):
    n_rows, n_cols = x.shape
    if n_rows == 0:
        return
    block = next_pow2(n_cols)
    warps = 1 if block <= 512 else 4 if block <= 4096 else 8
    d = delta if delta is not None else x
    sv = s if s is not None else y
    _rms_norm_kernel[(n_rows,)](x, d, w, sv, y, n_cols, x.stride(0), d.stride(0), sv.stride(0), y.stride(0),
                                float(eps), HAS_DELTA=delta is not None, BLOCK=block, num_warps=warps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of every row of x [rows, hidden] (see module docstring); returns a new tensor (or out)."""
    _check(x, weight, None)
    if out is None:
        y = torch.empty_like(x, memory_format=torch.contiguous_format)
    else:
        _check_out(x, out)
        y = out
    _launch(x, None, weight, eps, None, y)
    return y


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)) in one pass; x and delta are only read."""
    _check(x, weight, delta)
    s = torch.empty_like(x, memory_format=torch.contiguous_format)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch(x, delta, weight, eps, s, y)
    return s, y


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The plain-PyTorch definition (HF Llama semantics), the layers' CPU path."""
    return reference.rms_norm(x, weight, eps)
