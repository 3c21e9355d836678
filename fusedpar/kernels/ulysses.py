"""The two Ulysses all-to-alls of base mode, fused into the attention projections (DESIGN.md sections 4-5).

Notation (one SP group of W ranks, this rank s; per rank m token rows; d hidden; q / kv local heads
per rank after the exchange, hd head_dim; blk = (q + 2 kv) * hd; C = q * hd):

qkv_all_to_all(x [m, d], w [W*blk, d]) -> recv [W*m, blk]
    recv = seq_to_head_all_to_all(F.linear(x, w), sp_group), i.e. on rank g
        recv[p*m + r, c] = sum_k x_p[r, k] * w_p[g*blk + c, k]          (x_p, w_p: rank p's inputs)
    The base qkv weight is laid out as W blocks, block g = [q | k | v] rows of the chunk SP peer g
    computes (fusedpar/layouts/shards.py), so GEMM output column block g is exactly peer g's share.
    Kernel: a persistent GEMM (fusedpar/kernels/gemm.py's loop) whose N tiles never straddle a block;
    the epilogue stores tile (rows r, block g, columns c) straight into peer g's receive buffer at
    rows [s*m + r], columns c. The receive buffer is this rank's symmetric data buffer, read in
    place by attention: `qkv_all_to_all` returns it as a [W*m, blk] tensor view in x's dtype.

all_to_all_o_proj(attn [W*m, C], w_o [N, W*C]) -> out [m, N]
    out = F.linear(head_to_seq_all_to_all(attn, sp_group), w_o), i.e. on rank s
        out[r, n] = sum_g sum_c attn_g[s*m + r, c] * w_o[n, g*C + c]
    Kernel: push, then GEMM per chunk, in one launch. COMM programs copy attn rows
    [g*m, (g+1)*m) (contiguous, all C columns) into peer g's staging buffer, block s
    (staging layout [W, m, C], block p = what source p sent), band by band, and flag each
    (band, source) as it lands. The GEMM programs compute every output tile's K range as
    chunk s first (straight from the local attn, no wait), then wait for the tile's band flags
    of all peers, then chunks s+1, s+2, ... from the local staging buffer. Comm programs join
    the GEMM (dynamic tile counter) once their pushes are done.
    Why push and not "read peers' attention output as the GEMM's A operand": every output
    tile re-reads its whole A band, so pulled operands would cross NVLink once per N tile
    (d / BLOCK_N = 32 times for Llama-70B: ~400 KB per token row instead of 12 KB) because
    remote lines are not cached in the reader's L2. Pushing moves each byte over the link
    exactly once, as large coalesced posted writes, and the GEMM then reads local HBM at full
    speed. The push stays hidden behind the GEMM except for the first wave's wait on its bands
    (bands are pushed in row order, the order in which the GEMM consumes them).

qkv_all_to_all's copy-engine path (launch_qkv_copy_engine; QKV_COPY_ENGINE_TOKEN_RANGES): the same
    receive buffer from W cuBLAS GEMMs, one per owner block (rank s's share for owner g is a
    contiguous [m, blk] block of g's buffer), the remote ones staged locally and copied to their
    owners by the copy engines on a side stream while the next GEMM runs. Alone on 2 GPUs it beat
    the kernel's GPU time by 3-15% at 1024-2048 rows per rank, but cost 2-3x its host time and
    gained nothing in the decoder layer, so it is opt-in (copy_engine=True; QKV_COPY_ENGINE_TOKEN_RANGES
    says why). It shares the table and its epochs with the kernel, but not the kernel's flag rows:
    its READY and DONE are both arrival barriers (scattered_o_proj's, below) on the DONE row, and
    its transfers run on a side stream (launch_qkv_copy_engine).

scattered_o_proj(w_o, peers) -> out [m, N]: the same result when the attention did the exchange
    paged_attention(..., scatter=o_scatter_target(peers, m, C, dtype)) stores attention output row
    t straight into rank t // m's staging, [m, W*C] = exactly head_to_seq_all_to_all's result,
    columns s*C.. (fusedpar/kernels/attention.py, ScatterOut): NVLink stores spread over the
    attention's run, no copy kernel, no NCCL call. Then one tiny arrival-barrier launch (publish
    DONE after the attention completed, wait for every peer's) and a plain cuBLAS GEMM on the
    staging. The decoder layer's base mode uses this (FusedKernels o_scatter=True).

Protocol (epoch-valued flags, fusedpar/collectives/symmetric.py; each op owns its PeerTable;
primitives: fusedpar/kernels/_sync.py)
-----------------------------------------------------------------------------------------
A launch uses epoch e = counters[EPOCH] + 1; its last program to retire stores counters[EPOCH] = e.
Flag words of a table used by these ops (int64, never reset; word [row * W + src] is written only
by rank src, so no word is shared by two GPUs):
    row 0                 READY: rank src entered launch e, so it has finished reading everything
                          of launch e - 1 (stream order: its attention / GEMM kernels completed).
    row 1 (qkv)           DONE: every tile rank src stored into this rank for launch e is visible.
    rows 1 .. NB (o_proj) DONE for row band b - 1: source src's rows of band b - 1 have landed.
Producer side: data stores, CTA barrier, then a release (system scope) on the flag. qkv: every
program ends with an acq_rel system-scope RMW on counters[RETIRED] after its stores (so its
remote stores are performed before the counter moves); the last program therefore observes all
of them, and its release of DONE to every peer is cumulative over them. o_proj: one program per
(band, destination) item, so the item's program releases the flag itself.
Consumer side: RMW atomics (add 0) with acquire semantics at system scope until every word is
>= e (">=": a fast peer may already be one launch ahead), then a CTA barrier, then reads.

scattered_o_proj's table use: DONE only (row 1, epoch e = counters[EPOCH] + 1 of its arrival
launch). No READY: a peer's attention stores into this rank's staging only after receiving this
rank's qkv share of the same step, which this rank sent after (stream order) its previous GEMM on
the staging finished - the step's first all-to-all is the handshake. It shares the o workspace's
table with all_to_all_o_proj: epochs keep rising across both ops' launches, so a flag one op left
never satisfies the other's wait.

Buffer reuse without double buffering: a writer stores into peer g's buffer for launch e only
after acquiring g's READY >= e, which g released at the start of its launch e, after (stream
order) everything that read launch e - 1's data. So ONE slot is safe, the receive buffer has
a fixed address, and its view can be captured in a CUDA graph. (Epoch-parity double buffering
would need the slot index on the device - a host view of "slot e % 2" cannot follow the epoch
across CUDA-graph replays of an odd number of calls - and saves only the READY wait, which
overlaps the start-up of the launch and is one NVLink flag round when ranks are in step.)

Completion: qkv's last program (after publishing DONE) waits for every peer's DONE, so the
launch completes only when recv is whole: attention launched after it on the stream reads it
directly. wait=False leaves that wait to `qkv_all_to_all_wait`, which the consumer launches
before reading (e.g. to put independent work in between). o_proj's output is local; its
GEMM programs wait per band before reading staging.

Requirements (as for every PeerTable protocol): every rank of the group issues the same
sequence of launches on the table, same shapes, one stream; the grid (<= #SMs) is co-resident
(programs wait on peers' programs, never on later programs of their own launch). Each op needs
its own table: the epoch counts one op's launches and the flag rows are op-specific.
Spins are bounded (SPIN_LIMIT): on a timeout the kernel sets counters[STATUS] = 1 and goes
on (wrong data, no hang); `check_status(peers)` raises on it.

CPU emulation (TRITON_INTERPRET=1, EmulatedWorld): interpreted programs run one after another,
so the launchers take phase switches (send_ready / produce / wait, send_ready / push / gemm)
and `*_emulated` drivers run every rank's READY phase, then every rank's producing phase, then
every rank's consuming phase; the flag code still runs and the bounded spins prove each wait
is real (tests/kernels/test_ulysses.py).

Size-based routing: `qkv_all_to_all` / `all_to_all_o_proj` take the fused path for token counts
inside *_FUSED_TOKEN_RANGES and the plain path (F.linear + fusedpar.collectives all-to-all over
NCCL) elsewhere; the ranges are set from perf/bench_qkv_all_to_all.py and
perf/bench_all_to_all_o_proj.py so the library is never slower than the plain path.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer
from triton.runtime.jit import JITFunction

from fusedpar.collectives.symmetric import NUM_COUNTERS, EmulatedWorld, PeerTable, as_peer_table
from fusedpar.kernels._host import cdiv, require_pow2, require_same_on_ranks
from fusedpar.kernels._sync import (
    EPOCH,
    check_emulated_rank,
    device_guard,
    esize,
    flags_of,
    launch_epoch,
    next_pow2,
    publish,
    resolve_spin_limit,
    retire_system,
    sm_count,
    wait_flags,
)
from fusedpar.kernels.attention import ScatterOut
from fusedpar.kernels.gemm import (
    GemmConfig,
    _load_k_tile,
    _load_w_tile,
    _tile_coords,
    pick_config,
    require_one_block,
    split_w_descriptor,
    tma_compatible,
    tma_descriptors,
)

__all__ = [
    "GPU_SPIN_LIMIT",
    "O_PROJ_FUSED_TOKEN_RANGES",
    "QKV_COPY_ENGINE_TOKEN_RANGES",
    "QKV_FUSED_TOKEN_RANGES",
    "OProjConfig",
    "all_to_all_o_proj",
    "all_to_all_o_proj_emulated",
    "check_status",
    "launch_all_to_all_o_proj",
    "launch_qkv_all_to_all",
    "launch_qkv_copy_engine",
    "o_proj_workspace_bytes",
    "o_scatter_target",
    "qkv_all_to_all",
    "qkv_all_to_all_emulated",
    "qkv_all_to_all_wait",
    "qkv_recv_view",
    "qkv_timeline_summary",
    "qkv_workspace_bytes",
    "scattered_o_proj",
    "scattered_o_proj_emulated",
    "use_fused",
]

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# ---- routing thresholds (tokens = rows per rank, m) --------------------------------------------
# Inclusive (lo, hi) ranges of m where the fused kernel is used; hi None = no upper bound.
# Measured on 4 x H200, SP=4, Llama-3-70B and Qwen3-32B (perf/results/qkv_all_to_all.json,
# all_to_all_o_proj.json; the benches print these ranges): qkv_all_to_all beats cuBLAS + pack +
# NCCL all_to_all at every m from 8 to 16384 (1.01-1.47x); all_to_all_o_proj beats NCCL
# all-to-all + cuBLAS for m <= 128 on both models (1.05-1.23x) but not above (0.86-1.23x,
# model-dependent), so it routes to the plain path there.
QKV_FUSED_TOKEN_RANGES: tuple[tuple[int, int | None], ...] = ((1, None),)
O_PROJ_FUSED_TOKEN_RANGES: tuple[tuple[int, int | None], ...] = ((1, 128),)

# Bounded spins everywhere: on a GPU about 10-30 s of polling (a system-scope atomic per
# iteration), far above any legal wait (Triton compile skew between ranks included) yet a
# reported error rather than a hang. Interpreter: a few polls, since the phased emulation sets
# every flag before it is waited on.
GPU_SPIN_LIMIT = 1 << 24

# Flag rows (see the module docstring).
_READY_ROW = tl.constexpr(0)
_DONE_ROW = tl.constexpr(1)
# The spare counter word (symmetric.py: "one word spare for later protocols") is o_proj's
# dynamic tile counter; these tables are op-private, so nothing else uses it.
COUNTER_TILE = NUM_COUNTERS - 1
_TILE = tl.constexpr(COUNTER_TILE)

# qkv timeline (a diagnostic, GPU only): per program, %globaltimer ns at these points.
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
    x_desc,  # TMA descriptors of x [M, K] and w [WORLD*BLK, K]; None unless TMA (gemm.py)
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
):
    """GEMM x @ w^T with tile (rows r, block g, cols c) stored into rank g's buffer at [rank*M + r, c].

    The GEMM loop is fusedpar/kernels/gemm.py's _persistent_matmul_kernel (same swizzle, same
    flattened tile x K loop, same epilogue tile-id recomputation), with N tiled per block
    (tiles = cdiv(M, BLOCK_M) x WORLD * cdiv(BLK, TILE_N)) so that every tile has one owner,
    and the epilogue's store redirected to the owner. Flag code sits outside the loop only
    (DESIGN.md pitfall e). TMA / FLATTEN: the K loop's tile loads and the loop nest as in gemm.py; a W tile
    that runs past its block reads the next block's rows (or zeros), whose columns the store masks.
    BLOCK_N2: split tiles as in gemm.py (a second accumulator, TILE_N = BLOCK_N + BLOCK_N2 columns of
    one block; 320 columns cut blk = 2560 into 8 tiles).
    ROTATE: rank r's tile order starts at its own block (tile columns shifted by r blocks, modulo
    all of them). Concurrent tiles span one or two blocks, so without it every rank stores into the
    same owner at once (three peers into one GPU); rotated, the ranks' stores go round a ring.
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
            # Peers' buffers are free for this launch once they entered it (module docstring).
            wait_flags(my_flags + _READY_ROW * WORLD + peers, others, epoch, counters_ptr, SPIN_LIMIT)
        _stamp(timeline_ptr, pid, 1, TIMELINE)

        dtype = x_ptr.dtype.element_ty
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
            pid_m, pid_n = _tile_coords(tile_id, num_pid_in_group, num_pid_m, GROUP_M)
            if ROTATE:
                pid_n = (pid_n + rank * tiles_per_block) % num_pid_n
            blk_id = pid_n // tiles_per_block
            offs_am = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            c0 = (pid_n % tiles_per_block) * TILE_N
            offs_c = c0 + tl.arange(0, BLOCK_N)
            # Ragged edges: clamp to valid rows (see gemm.py); the store masks the extras off.
            offs_am = tl.where(offs_am < M, offs_am, 0)
            offs_wn = blk_id * BLK + tl.where(offs_c < BLK, offs_c, 0)

            accumulator = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
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
                    a, b = _load_k_tile(x_ptr, w_ptr, offs_am, offs_wn, offs_k_base, ki, K, stride_xm, stride_xk,
                                        stride_wk, stride_wn, BLOCK_K, EVEN_K)
                    if BLOCK_N2 > 0:
                        b2 = _load_w_tile(w_ptr, offs_wn2, offs_k_base, ki, K, stride_wk, stride_wn, BLOCK_K, EVEN_K)
                accumulator = tl.dot(a, b, accumulator, input_precision=INPUT_PRECISION)
                if BLOCK_N2 > 0:
                    accumulator2 = tl.dot(a, b2, accumulator2, input_precision=INPUT_PRECISION)

            tile_id_c += NUM_SMS
            pid_m, pid_n = _tile_coords(tile_id_c, num_pid_in_group, num_pid_m, GROUP_M)
            if ROTATE:
                pid_n = (pid_n + rank * tiles_per_block) % num_pid_n
            owner = pid_n // tiles_per_block
            offs_cm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_cn = (pid_n % tiles_per_block) * TILE_N + tl.arange(0, BLOCK_N)
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
):
    """Push attn rows to their owners (comm programs), then out = A @ w^T chunk by chunk (all programs)."""
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
            pid_m, pid_n = _tile_coords(tile_id, num_pid_in_group, num_pid_m, GROUP_M)
            offs_am = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_wn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            offs_am = tl.where(offs_am < M, offs_am, 0)
            offs_wn = tl.where(offs_wn < N, offs_wn, 0)
            accumulator = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

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


