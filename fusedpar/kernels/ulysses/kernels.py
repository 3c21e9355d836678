"""The @triton.jit kernels of the two Ulysses all-to-alls (launchers: launch.py).

One SP group of W ranks, this rank s; m token rows per rank; blk = (q + 2 kv) * hd the qkv columns
of one rank's heads; C = q * hd its attention columns.

_qkv_all_to_all_kernel: recv [W*m, blk] on rank g, recv[p*m + r, c] = sum_k x_p[r, k] w_p[g*blk + c, k].
    A persistent GEMM (fusedpar.kernels.gemm's loop) whose N tiles never straddle a column block;
    the epilogue stores tile (rows r, block g, columns c) into rank g's receive buffer at rows
    [s*m + r]. Flag rows: 0 READY (the sender entered the launch, so it finished reading the
    previous one), 1 DONE (every tile it stored here is visible; published by the last program).
_all_to_all_o_proj_kernel: out [m, N] = sum_g sum_c attn_g[s*m + r, c] w_o[n, g*C + c] (FP8: e4m3 rows
    pushed with their per-group activation scales, every K step scaled).
    COMM programs push attn rows [g*m, (g+1)*m) into rank g's staging [W, m, C] (block s), band
    by band, and flag each (band, source) on row 1 + band. GEMM programs (a dynamic tile counter
    that the comm programs join) compute chunk s from the local attn first, wait for their band's
    flags, then chunks s+1, s+2, ... from the local staging. Pushing moves each byte over NVLink
    once; a GEMM pulling remote A tiles would re-read them once per N tile.
_o_arrival_kernel: scattered_o_proj's arrival barrier on row 1 (DONE) of the o table.

The epoch / flag protocol and its primitives: fusedpar/kernels/_sync.py. The phase constexprs
(SEND_READY / PRODUCE / WAIT, SEND_READY / PUSH / GEMM) let the CPU emulation run every rank's
phase before the next phase; on a GPU one launch runs them all.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

from fusedpar.collectives.symmetric import NUM_COUNTERS
from fusedpar.kernels._sync import EPOCH, flags_of, launch_epoch, publish, retire_system, wait_flags
from fusedpar.kernels.fp8.kernels import fp8_dot, fp8_scale_epilogue, fp8_scale_rows
from fusedpar.kernels.gemm import load_k_tile, load_w_tile, tile_coords

# Flag rows of the tables these kernels use.
_READY_ROW = tl.constexpr(0)
_DONE_ROW = tl.constexpr(1)
# The spare counter word is o_proj's dynamic tile counter (its table is op-private).
COUNTER_TILE = NUM_COUNTERS - 1
_TILE = tl.constexpr(COUNTER_TILE)

# qkv timeline (a GPU diagnostic): per program, %globaltimer ns at these points.
QKV_TIMELINE_POINTS = ("enter", "ready", "gemm", "exit")


@triton.jit
def _stamp(timeline_ptr, pid, POINT: tl.constexpr, TIMELINE: tl.constexpr):
    if TIMELINE:
        tl.store(timeline_ptr + pid * 4 + POINT, globaltimer())


# ============================================================================ qkv_all_to_all


@triton.jit
def _qkv_all_to_all_kernel(
    x_ptr,
    w_ptr,
    x_desc,  # TMA descriptors of x [M, K] and w [WORLD*BLK, K]; None unless TMA (gemm/launch.py)
    w_desc,
    w2_desc,  # TMA descriptor of w with block [BLOCK_N2, BLOCK_K]; None unless TMA and BLOCK_N2 > 0
    buffer_ptrs,  # int64 [WORLD]: every rank's receive buffer ([WORLD*M, BLK] of x's dtype at offset 0)
    signal_ptrs,  # int64 [WORLD]: every rank's flag words
    counters_ptr,  # int64 local: EPOCH, RETIRED, STATUS
    timeline_ptr,  # int64 [programs, 4] (QKV_TIMELINE_POINTS), only with TIMELINE
    rank,
    M,
    BLK,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    fp8_scales,  # FP8: the scaled GEMM's scale arguments, one tuple (fusedpar.kernels.fp8.kernels)
    WORLD: tl.constexpr,
    WORLD_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr,
    EVEN_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    EPOCH_AHEAD: tl.constexpr,  # 1: this launch starts epoch counters[EPOCH] + 1; 0: wait-only launch
    SEND_READY: tl.constexpr,
    PRODUCE: tl.constexpr,
    WAIT: tl.constexpr,
    USE_FLAGS: tl.constexpr,
    SPIN_LIMIT: tl.constexpr,
    TIMELINE: tl.constexpr,
    TMA: tl.constexpr = False,
    FLATTEN: tl.constexpr = True,
    BLOCK_N2: tl.constexpr = 0,
    ROTATE: tl.constexpr = False,
    FP8: tl.constexpr = False,  # e4m3 x and w with their scales; the receive buffer holds OUT_DTYPE
    SCALE_IN_LOOP: tl.constexpr = False,  # FP8 block scales: every K step scaled (fusedpar.kernels.fp8)
    OUT_DTYPE: tl.constexpr = None,
):
    """GEMM x @ w^T with tile (rows r, block g, cols c) stored into rank g's buffer at [rank*M + r, c].

    The GEMM loop is fusedpar/kernels/gemm/kernels.py's _persistent_matmul_kernel (same swizzle, same
    flattened tile x K loop, same epilogue tile-id recomputation), with N tiled per block
    (tiles = cdiv(M, BLOCK_M) x WORLD * cdiv(BLK, TILE_N)) so that every tile has one owner,
    and the epilogue's store redirected to the owner. Flag code sits outside the tile loop only, so
    the loop stays the plain GEMM loop Triton pipelines. TMA / FLATTEN: the K loop's tile loads and
    the loop nest as in gemm/kernels.py; a W tile that runs past its block reads the next block's rows (or
    zeros), whose columns the store masks.
    BLOCK_N2: split tiles as in gemm/kernels.py (a second accumulator, TILE_N = BLOCK_N + BLOCK_N2 columns of
    one block; 320 columns cut blk = 2560 into 8 tiles).
    ROTATE: rank r's tile order starts at its own block (tile columns shifted by r blocks, modulo
    all of them). Concurrent tiles span one or two blocks, so without it every rank stores into the
    same owner at once (three peers into one GPU); rotated, the ranks' stores go round a ring.
    FP8: the K loop and the epilogue's scaling are the scaled GEMM's (fp8_scale_rows / fp8_dot /
    fp8_scale_epilogue); the owners receive the scaled products in OUT_DTYPE (no split tiles).
    """
    pid = tl.program_id(axis=0)
    nprog = tl.num_programs(axis=0)
    _stamp(timeline_ptr, pid, 0, TIMELINE)
    peers = tl.arange(0, WORLD_P2)
    others = (peers < WORLD) & (peers != rank)
    my_flags = flags_of(signal_ptrs, rank)
    epoch = launch_epoch(counters_ptr, EPOCH_AHEAD)

    if SEND_READY and USE_FLAGS:
        publish(signal_ptrs, _READY_ROW * WORLD + rank, epoch, tl.where(pid == 0, others, False))  # program 0 only

    do_wait = pid == 0  # a wait-only launch has one program
    if PRODUCE:
        if USE_FLAGS:
            # Peers' buffers are free for this launch once they entered it (READY >= epoch).
            wait_flags(my_flags + _READY_ROW * WORLD + peers, others, epoch, counters_ptr, SPIN_LIMIT)
        _stamp(timeline_ptr, pid, 1, TIMELINE)

        dtype = OUT_DTYPE if FP8 else x_ptr.dtype.element_ty
        # Every rank's buffer address, loaded once: the epilogue picks its owner's with integer
        # ops, so the pipelined loop body carries no extra memory access.
        bases = tl.load(buffer_ptrs + peers, mask=peers < WORLD, other=0)
        TILE_N: tl.constexpr = BLOCK_N + BLOCK_N2
        num_pid_m = tl.cdiv(M, BLOCK_M)
        tiles_per_block = tl.cdiv(BLK, TILE_N)
        num_pid_n = WORLD * tiles_per_block
        k_tiles = tl.cdiv(K, BLOCK_K)
        num_tiles = num_pid_m * num_pid_n
        num_pid_in_group = GROUP_M * num_pid_n
        tile_id_c = pid - NUM_SMS
        offs_k_base = tl.arange(0, BLOCK_K)

        for tile_id in tl.range(pid, num_tiles, NUM_SMS, flatten=FLATTEN):
            pid_m, pid_n = tile_coords(tile_id, num_pid_in_group, num_pid_m, GROUP_M)
            if ROTATE:
                pid_n = (pid_n + rank * tiles_per_block) % num_pid_n
            blk_id = pid_n // tiles_per_block
            offs_am = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            c0 = (pid_n % tiles_per_block) * TILE_N
            offs_c = c0 + tl.arange(0, BLOCK_N)
            # Ragged edges: clamp to valid rows (see gemm/kernels.py); the store masks the extras off.
            offs_am = tl.where(offs_am < M, offs_am, 0)
            offs_wn = blk_id * BLK + tl.where(offs_c < BLK, offs_c, 0)

            accumulator = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if FP8:
                as_row, ws_row = fp8_scale_rows(fp8_scales, offs_am, offs_wn)
            if BLOCK_N2 > 0:
                offs_c2 = c0 + BLOCK_N + tl.arange(0, BLOCK_N2)
                offs_wn2 = blk_id * BLK + tl.where(offs_c2 < BLK, offs_c2, 0)
                accumulator2 = tl.zeros((BLOCK_M, BLOCK_N2), dtype=tl.float32)
            for ki in range(k_tiles):
                if TMA:
                    a = x_desc.load([pid_m * BLOCK_M, ki * BLOCK_K])
                    b = w_desc.load([blk_id * BLK + c0, ki * BLOCK_K]).T
                    if BLOCK_N2 > 0:
                        b2 = w2_desc.load([blk_id * BLK + c0 + BLOCK_N, ki * BLOCK_K]).T
                else:
                    a, b = load_k_tile(x_ptr, w_ptr, offs_am, offs_wn, offs_k_base, ki, K, stride_xm, stride_xk,
                                        stride_wk, stride_wn, BLOCK_K, EVEN_K)
                    if BLOCK_N2 > 0:
                        b2 = load_w_tile(w_ptr, offs_wn2, offs_k_base, ki, K, stride_wk, stride_wn, BLOCK_K, EVEN_K)
                if FP8:
                    accumulator = fp8_dot(accumulator, a, b, as_row, ws_row, ki * BLOCK_K, ki * BLOCK_K, fp8_scales,
                                          SCALE_IN_LOOP)
                else:
                    accumulator = tl.dot(a, b, accumulator, input_precision=INPUT_PRECISION)
                if BLOCK_N2 > 0:
                    accumulator2 = tl.dot(a, b2, accumulator2, input_precision=INPUT_PRECISION)

            tile_id_c += NUM_SMS
            pid_m, pid_n = tile_coords(tile_id_c, num_pid_in_group, num_pid_m, GROUP_M)
            if ROTATE:
                pid_n = (pid_n + rank * tiles_per_block) % num_pid_n
            owner = pid_n // tiles_per_block
            offs_cm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_cn = (pid_n % tiles_per_block) * TILE_N + tl.arange(0, BLOCK_N)
            if FP8:  # the weight rows of the tile's columns (ragged ones clamped into the block)
                offs_wc = owner * BLK + tl.where(offs_cn < BLK, offs_cn, 0)
                accumulator = fp8_scale_epilogue(accumulator, fp8_scales, offs_cm, offs_wc, M, WORLD * BLK,
                                                 SCALE_IN_LOOP)
            dst = tl.sum(tl.where(peers == owner, bases, 0), axis=0).to(tl.pointer_type(dtype))
            # Buffers are ALIGN_BYTES-aligned; an address loaded from memory carries no such fact.
            dst = tl.multiple_of(dst, 16)
            c_ptrs = dst + ((rank * M + offs_cm)[:, None] * BLK + offs_cn[None, :])
            c_mask = (offs_cm[:, None] < M) & (offs_cn[None, :] < BLK)
            tl.store(c_ptrs, accumulator.to(dtype), mask=c_mask)
            if BLOCK_N2 > 0:
                offs_cn2 = (pid_n % tiles_per_block) * TILE_N + BLOCK_N + tl.arange(0, BLOCK_N2)
                c2_ptrs = dst + ((rank * M + offs_cm)[:, None] * BLK + offs_cn2[None, :])
                tl.store(c2_ptrs, accumulator2.to(dtype), mask=(offs_cm[:, None] < M) & (offs_cn2[None, :] < BLK))

        _stamp(timeline_ptr, pid, 2, TIMELINE)
        last = retire_system(counters_ptr, epoch, nprog)
        if USE_FLAGS:
            publish(signal_ptrs, _DONE_ROW * WORLD + rank, epoch, tl.where(last, others, False))  # last program only
        do_wait = last

    if WAIT and USE_FLAGS:
        # One waiter: the launch completes only when it does. Other programs see an empty mask.
        # tl.where, not `others & do_wait`: Triton 3.9's interpreter gives a [P] & scalar mask int32 data
        wait_flags(my_flags + _DONE_ROW * WORLD + peers, tl.where(do_wait, others, False), epoch, counters_ptr,
                   SPIN_LIMIT)
    _stamp(timeline_ptr, pid, 3, TIMELINE)


# ========================================================================= all_to_all_o_proj


@triton.jit
def _all_to_all_o_proj_kernel(
    attn_ptr,
    w_ptr,
    out_ptr,
    stage_ptr,  # this rank's staging buffer [WORLD, M, C] (attn dtype): block p = rows from source p
    buffer_ptrs,
    signal_ptrs,
    counters_ptr,
    rank,
    M,
    N,
    C,
    stride_am,
    stride_ak,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    band_rows,  # rows per push band (a multiple of BLOCK_M)
    num_bands,
    fp8_scales,  # FP8: the scaled GEMM's scale tuple; its activation scales: attn's, [WORLD*M, G] contiguous
    stage_s_ptr,  # FP8: this rank's staged activation scales [WORLD, M, G] fp32 (at scale_off of the buffer)
    scale_off,  # FP8: byte offset of the staged scales in every rank's buffer
    G,  # FP8: activation groups per attn row (C / the group)
    WORLD: tl.constexpr,
    WORLD_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_C: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    COMM_PROGRAMS: tl.constexpr,  # leading programs that push (when PUSH)
    COPY_ROWS: tl.constexpr,
    COPY_COLS: tl.constexpr,
    SEND_READY: tl.constexpr,
    PUSH: tl.constexpr,
    GEMM: tl.constexpr,
    USE_FLAGS: tl.constexpr,
    SPIN_LIMIT: tl.constexpr,
    FP8: tl.constexpr = False,  # e4m3 attn (quantised per row and group of C / G columns) and w_o
    G_P2: tl.constexpr = 1,  # FP8: next power of two >= G
):
    """Push attn rows to their owners (comm programs), then out = A @ w^T chunk by chunk (all programs).

    FP8: the pushed rows are e4m3 and each item also pushes its rows' activation scales; every K step
    is scaled (fusedpar.kernels.fp8's fp8_dot), the weight's scales read at the chunk's global column."""
    pid = tl.program_id(axis=0)
    nprog = tl.num_programs(axis=0)
    peers = tl.arange(0, WORLD_P2)
    others = (peers < WORLD) & (peers != rank)
    my_flags = flags_of(signal_ptrs, rank)
    # Every phase of launch e runs with e = counters[EPOCH] + 1; only the GEMM phase retires.
    epoch = launch_epoch(counters_ptr, 1)
    dtype = attn_ptr.dtype.element_ty

    if SEND_READY and USE_FLAGS:
        publish(signal_ptrs, _READY_ROW * WORLD + rank, epoch, tl.where(pid == 0, others, False))  # program 0 only

    # Nested on purpose: Triton cannot `and` a constexpr with a runtime value.
    if PUSH:  # noqa: SIM102
        if pid < COMM_PROGRAMS:
            if USE_FLAGS:
                wait_flags(my_flags + _READY_ROW * WORLD + peers, others, epoch, counters_ptr, SPIN_LIMIT)
            rr = tl.arange(0, COPY_ROWS)
            cc = tl.arange(0, COPY_COLS)
            n_col_blocks = tl.cdiv(C, COPY_COLS)
            # Items in band-major order: every destination gets band 0 of every source first,
            # the order in which the GEMM programs consume the bands.
            num_items = num_bands * (WORLD - 1)
            item = pid
            while item < num_items:
                band = item // (WORLD - 1)
                g = (rank + WORLD - 1 - item % (WORLD - 1)) % WORLD  # destination: s-1, s-2, ...
                row0 = band * band_rows
                rows = tl.minimum(band_rows, M - row0)
                dst = tl.load(buffer_ptrs + g).to(tl.pointer_type(dtype))
                dst = tl.multiple_of(dst, 16) + rank * M * C  # block `rank` of g's staging
                n_copy = tl.cdiv(rows, COPY_ROWS) * n_col_blocks
                t = 0
                while t < n_copy:
                    r = row0 + (t // n_col_blocks) * COPY_ROWS + rr
                    c = (t % n_col_blocks) * COPY_COLS + cc
                    msk = (r[:, None] < row0 + rows) & (c[None, :] < C)
                    v = tl.load(attn_ptr + ((g * M + r)[:, None] * stride_am + c[None, :] * stride_ak), mask=msk)
                    tl.store(dst + (r[:, None] * C + c[None, :]), v, mask=msk)
                    t += 1
                if FP8:  # the rows' scales into block `rank` of g's staged scales
                    gg = tl.arange(0, G_P2)
                    dst_s = tl.multiple_of((tl.load(buffer_ptrs + g) + scale_off).to(tl.pointer_type(tl.float32)), 16)
                    for r0 in range(row0, row0 + rows, COPY_ROWS):
                        r = r0 + rr
                        msk = (r[:, None] < row0 + rows) & (gg[None, :] < G)
                        v = tl.load(fp8_scales[0] + (g * M + r)[:, None] * G + gg[None, :], mask=msk)
                        tl.store(dst_s + (rank * M + r)[:, None] * G + gg[None, :], v, mask=msk)
                if USE_FLAGS:
                    tl.debug_barrier()  # every thread's stores of the item before the release
                    # One destination (no mask): a scalar release of the item's own flag.
                    g_flags = flags_of(signal_ptrs, g)
                    tl.atomic_xchg(g_flags + (_DONE_ROW + band) * WORLD + rank, epoch, sem="release", scope="sys")
                item += COMM_PROGRAMS

    if GEMM:
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        num_tiles = num_pid_m * num_pid_n
        num_pid_in_group = GROUP_M * num_pid_n
        kc_tiles = tl.cdiv(C, BLOCK_K)
        offs_k_base = tl.arange(0, BLOCK_K)
        # Dynamic tile scheduler: programs that finished pushing pick up the remaining tiles,
        # so the comm programs cost no GEMM throughput once the exchange is done.
        tile_id = tl.atomic_add(counters_ptr + _TILE, 1, sem="relaxed", scope="gpu")
        while tile_id < num_tiles:
            pid_m, pid_n = tile_coords(tile_id, num_pid_in_group, num_pid_m, GROUP_M)
            offs_am = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_wn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            offs_am = tl.where(offs_am < M, offs_am, 0)
            offs_wn = tl.where(offs_wn < N, offs_wn, 0)
            accumulator = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if FP8:
                as_row, ws_row = fp8_scale_rows(fp8_scales, rank * M + offs_am, offs_wn)

            # Chunk `rank`: this rank's own attention rows, local, no wait.
            a_base = attn_ptr + (rank * M + offs_am)[:, None] * stride_am
            for kt in range(kc_tiles):
                offs_k = kt * BLOCK_K + offs_k_base
                a_ptrs = a_base + offs_k[None, :] * stride_ak
                b_ptrs = w_ptr + ((rank * C + offs_k)[:, None] * stride_wk + offs_wn[None, :] * stride_wn)
                if EVEN_C:
                    a = tl.load(a_ptrs)
                    b = tl.load(b_ptrs)
                else:
                    # Mask both operands: A's zeros already cancel the products, but w past the
                    # last chunk's C columns may be out of bounds (or non-finite).
                    a = tl.load(a_ptrs, mask=offs_k[None, :] < C, other=0.0)
                    b = tl.load(b_ptrs, mask=offs_k[:, None] < C, other=0.0)
                if FP8:
                    accumulator = fp8_dot(accumulator, a, b, as_row, ws_row, kt * BLOCK_K, rank * C + kt * BLOCK_K,
                                          fp8_scales, True)
                else:
                    accumulator = tl.dot(a, b, accumulator, input_precision=INPUT_PRECISION)

            if USE_FLAGS:
                band = (pid_m * BLOCK_M) // band_rows
                wait_flags(my_flags + (_DONE_ROW + band) * WORLD + peers, others, epoch, counters_ptr, SPIN_LIMIT)

            # Chunks rank+1, rank+2, ...: the peers' rows, from the local staging buffer.
            for it in range((WORLD - 1) * kc_tiles):
                src = (rank + 1 + it // kc_tiles) % WORLD
                offs_k = (it % kc_tiles) * BLOCK_K + offs_k_base
                a_ptrs = stage_ptr + (src * M * C + offs_am[:, None] * C + offs_k[None, :])
                b_ptrs = w_ptr + ((src * C + offs_k)[:, None] * stride_wk + offs_wn[None, :] * stride_wn)
                if EVEN_C:
                    a = tl.load(a_ptrs)
                    b = tl.load(b_ptrs)
                else:
                    a = tl.load(a_ptrs, mask=offs_k[None, :] < C, other=0.0)
                    b = tl.load(b_ptrs, mask=offs_k[:, None] < C, other=0.0)
                if FP8:
                    ka = (it % kc_tiles) * BLOCK_K
                    accumulator = fp8_dot(accumulator, a, b, stage_s_ptr + (src * M + offs_am) * G, ws_row, ka,
                                          src * C + ka, fp8_scales, True)
                else:
                    accumulator = tl.dot(a, b, accumulator, input_precision=INPUT_PRECISION)

            offs_cm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            c_ptrs = out_ptr + (offs_cm[:, None] * stride_om + offs_cn[None, :] * stride_on)
            c_mask = (offs_cm[:, None] < M) & (offs_cn[None, :] < N)
            tl.store(c_ptrs, accumulator.to(out_ptr.dtype.element_ty), mask=c_mask)
            tile_id = tl.atomic_add(counters_ptr + _TILE, 1, sem="relaxed", scope="gpu")

        last = retire_system(counters_ptr, epoch, nprog)
        if last:
            # Every program has made its final tile fetch before retiring: safe to rewind.
            tl.atomic_xchg(counters_ptr + _TILE, 0, sem="relaxed", scope="gpu")


@triton.jit
def _o_arrival_kernel(
    signal_ptrs,
    counters_ptr,
    rank,
    WORLD: tl.constexpr,
    WORLD_P2: tl.constexpr,
    PUBLISH: tl.constexpr,
    WAIT: tl.constexpr,
    SPIN_LIMIT: tl.constexpr,
):
    """One program: the arrival barrier of scattered_o_proj (epoch e = counters[EPOCH] + 1).

    PUBLISH: release e (system scope) into word [DONE * W + rank] of every rank: this rank's
    attention launch, earlier on the stream, has completed, so all its stores into the peers'
    staging buffers are performed. WAIT: acquire every peer's word >= e, then counters[EPOCH] = e;
    kernels after this one on the stream may read the staging buffer.
    """
    peers = tl.arange(0, WORLD_P2)
    mask = peers < WORLD
    e = launch_epoch(counters_ptr, 1)
    if PUBLISH:
        publish(signal_ptrs, _DONE_ROW * WORLD + rank, e, mask)
    if WAIT:
        wait_flags(flags_of(signal_ptrs, rank) + _DONE_ROW * WORLD + peers, mask, e, counters_ptr, SPIN_LIMIT)
        tl.atomic_xchg(counters_ptr + EPOCH, e, sem="relaxed", scope="gpu")
