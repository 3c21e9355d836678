"""Row-parallel GEMM fused with its all-reduce: out = sum over ranks r of x_r @ w_r^T, no NCCL call.

Math and layouts
    Rank r of a group of W ranks holds x_r [M, K_r] (activations, any strides) and w_r [N, K_r], the
    row-parallel weight shard in nn.Linear orientation (out_features N = d_out, in_features K_r =
    K_local), typically a non-contiguous column view of the rank's base weight (DESIGN.md section
    3). Every rank returns the same [M, N] tensor of x's dtype:

        out[m, n] = round( sum_{r = 0..W-1} round_p( sum_k x_r[m, k] w_r[n, k] ) )

    The inner sum is the GEMM's fp32 accumulator; round_p rounds it once to the partial dtype
    (x's dtype by default, which is what the plain path's NCCL all-reduce sends; fp32 on request,
    which doubles the bytes on NVLink); the rank sum is done in fp32 in the fixed order 0..W-1
    (NCCL instead rounds to bf16 after every step), and round() is the final cast to x's dtype.
    Every rank's output has identical bits: one-shot sums in the same order everywhere, two-shot
    computes each tile once and copies it.

Two fused paths, one Triton kernel (`_gemm_all_reduce_kernel`, constexpr TWO_SHOT)
    one_shot (decode, M <= ONE_SHOT_MAX_TOKENS): weight-read-bound GEMM + one-shot all-reduce in
        one launch. Program p computes its output tiles t = p, p + S, ... (S = NUM_SMS, the
        persistent stride), PUSHES each fp32-accumulated partial tile (cast to the partial dtype)
        into slot e % 2 of EVERY rank's workspace (region [src = r][t], a contiguous
        BLOCK_M x BLOCK_N block), then publishes flag word [p, r] on every rank. Then it waits for
        flag words [p, 0..W-1] of its own rank (program p of every rank computed the same tiles,
        since every rank launches the same grid), and sums the W local partial copies of its
        tiles in fp32, rank order 0..W-1, into out. One cross-GPU hop per launch; all reads local.
        Only the tile's real rows (< M) are pushed: a 1-row decode step in a 16-row tile sends 1/16
        of the tile. Split-K (FusedConfig.split_k = S > 1, decode steps of <= SPLIT_K_MAX_ROWS rows
        whose output has too few tiles to occupy the SMs): work unit u = (tile u // S, K range
        u % S) replaces the tile in the loop above, each unit pushes its own partial (region
        [src][range][t]), flag word [p, r] still follows all of program p's units, and the
        reducer of tile t (program t, t + grid, ...) waits for the S x W words of the programs
        that computed its units and sums the S x W partials in the fixed order (rank, range). The
        roundings become round(sum over ranks and ranges of round_p(range partial))).
    two_shot (prefill, M >= TWO_SHOT_MIN_TOKENS): persistent GEMM + reduce-scatter + all-gather.
        Tile t is OWNED by rank t % W. Phase A (GEMM): program p computes tiles t = p, p + S, ...
        and pushes each partial straight into its owner's workspace, region partial[src = r]
        [j = t // W]; the remote stores leave from the GEMM epilogue, so the reduce-scatter
        traffic overlaps the rest of the GEMM. After its last tile: flag word [p, r] on every rank.
        Phase B (reduce): program p takes owned tiles j = p, p + P, ... (P = grid size); waits
        for flag words [t % S, 0..W-1] (the program that produced tile t, on every rank); sums
        the W partials (all local) in fp32; stores the result to its own out and pushes it into
        every peer's result region [t] (x's dtype); then flag word [S + j, r] on every peer.
        Phase C (copy): program p takes the non-owned tiles (k-th non-owned tile, k = p, p + P,
        ...), waits for flag word [S + t // W, t % W], copies result[t] into out. Every byte that
        crosses NVLink is a posted remote STORE (no remote loads: no round-trip latency to hide)
        and every load is local. Each rank sends and receives 2 (W-1)/W of the output, the
        all-reduce minimum; the reduce-scatter half is hidden behind the GEMM, the all-gather
        half runs after it on all SMs.
    Residual epilogue (constexpr HAS_RESIDUAL): the reduce (one-shot reduce, two-shot phase B) can
    add a residual [M, N] that is identical on every rank (the residual stream): out =
    round(round(sum) + residual), the plain path's roundings. In a decode step that removes the
    residual add after the down projection (and lets the o projection's output go straight into
    a plain RMSNorm), kernels the stock path (cuBLAS + one-shot all-reduce) launches separately:
    decode MLP tail (silu_mul -> down -> all-reduce -> + residual) in a CUDA graph 1.07-1.17x the
    stock tail on 4x H200, 1-64 rows (perf/results/gemm_all_reduce.json, "mlp-tail" records).
    A SwiGLU prologue (silu(gate) * up computed in the A-operand load from the gate_up output, so
    no activation tensor) was tried and measured 2.0-2.6x SLOWER than silu_mul + this kernel
    (e.g. Llama-70B down, 8 rows: 0.082 vs 0.039 ms per call in a graph, run 17): the exp and the
    second A load in every K step of every N tile outweigh one 2-3 us elementwise pass; it was removed.
    Large M is processed in row chunks (one launch each) sized to the workspace; each chunk
    must have >= W tiles (the double-buffering argument below needs every rank to own a tile).

Co-residency (DESIGN.md section 5, pitfall c)
    Grid <= NUM_SMS = the device's SM count, and each program does ALL of its GEMM work before it
    waits for anything; GEMM work never waits. So a waiting program only waits for (a) GEMM work
    of programs that never block, or (b) phase B of peers, which only waits for (a). No cycle,
    provided every program of a launch gets an SM eventually, which holds when the kernel is not
    sharing the GPU with other spinning kernels. A wait that still never ends (protocol bug, a
    rank that skipped a call) gives up after SPIN_LIMIT polls and sets counters[STATUS] = 1: a
    reported error, never a hang. The GEMM loop itself has no flag code (no barrier or atomic
    inside the pipelined loop, pitfall e): the only addition there is the store's destination.

Memory ordering (the PeerTable epoch protocol, fusedpar/collectives/symmetric.py; primitives: _sync.py)
    Launch e reads e = counters[EPOCH] + 1 and uses data slot e % 2; the last program to retire
    stores counters[EPOCH] = e (device-side, so CUDA-graph replays advance it).
    Publish: data stores (local or remote), CTA barrier (tl.debug_barrier), then one atomic
    exchange of e into each destination's flag word with release semantics at system scope; the
    release is cumulative over the CTA's stores ordered before it by the barrier.
    Consume: spin with RMW atomics (add 0) with acquire semantics at system scope on LOCAL flag
    words until >= e, CTA barrier, then load with .cg (L2, no stale L1 line).
    Each flag word has one writer per launch: word [p, src] only program p of rank src (phase A)
    and word [S + j, owner] only the owner's program reducing j (phase B). ">= e" because a fast
    peer may already have published e + 1; epochs never repeat, so an old value never passes. A
    value >= e + 1 in word [row, src] is only written by rank src in a later launch (the column
    is always the writer, in every kernel using the table), which src starts only after it
    finished launch e, including the launch-e stores that the word guards: so it is as good as e.
    Double buffering (why one flag round per launch suffices): all reads of rank q's workspace
    are q's own (local). Rank r writes into q's slot e % 2 again only at launch e + 2, i.e.
    after r's launch e + 1 finished; in launch e + 1, r waited for at least one flag that q
    published in its launch e + 1 (one-shot: every program waits for every rank; two-shot:
    r owns tile r < W, whose partials come from every rank), and q publishes those only after
    its launch e completed, reads included (stream order). Launches of other kernels on the
    same PeerTable (the one-shot all-reduce of the fallback) follow the same rule, so they may
    interleave with these: flags are epoch-valued and the slot parity is global.

CPU emulation (DESIGN.md section 6)
    The interpreter runs programs one after another, so a launch that waits for a peer's later
    phase would spin forever. `gemm_all_reduce_emulated` therefore drives every rank of an
    EmulatedWorld phase by phase (constexprs DO_GEMM / DO_REDUCE / DO_COPY): every rank's GEMM
    launch, then every rank's reduce, then (two-shot) every rank's copy. The flag code still
    runs (USE_FLAGS): the flags are simply set when the waits start; USE_FLAGS=False skips it.

Layers (DESIGN.md section 1): kernel -> launcher (`launch_gemm_all_reduce`) -> registered ops
`torch.ops.fusedpar.gemm_all_reduce` / `gemm_all_reduce_out` (fake impls; torch.compile and
CUDA-graph capture see one opaque node) -> the size-based router `gemm_all_reduce`, which falls
back to cuBLAS + fusedpar.kernels.allreduce.all_reduce (our one-shot or NCCL) where the fused
paths are not measured to win.

CPU: set TRITON_INTERPRET=1 before this module is first imported; the interpreter cannot tl.dot
bf16, so CPU tests use fp16/fp32.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from fusedpar.collectives.symmetric import EmulatedWorld, PeerTable, SymmetricWorkspace, _align, as_peer_table
from fusedpar.kernels._host import cdiv, check_out_overlap, overlaps_other_view, require_pow2, require_same_on_ranks
from fusedpar.kernels._sync import (
    check_emulated_rank,
    device_guard,
    esize,
    flags_of,
    group_size_and_pg,
    launch_epoch,
    next_pow2,
    publish,
    resolve_spin_limit,
    retire,
    routes_as_captured,
    routing_as_captured,
    slot_size,
    sm_count,
    wait_flags,
)
from fusedpar.kernels.allreduce import all_reduce, sum_over_group_
from fusedpar.kernels.gemm import GemmConfig, _load_k_tile, _tile_coords, pick_config, require_one_block

__all__ = [
    "GPU_SPIN_LIMIT",
    "ONE_SHOT_MAX_TOKENS",
    "PATHS",
    "SPLIT_K_MAX_ROWS",
    "TWO_SHOT_MIN_TOKENS",
    "FusedConfig",
    "FusedPlan",
    "auto_path",
    "choose_path",
    "default_config",
    "fused_plan",
    "gemm_all_reduce",
    "gemm_all_reduce_emulated",
    "gemm_all_reduce_reference",
    "launch_gemm_all_reduce",
    "required_workspace",
    "routing_as_captured",
    "slot_bytes_of",
]

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# ---- router thresholds (rows of x per rank) ---------------------------------------------------
# Measured with perf/bench_gemm_all_reduce.py on 4 x H200 (perf/results/gemm_all_reduce.json):
#  - one-shot (decode): inside a CUDA graph 1.07-1.33x cuBLAS + torch's symm_mem one-shot for
#    8-64 rows (Llama-70B o/down); eager it loses (0.57-0.83x cuBLAS + NCCL) to the Triton
#    launch's host cost, so "auto" takes it only while a CUDA graph is being captured.
#  - two-shot: timed one path after the other (GPU run 3) it measured 1.01-1.21x cuBLAS + NCCL
#    from 4096 rows; with the paths' samples interleaved (runs 108, 111, 113, which cancel the
#    host's drift) 0.88-1.02x at 4096 rows (6 of the 12 cases below 0.97x; Qwen3-32B down
#    0.88-0.93x in all three), 1.00-1.10x at 8192 and 1.00-1.15x at 16384. So it starts at 8192 rows.
# Between the two (and whenever the workspace is too small) the router uses cuBLAS + all_reduce.
ONE_SHOT_MAX_TOKENS = 64
TWO_SHOT_MIN_TOKENS = 8192

# Bounded spin on GPUs: polls of a local flag word (an acquire RMW at system scope, ~0.2-1 us
# each) before a wait gives up and reports counters[STATUS] = 1: ~7 s to ~30 s, far above any
# legitimate wait (a peer's GEMM, launch skew, a peer's first-call Triton compile).
GPU_SPIN_LIMIT = 1 << 25

PATHS = ("auto", "local", "one_shot", "two_shot", "unfused")


@triton.jit
def _store_tile_rows(out_ptr, vals, tile_id, r0, M, N, stride_om, stride_on, num_pid_in_group, num_pid_m,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
                     COMM_ROWS: tl.constexpr):
    """Masked store of rows [r0, r0 + COMM_ROWS) of output tile `tile_id` (a [COMM_ROWS, BLOCK_N] block)."""
    pid_m, pid_n = _tile_coords(tile_id, num_pid_in_group, num_pid_m, GROUP_M)
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
    pid_m, pid_n = _tile_coords(tile_id, num_pid_in_group, num_pid_m, GROUP_M)
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
):
    pid = tl.program_id(axis=0)
    nprog = tl.num_programs(axis=0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    num_pid_in_group = GROUP_M * num_pid_n
    TILE: tl.constexpr = BLOCK_M * BLOCK_N
    pdt = tl.float32 if PARTIAL_FP32 else a_ptr.dtype.element_ty  # constexpr condition: resolved at compile time
    odt = out_ptr.dtype.element_ty
    peers = tl.arange(0, WORLD_P2)
    peer_mask = peers < WORLD
    # Epoch of this launch (module docstring); it lives in device memory so graph replays advance it.
    epoch = launch_epoch(counters_ptr, 1)
    slot_off = (epoch % 2) * slot_bytes
    my_flags = flags_of(signal_ptrs, rank)
    # Workspace addresses come from memory and carry no alignment facts; the workspace guarantees
    # ALIGN_BYTES, and without the hint Triton would not emit 16-byte vector accesses.
    mine = tl.multiple_of((tl.load(buffer_ptrs + rank) + slot_off).to(tl.pointer_type(pdt)), 16)
    # Offsets of one contiguous BLOCK_M x BLOCK_N tile block and of one COMM_ROWS-row step of it.
    offs_tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    offs_rows = tl.arange(0, COMM_ROWS)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]

    # ---- phase A: the persistent GEMM (a copy of fusedpar.kernels.gemm's loop; only the epilogue's
    # destination differs: a contiguous tile block in a workspace instead of C) -----------------
    if DO_GEMM:
        unit_c = pid - NUM_SMS  # epilogue's own unit counter (see gemm.py: pipelining workaround)
        offs_k_base = tl.arange(0, BLOCK_K)
        k_tiles = tl.cdiv(K, BLOCK_K)
        # Work unit u = (tile u // SPLIT_K, K range u % SPLIT_K): every range has k_per BLOCK_K steps
        # (a uniform trip count keeps the loop pipelined; steps past K load zeros).
        k_per = tl.cdiv(k_tiles, SPLIT_K)
        for unit in tl.range(pid, num_tiles * SPLIT_K, NUM_SMS, flatten=True):
            tile_id = unit // SPLIT_K
            k_first = (unit % SPLIT_K) * k_per
            pid_m, pid_n = _tile_coords(tile_id, num_pid_in_group, num_pid_m, GROUP_M)
            offs_am = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_wn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            # Ragged edges: clamp to index 0 (valid memory) instead of masking; the extra rows and
            # columns are finite and only ever reach masked-off output positions.
            offs_am = tl.where(offs_am < M, offs_am, 0)
            offs_wn = tl.where(offs_wn < N, offs_wn, 0)
            accumulator = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kk in range(k_per):
                a, b = _load_k_tile(a_ptr, w_ptr, offs_am, offs_wn, offs_k_base, k_first + kk, K, stride_am,
                                    stride_ak, stride_wk, stride_wn, BLOCK_K, EVEN_K)
                accumulator = tl.dot(a, b, accumulator, input_precision=INPUT_PRECISION)

            unit_c += NUM_SMS
            tile_id_c = unit_c // SPLIT_K
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
                pm_c, _ = _tile_coords(tile_id_c, num_pid_in_group, num_pid_m, GROUP_M)
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


# Triton picks interpreter vs compiler when @triton.jit runs.
_INTERPRETED = not isinstance(_gemm_all_reduce_kernel, JITFunction)


# ---- configuration and planning ---------------------------------------------------------------


@dataclass(frozen=True)
class FusedConfig:
    """Launch shape of one fused path.

    gemm: tiling of the GEMM phase (fusedpar.kernels.gemm.GemmConfig).
    num_sms: persistent stride and upper bound of the grid (the device's SM count: every program
        must be co-resident with the ones it waits for).
    comm_rows: tile rows per step of the reduce / copy loops (comm_rows x block_n elements).
    split_k: one_shot only: K ranges per output tile, each a separate work unit with its own
        partial (1 = none). Decode GEMMs read the weight once and are bound by how many SMs
        stream it: split-K puts more SMs on an output too narrow to fill the GPU with tiles.
    """

    gemm: GemmConfig
    num_sms: int
    comm_rows: int
    split_k: int = 1

    def __post_init__(self) -> None:
        # The kernel does not survive bad values: num_sms=0 launches an empty grid (out never written),
        # and comm_rows must tile block_m exactly (a larger step reads and stores other tiles' rows).
        if self.num_sms < 1:
            raise ValueError(f"FusedConfig: num_sms={self.num_sms} must be >= 1 (the persistent grid size)")
        require_pow2("FusedConfig", comm_rows=self.comm_rows)
        if self.comm_rows > self.gemm.block_m:
            raise ValueError(f"FusedConfig: comm_rows={self.comm_rows} must divide block_m={self.gemm.block_m} "
                             "(a power of two <= block_m)")

    def as_list(self) -> list[int]:
        g = self.gemm
        return [g.block_m, g.block_n, g.block_k, g.group_m, g.num_warps, g.num_stages, self.num_sms, self.comm_rows,
                self.split_k]

    @staticmethod
    def from_list(v: list[int]) -> FusedConfig:
        return FusedConfig(GemmConfig(*v[:6]), num_sms=v[6], comm_rows=v[7], split_k=v[8] if len(v) > 8 else 1)


@dataclass(frozen=True)
class FusedPlan:
    """How one fused call runs: path, config, partial dtype and the row chunks (one launch each)."""

    path: str  # "one_shot" or "two_shot"
    config: FusedConfig
    partial_dtype: torch.dtype
    chunks: tuple[tuple[int, int], ...]  # (first row, rows)
    slot_bytes: int


_COMM_ELEMS_PER_WARP = 512  # elements per reduce/copy step and warp: 16 per thread (two 16-byte bf16 vectors)
_COMM_ELEMS_INTERPRETER = 256  # several steps per 32 x 32 tile


def default_config(path: str, m: int, n: int, k: int, dtype: torch.dtype, partial_dtype: torch.dtype,
                   num_sms: int, *, interpret: bool | None = None) -> FusedConfig:
    """Tiling of a fused path.

    Interpreter: 32x32x32 tiles (as fusedpar.kernels.gemm), 8-row comm steps.
    GPU: fusedpar.kernels.gemm.pick_config, the tiling measured best for the plain GEMM on H200
    (perf/results/gemm_tune.json), with the partial dtype as the epilogue dtype: for decode
    (m <= 64) BLOCK_M = next power of two >= m, BLOCK_N 64 on these shapes, BLOCK_K 256/128,
    4 warps; above, 128x256x64 / 8 warps, or 128x128x64 / 4 warps where 128x256 tiles quantise
    badly. The fused kernel's GEMM loop is the plain kernel's, so its best tiling should carry
    over (to be confirmed by perf/bench_gemm_all_reduce.py). Comm steps move 16 elements per
    thread (two 16-byte vectors of bf16 per rank).
    one_shot with m <= SPLIT_K_MAX_ROWS on a GPU: where the output has too few BLOCK_N-wide tiles to
    give most SMs a share of the weight (Qwen3-32B's hidden 5120: 80 tiles of 64 columns on 132
    SMs), 128-column tiles split in K (`split_k`) so that more SMs stream the weight, e.g. 40 x 3 =
    120 units; see _decode_split. The interpreter never splits (its one-launch emulation of a
    rank runs programs one after another, and a split tile's reducer waits for other programs).
    """
    interpreted = _INTERPRETED if interpret is None else interpret
    if interpreted:
        gcfg = pick_config(m, n, k, dtype=dtype, out_dtype=partial_dtype, num_sms=num_sms, interpret=True)
        comm = _COMM_ELEMS_INTERPRETER
    else:
        gcfg = pick_config(m, n, k, dtype=dtype, out_dtype=partial_dtype, num_sms=num_sms, interpret=False)
        comm = _COMM_ELEMS_PER_WARP * gcfg.num_warps
    split = 1
    if path == "one_shot" and not interpreted and m <= SPLIT_K_MAX_ROWS:
        gcfg, split = _decode_split(n, k, esize(dtype), gcfg, num_sms)
    elif (path == "one_shot" and not interpreted and DEEP_K_ROWS[0] <= m <= DEEP_K_ROWS[1]
          and gcfg.block_n <= 64 and gcfg.block_k == 128 and esize(dtype) == 2):
        stages = _stages_that_fit(gcfg.block_m, gcfg.block_n, 256, 2, esize(partial_dtype), cap=5)
        if stages >= 2:
            gcfg = dataclasses.replace(gcfg, block_k=256, num_stages=stages)
    return FusedConfig(gcfg, num_sms=num_sms, comm_rows=max(1, min(gcfg.block_m, comm // gcfg.block_n)),
                       split_k=split)


# One-shot split-K, from `perf/bench_gemm_all_reduce.py --split-sweep` on 4x H200 (bf16, CUDA graph,
# perf/results/gemm_all_reduce.json "split-sweep" records): Qwen3-32B down (N 5120, K 6400) 1 row
# 0.0254 ms with 40 x 3 units of 128 columns vs 0.0272 unsplit (80 tiles of 64), 2 rows 0.0260 vs
# 0.0270; from 4 rows on the unsplit tiling is as fast or faster (every unit pushes its partial
# rows to every rank, and the reducer sums W x split partials), and splits that leave < 1024 K
# per unit lose (Qwen o, K 2048: 3 ranges 0.0145 vs 0.0143 unsplit). Llama-70B (N 8192, 128
# tiles) never gains. Tile: 128 columns, 128-deep K steps, 4 warps, 4 stages; fp32 inputs get
# fewer stages (shared memory).
SPLIT_K_MAX_ROWS = 2
# One-shot decode of 17-32 rows takes 256-deep K steps (4 stages), as pick_config gives <= 16 rows: more
# weight bytes in flight per SM, where 64-column tiles leave SMs idle (N 5120: 80 tiles on 132 SMs).
# GPU run 114 (`perf/bench_gemm_all_reduce.py --tokens 8,16,32,64 --split-sweep`, 4x H200, CUDA graph), 32
# rows, 128- vs 256-deep: Qwen3-32B down 0.0352 vs 0.0290 ms (stock 0.0323), o 0.0201 vs 0.0186,
# Llama-70B down 0.0420 vs 0.0400, o 0.0229 vs 0.0224; at 64 rows 256-deep lost on three of the four.
DEEP_K_ROWS = (17, 32)
_SPLIT_MIN_K = 1024
_SPLIT_TILE = (128, 128, 4, 4)  # block_n, block_k, warps, stages
_SMEM_BYTES = 227 * 1024


def _stages_that_fit(bm: int, bn: int, bk: int, in_bytes: int, out_bytes: int, *, cap: int) -> int:
    """Most pipeline stages (<= cap) of bm x bk and bn x bk operand tiles that fit shared memory
    beside a bm x bn epilogue tile (may be < 2: the tiling does not fit)."""
    return min(cap, (_SMEM_BYTES - bm * bn * out_bytes) // ((bm + bn) * bk * in_bytes))


def _decode_split(n: int, k: int, elem: int, gcfg: GemmConfig, num_sms: int) -> tuple[GemmConfig, int]:
    """(tiling, split_k) that gives the most SMs a share of the weight: the unsplit tiling's
    cdiv(n, block_n) units, or 128-column tiles x s K ranges (units <= num_sms, >= _SPLIT_MIN_K of K
    per range); ties keep no split."""
    best = (cdiv(n, gcfg.block_n), gcfg, 1)
    bn, bk, warps, stages = _SPLIT_TILE
    bm = gcfg.block_m
    stages = _stages_that_fit(bm, bn, bk, elem, elem, cap=stages)
    if stages < 2:
        return gcfg, 1
    wide = GemmConfig(bm, bn, bk, gcfg.group_m, warps, stages)
    for split in range(2, 17):
        units = cdiv(n, bn) * split
        if units > num_sms or cdiv(k, split) < _SPLIT_MIN_K:
            break
        if units > best[0]:
            best = (units, wide, split)
    return best[1], best[2]


def _layout(path: str, rows: int, n: int, world: int, cfg: FusedConfig, psize: int, osize: int):
    """(tiles, own_cap, result_off, slot bytes needed, flag rows needed) of one launch over `rows` rows."""
    g = cfg.gemm
    require_one_block(g, "gemm_all_reduce")
    tiles = cdiv(rows, g.block_m) * cdiv(n, g.block_n)
    tile = g.block_m * g.block_n
    if path == "one_shot":
        units = tiles * cfg.split_k
        return tiles, 0, 0, world * units * tile * psize, min(cfg.num_sms, units)
    own_cap = cdiv(tiles, world)
    result_off = _align(world * own_cap * tile * psize)
    return tiles, own_cap, result_off, result_off + tiles * tile * osize, cfg.num_sms + own_cap


def required_workspace(
    path: str,
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    world_size: int,
    *,
    num_sms: int,
    partial_dtype: torch.dtype | None = None,
    config: FusedConfig | None = None,
) -> tuple[int, int]:
    """(nbytes, max_blocks) of a SymmetricWorkspace that runs `path` over m rows in ONE launch.

    nbytes covers both double-buffer slots. Smaller workspaces still run two_shot, in row chunks.
    """
    pdt = partial_dtype or dtype
    cfg = config or default_config(path, m, n, k, dtype, pdt, num_sms)
    _, _, _, need, flag_rows = _layout(path, m, n, world_size, cfg, esize(pdt), esize(dtype))
    return 2 * _align(need), flag_rows


def slot_bytes_of(table: PeerTable) -> int:
    """Bytes of one double-buffer slot of `table` (half the data buffer, ALIGN_BYTES-aligned)."""
    return slot_size(table)


def fused_plan(
    path: str,
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    table: PeerTable,
    *,
    partial_dtype: torch.dtype | None = None,
    config: FusedConfig | None = None,
) -> tuple[FusedPlan | None, str]:
    """(plan, "") if the fused `path` can run this call on `table`, else (None, why not).

    Pure function of shapes, dtypes and the table's sizes, so every rank makes the same choice.
    two_shot splits M into balanced chunks of whole tile rows, each fitting one slot and the flag
    words and holding >= world_size tiles; one_shot must fit in one launch.
    """
    if path not in ("one_shot", "two_shot"):
        raise ValueError(f"fused_plan: unknown path {path!r}")
    sms = config.num_sms if config is not None else sm_count(table.device, _INTERPRETED)
    args = (path, m, n, k, dtype, table.world_size, slot_bytes_of(table), table.max_blocks, sms, partial_dtype, config)
    # Cached in eager mode, where the router plans on every call and a decode step's host time
    # matters; dynamo traces the plain function instead (it would bypass the cache anyway).
    return _plan_cached.__wrapped__(*args) if torch.compiler.is_compiling() else _plan_cached(*args)


@functools.lru_cache(maxsize=4096)
def _plan_cached(path, m, n, k, dtype, world, slot, max_blocks, num_sms, partial_dtype, config):
    pdt = partial_dtype or dtype
    if pdt not in (dtype, torch.float32):
        return None, f"partial dtype must be {dtype} or torch.float32, got {pdt}"
    cfg = config or default_config(path, m, n, k, dtype, pdt, num_sms)
    psize, osize = esize(pdt), esize(dtype)
    bm = cfg.gemm.block_m

    def size_problem(rows: int) -> str:
        """Why one launch over `rows` rows does not fit the workspace ("" if it does); monotone in rows."""
        tiles, own_cap, _, need, flag_rows = _layout(path, rows, n, world, cfg, psize, osize)
        if need > slot:
            return f"needs a {need}-byte slot, the workspace has {slot}"
        if flag_rows > max_blocks:
            return f"needs {flag_rows} flag rows, the workspace has max_blocks={max_blocks}"
        tile = cfg.gemm.block_m * cfg.gemm.block_n
        region = world * (tiles * cfg.split_k if path == "one_shot" else own_cap) * tile
        if max(region, tiles * tile) >= 2**31:
            return "workspace regions of >= 2**31 elements (int32 offsets)"
        return ""

    if cfg.split_k < 1 or (cfg.split_k > 1 and path != "one_shot"):
        return None, f"split_k={cfg.split_k}: must be >= 1, and > 1 only on the one_shot path"
    if m == 0 or n == 0:
        return FusedPlan(path, cfg, pdt, (), slot), ""
    if path == "one_shot":
        why = size_problem(m)
        return (None, f"one_shot: {why}") if why else (FusedPlan(path, cfg, pdt, ((0, m),), slot), "")
    # two_shot: the largest chunk (in tile rows) that fits, by bisection; then balanced chunks so
    # the last one is not a sliver.
    tile_rows = cdiv(m, bm)
    lo, hi = 0, tile_rows
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if size_problem(min(m, mid * bm)):
            hi = mid - 1
        else:
            lo = mid
    if lo == 0:
        return None, f"two_shot: {size_problem(min(m, bm))}"
    n_chunks = cdiv(tile_rows, lo)
    per = cdiv(tile_rows, n_chunks) * bm
    chunks = tuple((m0, min(per, m - m0)) for m0 in range(0, m, per))
    # Every rank must own a tile of every launch (the double-buffering argument).
    smallest = min(rows for _, rows in chunks)
    tiles = cdiv(smallest, bm) * cdiv(n, cfg.gemm.block_n)
    if tiles < world:
        return None, f"two_shot: a chunk of {smallest} rows has {tiles} tiles < world size {world}"
    return FusedPlan(path, cfg, pdt, chunks, slot), ""


# ---- launcher -----------------------------------------------------------------------------------


def _check(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None, device: torch.device,
           residual: torch.Tensor | None = None) -> None:
    _check_shapes_only(x, w)
    if x.dtype not in _SUPPORTED_DTYPES or w.dtype != x.dtype:
        raise TypeError(
            f"gemm_all_reduce: x and w must share one dtype of {_SUPPORTED_DTYPES}, got {x.dtype}, {w.dtype}"
        )
    if x.device != device or w.device != device:
        raise ValueError(f"gemm_all_reduce: x ({x.device}) and w ({w.device}) must be on the workspace's {device}")
    if x.device.type == "cpu" and not _INTERPRETED:
        raise RuntimeError(
            "gemm_all_reduce on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 before "
            "fusedpar.kernels.gemm_all_reduce is first imported"
        )
    want = (x.shape[0], w.shape[0])
    for name, t in (("out", out), ("residual", residual)):
        if t is not None and (tuple(t.shape) != want or t.dtype != x.dtype or t.device != x.device):
            raise ValueError(
                f"gemm_all_reduce: {name} must be {want} of {x.dtype} on {x.device}, got {tuple(t.shape)} "
                f"{t.dtype} {t.device}"
            )
    for name, t in (("x", x), ("w", w), ("out", out), ("residual", residual)):
        if t is not None and sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride(), strict=True)) >= 2**31:
            raise ValueError(f"gemm_all_reduce: {name} spans >= 2**31 elements (int32 offsets); split the call")
    if out is not None and not torch.compiler.is_compiling():  # fakes have no memory; the op body checks again
        _check_out_overlap(x, w, out, residual)


def _check_out_overlap(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None) -> None:
    """out may be residual itself (each element is read by the program that then stores it) but no other
    view of it, and must not share memory with x or w: the fused kernel stores finished tiles of out
    while other programs (and, two-shot, other ranks' pushes) still read the operands."""
    check_out_overlap("gemm_all_reduce", out, x=x, w=w)
    if residual is not None and overlaps_other_view(out, residual):
        raise ValueError("gemm_all_reduce: out overlaps residual without being residual itself; pass "
                         "out=residual (in place) or a separate out")


def _launch_chunk(x, w, out, buffer_ptrs, signal_ptrs, counters, rank, world, plan: FusedPlan, *,
                  gemm: bool, reduce: bool, copy: bool, use_flags: bool, spin_limit: int | None,
                  residual: torch.Tensor | None = None):
    """One launch over x [rows, K] -> out [rows, N] (+ residual) (a chunk); returns Triton's compiled
    handle (GPU)."""
    two_shot = plan.path == "two_shot"
    cfg, g = plan.config, plan.config.gemm
    m, k = x.shape
    n = w.shape[0]
    res = residual if residual is not None else out
    tiles, own_cap, result_off, _, _ = _layout(plan.path, m, n, world, cfg, esize(plan.partial_dtype),
                                               esize(x.dtype))
    last = copy if two_shot else reduce
    split = 1 if two_shot else cfg.split_k
    if _INTERPRETED and split > 1 and gemm and reduce:
        # The interpreter runs a launch's programs one after another, so a reducer would wait for
        # a unit of a program that has not run yet (on GPUs every program is resident).
        raise ValueError("gemm_all_reduce: split_k > 1 under the interpreter needs the GEMM and reduce phases in "
                         "separate launches (gemm_all_reduce_emulated with schedule='phased')")
    with device_guard(x.device):
        return _gemm_all_reduce_kernel[(min(cfg.num_sms, tiles * split),)](
            x,
            w,
            out,
            m,
            n,
            k,
            x.stride(0),
            x.stride(1),
            w.stride(0),
            w.stride(1),
            out.stride(0),
            out.stride(1),
            res,
            res.stride(0),
            res.stride(1),
            buffer_ptrs,
            signal_ptrs,
            counters,
            rank,
            plan.slot_bytes,
            result_off,
            own_cap,
            WORLD=world,
            WORLD_P2=next_pow2(world),
            BLOCK_M=g.block_m,
            BLOCK_N=g.block_n,
            BLOCK_K=g.block_k,
            GROUP_M=g.group_m,
            NUM_SMS=cfg.num_sms,
            EVEN_K=k % g.block_k == 0 and cdiv(k, g.block_k) % split == 0,  # every range's steps full
            INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            PARTIAL_FP32=plan.partial_dtype == torch.float32 and x.dtype != torch.float32,
            COMM_ROWS=cfg.comm_rows,
            SPLIT_K=split,
            SPLIT_WORLD_P2=next_pow2(split * world),
            TWO_SHOT=two_shot,
            DO_GEMM=gemm,
            DO_REDUCE=reduce,
            DO_COPY=copy and two_shot,
            RETIRE=last,
            USE_FLAGS=use_flags,
            HAS_RESIDUAL=residual is not None,
            SPIN_LIMIT=resolve_spin_limit(spin_limit, _INTERPRETED, GPU_SPIN_LIMIT),
            num_warps=g.num_warps,
            num_stages=g.num_stages,
        )


def _run_plan(x, w, out, buffer_ptrs, signal_ptrs, counters, rank, world, plan: FusedPlan, *, gemm: bool = True,
              reduce: bool = True, copy: bool = True, use_flags: bool = True, spin_limit: int | None = None,
              residual: torch.Tensor | None = None):
    """The chosen phases (default all: the GPU path) of every chunk, one launch per chunk. Returns the last handle."""
    if len(plan.chunks) == 1 and plan.chunks[0] == (0, x.shape[0]):  # the decode case: no row views to build
        return _launch_chunk(x, w, out, buffer_ptrs, signal_ptrs, counters, rank, world, plan, gemm=gemm,
                             reduce=reduce, copy=copy, use_flags=use_flags, spin_limit=spin_limit, residual=residual)
    handle = None
    for m0, rows in plan.chunks:
        handle = _launch_chunk(x.narrow(0, m0, rows), w, out.narrow(0, m0, rows), buffer_ptrs, signal_ptrs,
                               counters, rank, world, plan, gemm=gemm, reduce=reduce, copy=copy,
                               use_flags=use_flags, spin_limit=spin_limit,
                               residual=None if residual is None else residual.narrow(0, m0, rows))
    return handle


def _plan_or_raise(path, x, w, table, partial_dtype, config) -> FusedPlan:
    plan, why = fused_plan(path, x.shape[0], w.shape[0], x.shape[1], x.dtype, table,
                           partial_dtype=partial_dtype, config=config)
    if plan is None:
        raise ValueError(f"gemm_all_reduce: the fused {path} path cannot run this call: {why}")
    return plan


def launch_gemm_all_reduce(
    x: torch.Tensor,
    w: torch.Tensor,
    table: PeerTable,
    out: torch.Tensor,
    *,
    path: str = "two_shot",
    gemm: bool = True,
    reduce: bool = True,
    copy: bool = True,
    partial_dtype: torch.dtype | None = None,
    use_flags: bool = True,
    spin_limit: int | None = None,
    config: FusedConfig | None = None,
    residual: torch.Tensor | None = None,
):
    """Raw launcher as `table.rank`: the chosen phases (all: the GPU path; one: a step of the CPU
    emulation), one launch per row chunk. No routing, no op registration: callers normally want
    gemm_all_reduce().

    A subset of the phases needs a one-chunk plan: the epoch only advances in the last phase, so
    the next chunk's phases must wait for it (gemm_all_reduce_emulated interleaves chunks and
    phases properly). use_flags=False skips the flag protocol: correct only when something else
    orders the ranks (the phased emulation); a data race on GPUs. Returns the last launch's
    compiled handle (GPU; PTX/TTGIR inspection).
    """
    if path not in ("one_shot", "two_shot"):
        raise ValueError(f"launch_gemm_all_reduce: path must be 'one_shot' or 'two_shot', got {path!r}")
    if not (gemm or reduce or (copy and path == "two_shot")):
        raise ValueError("launch_gemm_all_reduce: nothing to do (no phase selected)")
    _check(x, w, out, table.device, residual)
    plan = _plan_or_raise(path, x, w, table, partial_dtype, config)
    if len(plan.chunks) > 1 and not (gemm and reduce and (copy or path == "one_shot")):
        raise ValueError(
            f"launch_gemm_all_reduce: a subset of the phases needs a one-chunk plan, this call runs "
            f"{len(plan.chunks)} chunks (use gemm_all_reduce_emulated, or a bigger workspace)"
        )
    return _run_plan(x, w, out, table.buffer_ptrs, table.signal_ptrs, table.counters, table.rank, table.world_size,
                     plan, gemm=gemm, reduce=reduce, copy=copy, use_flags=use_flags, spin_limit=spin_limit,
                     residual=residual)


# ---- registered ops -----------------------------------------------------------------------------
# The peer table travels as its tensors + ints (no registry of workspaces). counters is declared
# mutated: it is (the epoch advances), and that keeps the op from being dead-code eliminated or
# reordered across another launch on the same table, which would desynchronise the ranks.


def _run_op(x, w, out, buffer_ptrs, signal_ptrs, counters, rank, world_size, buffer_bytes, max_blocks, path,
            partial_fp32, config, use_flags, residual=None) -> None:
    """Body of the registered ops: plan from the op's arguments, then every phase of every chunk."""
    # A light PeerTable stand-in for fused_plan (sizes only).
    table = _Sizes(world_size, buffer_bytes, max_blocks, counters.device)
    pdt = torch.float32 if partial_fp32 else x.dtype
    plan = _plan_or_raise(path, x, w, table, pdt, FusedConfig.from_list(list(config)))
    _run_plan(x, w, out, buffer_ptrs, signal_ptrs, counters, rank, world_size, plan, use_flags=use_flags,
              residual=residual)


@dataclass(frozen=True)
class _Sizes:
    world_size: int
    buffer_bytes: int
    max_blocks: int
    device: torch.device


@torch.library.custom_op("fusedpar::gemm_all_reduce", mutates_args=("counters",))
def _fused_op(
    x: torch.Tensor,
    w: torch.Tensor,
    buffer_ptrs: torch.Tensor,
    signal_ptrs: torch.Tensor,
    counters: torch.Tensor,
    rank: int,
    world_size: int,
    buffer_bytes: int,
    max_blocks: int,
    path: str,
    partial_fp32: bool,
    config: list[int],
    use_flags: bool,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """out = [residual +] sum over ranks of x @ w^T through a fused path; a new contiguous [M, N] tensor
    of x's dtype."""
    _check(x, w, None, counters.device, residual)
    out = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    _run_op(x, w, out, buffer_ptrs, signal_ptrs, counters, rank, world_size, buffer_bytes, max_blocks, path,
            partial_fp32, config, use_flags, residual)
    return out


@_fused_op.register_fake
def _fused_fake(x, w, buffer_ptrs, signal_ptrs, counters, rank, world_size, buffer_bytes, max_blocks, path,
                partial_fp32, config, use_flags, residual=None):
    _check_shapes_only(x, w)
    return x.new_empty((x.shape[0], w.shape[0]))


@torch.library.custom_op("fusedpar::gemm_all_reduce_out", mutates_args=("out", "counters"))
def _fused_out_op(
    x: torch.Tensor,
    w: torch.Tensor,
    buffer_ptrs: torch.Tensor,
    signal_ptrs: torch.Tensor,
    counters: torch.Tensor,
    out: torch.Tensor,
    rank: int,
    world_size: int,
    buffer_bytes: int,
    max_blocks: int,
    path: str,
    partial_fp32: bool,
    config: list[int],
    use_flags: bool,
    residual: torch.Tensor | None = None,
) -> None:
    """out[:] = [residual +] sum over ranks of x @ w^T through a fused path; out may be any strided
    [M, N] view not sharing memory with x or w, and either residual itself or not overlapping it."""
    _check(x, w, out, counters.device, residual)
    _run_op(x, w, out, buffer_ptrs, signal_ptrs, counters, rank, world_size, buffer_bytes, max_blocks, path,
            partial_fp32, config, use_flags, residual)


@_fused_out_op.register_fake
def _fused_out_fake(x, w, buffer_ptrs, signal_ptrs, counters, out, rank, world_size, buffer_bytes, max_blocks, path,
                    partial_fp32, config, use_flags, residual=None):
    _check_shapes_only(x, w)


def _check_shapes_only(x: torch.Tensor, w: torch.Tensor) -> None:
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"gemm_all_reduce: x must be [M, K] and w [N, K], got {tuple(x.shape)}, {tuple(w.shape)}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(
            f"gemm_all_reduce: inner dims differ: x {tuple(x.shape)} is [M, K_local] and w {tuple(w.shape)} is "
            "[N, K_local] (nn.Linear orientation)"
        )


def _call_fused(x, w, table: PeerTable, out, plan: FusedPlan, use_flags: bool = True,
                residual: torch.Tensor | None = None) -> torch.Tensor:
    """Run a fused plan: through the registered op under torch.compile, else a direct launch (the
    custom-op dispatcher's host cost is a sizeable part of a ~20 us decode step)."""
    if torch.compiler.is_compiling():
        args = (table.buffer_ptrs, table.signal_ptrs, table.counters)
        meta = (table.rank, table.world_size, table.buffer_bytes, table.max_blocks, plan.path,
                plan.partial_dtype == torch.float32 and x.dtype != torch.float32, plan.config.as_list(), use_flags,
                residual)
        if out is None:
            return torch.ops.fusedpar.gemm_all_reduce(x, w, *args, *meta)
        torch.ops.fusedpar.gemm_all_reduce_out(x, w, *args, out, *meta)
        return out
    if out is None:
        out = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    _run_plan(x, w, out, table.buffer_ptrs, table.signal_ptrs, table.counters, table.rank, table.world_size, plan,
              use_flags=use_flags, residual=residual)
    return out


# ---- router --------------------------------------------------------------------------------------


def choose_path(
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    world_size: int,
    table: PeerTable | None,
    *,
    device: torch.device | None = None,
    partial_dtype: torch.dtype | None = None,
    one_shot_max_tokens: int = ONE_SHOT_MAX_TOKENS,
    two_shot_min_tokens: int = TWO_SHOT_MIN_TOKENS,
) -> str:
    """The path the router takes for x [m, k], w [n, k]: "local" | "one_shot" | "two_shot" | "unfused".

    Depends only on shapes, dtype, the thresholds and the workspace's sizes, so every rank of the
    group chooses alike. "local": a group of one (plain GEMM). "unfused": cuBLAS + all_reduce.
    """
    if world_size == 1:
        return "local"
    if table is None or dtype not in _SUPPORTED_DTYPES or table.world_size != world_size:
        return "unfused"
    if device is not None and device != table.device:
        return "unfused"
    if m <= one_shot_max_tokens and fused_plan("one_shot", m, n, k, dtype, table, partial_dtype=partial_dtype)[0]:
        return "one_shot"
    if m >= two_shot_min_tokens and fused_plan("two_shot", m, n, k, dtype, table, partial_dtype=partial_dtype)[0]:
        return "two_shot"
    return "unfused"


def auto_path(
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    world_size: int,
    table: PeerTable | None,
    device: torch.device,
    *,
    partial_dtype: torch.dtype | None = None,
    one_shot_max_tokens: int = ONE_SHOT_MAX_TOKENS,
    two_shot_min_tokens: int = TWO_SHOT_MIN_TOKENS,
) -> str:
    """The path gemm_all_reduce(path="auto") takes for x [m, k], w [n, k] right now.

    Eager decode loses to the Triton launch's host cost (see the thresholds above), so the
    one-shot is only taken while a CUDA graph is captured (or under routing_as_captured());
    capture is the same on every rank of a collective, so the choice still agrees across ranks.
    """
    capturing = routes_as_captured(device)
    return choose_path(m, n, k, dtype, world_size, table, device=device, partial_dtype=partial_dtype,
                       one_shot_max_tokens=one_shot_max_tokens if capturing or device.type != "cuda" else 0,
                       two_shot_min_tokens=two_shot_min_tokens)


def gemm_all_reduce_reference(x: torch.Tensor, w: torch.Tensor, group, workspace=None) -> torch.Tensor:
    """The plain path: cuBLAS F.linear, then fusedpar.kernels.allreduce.all_reduce (our one-shot for
    small messages inside a CUDA graph when a workspace is given, NCCL otherwise). Also the
    router's fallback."""
    y = torch.nn.functional.linear(x, w)
    if group is None:
        return y
    return all_reduce(y, group, workspace, inplace=True)


def _eager_pg_or_none(group, workspace):
    """The process group the eager short path reduces over, or None where the full path decides (a
    group of one, no process group, a workspace over another number of ranks). Fixed per (group,
    workspace), so a SymmetricWorkspace keeps the answer (`eager_route`)."""
    size, pg = group_size_and_pg(group)
    if size < 2 or pg is None or (workspace is not None and as_peer_table(workspace).world_size != size):
        return None
    return pg


def _eager_plain_or_none(x, w, group, workspace, residual, two_shot_min_tokens: int) -> torch.Tensor | None:
    """The router's eager CUDA answer below the two-shot range, cuBLAS + the process group's
    allreduce [+ residual], reached in as few Python steps as possible; None where the full path
    must decide (capture, a group of one, a workspace of another size, a residual of another shape).

    Such calls are bound by the host's launch cost, and on the lent machines every Python step
    shows: with the general prelude below (views, checks, table lookups) this path measured
    0.86-0.93x of F.linear + dist.all_reduce, the same launches alone 1.05-1.23x (GPU run 112,
    perf/probe_eager_fallback.py)."""
    if x.shape[0] >= two_shot_min_tokens or routes_as_captured(x.device):
        return None
    route = getattr(workspace, "eager_route", None)  # a SymmetricWorkspace's cached answer
    if route is None or route[0] is not group:
        route = (group, _eager_pg_or_none(group, workspace))
        if isinstance(workspace, SymmetricWorkspace):
            workspace.eager_route = route
    pg = route[1]
    if pg is None:
        return None
    if residual is not None and tuple(residual.shape) != (x.shape[0], w.shape[0]):
        return None  # the full path names the shape it wants
    _check_shapes_only(x, w)
    y = sum_over_group_(torch.nn.functional.linear(x, w), pg)
    return y if residual is None else residual + y


def gemm_all_reduce(
    x: torch.Tensor,
    w: torch.Tensor,
    group,
    workspace=None,
    *,
    out: torch.Tensor | None = None,
    path: str = "auto",
    partial_dtype: torch.dtype | None = None,
    one_shot_max_tokens: int = ONE_SHOT_MAX_TOKENS,
    two_shot_min_tokens: int = TWO_SHOT_MIN_TOKENS,
    config: FusedConfig | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row-parallel linear + all-reduce: [residual +] sum over the group of x @ w^T, the same on every rank.

    x: [..., K_local] activations (any strides; leading dims are flattened); w: [N, K_local]
    weight shard in nn.Linear orientation, any strides (a column view of the base weight is
    read in place); fp16/bf16/fp32, same dtype. group: a ProcessGroup or a CommGroup (.size,
    .pg); None only with an explicit fused path (the size then comes from the workspace).
    workspace: SymmetricWorkspace / PeerTable over the same group, or None (always unfused). The
    fused paths need room (required_workspace): per-program flag rows, e.g. max_blocks >= 132
    for decode and >= 132 + tiles / W for prefill on an H200 (the default of 64 is too small),
    and a data buffer of ~4 x the output bytes for one-launch prefill (less: row chunks).
    Without room the router falls back to the unfused path.
    residual: optional [..., N] tensor, identical on every rank (the residual stream), added to the
    reduced sum with the plain path's roundings (sum rounded to x's dtype, then torch's add); the
    fused paths add it in their reduce epilogue, the others with a torch add.
    out: optional [..., N] destination (fully overwritten); on the fused paths it must not share memory
    with x, w or itself (ValueError), and may be residual itself (in place) but no other view of it.
    partial_dtype: None (x's dtype) or
    torch.float32 (more accurate, twice the NVLink bytes).
    path: "auto" (choose_path), or force "one_shot" / "two_shot" (ValueError if the workspace
    cannot hold it), "unfused" (cuBLAS + all_reduce) or "local" (no communication).
    Collective: every rank calls it with the same shapes, in the same order relative to other
    launches on the workspace, from one stream. Capture-safe (CUDA graphs): no host sync, no
    allocation besides the output. No autograd (inference).
    """
    if path not in PATHS:
        raise ValueError(f"gemm_all_reduce: path must be one of {PATHS}, got {path!r}")
    if path == "auto" and out is None and group is not None and x.dim() == 2 and x.is_cuda:
        y = _eager_plain_or_none(x, w, group, workspace, residual, two_shot_min_tokens)
        if y is not None:
            return y
    if x.dim() < 1 or w.dim() != 2:
        raise ValueError(f"gemm_all_reduce: x must be [..., K] and w [N, K], got {tuple(x.shape)}, {tuple(w.shape)}")
    flat = x.dim() == 2  # the common case: no reshapes (each costs host time in an eager decode step)
    lead = x.shape[:-1]
    x2 = x if flat else x.reshape(-1, x.shape[-1])
    _check_shapes_only(x2, w)
    res2 = None
    if residual is not None:
        if tuple(residual.shape) != (*lead, w.shape[0]):
            raise ValueError(f"gemm_all_reduce: residual must be {(*lead, w.shape[0])}, got {tuple(residual.shape)}")
        res2 = residual if flat else residual.reshape(-1, w.shape[0])
    out2 = None
    if out is not None:
        if tuple(out.shape) != (*lead, w.shape[0]):
            raise ValueError(f"gemm_all_reduce: out must be {(*lead, w.shape[0])}, got {tuple(out.shape)}")
        # A view (never a copy): the result must land in `out` itself; view() raises otherwise.
        out2 = out if out.dim() == 2 else out.view(-1, w.shape[0])
    table = as_peer_table(workspace) if workspace is not None else None
    if group is None:
        if table is None or path not in ("one_shot", "two_shot", "local"):
            raise ValueError("gemm_all_reduce: group=None needs a workspace and an explicit fused path")
        size, pg = table.world_size, None
    else:
        size, pg = group_size_and_pg(group)
    if table is not None and table.world_size != size:
        raise ValueError(f"gemm_all_reduce: workspace spans {table.world_size} ranks but the group has {size}")

    # An eager CUDA call is host-bound at the sizes where this matters: its unfused path goes
    # straight to cuBLAS + the process group's allreduce (what the plain path launches, minus
    # dist.all_reduce's Python wrapper), and auto below the two-shot range needs no lookups
    # (auto_path answers "unfused" there for every eager call).
    eager_cuda = size > 1 and pg is not None and x2.device.type == "cuda" and not routes_as_captured(x2.device)
    if path == "auto":
        if eager_cuda and x2.shape[0] < two_shot_min_tokens:
            path = "unfused"
        else:
            path = auto_path(x2.shape[0], w.shape[0], w.shape[1], x2.dtype, size, table, x2.device,
                             partial_dtype=partial_dtype, one_shot_max_tokens=one_shot_max_tokens,
                             two_shot_min_tokens=two_shot_min_tokens)
    if path in ("one_shot", "two_shot"):
        if table is None:
            raise ValueError(f"gemm_all_reduce: path {path!r} needs a workspace")
        _check(x2, w, out2, table.device, res2)
        plan = _plan_or_raise(path, x2, w, table, partial_dtype, config)
        result = _call_fused(x2, w, table, out2, plan, residual=res2)
        res2 = None  # added in the kernel
    elif path == "local":
        result = torch.nn.functional.linear(x2, w)
    elif eager_cuda:
        result = sum_over_group_(torch.nn.functional.linear(x2, w), pg)
    else:
        result = gemm_all_reduce_reference(x2, w, group, table)
    if res2 is not None:
        result = res2 + result
    if out is not None:
        if result is not out2:
            out2.copy_(result)
        return out
    return result if flat else result.reshape(*lead, w.shape[0])


# ---- CPU emulation ------------------------------------------------------------------------------


def gemm_all_reduce_emulated(
    world: EmulatedWorld,
    xs: list[torch.Tensor],
    ws: list[torch.Tensor],
    *,
    path: str = "two_shot",
    outs: list[torch.Tensor] | None = None,
    partial_dtype: torch.dtype | None = None,
    use_flags: bool = True,
    schedule: str = "phased",
    config: FusedConfig | None = None,
    residuals: list[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """One fused call on every rank of an EmulatedWorld (CPU, interpreter); rank r's output at [r].

    residuals: as gemm_all_reduce's residual, one per rank (the reduce epilogues of both paths).

    schedule "phased": per chunk, each phase for every rank before the next phase.
    schedule "staggered": a legal interleaving with multi-phase launches and live flags.
      one_shot: GEMM for ranks 0..W-2; rank W-1 runs the registered op (both phases, one
      launch: the GPU code path); then the reduce for ranks 0..W-2.
      two_shot: GEMM for every rank; reduce for ranks 0..W-2; rank W-1 runs reduce + copy in
      ONE launch; then copy for ranks 0..W-2. (All three phases in one launch need peers that
      run concurrently; with one rank they are covered by the registered-op tests.)
    Raises RuntimeError if a bounded flag wait timed out (a protocol bug).
    """
    W = world.world_size
    if len(xs) != W or len(ws) != W:
        raise ValueError(f"gemm_all_reduce_emulated: {len(xs)} inputs and {len(ws)} weights for {W} ranks")
    if schedule not in ("phased", "staggered"):
        raise ValueError(f"gemm_all_reduce_emulated: unknown schedule {schedule!r}")
    require_same_on_ranks("gemm_all_reduce_emulated", "x", xs)
    require_same_on_ranks("gemm_all_reduce_emulated", "w", ws)
    if outs is None:
        outs = [torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype) for x, w in zip(xs, ws, strict=True)]
    res = residuals if residuals is not None else [None] * W
    for r in range(W):
        _check(xs[r], ws[r], outs[r], world[r].device, res[r])
    plan = _plan_or_raise(path, xs[0], ws[0], world[0], partial_dtype, config)

    def run(r: int, m0: int, rows: int, **phases) -> None:
        t = world[r]
        _launch_chunk(xs[r].narrow(0, m0, rows), ws[r], outs[r].narrow(0, m0, rows), t.buffer_ptrs, t.signal_ptrs,
                      t.counters, r, W, plan, use_flags=use_flags, spin_limit=None,
                      residual=None if res[r] is None else res[r].narrow(0, m0, rows),
                      **{"gemm": False, "reduce": False, "copy": False, **phases})

    def checked(r: int) -> None:
        check_emulated_rank(world[r], r, "gemm_all_reduce")

    rest = range(W - 1)
    for m0, rows in plan.chunks:
        if path == "one_shot":
            if schedule == "phased":
                for r in range(W):
                    run(r, m0, rows, gemm=True)
                for r in range(W):
                    run(r, m0, rows, reduce=True)
                    checked(r)
            else:
                for r in rest:
                    run(r, m0, rows, gemm=True)
                t = world[W - 1]
                torch.ops.fusedpar.gemm_all_reduce_out(
                    xs[W - 1].narrow(0, m0, rows), ws[W - 1], t.buffer_ptrs, t.signal_ptrs, t.counters,
                    outs[W - 1].narrow(0, m0, rows), W - 1, W, t.buffer_bytes, t.max_blocks, path,
                    plan.partial_dtype == torch.float32 and xs[0].dtype != torch.float32, plan.config.as_list(),
                    use_flags, None if res[W - 1] is None else res[W - 1].narrow(0, m0, rows),
                )
                checked(W - 1)
                for r in rest:
                    run(r, m0, rows, reduce=True)
                    checked(r)
        else:
            for r in range(W):
                run(r, m0, rows, gemm=True)
            if schedule == "phased":
                for r in range(W):
                    run(r, m0, rows, reduce=True)
                    checked(r)
                for r in range(W):
                    run(r, m0, rows, copy=True)
                    checked(r)
            else:
                for r in rest:
                    run(r, m0, rows, reduce=True)
                    checked(r)
                run(W - 1, m0, rows, reduce=True, copy=True)
                checked(W - 1)
                for r in rest:
                    run(r, m0, rows, copy=True)
                    checked(r)
    return outs

