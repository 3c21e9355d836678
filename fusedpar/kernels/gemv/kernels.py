"""The @triton.jit code of the weight-streaming decode GEMM (launcher: launch.py; math: __init__.py).

Work is counted in units: one unit is one [BLOCK_N, BLOCK_K] W tile of one N tile, so an N tile is
k_steps = cdiv(K, BLOCK_K) consecutive units and the GEMM U = N tiles x k_steps units, numbered
tile-major. Program p of P runs units [p U / P, (p + 1) U / P) (stream-K: every program the same
share of W, whatever N is). The run of units a program has in one N tile is a segment:
  - a segment that is the whole tile (one program owns it) is stored to out directly;
  - otherwise the segment's fp32 partial sums go to workspace slot j = p - (first program of the
    tile), and _skinny_reduce_kernel sums slots 0, 1, ... of every split tile in that order, so the
    result does not depend on which program finished first (deterministic).
With P a multiple of the N tiles this is a plain split-K (every tile cut into P / N-tiles equal
parts); with P = N tiles, no tile is split and there is no workspace.

SWIGLU (a gate_up projection's epilogue): W is [blocks * 2I, K] in per-block [gate | up] row chunks
of I rows (fusedpar.kernels.swiglu's layout), N = blocks * I output columns, and each unit reads the
gate and the up rows of its columns: out[m, c] = silu(gate) * up with torch's roundings (the GEMM
result, silu and the product each rounded to out's dtype, as F.silu(gate) * up after a GEMM would).
Split tiles keep two workspace planes (gate, up) per slot; the reduce pass applies the activation.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _first_program(u, P, U):
    """The program whose units include unit u: the largest p with p U / P <= u (integer division)."""
    return ((u + 1) * P - 1) // U


@triton.jit
def _silu_mul(g, u, dtype: tl.constexpr):
    """silu(g) * u of fp32 GEMM results with torch's roundings to `dtype` (see SWIGLU above)."""
    gr = g.to(dtype).to(tl.float32)
    ur = u.to(dtype).to(tl.float32)
    s = (gr / (1.0 + tl.exp(-gr))).to(dtype).to(tl.float32)
    return (s * ur).to(dtype)


