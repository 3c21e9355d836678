"""The @triton.jit code of the FP8 (e4m3) linear layer (launcher: launch.py; math: __init__.py).

_quantize_rows_kernel / _quantize_groups_kernel: dynamic activation quantisation, one fp32 scale per
token (row) or per token and group of GROUP input columns, with the reference's rules
(fusedpar.kernels.fp8.reference): scale = max(amax, 1e-12) / 448, q = clamp(x / scale, +-448) rounded
to the nearest e4m3 value (ties to even). Divisions are IEEE (div_rn) and the rounding is done in fp32
by `_round_e4m3` before the cast, so every value the cast sees is exactly representable: the result
is the reference's bit for bit, on the GPU and under the Triton interpreter alike (whose own
fp32 -> e4m3 cast does not round to nearest).

_fp8_matmul_kernel: C[M, N] = (A_q * a_scale) @ (W_q * w_scale)^T with fp32 accumulation, the
persistent GROUP_M-swizzled loop of fusedpar.kernels.gemm (`tile_coords`, `load_k_tile`). Its mainloop
pieces (fp8_scale_rows, fp8_dot, fp8_scale_epilogue) are shared with the fused communication kernels
(fusedpar.kernels.gemm_all_reduce, fusedpar.kernels.ulysses), which take e4m3 operands through them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fusedpar.kernels.gemm.kernels import load_k_tile, tile_coords


@triton.jit
def _round_e4m3(x):
    """fp32 x with |x| <= 448 -> the nearest e4m3 value (ties to even), still fp32 and exact in e4m3.

    e4m3 keeps 3 mantissa bits: for |x| >= 2^-6 (normals) the step is 2^(exponent - 3), below it the
    subnormal step 2^-9. x / step is exact (a power of two), and adding then subtracting 1.5 * 2^23
    rounds it to an integer in fp32's round-to-nearest-even (|x / step| < 16 here). The sign is put
    back from x's sign bit, so -0 and values rounding to zero keep it, as torch's cast does."""
    bits = x.to(tl.int32, bitcast=True)
    exp = tl.maximum(((bits >> 23) & 0xFF) - 127, -6) - 3  # log2 of the step
    inv_step = ((127 - exp) << 23).to(tl.float32, bitcast=True)
    step = ((127 + exp) << 23).to(tl.float32, bitcast=True)
    mag = ((tl.abs(x) * inv_step + 12582912.0) - 12582912.0) * step
    return tl.where(bits < 0, -mag, mag)


@triton.jit
def _quantize_block(x, scale):
    """x [..] fp32 and its (broadcast) scale -> e4m3 q = round(clamp(x / scale, +-448))."""
    y = tl.math.div_rn(x, scale)
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    return _round_e4m3(y).to(tl.float8e4nv)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_xk, stride_qm, stride_sm,
                          BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr):
    """One program per token: amax over its K inputs, scale, then its e4m3 row. ONE_BLOCK (K <= BLOCK):
    the row is loaded once and stays in registers; else two passes over x in BLOCK-wide steps."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    if ONE_BLOCK:
        mask = offs < K
        x = tl.load(x_row + offs * stride_xk, mask=mask, other=0.0).to(tl.float32)
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12), 448.0)
        tl.store(s_ptr + row * stride_sm, scale)
        tl.store(q_row + offs, _quantize_block(x, scale), mask=mask)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            x = tl.load(x_row + (k0 + offs) * stride_xk, mask=k0 + offs < K, other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), 1e-12), 448.0)
        tl.store(s_ptr + row * stride_sm, scale)
        for k0 in range(0, K, BLOCK):
            mask = k0 + offs < K
            x = tl.load(x_row + (k0 + offs) * stride_xk, mask=mask, other=0.0)
            tl.store(q_row + k0 + offs, _quantize_block(x.to(tl.float32), scale), mask=mask)


