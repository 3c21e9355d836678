"""The fused GEMM + all-reduce kernel: one @triton.jit kernel, two paths (constexpr TWO_SHOT).

one_shot (decode): program p computes its work units u = p, p + S, ... (S = NUM_SMS; a unit is a
    tile, or with split-K (tile u // SPLIT_K, K range u % SPLIT_K)), PUSHES each fp32 partial, cast to
    the partial dtype, into region [src = rank][range][tile] of slot e % 2 of EVERY rank's workspace
    (a contiguous BLOCK_M x BLOCK_N block, real rows only), then publishes flag word [p, rank] on
    every rank. The reducer of tile t (program t, t + grid, ...) waits for the words of the
    programs that computed its units on every rank and sums the W x SPLIT_K local partials in
    fp32 in the fixed order (rank, range) into out. One cross-GPU hop; every load is local.
two_shot (prefill): tile t is OWNED by rank t % W. Phase A: the GEMM pushes each partial straight
    into its owner's partial region [src][t // W] (the reduce-scatter leaves from the epilogue and
    overlaps the rest of the GEMM); flag word [p, rank] after the program's last tile. Phase B:
    program p reduces owned tiles j = p, p + P, ... (waits for words [t % S, 0..W-1]), stores to
    out and pushes the result into every peer's result region [t]; flag word [S + j, rank] on every
    peer. Phase C: non-owned tiles wait for [S + t // W, t % W] and copy result[t] into out. Every
    NVLink byte is a posted remote store; each rank sends 2 (W-1)/W of the output.
FP8 (e4m3 x and w, fusedpar.kernels.fp8's scale schemes): the GEMM phase runs the scaled GEMM's mainloop
pieces (fp8_scale_rows / fp8_dot / fp8_scale_epilogue: per-tensor and per-channel scales on the
accumulator, block scales per K step); each unit's scaled fp32 accumulator becomes the partial, in
the output's dtype (or fp32). The reduce is the same.
Residual (HAS_RESIDUAL): the reduce adds a residual identical on every rank, with the plain path's
roundings: out = round(round(sum) + residual).

Co-residency: grid <= NUM_SMS and each program does ALL its GEMM work before it waits, so waits
only depend on programs that never block (or on phase B, which only waits for those): no cycle.
A wait that never ends gives up after SPIN_LIMIT polls and sets counters[STATUS] = 1. The
pipelined GEMM loop has no flag code; only its store destination differs from the plain GEMM.
Memory ordering and double buffering: the PeerTable epoch protocol (fusedpar/kernels/_sync.py).
One flag round per launch suffices: rank r rewrites q's slot e % 2 only at launch e + 2, after it
waited in launch e + 1 for a flag q published only once its launch e (reads included) finished.
Other kernels on the same PeerTable (the fallback's one-shot all-reduce) follow the same rule, so
launches may interleave: flags are epoch-valued and the slot parity is global.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fusedpar.kernels._sync import flags_of, launch_epoch, publish, retire, wait_flags
from fusedpar.kernels.fp8.kernels import fp8_dot, fp8_scale_epilogue, fp8_scale_rows
from fusedpar.kernels.gemm import load_k_tile, tile_coords


@triton.jit
def _store_tile_rows(out_ptr, vals, tile_id, r0, M, N, stride_om, stride_on, num_pid_in_group, num_pid_m,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
                     COMM_ROWS: tl.constexpr):
    """Masked store of rows [r0, r0 + COMM_ROWS) of output tile `tile_id` (a [COMM_ROWS, BLOCK_N] block)."""
    pid_m, pid_n = tile_coords(tile_id, num_pid_in_group, num_pid_m, GROUP_M)
    rows = pid_m * BLOCK_M + r0 + tl.arange(0, COMM_ROWS)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on
    tl.store(ptrs, vals.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _add_residual_rows(vals, res_ptr, tile_id, r0, M, N, stride_rm, stride_rn, num_pid_in_group, num_pid_m,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
                       COMM_ROWS: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """round(round(vals) + residual) for rows [r0, r0 + COMM_ROWS) of tile `tile_id`: the plain path's
    roundings (the all-reduced sum in the output dtype, then torch's add). Rows/columns outside
    [M, N] read 0 (they are never stored to out; the two-shot result region gets finite values)."""
    pid_m, pid_n = tile_coords(tile_id, num_pid_in_group, num_pid_m, GROUP_M)
    rows = pid_m * BLOCK_M + r0 + tl.arange(0, COMM_ROWS)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    res = tl.load(res_ptr + rows[:, None] * stride_rm + cols[None, :] * stride_rn,
                  mask=(rows[:, None] < M) & (cols[None, :] < N), other=0.0)
    return (vals.to(OUT_DTYPE).to(tl.float32) + res.to(tl.float32)).to(OUT_DTYPE)


@triton.jit
def _gemm_all_reduce_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    res_ptr,  # HAS_RESIDUAL: [M, N] added to the reduced sum (identical on every rank)
    stride_rm,
    stride_rn,
    buffer_ptrs,  # int64 [WORLD]: every rank's data buffer
    signal_ptrs,  # int64 [WORLD]: every rank's flag words (int64 [max_blocks * WORLD] each)
    counters_ptr,  # int64 local: EPOCH, RETIRED, STATUS
    rank,
    slot_bytes,  # bytes per double-buffer slot (multiple of ALIGN_BYTES)
    result_off,  # two-shot: byte offset of the result region inside a slot
    own_cap,  # two-shot: tiles per (src) partial region = cdiv(num_tiles, WORLD)
    fp8_scales,  # FP8: the scaled GEMM's scale arguments, one tuple (fusedpar.kernels.fp8.kernels)
    WORLD: tl.constexpr,
    WORLD_P2: tl.constexpr,  # next power of two >= WORLD (tl.arange needs one)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr,  # persistent stride; flag rows [0, NUM_SMS) are per-producer
    EVEN_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    PARTIAL_FP32: tl.constexpr,  # partials in fp32 (else in x's dtype)
    COMM_ROWS: tl.constexpr,  # tile rows per step of the reduce / copy loops
    SPLIT_K: tl.constexpr,  # one-shot: K ranges per output tile (units = tiles x SPLIT_K); two-shot: 1
    SPLIT_WORLD_P2: tl.constexpr,  # next power of two >= SPLIT_K * WORLD (the one-shot reducer's flag vector)
    TWO_SHOT: tl.constexpr,
    DO_GEMM: tl.constexpr,
    DO_REDUCE: tl.constexpr,
    DO_COPY: tl.constexpr,  # two-shot only
    RETIRE: tl.constexpr,  # this launch runs the last phase: advance the epoch
    USE_FLAGS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    SPIN_LIMIT: tl.constexpr,  # 0: spin until the flag arrives; > 0: give up, set STATUS
    FP8: tl.constexpr = False,  # e4m3 x and w with their scales; partials and out in out's dtype
    SCALE_IN_LOOP: tl.constexpr = False,  # FP8 block scales: every K step scaled (fusedpar.kernels.fp8)
):
    pid = tl.program_id(axis=0)
    nprog = tl.num_programs(axis=0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    num_pid_in_group = GROUP_M * num_pid_n
    TILE: tl.constexpr = BLOCK_M * BLOCK_N
    odt = out_ptr.dtype.element_ty
    pdt = tl.float32 if PARTIAL_FP32 else odt  # constexpr condition: resolved at compile time
    peers = tl.arange(0, WORLD_P2)
    peer_mask = peers < WORLD
    # Epoch of this launch (the PeerTable epoch protocol); it lives in device memory so graph replays advance it.
    epoch = launch_epoch(counters_ptr, 1)
    slot_off = (epoch % 2) * slot_bytes
    my_flags = flags_of(signal_ptrs, rank)
    # Workspace addresses come from memory and carry no alignment facts; the workspace guarantees
    # ALIGN_BYTES, and without the hint Triton would not emit 16-byte vector accesses.
    mine = tl.multiple_of((tl.load(buffer_ptrs + rank) + slot_off).to(tl.pointer_type(pdt)), 16)
    # Offsets of one contiguous BLOCK_M x BLOCK_N tile block and of one COMM_ROWS-row step of it.
    offs_tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    offs_rows = tl.arange(0, COMM_ROWS)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]

    # ---- phase A: the persistent GEMM (fusedpar.kernels.gemm's loop; only the epilogue's destination
    # differs: a contiguous tile block in a workspace instead of C) ------------------------------
    if DO_GEMM:
        unit_c = pid - NUM_SMS  # epilogue's own unit counter (as in fusedpar.kernels.gemm: pipelining workaround)
        offs_k_base = tl.arange(0, BLOCK_K)
        k_tiles = tl.cdiv(K, BLOCK_K)
        # Work unit u = (tile u // SPLIT_K, K range u % SPLIT_K): every range has k_per BLOCK_K steps
        # (a uniform trip count keeps the loop pipelined; steps past K load zeros).
        k_per = tl.cdiv(k_tiles, SPLIT_K)
        for unit in tl.range(pid, num_tiles * SPLIT_K, NUM_SMS, flatten=True):
            tile_id = unit // SPLIT_K
            k_first = (unit % SPLIT_K) * k_per
            pid_m, pid_n = tile_coords(tile_id, num_pid_in_group, num_pid_m, GROUP_M)
            offs_am = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_wn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            # Ragged edges: clamp to index 0 (valid memory) instead of masking; the extra rows and
            # columns are finite and only ever reach masked-off output positions.
            offs_am = tl.where(offs_am < M, offs_am, 0)
            offs_wn = tl.where(offs_wn < N, offs_wn, 0)
            accumulator = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if FP8:
                as_row, ws_row = fp8_scale_rows(fp8_scales, offs_am, offs_wn)
            for kk in range(k_per):
                a, b = load_k_tile(a_ptr, w_ptr, offs_am, offs_wn, offs_k_base, k_first + kk, K, stride_am,
                                    stride_ak, stride_wk, stride_wn, BLOCK_K, EVEN_K)
                if FP8:
                    # a split range's steps past K load zeros; their scale index is clamped into K
                    k0 = tl.minimum((k_first + kk) * BLOCK_K, K - 1)
                    accumulator = fp8_dot(accumulator, a, b, as_row, ws_row, k0, k0, fp8_scales, SCALE_IN_LOOP)
                else:
                    accumulator = tl.dot(a, b, accumulator, input_precision=INPUT_PRECISION)

            unit_c += NUM_SMS
            tile_id_c = unit_c // SPLIT_K
            if FP8:
                pm_s, pn_s = tile_coords(tile_id_c, num_pid_in_group, num_pid_m, GROUP_M)
                accumulator = fp8_scale_epilogue(accumulator, fp8_scales, pm_s * BLOCK_M + tl.arange(0, BLOCK_M),
                                                 pn_s * BLOCK_N + tl.arange(0, BLOCK_N), M, N, SCALE_IN_LOOP)
            part = accumulator.to(pdt)
            if TWO_SHOT:
                # Reduce-scatter by push: straight into the owner's partial region [rank][t // WORLD].
                owner = tile_id_c % WORLD
                dst = tl.multiple_of((tl.load(buffer_ptrs + owner) + slot_off).to(tl.pointer_type(pdt)), 16)
                tl.store(dst + (rank * own_cap + tile_id_c // WORLD) * TILE + offs_tile, part)
            else:
                # One-shot by push: into region [rank][K range][t] of every rank (own copy included),
                # real rows only (a decode step of 1 row must not send 15 padding rows over NVLink;
                # the reduce never stores the unsent rows).
                pm_c, _ = tile_coords(tile_id_c, num_pid_in_group, num_pid_m, GROUP_M)
                row_ok = (pm_c * BLOCK_M + tl.arange(0, BLOCK_M)) < M
                region = (rank * SPLIT_K + unit_c % SPLIT_K) * num_tiles + tile_id_c
                for q in tl.static_range(WORLD):
                    dst = tl.multiple_of((tl.load(buffer_ptrs + q) + slot_off).to(tl.pointer_type(pdt)), 16)
                    tl.store(dst + region * TILE + offs_tile, part, mask=row_ok[:, None])
        if USE_FLAGS:
            # One flag per program and rank, after ALL its tiles: nothing of the flag protocol sits
            # inside the pipelined loop, and the system-scope fence is paid once per program.
            tl.debug_barrier()
            publish(signal_ptrs, pid * WORLD + rank, epoch, peer_mask)

    # ---- phase B: reduce -------------------------------------------------------------------------
    if DO_REDUCE:
        if TWO_SHOT:
            n_own = (num_tiles - rank + WORLD - 1) // WORLD
            j = pid
            while j < n_own:
                t = j * WORLD + rank
                if USE_FLAGS:
                    # Tile t was produced by program t % NUM_SMS of every rank.
                    wait_flags(my_flags + (t % NUM_SMS) * WORLD + peers, peer_mask, epoch, counters_ptr, SPIN_LIMIT)
                src = mine + j * TILE
                for r0 in range(0, BLOCK_M, COMM_ROWS):
                    acc = tl.zeros((COMM_ROWS, BLOCK_N), dtype=tl.float32)
                    # Fixed rank order 0..WORLD-1; the result is computed once and copied everywhere.
                    for q in tl.static_range(WORLD):
                        acc += tl.load(src + q * own_cap * TILE + r0 * BLOCK_N + offs_rows,
                                       cache_modifier=".cg").to(tl.float32)
                    if HAS_RESIDUAL:
                        res = _add_residual_rows(acc, res_ptr, t, r0, M, N, stride_rm, stride_rn, num_pid_in_group,
                                                 num_pid_m, BLOCK_M, BLOCK_N, GROUP_M, COMM_ROWS, odt)
                    else:
                        res = acc.to(odt)
                    _store_tile_rows(out_ptr, res, t, r0, M, N, stride_om, stride_on, num_pid_in_group,
                                     num_pid_m, BLOCK_M, BLOCK_N, GROUP_M, COMM_ROWS)
                    # All-gather by push: the full tile block (ragged rows too: finite values) into
                    # every peer's result region [t].
                    for q in tl.static_range(WORLD):
                        if q != rank:
                            dst = (tl.load(buffer_ptrs + q) + slot_off + result_off).to(tl.pointer_type(odt))
                            dst = tl.multiple_of(dst, 16)
                            tl.store(dst + t * TILE + r0 * BLOCK_N + offs_rows, res)
                if USE_FLAGS:
                    tl.debug_barrier()
                    publish(signal_ptrs, (NUM_SMS + j) * WORLD + rank, epoch, peer_mask & (peers != rank))
                j += nprog
        else:
            # Unsplit: program pid of every rank computed exactly this program's tiles (one wait).
            # Split-K: tile t's K ranges came from programs (t SPLIT_K + s) % NUM_SMS of every rank
            # (a wait per tile). Program p reduces tiles p, p + grid, ... (grid = NUM_SMS whenever
            # there are more tiles than SMs, so unsplit tiles are still this program's own).
            if USE_FLAGS and SPLIT_K == 1:
                wait_flags(my_flags + pid * WORLD + peers, peer_mask, epoch, counters_ptr, SPIN_LIMIT)
            sw = tl.arange(0, SPLIT_WORLD_P2)
            t = pid
            while t < num_tiles:
                if USE_FLAGS and SPLIT_K > 1:
                    wait_flags(my_flags + ((t * SPLIT_K + sw // WORLD) % NUM_SMS) * WORLD + sw % WORLD,
                               sw < SPLIT_K * WORLD, epoch, counters_ptr, SPIN_LIMIT)
                for r0 in range(0, BLOCK_M, COMM_ROWS):
                    acc = tl.zeros((COMM_ROWS, BLOCK_N), dtype=tl.float32)
                    # Fixed order (rank 0..WORLD-1, then K range) on every rank: identical bits everywhere.
                    for q in tl.static_range(WORLD):
                        for ks in tl.static_range(SPLIT_K):
                            src = mine + ((q * SPLIT_K + ks) * num_tiles + t) * TILE
                            acc += tl.load(src + r0 * BLOCK_N + offs_rows, cache_modifier=".cg").to(tl.float32)
                    if HAS_RESIDUAL:
                        acc = _add_residual_rows(acc, res_ptr, t, r0, M, N, stride_rm, stride_rn, num_pid_in_group,
                                                 num_pid_m, BLOCK_M, BLOCK_N, GROUP_M, COMM_ROWS, odt)
                    _store_tile_rows(out_ptr, acc, t, r0, M, N, stride_om, stride_on, num_pid_in_group,
                                     num_pid_m, BLOCK_M, BLOCK_N, GROUP_M, COMM_ROWS)
                t += nprog

    # ---- phase C (two-shot): copy the tiles reduced by their owners into out ----------------------
    if DO_COPY and WORLD > 1:  # WORLD == 1 has no tile to copy (and WORLD - 1 would divide by 0)
        n_own = (num_tiles - rank + WORLD - 1) // WORLD
        n_other = num_tiles - n_own
        results = tl.multiple_of((tl.load(buffer_ptrs + rank) + slot_off + result_off).to(tl.pointer_type(odt)), 16)
        one = tl.arange(0, 1)
        k = pid
        while k < n_other:
            # k-th non-owned tile in increasing order: groups of WORLD tiles minus the own one.
            g = k // (WORLD - 1)
            rr = k % (WORLD - 1)
            owner = tl.where(rr >= rank, rr + 1, rr)
            t = g * WORLD + owner
            if USE_FLAGS:
                wait_flags(my_flags + (NUM_SMS + g) * WORLD + owner + one, one < 1, epoch, counters_ptr,
                           SPIN_LIMIT)
            for r0 in range(0, BLOCK_M, COMM_ROWS):
                vals = tl.load(results + t * TILE + r0 * BLOCK_N + offs_rows, cache_modifier=".cg")
                _store_tile_rows(out_ptr, vals, t, r0, M, N, stride_om, stride_on, num_pid_in_group,
                                 num_pid_m, BLOCK_M, BLOCK_N, GROUP_M, COMM_ROWS)
            k += nprog

    if RETIRE:
        # The last program of this launch publishes the epoch for the next launch.
        retire(counters_ptr, epoch, nprog)