# Triton picks interpreter vs compiler when @triton.jit runs.
_INTERPRETED = not isinstance(_qkv_all_to_all_kernel, JITFunction)


# ================================================================================ host side


def _max_offset(t: torch.Tensor) -> int:
    return sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride(), strict=True))


def _spin_limit(spin_limit: int | None) -> int:
    return resolve_spin_limit(spin_limit, _INTERPRETED, GPU_SPIN_LIMIT)


def _check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name}: tensor on {t.device} but the peer table is on {device}")
    if t.device.type == "cpu" and not _INTERPRETED:
        raise RuntimeError(
            f"{name} got CPU tensors but its Triton kernel was compiled for a GPU: set TRITON_INTERPRET=1 "
            "before fusedpar.kernels.ulysses is first imported to use the CPU interpreter"
        )
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} supports CUDA (and CPU under TRITON_INTERPRET=1), got {t.device}")


def _check_int32(name: str, **tensors: torch.Tensor) -> None:
    for what, t in tensors.items():
        if _max_offset(t) >= 2**31:
            raise ValueError(f"{name}: {what} {tuple(t.shape)} strides {t.stride()} spans >= 2**31 elements")


def check_status(peers) -> None:
    """Raise RuntimeError if a bounded flag wait on this table timed out (host sync; tests/debugging)."""
    table = as_peer_table(peers)
    if table.status() != 0:
        raise RuntimeError(
            f"rank {table.rank}: a Ulysses flag wait timed out (counters[STATUS] = {table.status()}): a peer "
            "never reached the same launch (ranks issued different launch sequences on this table, or a "
            "peer died); the data of that launch is wrong"
        )


def use_fused(tokens: int, ranges) -> bool:
    """True iff `tokens` lies in one of the inclusive (lo, hi) ranges (hi None = unbounded)."""
    return any(lo <= tokens and (hi is None or tokens <= hi) for lo, hi in ranges)


class _Group:
    """The (size, pg) pair fusedpar.collectives.comm needs, from a CommGroup or a ProcessGroup."""

    def __init__(self, group):
        if hasattr(group, "pg") and hasattr(group, "size") and not callable(group.size):
            self.size, self.pg = int(group.size), group.pg
        else:
            self.size, self.pg = int(group.size()), group


# ---------------------------------------------------------------------------- qkv launcher


def qkv_workspace_bytes(tokens: int, blk: int, sp: int, dtype: torch.dtype) -> int:
    """Data bytes per rank the qkv receive buffer needs: [sp * tokens, blk] of dtype."""
    return sp * tokens * blk * esize(dtype)


def qkv_recv_view(peers, tokens: int, blk: int, dtype: torch.dtype) -> torch.Tensor:
    """This rank's receive buffer as [W * tokens, blk] of dtype (where qkv_all_to_all's result lives).

    Same address on every call: attention reads it in place, and a CUDA graph may capture it.
    Valid until the next qkv_all_to_all launch on the same table.
    """
    table = as_peer_table(peers)
    n = table.world_size * tokens
    return table.view(dtype, n * blk).view(n, blk)