@triton.jit
def _quantize_groups_kernel(x_ptr, q_ptr, s_ptr, K, GROUP, num_groups, stride_xm, stride_xk, stride_qm, stride_sm,
                            GROUPS_PER_PROG: tl.constexpr, GROUP_P2: tl.constexpr):
    """Program (token, c) quantises groups c * GROUPS_PER_PROG ... of its token: a [groups, GROUP_P2]
    tile whose row g holds input columns [g * GROUP, (g + 1) * GROUP) (the last group may be short);
    one scale per row of the tile."""
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)
    cols = tl.arange(0, GROUP_P2)
    offs_k = groups[:, None] * GROUP + cols[None, :]
    mask = (cols[None, :] < GROUP) & (offs_k < K) & (groups[:, None] < num_groups)
    x = tl.load(x_ptr + row * stride_xm + offs_k * stride_xk, mask=mask, other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12), 448.0)
    tl.store(s_ptr + row * stride_sm + groups, scale, mask=groups < num_groups)
    tl.store(q_ptr + row * stride_qm + offs_k, _quantize_block(x, scale[:, None]), mask=mask)


# ================================================ the scaled GEMM's mainloop pieces (shared by the fused kernels)
# S, the scale arguments, one tuple: (as_ptr, ws_ptr, W_TILE_N, W_TILE_K, X_GROUP, stride_asm, stride_asg,
# stride_wsn, stride_wsk) with as [M, ceil(K / X_GROUP)] and ws [ceil(N / W_TILE_N), ceil(K / W_TILE_K)], fp32.


