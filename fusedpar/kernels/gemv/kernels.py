"""The @triton.jit code of the weight-streaming decode GEMM (launcher: launch.py; math: __init__.py).

_skinny_partial_kernel: grid (N tiles, K splits). Program (pid_n, pid_k) reads the W rows of its N
tile over its own contiguous range of K steps once, with the few rows of A, and writes either the
finished tile (one split) or its fp32 partial sums to a [split_k, M, N] workspace.
_skinny_reduce_kernel: out[m, n] = sum over s = 0 .. split_k - 1 of the workspace, always in that
order, so the result does not depend on which program finished first (deterministic).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _skinny_partial_kernel(
    a_ptr,
    w_ptr,
    c_ptr,  # out [M, N] (one split) or the fp32 workspace [split_k, M, N] (contiguous)
    M,
    N,
    K,
    k_steps_per_split,  # BLOCK_K steps per K split (the last split may have fewer)
    stride_am,
    stride_ak,
    stride_wn,
    stride_wk,
    stride_cm,
    stride_cn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """Partial C^T tile [BLOCK_N, BLOCK_M] = W[n tile, k range] @ A[:, k range]^T, fp32 accumulator.

    W is read as [BLOCK_N, BLOCK_K] tiles along its rows (K is W's contiguous dim in nn.Linear
    storage, so each thread's loads are wide vectors); strided views work through the strides.
    The tile is computed transposed ("swap AB"): W's tile is the wide left operand of tl.dot and
    A's few rows (padded to BLOCK_M >= 16) the narrow right one.
    DOT: tl.dot (tensor cores); False: products summed with tl.sum in fp32 (CUDA cores, any BLOCK_M;
    also what the interpreter runs for bf16, which its tl.dot cannot).
    EVEN_K: K % BLOCK_K == 0, so the loads need no K mask. Ragged M / N edges are clamped to row 0
    (always valid memory) and masked off at the store.
    """
    pid_n = tl.program_id(axis=0)
    pid_k = tl.program_id(axis=1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_wn = tl.where(offs_n < N, offs_n, 0)
    offs_am = tl.where(offs_m < M, offs_m, 0)
    offs_kb = tl.arange(0, BLOCK_K)

    k_steps = tl.cdiv(K, BLOCK_K)
    k_begin = pid_k * k_steps_per_split
    k_end = tl.minimum(k_begin + k_steps_per_split, k_steps)

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for ki in range(k_begin, k_end):
        offs_k = ki * BLOCK_K + offs_kb
        w_ptrs = w_ptr + (offs_wn[:, None] * stride_wn + offs_k[None, :] * stride_wk)
        a_ptrs = a_ptr + (offs_am[:, None] * stride_am + offs_k[None, :] * stride_ak)
        if EVEN_K:
            w = tl.load(w_ptrs)
            a = tl.load(a_ptrs)
        else:
            k_mask = offs_k[None, :] < K
            w = tl.load(w_ptrs, mask=k_mask, other=0.0)
            a = tl.load(a_ptrs, mask=k_mask, other=0.0)
        if DOT:
            acc = tl.dot(w, tl.trans(a), acc, input_precision=INPUT_PRECISION)
        else:
            prod = w.to(tl.float32)[:, None, :] * a.to(tl.float32)[None, :, :]
            acc += tl.sum(prod, axis=2)

    c_ptrs = c_ptr + pid_k * M * N + (offs_m[None, :] * stride_cm + offs_n[:, None] * stride_cn)
    c_mask = (offs_m[None, :] < M) & (offs_n[:, None] < N)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def _skinny_reduce_kernel(ws_ptr, out_ptr, M, N, split_k, stride_om, stride_on, BLOCK: tl.constexpr):
    """out[m, n] = sum_{s < split_k} ws[s, m, n] in s order (ws: contiguous fp32 [split_k, M, N])."""
    idx = tl.program_id(axis=0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(split_k):
        acc += tl.load(ws_ptr + s * M * N + idx, mask=mask, other=0.0)
    m = idx // N
    n = idx - m * N
    tl.store(out_ptr + m * stride_om + n * stride_on, acc.to(out_ptr.dtype.element_ty), mask=mask)