@triton.jit
def _skinny_partial_kernel(
    a_ptr,
    w_ptr,
    c_ptr,  # out [M, N]
    ws_ptr,  # fp32 workspace [slots, planes, M, N] (contiguous; planes = 2 with SWIGLU); unused when no tile is split
    M,
    N,  # out's columns (with SWIGLU half of W's rows)
    K,
    swiglu_block,  # I: rows of each gate / up chunk of W (SWIGLU only)
    k_steps,  # cdiv(K, BLOCK_K): units per N tile
    total_units,  # U = cdiv(N, BLOCK_N) * k_steps
    max_segments,  # the most N tiles one program's units touch
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
    SWIGLU: tl.constexpr = False,
):
    """Each segment of this program: C^T tile [BLOCK_N, BLOCK_M] over its K steps, fp32 accumulator.

    W is read as [BLOCK_N, BLOCK_K] tiles along its rows (K is W's contiguous dim in nn.Linear storage,
    so each thread's loads are wide vectors); strided views work through the strides. The tile is
    computed transposed ("swap AB"): W's tile is the wide left operand of tl.dot and A's few rows
    (padded to BLOCK_M >= 16) the narrow right one.
    DOT: tl.dot (tensor cores); False: products summed with tl.sum in fp32 (CUDA cores, any BLOCK_M;
    also what the interpreter runs for bf16, which its tl.dot cannot).
    EVEN_K: K % BLOCK_K == 0, so the loads need no K mask. Ragged M / N edges are clamped to row 0
    (always valid memory) and masked off at the stores. The loads are 16-byte vectors, and so
    pipelined through shared memory (cp.async), where Triton's launch specialisation sees 16-byte
    aligned bases, K and row strides that are multiples of 16 (every shard shape); otherwise they
    are correct but element-wise and unpipelined.
    The segment loop has a fixed trip count (max_segments) with the K loop nested, empty where a
    program has fewer segments: the K loop is the software pipeliner's innermost loop.
    """
    pid = tl.program_id(axis=0)
    P = tl.num_programs(axis=0)
    u_begin = (pid * total_units) // P
    u_end = ((pid + 1) * total_units) // P
    offs_m = tl.arange(0, BLOCK_M)
    offs_am = tl.where(offs_m < M, offs_m, 0)
    offs_kb = tl.arange(0, BLOCK_K)

    u = u_begin
    for _ in range(0, max_segments):
        tile = u // k_steps
        seg_end = tl.minimum(u_end, (tile + 1) * k_steps)
        k_first = u - tile * k_steps
        k_last = seg_end - tile * k_steps  # exclusive; k_first when this program is done
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_wn = tl.where(offs_n < N, offs_n, 0)
        if SWIGLU:  # output column c: gate row (c // I) * 2I + c % I, up row I further
            offs_wn = (offs_wn // swiglu_block) * (2 * swiglu_block) + offs_wn % swiglu_block

        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for ki in range(k_first, k_last):
            offs_k = ki * BLOCK_K + offs_kb
            w_ptrs = w_ptr + (offs_wn[:, None] * stride_wn + offs_k[None, :] * stride_wk)
            a_ptrs = a_ptr + (offs_am[:, None] * stride_am + offs_k[None, :] * stride_ak)
            if EVEN_K:
                w = tl.load(w_ptrs)
                a = tl.load(a_ptrs)
                if SWIGLU:
                    wu = tl.load(w_ptrs + swiglu_block * stride_wn)
            else:
                k_mask = offs_k[None, :] < K
                w = tl.load(w_ptrs, mask=k_mask, other=0.0)
                a = tl.load(a_ptrs, mask=k_mask, other=0.0)
                if SWIGLU:
                    wu = tl.load(w_ptrs + swiglu_block * stride_wn, mask=k_mask, other=0.0)
            if DOT:
                acc = tl.dot(w, tl.trans(a), acc, input_precision=INPUT_PRECISION)
                if SWIGLU:
                    acc_up = tl.dot(wu, tl.trans(a), acc_up, input_precision=INPUT_PRECISION)
            else:
                acc += tl.sum(w.to(tl.float32)[:, None, :] * a.to(tl.float32)[None, :, :], axis=2)
                if SWIGLU:
                    acc_up += tl.sum(wu.to(tl.float32)[:, None, :] * a.to(tl.float32)[None, :, :], axis=2)

        live = u < u_end
        whole = (k_first == 0) & (k_last == k_steps)  # this program owns the whole tile
        mask = (offs_m[None, :] < M) & (offs_n[:, None] < N)
        # tl.where rather than `mask & scalar`: the interpreter's stores reject a scalar-broadcast mask
        c_ptrs = c_ptr + (offs_m[None, :] * stride_cm + offs_n[:, None] * stride_cn)
        result = _silu_mul(acc, acc_up, c_ptr.dtype.element_ty) if SWIGLU else acc.to(c_ptr.dtype.element_ty)
        tl.store(c_ptrs, result, mask=tl.where(live & whole, mask, False))
        slot = pid - _first_program(tile * k_steps, P, total_units)
        ws_mask = tl.where(live & (whole == 0), mask, False)
        if SWIGLU:
            ws_ptrs = ws_ptr + slot * 2 * M * N + (offs_m[None, :] * N + offs_n[:, None])
            tl.store(ws_ptrs, acc, mask=ws_mask)
            tl.store(ws_ptrs + M * N, acc_up, mask=ws_mask)
        else:
            ws_ptrs = ws_ptr + slot * M * N + (offs_m[None, :] * N + offs_n[:, None])
            tl.store(ws_ptrs, acc, mask=ws_mask)
        u = seg_end


@triton.jit
def _skinny_reduce_kernel(ws_ptr, out_ptr, M, N, k_steps, total_units, programs, max_slots, stride_om, stride_on,
                          BLOCK_N: tl.constexpr, BLOCK: tl.constexpr, SWIGLU: tl.constexpr = False):
    """out[m, n] = sum of ws[j, m, n] over the slots j = 0, 1, ... of n's tile, in that order, for the
    tiles that more than one program shares (the others were stored by their owner); with SWIGLU the
    gate and up planes are summed so and out = silu(gate) * up."""
    idx = tl.program_id(axis=0) * BLOCK + tl.arange(0, BLOCK)
    in_range = idx < M * N
    m = idx // N
    n = idx - m * N
    tile = n // BLOCK_N
    first = _first_program(tile * k_steps, programs, total_units)
    slots = _first_program(tile * k_steps + k_steps - 1, programs, total_units) - first + 1
    shared = in_range & (slots > 1)  # whole tiles were stored by their owner; their slots were never written
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(0, max_slots):
        if SWIGLU:
            acc += tl.load(ws_ptr + j * 2 * M * N + idx, mask=shared & (j < slots), other=0.0)
            acc_up += tl.load(ws_ptr + (j * 2 + 1) * M * N + idx, mask=shared & (j < slots), other=0.0)
        else:
            acc += tl.load(ws_ptr + j * M * N + idx, mask=shared & (j < slots), other=0.0)
    result = _silu_mul(acc, acc_up, out_ptr.dtype.element_ty) if SWIGLU else acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + m * stride_om + n * stride_on, result, mask=shared)