@triton.jit
def fp8_scale_rows(S, offs_am, offs_wn):
    """A tile's activation-scale and weight-scale row pointers: as[rows, :] and ws[cols // W_TILE_N, :] (rows
    and columns already clamped into [M, N])."""
    as_ptr, ws_ptr, tile_n, _tile_k, _x_group, stride_asm, _stride_asg, stride_wsn, _stride_wsk = S
    return as_ptr + offs_am * stride_asm, ws_ptr + (offs_wn // tile_n) * stride_wsn


@triton.jit
def fp8_dot(accumulator, a, b, as_row, ws_row, ka, kw, S, SCALE_IN_LOOP: tl.constexpr):
    """One K step of the e4m3 GEMM into the fp32 accumulator. SCALE_IN_LOOP (block scales): the step's
    partial product is scaled by as[rows, ka // X_GROUP] x ws[cols, kw // W_TILE_K] (ka, kw: the step's first
    column in the activations' and the weight's K; the step lies in one group and one weight tile); else the
    scales wait for fp8_scale_epilogue."""
    if SCALE_IN_LOOP:
        _as_ptr, _ws_ptr, _tile_n, tile_k, x_group, _stride_asm, stride_asg, _stride_wsn, stride_wsk = S
        a_s = tl.load(as_row + (ka // x_group) * stride_asg)
        w_s = tl.load(ws_row + (kw // tile_k) * stride_wsk)
        accumulator += tl.dot(a, b) * (a_s[:, None] * w_s[None, :])
    else:
        accumulator = tl.dot(a, b, accumulator)
    return accumulator


@triton.jit
def fp8_scale_epilogue(accumulator, S, offs_cm, offs_cn, M, N, SCALE_IN_LOOP: tl.constexpr):
    """The accumulator of output rows offs_cm and columns offs_cn times as[row] x ws[col // W_TILE_N] where the
    scales span K (not SCALE_IN_LOOP); ragged rows and columns read row / column 0's scales (masked later)."""
    if not SCALE_IN_LOOP:
        as_ptr, ws_ptr, tile_n, _tile_k, _x_group, stride_asm, _stride_asg, stride_wsn, _stride_wsk = S
        a_s = tl.load(as_ptr + tl.where(offs_cm < M, offs_cm, 0) * stride_asm)
        w_s = tl.load(ws_ptr + (tl.where(offs_cn < N, offs_cn, 0) // tile_n) * stride_wsn)
        accumulator = accumulator * (a_s[:, None] * w_s[None, :])
    return accumulator


@triton.jit
def _fp8_matmul_kernel(
    a_ptr,
    w_ptr,
    c_ptr,
    as_ptr,  # activation scales [M, ceil(K / X_GROUP)] fp32
    ws_ptr,  # weight scales [ceil(N / W_TILE_N), ceil(K / W_TILE_K)] fp32
    bias_ptr,  # [N] or None
    a_desc,  # TMA descriptors of a [M, K] and w [N, K] (block [BLOCK_M|BLOCK_N, BLOCK_K]); None unless TMA
    w_desc,
    M,
    N,
    K,
    W_TILE_N,
    W_TILE_K,
    X_GROUP,
    stride_am,
    stride_ak,
    stride_wn,
    stride_wk,
    stride_cm,
    stride_cn,
    stride_asm,
    stride_asg,
    stride_wsn,
    stride_wsk,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr,
    EVEN_K: tl.constexpr,
    SCALE_IN_LOOP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    TMA: tl.constexpr = False,
    FLATTEN: tl.constexpr = True,
):
    """C = (A * a_scale) @ (W * w_scale)^T (+ bias), fp32 accumulation, C in its own dtype.

    A [M, K] and W [N, K] are e4m3 (W read in place through its strides, as B = W^T). Element (m, k)
    of A has scale as[m, k // X_GROUP]; element (n, k) of W has ws[n // W_TILE_N, k // W_TILE_K].
    SCALE_IN_LOOP False: one scale along K on both sides (X_GROUP, W_TILE_K >= K), so the scales
    factor out of the K sum and multiply the accumulator once, in the epilogue. True (block scales):
    every BLOCK_K step lies in one activation group and one weight tile (the launcher picks BLOCK_K
    dividing both), and its partial product is scaled by as[rows, g] x ws[cols, g'] into the fp32
    accumulator. Ragged M/N edges clamp to row/column 0 (as the bf16 kernel), so scale loads need no
    mask either. TMA / FLATTEN / EVEN_K / NUM_SMS: as fusedpar.kernels.gemm's kernel.
    """
    start_pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n
    num_pid_in_group = GROUP_M * num_pid_n
    tile_id_c = start_pid - NUM_SMS  # the epilogue's own tile counter (see the bf16 kernel)

    offs_k_base = tl.arange(0, BLOCK_K)
    S = (as_ptr, ws_ptr, W_TILE_N, W_TILE_K, X_GROUP, stride_asm, stride_asg, stride_wsn, stride_wsk)

    for tile_id in tl.range(start_pid, num_tiles, NUM_SMS, flatten=FLATTEN):
        pid_m, pid_n = tile_coords(tile_id, num_pid_in_group, num_pid_m, GROUP_M)
        offs_am = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_wn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_am = tl.where(offs_am < M, offs_am, 0)
        offs_wn = tl.where(offs_wn < N, offs_wn, 0)
        as_row, ws_row = fp8_scale_rows(S, offs_am, offs_wn)
        accumulator = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

        for ki in range(k_tiles):
            if TMA:
                a = a_desc.load([pid_m * BLOCK_M, ki * BLOCK_K])
                b = w_desc.load([pid_n * BLOCK_N, ki * BLOCK_K]).T
            else:
                a, b = load_k_tile(a_ptr, w_ptr, offs_am, offs_wn, offs_k_base, ki, K, stride_am, stride_ak,
                                    stride_wk, stride_wn, BLOCK_K, EVEN_K)
            accumulator = fp8_dot(accumulator, a, b, as_row, ws_row, ki * BLOCK_K, ki * BLOCK_K, S, SCALE_IN_LOOP)

        tile_id_c += NUM_SMS
        pid_m, pid_n = tile_coords(tile_id_c, num_pid_in_group, num_pid_m, GROUP_M)
        offs_cm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        accumulator = fp8_scale_epilogue(accumulator, S, offs_cm, offs_cn, M, N, SCALE_IN_LOOP)
        if HAS_BIAS:
            accumulator += tl.load(bias_ptr + offs_cn, mask=offs_cn < N, other=0.0).to(tl.float32)[None, :]
        c_ptrs = c_ptr + (offs_cm[:, None] * stride_cm + offs_cn[None, :] * stride_cn)
        c_mask = (offs_cm[:, None] < M) & (offs_cn[None, :] < N)
        tl.store(c_ptrs, accumulator.to(c_ptr.dtype.element_ty), mask=c_mask)