# Rows per rank (inclusive) where the qkv GEMM takes split 64 x (256 + 64) tiles (_qkv_config).
QKV_SPLIT_TILE_ROWS = (512, 1024)
# Rows per rank (inclusive) where the qkv kernel rotates its tile order (the kernel's ROTATE). Peer
# stores cost the kernel 25-55 us against its own GEMM at 1024-2048 rows (perf/probe_qkv_stores.py,
# GPU runs 128-131, 4x H200: same tiling with every store local 0-2% off the GEMM alone, the READY /
# DONE flags 4-16 us more); storing through TMA (bulk async stores from shared memory) left that cost
# unchanged (commit 8079408, reverted). Rotated, the ranks store into different owners at any moment:
# the fused kernel at 1024 rows 273.9 -> 265.9 / 273.6 -> 265.3 us (Llama-70B), 193.6 -> 182.7 (Qwen3-32B),
# at 2048 rows Qwen3-32B 357.6 -> 350.7 / 366.0 -> 352.6, Llama-70B 500.0 -> 483.1 / 508.7 -> 526.9;
# the flag-free launch 2.5-5% faster in every 1024-2048-row case. At 4096 rows Llama-70B measured
# slower rotated in both runs (969 -> 1042, 1029 -> 1071 us; noise there is ~4%), at 512 mixed, so
# those keep the plain order. An interleaved order (consecutive tile columns cycling over the owners,
# from this rank's own: every rank stores into every owner at once; commit 9907794, reverted) measured
# once (run 135) against the rotated one: 2048 rows 491.7 -> 483.3 us (Llama-70B), 355.0 -> 334.5
# (Qwen3-32B); 1024 rows 271.3 -> 279.2, 181.4 -> 179.1; 4096 rows slower (1037 -> 1051, 686 -> 691).
QKV_ROTATE_ROWS = (1024, 2048)


