"""The @triton.jit code of the persistent GEMM (launcher: launch.py; math and layout: __init__.py).

_persistent_matmul_kernel: C[M, N] = A[M, K] @ W[N, K]^T over arbitrarily strided operands, grid
min(#SMs, #tiles), program p running tiles p, p + #SMs, ... in a GROUP_M-swizzled order.
The fused kernels (fusedpar.kernels.gemm_all_reduce, fusedpar.kernels.ulysses) reuse its loop
through the device helpers `tile_coords`, `load_k_tile` and `load_w_tile`: resident programs
owning a known tile sequence can publish each finished tile.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tile_coords(tile_id, num_pid_in_group, num_pid_m, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of linear tile `tile_id` in the GROUP_M-swizzled order.

    Tiles are numbered in groups of GROUP_M tile rows; inside a group the order is column-major,
    so consecutive tiles (which run concurrently on neighbouring programs) share W tiles and a
    narrow band of A rows. The last group may have fewer than GROUP_M rows (ragged M).
    """
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile_id % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def load_k_tile(a_ptr, w_ptr, offs_am, offs_wn, offs_k_base, ki, K, stride_am, stride_ak, stride_wk, stride_wn,
                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """K step `ki` of the persistent GEMMs by pointer loads: the A tile [rows offs_am, BLOCK_K] and the
    B = W^T tile [BLOCK_K, cols offs_wn] (W read in place through its strides). Past K both are zero,
    so the tail adds nothing; offs_am / offs_wn must already be clamped to valid rows. Inlined by
    Triton, so the software pipeliner sees the loads in the caller's loop."""
    offs_k = ki * BLOCK_K + offs_k_base
    a_ptrs = a_ptr + (offs_am[:, None] * stride_am + offs_k[None, :] * stride_ak)
    b_ptrs = w_ptr + (offs_k[:, None] * stride_wk + offs_wn[None, :] * stride_wn)
    if EVEN_K:
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
    else:
        k_left = K - ki * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k_base[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k_base[:, None] < k_left, other=0.0)
    return a, b


@triton.jit
def load_w_tile(w_ptr, offs_wn, offs_k_base, ki, K, stride_wk, stride_wn, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr):
    """K step `ki`'s B = W^T tile [BLOCK_K, cols offs_wn] alone (zero past K), as in load_k_tile."""
    offs_k = ki * BLOCK_K + offs_k_base
    b_ptrs = w_ptr + (offs_k[:, None] * stride_wk + offs_wn[None, :] * stride_wn)
    if EVEN_K:
        return tl.load(b_ptrs)
    return tl.load(b_ptrs, mask=offs_k_base[:, None] < K - ki * BLOCK_K, other=0.0)


@triton.jit
def _persistent_matmul_kernel(
    a_ptr,
    w_ptr,
    c_ptr,
    a_desc,  # TMA descriptors of a [M, K] and w [N, K] (block [BLOCK_M|BLOCK_N, BLOCK_K]); None unless TMA
    w_desc,
    w2_desc,  # TMA descriptor of w with block [BLOCK_N2, BLOCK_K]; None unless TMA and BLOCK_N2 > 0
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_wn,
    stride_wk,
    stride_cm,
    stride_cn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr,
    EVEN_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    TMA: tl.constexpr = False,
    FLATTEN: tl.constexpr = True,
    BLOCK_N2: tl.constexpr = 0,
):
    """C[M, N] = A[M, K] @ W[N, K]^T with fp32 accumulation; every operand arbitrarily strided.

    W is read as B = W^T, a [K, N] matrix with strides (stride_wk, stride_wn): no transpose is
    materialised, and the same code serves row views, column views and transposed storage.
    NUM_SMS is the stride of the persistent loop (the device's SM count); the grid may be smaller
    when there are fewer tiles than SMs, in which case each program runs exactly one tile.
    EVEN_K: K % BLOCK_K == 0, so the K loop needs no mask.
    INPUT_PRECISION: "ieee" for fp32 inputs (exact fp32 products, like torch's default of no
    TF32); for fp16/bf16 Triton ignores it.
    TMA: the K loop reads A and W tiles through the tensor descriptors a_desc / w_desc (Hopper's
    bulk tensor copies: one instruction per tile, no address math in the loop, zero fill past the
    M/N/K edges so no masks) instead of per-thread pointer loads. Needs both operands row-major
    in K (stride 1) with 16-byte aligned bases and row strides (`tma_compatible`).
    FLATTEN: fuse the tile loop and the K loop into one loop for the software pipeliner (the
    next tile's loads are in flight during this tile's epilogue); False keeps them nested (with
    TMA loads the qkv kernel's fastest tiling at 1024 rows per rank).
    BLOCK_N2: a second, narrower column block per tile, so one tile is BLOCK_M x (BLOCK_N + BLOCK_N2)
    with two accumulators (Triton blocks are powers of two; 256 + 64 = 320 columns is not), against
    wave quantisation: N = 2560 (Llama-70B / Qwen3-32B qkv at TP=4) and 5120 in 64 x 320 tiles give
    128 or 256 tiles at 1024-2048 rows (~97% of 132 SMs), where 128 x 256 tiles fill 61%.
    0 = one block (pick_config says when it picks two). Triton's Hopper warp specialisation is not
    offered: with 4 warps it failed to build the qkv kernel, with 8 it leaves the loop unpartitioned.
    """
    start_pid = tl.program_id(axis=0)
    TILE_N: tl.constexpr = BLOCK_N + BLOCK_N2
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, TILE_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n
    num_pid_in_group = GROUP_M * num_pid_n

    # A second tile counter for the epilogue, as in Triton's persistent-matmul tutorial, which
    # works around a pipelining bug (seen on Blackwell) with a value used both by the loads and
    # by the epilogue of the flattened loop: the epilogue recomputes its tile coordinates.
    tile_id_c = start_pid - NUM_SMS

    offs_k_base = tl.arange(0, BLOCK_K)

    for tile_id in tl.range(start_pid, num_tiles, NUM_SMS, flatten=FLATTEN):
        pid_m, pid_n = tile_coords(tile_id, num_pid_in_group, num_pid_m, GROUP_M)
        offs_am = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_wn = pid_n * TILE_N + tl.arange(0, BLOCK_N)
        # Ragged M/N edges: clamp out-of-range rows/columns to index 0 (always valid memory)
        # instead of masking them, so the K-loop loads carry at most a K mask; the extra
        # results land in rows/columns of the accumulator that the store masks off.
        offs_am = tl.where(offs_am < M, offs_am, 0)
        offs_wn = tl.where(offs_wn < N, offs_wn, 0)
        accumulator = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if BLOCK_N2 > 0:
            offs_wn2 = pid_n * TILE_N + BLOCK_N + tl.arange(0, BLOCK_N2)
            offs_wn2 = tl.where(offs_wn2 < N, offs_wn2, 0)
            accumulator2 = tl.zeros((BLOCK_M, BLOCK_N2), dtype=tl.float32)

        for ki in range(k_tiles):
            if TMA:
                a = a_desc.load([pid_m * BLOCK_M, ki * BLOCK_K])
                b = w_desc.load([pid_n * TILE_N, ki * BLOCK_K]).T
                if BLOCK_N2 > 0:
                    b2 = w2_desc.load([pid_n * TILE_N + BLOCK_N, ki * BLOCK_K]).T
            else:
                a, b = load_k_tile(a_ptr, w_ptr, offs_am, offs_wn, offs_k_base, ki, K, stride_am, stride_ak,
                                    stride_wk, stride_wn, BLOCK_K, EVEN_K)
                if BLOCK_N2 > 0:
                    b2 = load_w_tile(w_ptr, offs_wn2, offs_k_base, ki, K, stride_wk, stride_wn, BLOCK_K, EVEN_K)
            accumulator = tl.dot(a, b, accumulator, input_precision=INPUT_PRECISION)
            if BLOCK_N2 > 0:
                accumulator2 = tl.dot(a, b2, accumulator2, input_precision=INPUT_PRECISION)

        tile_id_c += NUM_SMS
        pid_m, pid_n = tile_coords(tile_id_c, num_pid_in_group, num_pid_m, GROUP_M)
        offs_cm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_cn = pid_n * TILE_N + tl.arange(0, BLOCK_N)
        c_ptrs = c_ptr + (offs_cm[:, None] * stride_cm + offs_cn[None, :] * stride_cn)
        c_mask = (offs_cm[:, None] < M) & (offs_cn[None, :] < N)
        tl.store(c_ptrs, accumulator.to(c_ptr.dtype.element_ty), mask=c_mask)
        if BLOCK_N2 > 0:
            offs_cn2 = pid_n * TILE_N + BLOCK_N + tl.arange(0, BLOCK_N2)
            c2_ptrs = c_ptr + (offs_cm[:, None] * stride_cm + offs_cn2[None, :] * stride_cn)
            c2_mask = (offs_cm[:, None] < M) & (offs_cn2[None, :] < N)
            tl.store(c2_ptrs, accumulator2.to(c_ptr.dtype.element_ty), mask=c2_mask)