@functools.lru_cache(maxsize=1024)  # per launch; a cached tiling costs no host time (see gemm.pick_config)
def _qkv_config(m: int, n_total: int, k: int, blk: int, dtype: torch.dtype, num_sms: int,
                tma_ok: bool = False) -> GemmConfig:
    # The GEMM's own tiling. perf/bench_qkv_all_to_all.py --sweep-configs (4x H200, GPU runs 50, 52
    # 53 and 54; the Llama-70B and Qwen3-32B base shapes, N = 10240): at 3-6 waves of 128x128 tiles
    # (1024 rows per rank: a 4096-token prefill at SP=4) the TMA-fed 128x128x64 tiling with nested
    # tile/K loops beat the pointer-load pick in all three runs (Llama 287-293 vs 303-308 us, Qwen
    # 204-212 vs 214-235 us). At 2048-4096 rows the runs disagree (the best nested TMA tiling from
    # 5% slower to 11% faster than the pointer pick), and at 256-512 rows TMA was up to 2x slower on
    # the Qwen shape, so elsewhere the plain GEMM's pointer-load pick stays.
    # Split tiles (64 x (256 + 64), TMA, nested loops, 4 stages) where 320 columns tile a block
    # exactly (blk 2560: both models' base shapes at SP=4): in GPU run 121's sweep
    # (--sweep-configs --sweep-match +64, perf/results/gpu_run_h200x4_run121.log) they beat the pick
    # above at 512 / 1024 rows (Llama-70B 177.0 -> 149.9 / 290.1 -> 271.6 us, Qwen3-32B 135.4 ->
    # 116.5 / 205.6 -> 193.5) and lost or tied at 2048 (525.2 vs 511.3, 345.4 vs 348.1) and 4096
    # (1079.1 vs 986.6, 703.1 vs 648.7). 64-row tiles of 320 columns fill 1.94 / 3.88 waves there.
    split_n = 320
    tiles = cdiv(m, 128) * cdiv(n_total, 128)
    if (tma_ok and not _INTERPRETED and dtype.itemsize == 2 and blk % split_n == 0
            and QKV_SPLIT_TILE_ROWS[0] <= m <= QKV_SPLIT_TILE_ROWS[1]):
        cfg = GemmConfig(64, 256, 64, group_m=8, num_warps=4, num_stages=4, tma=True, flatten=False, block_n2=64)
    elif tma_ok and not _INTERPRETED and dtype.itemsize == 2 and 3 * num_sms < tiles <= 6 * num_sms:
        cfg = GemmConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=4, tma=True, flatten=False)
    else:
        cfg = pick_config(m, n_total, k, dtype=dtype, num_sms=num_sms, interpret=_INTERPRETED)
    # N tiles never straddle a block: a 256-wide tile would waste half its MMA on blocks that are
    # odd multiples of 128 (e.g. hd=128 with q + 2 kv odd).
    while not cfg.block_n2 and cfg.block_n > 32 and blk % cfg.block_n and blk % (cfg.block_n // 2) == 0:
        cfg = dataclasses.replace(cfg, block_n=cfg.block_n // 2)
    return cfg


def _check_qkv(x: torch.Tensor, w: torch.Tensor, table: PeerTable) -> int:
    """Checks shared by the launcher, the op and its fake; returns blk."""
    W = table.world_size
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"qkv_all_to_all: x must be [m, d] and w [W*blk, d], got {tuple(x.shape)}, {tuple(w.shape)}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(
            f"qkv_all_to_all: x {tuple(x.shape)} and w {tuple(w.shape)} disagree on d (nn.Linear [out, in])"
        )
    if w.shape[0] % W:
        raise ValueError(f"qkv_all_to_all: w has {w.shape[0]} rows, not a multiple of the SP size {W}")
    if x.dtype not in _SUPPORTED_DTYPES or w.dtype != x.dtype:
        raise TypeError(
            f"qkv_all_to_all: x and w must share one dtype of {_SUPPORTED_DTYPES}, got {x.dtype}, {w.dtype}"
        )
    blk = w.shape[0] // W
    need = qkv_workspace_bytes(x.shape[0], blk, W, x.dtype)
    if need > table.buffer_bytes:
        raise ValueError(
            f"qkv_all_to_all: the receive buffer [{W}*{x.shape[0]}, {blk}] {x.dtype} needs {need} bytes, the "
            f"workspace has {table.buffer_bytes} (size it with qkv_workspace_bytes for the largest step)"
        )
    if table.max_blocks < 2:
        raise ValueError("qkv_all_to_all: the peer table needs max_blocks >= 2 (flag rows READY and DONE)")
    if W * x.shape[0] * blk >= 2**31:
        raise ValueError("qkv_all_to_all: the receive buffer spans >= 2**31 elements (int32 offsets)")
    return blk


def launch_qkv_all_to_all(
    x: torch.Tensor,
    w: torch.Tensor,
    table: PeerTable,
    *,
    send_ready: bool = True,
    produce: bool = True,
    wait: bool = True,
    use_flags: bool = True,
    spin_limit: int | None = None,
    config: GemmConfig | None = None,
    timeline: torch.Tensor | None = None,
    rotate: bool | None = None,
):
    """Launch the qkv kernel as `table.rank`: all phases (GPU) or some of them (CPU emulation).

    Phases: send_ready (publish READY e), produce (wait READY, GEMM + peer stores, retire, DONE),
    wait (wait DONE). A wait-only launch (send_ready=produce=False) waits for the epoch the last
    produce advanced to. use_flags=False skips all flag traffic: only correct when something else
    orders the ranks (the phased emulation). timeline: see qkv_all_to_all. rotate: the kernel's
    ROTATE (None: by QKV_ROTATE_ROWS; a rank's own tile order, so ranks need not agree). Returns Triton's
    compiled kernel (None if nothing ran or interpreting). Raw launcher, no op registration:
    callers want qkv_all_to_all().
    """
    table = as_peer_table(table)
    _check_device("qkv_all_to_all", x, table.device)
    blk = _check_qkv(x, w, table)
    if not (send_ready or produce or wait):
        raise ValueError("launch_qkv_all_to_all: nothing to do")
    m, k = x.shape
    _check_int32("qkv_all_to_all", x=x, w=w)
    W = table.world_size
    num_sms = sm_count(x.device, _INTERPRETED)
    tma_ok = tma_compatible(x, w)
    cfg = config or _qkv_config(m, W * blk, k, blk, x.dtype, num_sms, tma_ok=tma_ok)
    if produce:
        tiles = cdiv(m, cfg.block_m) * W * cdiv(blk, cfg.tile_n)
        grid = max(1, min(num_sms, tiles))
    else:
        grid = 1
    if timeline is not None:
        if not produce:
            raise ValueError("launch_qkv_all_to_all: a timeline times the produce phase; this launch has none")
        _check_timeline(timeline, grid, x.device)
    use_tma = produce and cfg.tma and tma_ok
    x_desc, w_desc = tma_descriptors(x, w, cfg.block_m, cfg.block_n, cfg.block_k) if use_tma else (None, None)
    w2_desc = split_w_descriptor(w, cfg, use_tma)
    with device_guard(x.device):
        return _qkv_all_to_all_kernel[(grid,)](
            x,
            w,
            x_desc,
            w_desc,
            w2_desc,
            table.buffer_ptrs,
            table.signal_ptrs,
            table.counters,
            table.counters if timeline is None else timeline,
            table.rank,
            m,
            blk,
            k,
            x.stride(0),
            x.stride(1),
            w.stride(0),
            w.stride(1),
            WORLD=W,
            WORLD_P2=next_pow2(W),
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            GROUP_M=cfg.group_m,
            NUM_SMS=num_sms,
            EVEN_K=k % cfg.block_k == 0,
            INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            EPOCH_AHEAD=1 if (send_ready or produce) else 0,
            SEND_READY=send_ready,
            PRODUCE=produce,
            WAIT=wait,
            USE_FLAGS=use_flags,
            SPIN_LIMIT=_spin_limit(spin_limit),
            TIMELINE=timeline is not None,
            TMA=use_tma,
            FLATTEN=cfg.flatten,
            BLOCK_N2=cfg.block_n2,
            ROTATE=QKV_ROTATE_ROWS[0] <= m <= QKV_ROTATE_ROWS[1] if rotate is None else rotate,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )


def _check_timeline(timeline: torch.Tensor, programs: int, device: torch.device) -> None:
    if timeline.dtype != torch.int64 or timeline.device != device or not timeline.is_contiguous():
        raise ValueError(f"qkv_all_to_all: timeline must be a contiguous int64 tensor on {device}, got "
                         f"{timeline.dtype} on {timeline.device} (contiguous={timeline.is_contiguous()})")
    if timeline.numel() < programs * len(QKV_TIMELINE_POINTS):
        raise ValueError(f"qkv_all_to_all: timeline has {timeline.numel()} elements; this launch has {programs} "
                         f"programs x {len(QKV_TIMELINE_POINTS)} points (size it [#SMs, 4])")
    if _INTERPRETED:
        raise ValueError("qkv_all_to_all: timeline reads the GPU's %globaltimer; the interpreter has none")


def qkv_timeline_summary(timeline: torch.Tensor) -> dict[str, float]:
    """Phase times (us) of one timed qkv launch from its [programs, 4] timeline (QKV_TIMELINE_POINTS).

    Rows still holding a negative poison value (programs that did not run) are dropped.
    enter_spread: last - first program start (block scheduling, SMs still busy with the previous
    kernel). ready_wait: per program, READY wait = ready - enter (median and max): how long the
    launch idled for the latest peer to enter it (rank skew). gemm: per program ready -> gemm
    (median, max): its tiles, remote stores included. done_wait: the waiter's gemm -> exit, max
    over programs (the completion wait for the slowest peer's tiles). total: first enter -> last exit.
    All from one GPU's clock, so no cross-GPU clock comparison is involved.
    """
    t = timeline.reshape(-1, len(QKV_TIMELINE_POINTS)).to("cpu", torch.int64)
    t = t[(t >= 0).all(dim=1)]
    if t.shape[0] == 0:
        raise ValueError("qkv_timeline_summary: no program wrote the timeline (plain path taken, or not launched)")
    if bool((t.diff(dim=1) < 0).any()):
        raise ValueError("qkv_timeline_summary: a program's points are out of order (not one launch's timeline?)")
    us = t.double() / 1e3
    enter, ready, gemm, exit_ = us.unbind(dim=1)
    return {
        "programs": float(t.shape[0]),
        "enter_spread_us": float(enter.max() - enter.min()),
        "ready_wait_median_us": float((ready - enter).median()),
        "ready_wait_max_us": float((ready - enter).max()),
        "gemm_median_us": float((gemm - ready).median()),
        "gemm_max_us": float((gemm - ready).max()),
        "done_wait_us": float((exit_ - gemm).max()),
        "total_us": float(exit_.max() - enter.min()),
    }


# ---------------------------------------------------------------------------- o_proj launcher


@dataclass(frozen=True)
class OProjConfig:
    """Launch shape of all_to_all_o_proj.

    gemm: GEMM tiling (None: fusedpar.kernels.gemm.pick_config for [m, N] x K = W*C).
    comm_programs: programs that push first (then join the GEMM). A handful suffices: each keeps
        32 KiB of posted stores in flight, so 8 of an H200's 132 SMs can outrun its NVLink
        (~450 GB/s per direction) while the other 124 start the GEMM; tune with
        perf/bench_all_to_all_o_proj.py --comm-programs.
    copy_rows x copy_cols: elements one program moves per copy step (8 per thread for 8 warps at
        32 x 512: 16-byte vector loads/stores, 32 KiB in flight per program).
    max_bands: most push bands (each band = ceil(m / bands) rows rounded up to BLOCK_M, one flag
        row each; capped by the table's max_blocks - 1).
    """

    gemm: GemmConfig | None = None
    comm_programs: int = 8
    copy_rows: int = 32
    copy_cols: int = 512
    max_bands: int = 64

    def __post_init__(self) -> None:
        # copy_rows x copy_cols is a tl.arange tile; comm_programs and max_bands are clamped to >= 1 by
        # the launcher (and gemm checked itself), so only the tile needs a check.
        require_pow2("OProjConfig", copy_rows=self.copy_rows, copy_cols=self.copy_cols)


_INTERPRETER_O_CONFIG = OProjConfig(comm_programs=2, copy_rows=8, copy_cols=16, max_bands=64)
_GPU_O_CONFIG = OProjConfig()  # one instance: the default is taken per launch


def o_proj_workspace_bytes(tokens: int, c: int, sp: int, dtype: torch.dtype) -> int:
    """Data bytes per rank the o_proj staging buffer needs: [sp, tokens, c] of dtype (c = q * hd)."""
    return sp * tokens * c * esize(dtype)


def _check_o(attn: torch.Tensor, w: torch.Tensor, table: PeerTable, out: torch.Tensor | None) -> tuple[int, int]:
    """Checks shared by the launcher, the ops and their fakes; returns (m, C)."""
    W = table.world_size
    if attn.dim() != 2 or w.dim() != 2:
        raise ValueError(
            f"all_to_all_o_proj: attn must be [W*m, C] and w_o [N, W*C], got {tuple(attn.shape)}, {tuple(w.shape)}"
        )
    if attn.shape[0] % W:
        raise ValueError(
            f"all_to_all_o_proj: {attn.shape[0]} attention rows are not divisible by the SP size {W} "
            "(pad the step to a multiple of SP first)"
        )
    m, C = attn.shape[0] // W, attn.shape[1]
    if w.shape[1] != W * C:
        raise ValueError(f"all_to_all_o_proj: w_o {tuple(w.shape)} must have W*C = {W}*{C} = {W * C} columns")
    if attn.dtype not in _SUPPORTED_DTYPES or w.dtype != attn.dtype:
        raise TypeError(
            f"all_to_all_o_proj: attn and w_o must share one dtype of {_SUPPORTED_DTYPES}, got {attn.dtype}, {w.dtype}"
        )
    need = o_proj_workspace_bytes(m, C, W, attn.dtype)
    if need > table.buffer_bytes:
        raise ValueError(
            f"all_to_all_o_proj: the staging buffer [{W}, {m}, {C}] {attn.dtype} needs {need} bytes, the workspace "
            f"has {table.buffer_bytes} (size it with o_proj_workspace_bytes for the largest step)"
        )
    if table.max_blocks < 2:
        raise ValueError("all_to_all_o_proj: the peer table needs max_blocks >= 2 (flag rows READY and DONE)")
    if W * m * C >= 2**31:
        raise ValueError("all_to_all_o_proj: the staging buffer spans >= 2**31 elements (int32 offsets)")
    if out is not None:
        if tuple(out.shape) != (m, w.shape[0]):
            raise ValueError(f"all_to_all_o_proj: out must be [m, N] = {(m, w.shape[0])}, got {tuple(out.shape)}")
        if out.dtype not in (attn.dtype, torch.float32):
            raise TypeError(f"all_to_all_o_proj: out dtype must be {attn.dtype} or float32, got {out.dtype}")
        if out.device != attn.device:
            raise ValueError(f"all_to_all_o_proj: out is on {out.device} but attn on {attn.device}")
    return m, C


def _o_launch_shape(m: int, n: int, C: int, W: int, dtype, out_dtype, table: PeerTable, cfg: OProjConfig, num_sms):
    gemm = cfg.gemm or pick_config(
        m, n, W * C, dtype=dtype, out_dtype=out_dtype, num_sms=num_sms, interpret=_INTERPRETED
    )
    require_one_block(gemm, "all_to_all_o_proj")
    m_tiles = cdiv(m, gemm.block_m)
    bands_cap = max(1, min(cfg.max_bands, table.max_blocks - 1))
    band_rows = gemm.block_m * cdiv(m_tiles, bands_cap)
    num_bands = cdiv(m, band_rows)
    comm = max(1, min(cfg.comm_programs, num_sms - 1)) if W > 1 else 0
    return gemm, band_rows, num_bands, comm


def launch_all_to_all_o_proj(
    attn: torch.Tensor,
    w: torch.Tensor,
    table: PeerTable,
    out: torch.Tensor,
    *,
    send_ready: bool = True,
    push: bool = True,
    gemm: bool = True,
    use_flags: bool = True,
    spin_limit: int | None = None,
    config: OProjConfig | None = None,
):
    """Launch the o_proj kernel as `table.rank`: all phases (GPU) or some (CPU emulation).

    Phases: send_ready (publish READY e), push (comm programs: wait READY, copy rows to their
    owners, flag each band), gemm (all programs: out = A @ w^T with per-band waits; retires the
    launch). Raw launcher: callers want all_to_all_o_proj(). Returns Triton's compiled kernel.
    """
    table = as_peer_table(table)
    _check_device("all_to_all_o_proj", attn, table.device)
    m, C = _check_o(attn, w, table, out)
    if not (send_ready or push or gemm):
        raise ValueError("launch_all_to_all_o_proj: nothing to do")
    if out is None:
        raise ValueError("launch_all_to_all_o_proj: out is required")
    _check_int32("all_to_all_o_proj", attn=attn, w=w, out=out)
    W, n = table.world_size, w.shape[0]
    num_sms = sm_count(attn.device, _INTERPRETED)
    cfg = config or (_INTERPRETER_O_CONFIG if _INTERPRETED else _GPU_O_CONFIG)
    gcfg, band_rows, num_bands, comm = _o_launch_shape(m, n, C, W, attn.dtype, out.dtype, table, cfg, num_sms)
    comm = comm if push else 0
    tiles = cdiv(m, gcfg.block_m) * cdiv(n, gcfg.block_n)
    grid = comm + (min(num_sms - comm, tiles) if gemm else 0)
    grid = max(grid, 1)  # a READY-only launch
    stage = table.view(attn.dtype, W * m * C)
    with device_guard(attn.device):
        return _all_to_all_o_proj_kernel[(grid,)](
            attn,
            w,
            out,
            stage,
            table.buffer_ptrs,
            table.signal_ptrs,
            table.counters,
            table.rank,
            m,
            n,
            C,
            attn.stride(0),
            attn.stride(1),
            w.stride(0),
            w.stride(1),
            out.stride(0),
            out.stride(1),
            band_rows,
            num_bands,
            WORLD=W,
            WORLD_P2=next_pow2(W),
            BLOCK_M=gcfg.block_m,
            BLOCK_N=gcfg.block_n,
            BLOCK_K=gcfg.block_k,
            GROUP_M=gcfg.group_m,
            EVEN_C=C % gcfg.block_k == 0,
            INPUT_PRECISION="ieee" if attn.dtype == torch.float32 else "tf32",
            COMM_PROGRAMS=comm,
            COPY_ROWS=cfg.copy_rows,
            COPY_COLS=cfg.copy_cols,
            SEND_READY=send_ready,
            PUSH=push and W > 1,
            GEMM=gemm,
            USE_FLAGS=use_flags,
            SPIN_LIMIT=_spin_limit(spin_limit),
            num_warps=gcfg.num_warps,
            num_stages=gcfg.num_stages,
        )


# ============================================================================ registered ops
# The peer table travels as its tensors + ints (no registry of workspaces). Only tensors the
# kernel writes THROUGH ITS ARGUMENT POINTER are declared mutated (counters, out): functionalization
# may run a mutating op on clones and copy them back, which would overwrite the receive/staging
# buffer that peers fill through the pointer table. Hence the qkv op returns a COPY of the receive
# buffer (functional semantics under torch.compile); eager callers get the zero-copy view.


def _table_from(buffer, buffer_ptrs, signal_ptrs, counters, rank, world_size, max_blocks) -> PeerTable:
    return PeerTable(
        rank=rank,
        world_size=world_size,
        buffer=buffer,
        buffer_ptrs=buffer_ptrs,
        signal_ptrs=signal_ptrs,
        counters=counters,
        max_blocks=max_blocks,
    )


_GEMM_META = 9  # the ints of a GemmConfig in an op's schema (_gemm_meta)


def _gemm_cfg(block_m, block_n, block_k, group_m, num_warps, num_stages, tma=0, flatten=1,
              block_n2=0) -> GemmConfig | None:
    if block_m <= 0:
        return None
    return GemmConfig(block_m, block_n, block_k, group_m=group_m, num_warps=num_warps, num_stages=num_stages,
                      tma=bool(tma), flatten=bool(flatten), block_n2=block_n2)


def _gemm_meta(cfg: GemmConfig | None) -> tuple[int, ...]:
    if cfg is None:
        return (0,) * _GEMM_META
    return (cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m, cfg.num_warps, cfg.num_stages,
            int(cfg.tma), int(cfg.flatten), cfg.block_n2)


@torch.library.custom_op("fusedpar::qkv_all_to_all", mutates_args=("counters",))
def _qkv_op(
    x: torch.Tensor,
    w: torch.Tensor,
    buffer: torch.Tensor,
    buffer_ptrs: torch.Tensor,
    signal_ptrs: torch.Tensor,
    counters: torch.Tensor,
    rank: int,
    world_size: int,
    max_blocks: int,
    use_flags: bool,
    gemm_meta: list[int],
) -> torch.Tensor:
    """All phases in one launch, then a copy of the receive buffer [W*m, blk]."""
    table = _table_from(buffer, buffer_ptrs, signal_ptrs, counters, rank, world_size, max_blocks)
    launch_qkv_all_to_all(x, w, table, use_flags=use_flags, config=_gemm_cfg(*gemm_meta))
    blk = w.shape[0] // world_size
    return qkv_recv_view(table, x.shape[0], blk, x.dtype).clone()


@_qkv_op.register_fake
def _qkv_fake(x, w, buffer, buffer_ptrs, signal_ptrs, counters, rank, world_size, max_blocks, use_flags, gemm_meta):
    if w.dim() != 2 or x.dim() != 2 or w.shape[0] % world_size or x.shape[1] != w.shape[1]:
        raise ValueError("qkv_all_to_all: x must be [m, d] and w [W*blk, d]")
    return x.new_empty((world_size * x.shape[0], w.shape[0] // world_size))


@torch.library.custom_op("fusedpar::qkv_all_to_all_wait", mutates_args=("counters",))
def _qkv_wait_op(signal_ptrs: torch.Tensor, counters: torch.Tensor, rank: int, world_size: int) -> None:
    _launch_wait(signal_ptrs, counters, rank, world_size, use_flags=True, spin_limit=None)


@_qkv_wait_op.register_fake
def _qkv_wait_fake(signal_ptrs, counters, rank, world_size):
    return None


def _o_meta(cfg: OProjConfig) -> list[int]:
    return [*_gemm_meta(cfg.gemm), cfg.comm_programs, cfg.copy_rows, cfg.copy_cols, cfg.max_bands]


def _o_cfg(meta: list[int]) -> OProjConfig:
    return OProjConfig(_gemm_cfg(*meta[:_GEMM_META]), *meta[_GEMM_META:])


@torch.library.custom_op("fusedpar::all_to_all_o_proj", mutates_args=("counters",))
def _o_op(
    attn: torch.Tensor,
    w: torch.Tensor,
    buffer: torch.Tensor,
    buffer_ptrs: torch.Tensor,
    signal_ptrs: torch.Tensor,
    counters: torch.Tensor,
    rank: int,
    world_size: int,
    max_blocks: int,
    use_flags: bool,
    meta: list[int],
) -> torch.Tensor:
    table = _table_from(buffer, buffer_ptrs, signal_ptrs, counters, rank, world_size, max_blocks)
    out = torch.empty((attn.shape[0] // world_size, w.shape[0]), dtype=attn.dtype, device=attn.device)
    launch_all_to_all_o_proj(attn, w, table, out, use_flags=use_flags, config=_o_cfg(meta))
    return out


@_o_op.register_fake
def _o_fake(attn, w, buffer, buffer_ptrs, signal_ptrs, counters, rank, world_size, max_blocks, use_flags, meta):
    if attn.dim() != 2 or w.dim() != 2 or attn.shape[0] % world_size or w.shape[1] != world_size * attn.shape[1]:
        raise ValueError("all_to_all_o_proj: attn must be [W*m, C] and w_o [N, W*C]")
    return attn.new_empty((attn.shape[0] // world_size, w.shape[0]))


@torch.library.custom_op("fusedpar::all_to_all_o_proj_out", mutates_args=("out", "counters"))
def _o_out_op(
    attn: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    buffer: torch.Tensor,
    buffer_ptrs: torch.Tensor,
    signal_ptrs: torch.Tensor,
    counters: torch.Tensor,
    rank: int,
    world_size: int,
    max_blocks: int,
    use_flags: bool,
    meta: list[int],
) -> None:
    table = _table_from(buffer, buffer_ptrs, signal_ptrs, counters, rank, world_size, max_blocks)
    launch_all_to_all_o_proj(attn, w, table, out, use_flags=use_flags, config=_o_cfg(meta))


@_o_out_op.register_fake
def _o_out_fake(
    attn, w, out, buffer, buffer_ptrs, signal_ptrs, counters, rank, world_size, max_blocks, use_flags, meta
):
    return None


def _table_args(table: PeerTable) -> tuple:
    return (table.buffer, table.buffer_ptrs, table.signal_ptrs, table.counters)


def _table_meta(table: PeerTable) -> tuple:
    return (table.rank, table.world_size, table.max_blocks)


# ---------------------------------------------------------------------------------- wait


def _launch_wait(signal_ptrs, counters, rank, world_size, *, use_flags, spin_limit) -> None:
    """One-program launch of the qkv kernel's WAIT phase (epoch = the last produce's)."""
    W = world_size
    dummy = counters.new_empty((1, 1), dtype=torch.float16)  # x/w unused by a wait-only launch
    with device_guard(counters.device):
        _qkv_all_to_all_kernel[(1,)](
            dummy,
            dummy,
            None,
            None,
            None,
            signal_ptrs,  # buffer_ptrs unused
            signal_ptrs,
            counters,
            counters,  # timeline unused
            rank,
            1,
            1,
            1,
            1,
            1,
            1,
            1,
            WORLD=W,
            WORLD_P2=next_pow2(W),
            BLOCK_M=16,
            BLOCK_N=16,
            BLOCK_K=16,
            GROUP_M=1,
            NUM_SMS=1,
            EVEN_K=True,
            INPUT_PRECISION="tf32",
            EPOCH_AHEAD=0,
            SEND_READY=False,
            PRODUCE=False,
            WAIT=True,
            USE_FLAGS=use_flags,
            SPIN_LIMIT=_spin_limit(spin_limit),
            TIMELINE=False,
            num_warps=1,
        )


def qkv_all_to_all_wait(peers, *, use_flags: bool = True, spin_limit: int | None = None) -> None:
    """Consumer step after qkv_all_to_all(..., wait=False): stream-ordered wait until every peer's tiles landed.

    Launch it before the first kernel that reads the receive buffer. Not needed after the default
    wait=True (the launch itself completes only when the buffer is whole).
    """
    table = as_peer_table(peers)
    if torch.compiler.is_compiling():
        torch.ops.fusedpar.qkv_all_to_all_wait(table.signal_ptrs, table.counters, table.rank, table.world_size)
        return
    _launch_wait(table.signal_ptrs, table.counters, table.rank, table.world_size, use_flags=use_flags,
                 spin_limit=spin_limit)


# ==================================================== the return all-to-all in the attention's stores


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


def o_scatter_target(peers, tokens: int, c: int, dtype: torch.dtype) -> ScatterOut:
    """The ScatterOut that makes paged_attention do this SP rank's share of the return all-to-all.

    tokens: m, rows per rank of the padded step; c: C = q * hd, this rank's attention columns.
    Every rank's staging buffer is [m, W * C] of dtype at the start of its data buffer (the memory
    all_to_all_o_proj stages in, o_proj_workspace_bytes); rank s stores its output row t into
    rank t // m's buffer, row t % m, columns [s * C, (s + 1) * C).
    """
    table = as_peer_table(peers)
    W = table.world_size
    need = o_proj_workspace_bytes(tokens, c, W, dtype)
    if tokens < 1 or need > table.buffer_bytes:
        raise ValueError(
            f"o_scatter_target: {tokens} rows x {W} x {c} columns of {dtype} need {need} bytes, the workspace has "
            f"{table.buffer_bytes} (and rows must be >= 1)"
        )
    local = table.view(dtype, tokens * W * c).view(tokens, W * c)
    return ScatterOut(peer_ptrs=table.buffer_ptrs, local=local, rows_per_rank=tokens, col_offset=table.rank * c)


def _launch_arrival(table: PeerTable, *, publish: bool = True, wait: bool = True,
                    spin_limit: int | None = None) -> None:
    W = table.world_size
    with device_guard(table.device):
        _o_arrival_kernel[(1,)](
            table.signal_ptrs, table.counters, table.rank, WORLD=W, WORLD_P2=next_pow2(W), PUBLISH=publish,
            WAIT=wait, SPIN_LIMIT=resolve_spin_limit(spin_limit, _INTERPRETED, GPU_SPIN_LIMIT), num_warps=1,
        )


@torch.library.custom_op("fusedpar::o_scatter_arrival", mutates_args=("local", "counters"))
def _o_arrival_op(local: torch.Tensor, buffer: torch.Tensor, buffer_ptrs: torch.Tensor, signal_ptrs: torch.Tensor,
                  counters: torch.Tensor, rank: int, world_size: int, max_blocks: int) -> None:
    """The arrival barrier; `local` (the staging view) is what the peers' stores filled."""
    _launch_arrival(_table_from(buffer, buffer_ptrs, signal_ptrs, counters, rank, world_size, max_blocks))


@_o_arrival_op.register_fake
def _o_arrival_fake(local, buffer, buffer_ptrs, signal_ptrs, counters, rank, world_size, max_blocks) -> None:
    return None


def _zeroed_padding(table: PeerTable, tokens: int, num_tokens: int, c: int, dtype: torch.dtype) -> torch.Tensor:
    """This rank's [m, W * C] staging with its padding rows (step rows >= num_tokens, which no
    attention stores) zero-filled, as the reference sends them."""
    local = o_scatter_target(table, tokens, c, dtype).local
    first_pad = min(tokens, max(0, num_tokens - table.rank * tokens))
    if first_pad < tokens:
        local[first_pad:].zero_()
    return local


def scattered_o_proj(
    w_o: torch.Tensor,
    peers,
    *,
    tokens: int,
    num_tokens: int,
    c: int,
    spin_limit: int | None = None,
) -> torch.Tensor:
    """out [m, N] = F.linear(head_to_seq_all_to_all(attn), w_o), where every SP rank's attention
    already stored its rows into the owners' staging buffers (paged_attention(scatter=
    o_scatter_target(peers, m, C, dtype))).

    Zero-fills this rank's padding rows (step rows >= num_tokens, which no attention stores),
    publishes its arrival and waits for every peer's (one tiny launch), then runs the plain cuBLAS
    GEMM on the [m, W * C] staging view. The exchange costs no launch of its own: the attention's
    epilogue stores are its transfers, spread over the attention's run.

    Buffer reuse: a peer stores into this rank's staging only in base-mode attention, which runs
    after the step's qkv exchange (fused or NCCL) has received this rank's share - sent by this
    rank only after (stream order) its previous o-projection finished reading the staging. So
    one buffer suffices without a READY handshake; a caller outside the decoder layer must keep
    that order (a data exchange with every peer between two uses).
    Collective: every SP rank calls it once per attention launch, same shapes, one stream.
    """
    table = as_peer_table(peers)
    if w_o.device != table.device:
        raise ValueError(f"scattered_o_proj: w_o is on {w_o.device}, the workspace on {table.device}")
    W = table.world_size
    if w_o.dim() != 2 or w_o.shape[1] != W * c:
        raise ValueError(f"scattered_o_proj: w_o must be [N, W * C] = [N, {W * c}], got {tuple(w_o.shape)}")
    if not 0 <= num_tokens <= W * tokens:
        raise ValueError(f"scattered_o_proj: num_tokens={num_tokens} outside [0, W * m = {W * tokens}]")
    local = _zeroed_padding(table, tokens, num_tokens, c, w_o.dtype)
    if torch.compiler.is_compiling():
        torch.ops.fusedpar.o_scatter_arrival(local, *_table_args(table), *_table_meta(table))
    else:
        _launch_arrival(table, spin_limit=spin_limit)
    return F.linear(local, w_o)


# ========================================================= the qkv exchange from cuBLAS and the copy engines

# Rows per rank (inclusive) where qkv_all_to_all's symmetric-memory exchange runs
# launch_qkv_copy_engine instead of the fused kernel: none by default, an opt-in until a 4-GPU host
# shows a gain in a layer. Measured on 2x H200 (SP=2; perf/probe_qkv_cublas.py, GPU runs 181 and 183;
# bench_qkv_all_to_all.py, run 182; us per call, x = over the GEMM alone):
#   - the op alone, GPU time: at 1024 / 2048 rows the per-owner cuBLAS GEMMs with copy-engine transfers
#     took 1.08 / 1.15x (Llama-70B base shape), 1.06 / 1.11x (Qwen3-32B), and on SP=4's per-owner
#     shape (blk 2560) 1.10 / 1.07x and 1.20 / 1.08x, where the fused kernel took 1.17 / 1.12, 1.20 /
#     1.10, 1.13 / 1.17 and 1.26 / 1.22x; at 512 and 4096 rows the kernel was as fast or faster. cuBLAS
#     storing straight into the peers' buffers (no staging) took 1.16-1.39x.
#   - its host cost: 300-670 us per call against the kernel's 110-240 us (W GEMMs, W - 1 copies, two
#     arrival launches, stream switches), so a lone eager call is host-bound up to ~2048 rows.
#   - in the decoder layer (perf/bench_layer.py, old/new in one call, run 184), base mode at 2048 / 4096
#     tokens: pipelined calls Llama-70B 2.933 -> 2.939 / 5.924 -> 6.062 ms, Qwen3-32B 1.817 -> 1.829 /
#     3.700 -> 3.692 ms (no gain); single calls 3-17% slower (the host).
QKV_COPY_ENGINE_TOKEN_RANGES: tuple[tuple[int, int | None], ...] = ()


def _copy_stream(table: PeerTable) -> torch.cuda.Stream:
    """The copy-engine path's side stream of this table, created once. One per table, not per device:
    a stream shared by two tables would order one op's READY spin behind the other's work, and two
    ranks issuing the ops in different orders would then wait for each other."""
    side = table.host_cache.get("qkv_copy_stream")
    if side is None:
        side = table.host_cache["qkv_copy_stream"] = torch.cuda.Stream(device=table.device)
    return side


def _arrival(table: PeerTable, publish: bool, wait: bool, spin_limit: int | None) -> None:
    if publish or wait:
        _launch_arrival(table, publish=publish, wait=wait, spin_limit=spin_limit)


def launch_qkv_copy_engine(
    x: torch.Tensor,
    w: torch.Tensor,
    table: PeerTable,
    *,
    send_ready: bool = True,
    produce: bool = True,
    wait: bool = True,
    spin_limit: int | None = None,
) -> None:
    """qkv_all_to_all's result from W cuBLAS GEMMs and copy-engine transfers, as `table.rank`.

    The receive layout makes rank s's share for owner g one contiguous block, rows [s*m, (s+1)*m)
    of g's [W*m, blk] buffer = x @ w[g*blk:(g+1)*blk]^T. So each owner's block is its own cuBLAS
    GEMM: the remote owners' first, in rotated order (s+1, s+2, ...: at any moment the ranks feed
    different owners), each into local staging and then copied to its owner by cudaMemcpy on a
    side stream (a copy engine: no SM time) while the next GEMM runs; this rank's own block last,
    straight into its receive rows. The exchange then costs the GEMM little more than splitting it
    by owner, where the fused kernel's NVLink stores from its epilogue cost it 25-55 us at 1024-2048
    rows (perf/probe_qkv_stores.py).
    Protocol: the arrival barrier of scattered_o_proj (one flag word per source, epoch-valued) twice
    on this op's table. READY: a peer that arrived has entered this call, so (stream order) it has
    finished reading its buffer from the last one; only the copies wait for it, the GEMMs write
    local memory, so on the GPU the side stream runs it beside the first GEMM. DONE: after the
    main stream joined the side stream (every copy completed), publish, then wait for every peer:
    the buffer is whole when this returns in stream order. Two epochs per call; mixing calls with
    the fused kernel on one table is safe (epochs only rise, and every rank takes the same path).
    Phases (the CPU emulation runs ranks one after another): send_ready publishes READY; produce
    waits for READY, runs the GEMMs and copies and publishes DONE; wait waits for DONE. A produce
    launch without wait is completed by this function's wait-only launch (send_ready=produce=False),
    not by qkv_all_to_all_wait, whose epoch convention is the fused kernel's; send_ready with wait
    but no produce is refused (it would wait for READY, not DONE). qkv_all_to_all(copy_engine=True)
    runs all three phases.
    Needs table.peer_buffers (SymmetricWorkspace and EmulatedWorld tables have them).
    """
    table = as_peer_table(table)
    _check_device("qkv_all_to_all", x, table.device)
    blk = _check_qkv(x, w, table)
    if not (send_ready or produce or wait):
        raise ValueError("launch_qkv_copy_engine: nothing to do")
    if send_ready and wait and not produce:
        raise ValueError("launch_qkv_copy_engine: send_ready + wait without produce would wait for READY, not DONE")
    if table.peer_buffers is None:
        raise ValueError("qkv_all_to_all: the copy-engine path needs a table with peer_buffers (SymmetricWorkspace)")
    W, s, m = table.world_size, table.rank, x.shape[0]
    if not produce:
        _arrival(table, send_ready, False, spin_limit)  # publish READY only
        _arrival(table, False, wait, spin_limit)  # or wait for DONE only
        return
    key = ("qkv_copy_engine", x.dtype)
    flat = table.host_cache.get(key)
    if flat is None:  # every rank's whole buffer as x's dtype, built once: views per call cost host time
        numel = table.buffer_bytes // esize(x.dtype)
        flat = table.host_cache[key] = [table.peer_view(g, x.dtype, numel) for g in range(W)]
    rows = [f[s * m * blk:(s + 1) * m * blk].view(m, blk) for f in flat]  # block s of every owner
    remote = [(s + j) % W for j in range(1, W)]
    if not x.is_cuda:  # the CPU emulation: one rank at a time, in program order
        _arrival(table, send_ready, True, spin_limit)
        for g in remote:
            torch.mm(x, w[g * blk:(g + 1) * blk].t(), out=rows[g])
        torch.mm(x, w[s * blk:(s + 1) * blk].t(), out=rows[s])
        _arrival(table, True, wait, spin_limit)
        return
    main, side = torch.cuda.current_stream(x.device), _copy_stream(table)
    staging = torch.empty((len(remote), m, blk), dtype=x.dtype, device=x.device)
    side.wait_stream(main)
    try:
        with torch.cuda.stream(side):
            _arrival(table, send_ready, True, spin_limit)  # READY, beside the first GEMM
        for i, g in enumerate(remote):
            torch.mm(x, w[g * blk:(g + 1) * blk].t(), out=staging[i])
            side.wait_stream(main)
            with torch.cuda.stream(side):
                rows[g].copy_(staging[i])
        torch.mm(x, w[s * blk:(s + 1) * blk].t(), out=rows[s])
    finally:  # joined even on an error: a capture in progress must not end with the side stream forked
        main.wait_stream(side)
    _arrival(table, True, wait, spin_limit)


# ================================================================================ public API


def _fused_possible(t: torch.Tensor, table: PeerTable | None) -> bool:
    return table is not None and t.dtype in _SUPPORTED_DTYPES and t.device == table.device


def qkv_all_to_all(
    x: torch.Tensor,
    w_qkv: torch.Tensor,
    peers=None,
    group=None,
    *,
    fused: bool | None = None,
    wait: bool = True,
    use_flags: bool = True,
    config: GemmConfig | None = None,
    timeline: torch.Tensor | None = None,
    copy_engine: bool | None = None,
) -> torch.Tensor:
    """recv [W*m, blk] = seq_to_head_all_to_all(F.linear(x, w_qkv), sp_group), one fused kernel.

    x: [m, d], this rank's token rows (padded step: every SP rank has the same m).
    w_qkv: [W*blk, d] base qkv weight (block g = [q | k | v] rows of SP peer g), any strides.
    peers: the SP group's SymmetricWorkspace / PeerTable for THIS op (qkv_workspace_bytes of the
        largest step); None: plain path only.
    group: the SP group (CommGroup or ProcessGroup) for the plain path; None: fused path only.
    fused: None picks by size (QKV_FUSED_TOKEN_RANGES; same choice on every rank); True / False force.
    wait: False returns right after the producing phase; call qkv_all_to_all_wait(peers) before
        reading the result.
    timeline: a diagnostic (GPU, eager fused path): an int64 [#SMs, 4] tensor that receives each
        program's %globaltimer ns at QKV_TIMELINE_POINTS; read it with qkv_timeline_summary. It
        tells rank skew (READY wait) from GEMM time in a real step. Left untouched by the plain path.
    copy_engine: how the symmetric-memory exchange (fused path) is made: True runs launch_qkv_copy_engine
        (cuBLAS GEMMs per owner, copy-engine transfers; always completes, whatever `wait` says),
        False the fused kernel, None picks by size (QKV_COPY_ENGINE_TOKEN_RANGES, empty by default;
        the kernel whenever config, timeline or use_flags=False ask for it, under torch.compile, or
        when the table has no peer_buffers). A step on the plain path ignores it; fused=False with
        copy_engine=True is refused.
    Returns (fused, eager) the receive buffer view: fixed address, valid until the next call on
    the same workspace; under torch.compile a copy of it (registered op); plain path: a new tensor.
    Collective: every rank of the SP group calls it with the same shapes, in the same order.
    """
    table = None if peers is None else as_peer_table(peers)
    m = x.shape[0]
    if fused is False and copy_engine:
        raise ValueError("qkv_all_to_all: copy_engine=True is an exchange of the fused path; fused=False asks for "
                         "the plain path")
    if fused is None:
        # Same inputs on every rank -> same choice everywhere (no extra synchronisation).
        fused = (
            _fused_possible(x, table)
            and w_qkv.shape[0] % table.world_size == 0
            and qkv_workspace_bytes(m, w_qkv.shape[0] // table.world_size, table.world_size, x.dtype)
            <= table.buffer_bytes
            and use_fused(m, QKV_FUSED_TOKEN_RANGES)
        )
        if not fused and group is None:
            fused = True  # no plain path to take; the checks below explain what is wrong
    if not fused:
        if group is None:
            raise ValueError("qkv_all_to_all: the plain path needs the SP group (group=...)")
        from fusedpar.collectives.comm import seq_to_head_all_to_all

        return seq_to_head_all_to_all(F.linear(x, w_qkv), _Group(group))
    if table is None:
        raise ValueError("qkv_all_to_all: the fused path needs the SP group's workspace (peers=...)")
    blk = _check_qkv(x, w_qkv, table)
    _check_device("qkv_all_to_all", x, table.device)
    if m == 0:
        return qkv_recv_view(table, 0, blk, x.dtype)
    kernel_only = config is not None or timeline is not None or not use_flags
    if copy_engine is None:
        copy_engine = (not kernel_only and table.peer_buffers is not None and not torch.compiler.is_compiling()
                       and use_fused(m, QKV_COPY_ENGINE_TOKEN_RANGES))
    if copy_engine:
        if kernel_only:
            raise ValueError("qkv_all_to_all: config, timeline and use_flags=False are the fused kernel's options; "
                             "they cannot be combined with copy_engine=True")
        if torch.compiler.is_compiling():
            raise ValueError("qkv_all_to_all: the copy-engine path is not a registered op (torch.compile); "
                             "pass copy_engine=False or None")
        launch_qkv_copy_engine(x, w_qkv, table)
        return qkv_recv_view(table, m, blk, x.dtype)
    if torch.compiler.is_compiling():
        if timeline is not None:
            raise ValueError("qkv_all_to_all: timeline is an eager diagnostic, not supported under torch.compile")
        return torch.ops.fusedpar.qkv_all_to_all(
            x, w_qkv, *_table_args(table), *_table_meta(table), use_flags, list(_gemm_meta(config))
        )
    launch_qkv_all_to_all(x, w_qkv, table, wait=wait, use_flags=use_flags, config=config, timeline=timeline)
    return qkv_recv_view(table, m, blk, x.dtype)


def all_to_all_o_proj(
    attn: torch.Tensor,
    w_o: torch.Tensor,
    peers=None,
    group=None,
    *,
    out: torch.Tensor | None = None,
    fused: bool | None = None,
    use_flags: bool = True,
    config: OProjConfig | None = None,
) -> torch.Tensor:
    """out [m, N] = F.linear(head_to_seq_all_to_all(attn, sp_group), w_o), one fused kernel.

    attn: [W*m, C] this rank's attention output for all W*m tokens of the step, its q heads
        (C = q * hd), rows in source-rank order; any strides.
    w_o: [N, W*C] base O weight (input columns = the SP peers' heads in SP order), any strides.
    peers: the SP group's workspace for THIS op (o_proj_workspace_bytes of the largest step).
    group / fused / use_flags: as in qkv_all_to_all (O_PROJ_FUSED_TOKEN_RANGES).
    out: optional [m, N] destination (attn's dtype or fp32, any strides). The result still needs
        the TP all-reduce (fusedpar's gemm_all_reduce / all_reduce).
    """
    table = None if peers is None else as_peer_table(peers)
    W = table.world_size if table is not None else None
    m = attn.shape[0] // W if W else None
    if fused is None:
        fused = (
            _fused_possible(attn, table)
            and attn.shape[0] % W == 0
            and o_proj_workspace_bytes(m, attn.shape[1], W, attn.dtype) <= table.buffer_bytes
            and use_fused(m, O_PROJ_FUSED_TOKEN_RANGES)
        )
        if not fused and group is None:
            fused = True
    if not fused:
        if group is None:
            raise ValueError("all_to_all_o_proj: the plain path needs the SP group (group=...)")
        from fusedpar.collectives.comm import head_to_seq_all_to_all

        result = F.linear(head_to_seq_all_to_all(attn, _Group(group)), w_o)
        if out is None:
            return result
        out.copy_(result)
        return out
    if table is None:
        raise ValueError("all_to_all_o_proj: the fused path needs the SP group's workspace (peers=...)")
    _check_device("all_to_all_o_proj", attn, table.device)
    m, _ = _check_o(attn, w_o, table, out)
    cfg = config or (_INTERPRETER_O_CONFIG if _INTERPRETED else _GPU_O_CONFIG)
    if torch.compiler.is_compiling():
        args = (*_table_args(table), *_table_meta(table), use_flags, _o_meta(cfg))
        if out is None:
            return torch.ops.fusedpar.all_to_all_o_proj(attn, w_o, *args)
        torch.ops.fusedpar.all_to_all_o_proj_out(attn, w_o, out, *args)
        return out
    if out is None:
        out = torch.empty((m, w_o.shape[0]), dtype=attn.dtype, device=attn.device)
    if m == 0:
        return out
    launch_all_to_all_o_proj(attn, w_o, table, out, use_flags=use_flags, config=cfg)
    return out


# ============================================================================ CPU emulation


def scattered_o_proj_emulated(world: EmulatedWorld, ws: list[torch.Tensor], *, tokens: int, num_tokens: int,
                              c: int) -> list[torch.Tensor]:
    """scattered_o_proj on every rank of an EmulatedWorld, after every rank's scattering attention:
    every rank's arrival publish, then every rank's wait + GEMM. Raises if a flag wait timed out."""
    W = world.world_size
    if len(ws) != W:
        raise ValueError(f"scattered_o_proj_emulated: {len(ws)} weights for {W} ranks")
    for r in range(W):
        _launch_arrival(world[r], wait=False)
    outs = []
    for r in range(W):
        local = _zeroed_padding(world[r], tokens, num_tokens, c, ws[r].dtype)
        _launch_arrival(world[r], publish=False)
        outs.append(F.linear(local, ws[r]))
    _emulated_check(world, "scattered_o_proj")
    return outs


def _emulated_check(world: EmulatedWorld, what: str) -> None:
    for r in range(world.world_size):
        check_emulated_rank(world[r], r, what)


def qkv_all_to_all_emulated(
    world: EmulatedWorld,
    xs: list[torch.Tensor],
    ws: list[torch.Tensor],
    *,
    schedule: str = "phased",
    use_flags: bool = True,
    config: GemmConfig | None = None,
    rotate: bool | None = None,
    copy_engine: bool = False,
) -> list[torch.Tensor]:
    """One qkv_all_to_all on every rank of an EmulatedWorld; returns every rank's receive-buffer view.

    "phased": every rank's READY launch, then every rank's produce launch, then every rank's wait
    launch. "staggered": READY for all ranks, produce for ranks 0..W-2, then rank W-1 runs the
    registered op (all phases in ONE launch, the GPU code path, with live flags; its READY is
    re-sent, harmlessly, with the same epoch), then ranks 0..W-2 wait through the registered wait
    op (the wait-only launch of qkv_all_to_all(wait=False) + qkv_all_to_all_wait).
    copy_engine: the same schedules over launch_qkv_copy_engine's phases; "staggered" runs rank W-1
    through the public qkv_all_to_all(copy_engine=True) (all phases, one call), then the others' waits.
    Raises RuntimeError if a bounded flag wait timed out.
    """
    W = world.world_size
    if len(xs) != W or len(ws) != W:
        raise ValueError(f"qkv_all_to_all_emulated: {len(xs)} inputs / {len(ws)} weights for {W} ranks")
    if schedule not in ("phased", "staggered"):
        raise ValueError(f"qkv_all_to_all_emulated: unknown schedule {schedule!r}")
    require_same_on_ranks("qkv_all_to_all_emulated", "x", xs)
    require_same_on_ranks("qkv_all_to_all_emulated", "w", ws)
    first = range(W) if schedule == "phased" else range(W - 1)
    if copy_engine:
        if not use_flags or config is not None or rotate is not None:
            raise ValueError("qkv_all_to_all_emulated: use_flags, config and rotate are the fused kernel's options")
        for r in range(W):
            launch_qkv_copy_engine(xs[r], ws[r], world[r], produce=False, wait=False)
        for r in first:
            launch_qkv_copy_engine(xs[r], ws[r], world[r], send_ready=False, wait=False)
        if schedule == "staggered":
            R = W - 1
            qkv_all_to_all(xs[R], ws[R], world[R], fused=True, copy_engine=True)
        for r in first:
            launch_qkv_copy_engine(xs[r], ws[r], world[r], send_ready=False, produce=False)
        _emulated_check(world, "qkv_all_to_all")
        return [qkv_recv_view(world[r], xs[r].shape[0], ws[r].shape[0] // W, xs[r].dtype) for r in range(W)]
    kw = {"use_flags": use_flags, "config": config, "rotate": rotate}
    for r in range(W):
        launch_qkv_all_to_all(xs[r], ws[r], world[r], produce=False, wait=False, **kw)
    for r in first:
        launch_qkv_all_to_all(xs[r], ws[r], world[r], send_ready=False, wait=False, **kw)
    if schedule == "staggered":
        R = W - 1
        t = world[R]
        got = torch.ops.fusedpar.qkv_all_to_all(
            xs[R], ws[R], *_table_args(t), *_table_meta(t), use_flags, list(_gemm_meta(config))
        )
        if not torch.equal(got, qkv_recv_view(t, xs[R].shape[0], ws[R].shape[0] // W, xs[R].dtype)):
            raise AssertionError("the registered op's copy differs from its receive buffer")
    for r in first:
        if schedule == "staggered" and use_flags:
            t = world[r]
            torch.ops.fusedpar.qkv_all_to_all_wait(t.signal_ptrs, t.counters, t.rank, W)
        else:
            launch_qkv_all_to_all(xs[r], ws[r], world[r], send_ready=False, produce=False, **kw)
    _emulated_check(world, "qkv_all_to_all")
    return [qkv_recv_view(world[r], xs[r].shape[0], ws[r].shape[0] // W, xs[r].dtype) for r in range(W)]


def all_to_all_o_proj_emulated(
    world: EmulatedWorld,
    attns: list[torch.Tensor],
    ws: list[torch.Tensor],
    *,
    outs: list[torch.Tensor] | None = None,
    schedule: str = "phased",
    use_flags: bool = True,
    config: OProjConfig | None = None,
) -> list[torch.Tensor]:
    """One all_to_all_o_proj on every rank of an EmulatedWorld; rank r's output at [r].

    "phased": READY launches, then push launches, then GEMM launches, each over all ranks.
    "staggered": READY for all, push for ranks 0..W-2, the registered op (one launch, all phases)
    for rank W-1, then GEMM for ranks 0..W-2. Raises RuntimeError if a flag wait timed out.
    """
    W = world.world_size
    if len(attns) != W or len(ws) != W:
        raise ValueError(f"all_to_all_o_proj_emulated: {len(attns)} inputs / {len(ws)} weights for {W} ranks")
    if schedule not in ("phased", "staggered"):
        raise ValueError(f"all_to_all_o_proj_emulated: unknown schedule {schedule!r}")
    require_same_on_ranks("all_to_all_o_proj_emulated", "attn", attns)
    require_same_on_ranks("all_to_all_o_proj_emulated", "w", ws)
    if outs is None:
        outs = [torch.empty((a.shape[0] // W, w.shape[0]), dtype=a.dtype) for a, w in zip(attns, ws, strict=True)]
    first = range(W) if schedule == "phased" else range(W - 1)
    kw = {"use_flags": use_flags, "config": config}
    for r in range(W):
        launch_all_to_all_o_proj(attns[r], ws[r], world[r], outs[r], push=False, gemm=False, **kw)
    for r in first:
        launch_all_to_all_o_proj(attns[r], ws[r], world[r], outs[r], send_ready=False, gemm=False, **kw)
    if schedule == "staggered":
        R = W - 1
        t = world[R]
        cfg = config or _INTERPRETER_O_CONFIG
        torch.ops.fusedpar.all_to_all_o_proj_out(
            attns[R], ws[R], outs[R], *_table_args(t), *_table_meta(t), use_flags, _o_meta(cfg)
        )
    for r in first:
        launch_all_to_all_o_proj(attns[r], ws[r], world[r], outs[r], send_ready=False, push=False, **kw)
    _emulated_check(world, "all_to_all_o_proj")
    return outs
