"""Ulysses all-to-alls fused into the projections (fusedpar.kernels.ulysses): CPU emulation and GPU.

CPU (Triton interpreter, EmulatedWorld): every emulated rank runs the real kernels phase by phase
(READY, produce/push, wait/GEMM) or with one rank running the registered op in a single launch
with live flags. Inputs are random, shapes odd (m = 1, 3, 13; blk, C and d not multiples of the
32-wide interpreter tiles; GQA-like blk = (q + 2 kv) * hd with hd 8 / 16), weights are strided
views, receive / staging buffers start poisoned (NaN bytes) and outputs are pre-filled with NaN.
The reference is float64: F.linear, then exactly the permutation fusedpar.collectives.comm's
all-to-alls perform (checked against the real gloo implementation in one test).
GPU: `torchrun --nproc-per-node 4 -m pytest -m gpu tests/kernels/test_ulysses.py`: bf16 on real
SymmetricWorkspaces, Llama-70B per-rank shapes with SP = world, against float64 over NCCL and the
plain bf16 path, eager and CUDA-graph replays; every flag wait is bounded, ranks assert together.
"""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fusedpar.collectives import comm
from fusedpar.collectives.symmetric import COUNTER_EPOCH, EmulatedWorld, SymmetricWorkspace
from fusedpar.kernels import ulysses as u
from fusedpar.kernels._host import INTERPRETED
from fusedpar.kernels.gemm import GemmConfig, tma_compatible
from fusedpar.kernels.routing import Thresholds, in_ranges, thresholds
from fusedpar.kernels.ulysses import (
    OProjConfig,
    UlyssesOptions,
    all_to_all_o_proj,
    launch_all_to_all_o_proj,
    launch_qkv_all_to_all,
    o_proj_workspace_bytes,
    qkv_all_to_all,
    qkv_all_to_all_wait,
    qkv_recv_view,
    qkv_workspace_bytes,
)
from fusedpar.kernels.ulysses import config as ucfg
from fusedpar.kernels.ulysses import kernels as ukernels
from fusedpar.kernels.ulysses import launch as ulaunch
from fusedpar.kernels.ulysses import ops as uops
from fusedpar.testing.gpu import all_ranks_ok, world_group_or_skip
from fusedpar.testing.numerics import assert_close, poison_
from fusedpar.testing.ulysses_emulation import all_to_all_o_proj_emulated, qkv_all_to_all_emulated
from tests.profile import examples

CPU_DTYPES = (torch.float16, torch.float32)
FUSED = UlyssesOptions(path="fused")
PLAIN = UlyssesOptions(path="plain")
TAIL = 512  # workspace bytes past the data region: must stay poisoned (never written)


# ------------------------------------------------------------------------------- references


def seq_to_head_reference(outs: list[torch.Tensor]) -> list[torch.Tensor]:
    """What comm.seq_to_head_all_to_all returns on every rank, given every rank's [m, W*blk] input.

    Rank p sends send_p = out_p.reshape(m, W, blk).transpose(0, 1) (block g to rank g); rank g
    receives send_p[g] from every p, stacked by source rank: [W*m, blk].
    """
    W = len(outs)
    m, n = outs[0].shape
    sends = [o.reshape(m, W, n // W).transpose(0, 1) for o in outs]
    return [torch.cat([sends[p][g] for p in range(W)]) for g in range(W)]


def head_to_seq_reference(attns: list[torch.Tensor]) -> list[torch.Tensor]:
    """What comm.head_to_seq_all_to_all returns on every rank: [m, W*C], column block g from rank g."""
    W = len(attns)
    m = attns[0].shape[0] // W
    return [torch.cat([attns[g][s * m : (s + 1) * m] for g in range(W)], dim=1) for s in range(W)]


def qkv_reference(xs, ws) -> list[torch.Tensor]:
    return seq_to_head_reference([x.double() @ w.double().T for x, w in zip(xs, ws, strict=True)])


def o_proj_reference(attns, ws) -> list[torch.Tensor]:
    return [a @ w.double().T for a, w in zip(head_to_seq_reference([a.double() for a in attns]), ws, strict=True)]


# ---------------------------------------------------------------------------------- inputs


def _weight(n: int, k: int, dtype, gen, kind: str, col_offset: int = 3) -> torch.Tensor:
    """[n, k], entries ~ N(0, 1/k), stored as `kind` (the strided weight views shift mode uses).
    The view is taken last: arithmetic on a view returns a new contiguous tensor."""
    scale = 1.0 / math.sqrt(k)

    def draw(shape):
        return (torch.randn(shape, generator=gen) * scale).to(dtype)

    if kind == "contiguous":
        return draw((n, k))
    if kind == "row_view":  # rows of a larger base weight: offset pointer
        return draw((n + 7, k)).narrow(0, 5, n)
    if kind == "col_view":  # columns of a wider base weight: stride(0) != k
        return draw((n, k + 2 * col_offset)).narrow(1, col_offset, k)
    if kind == "transposed":
        return draw((k, n)).T
    raise ValueError(kind)


def qkv_inputs(W, m, d, blk, dtype, seed, kind="row_view"):
    gen = torch.Generator().manual_seed(seed)
    xs = [(torch.randn((m, d), generator=gen) + 0.1).to(dtype) for _ in range(W)]
    ws = [_weight(W * blk, d, dtype, gen, kind) for _ in range(W)]
    return xs, ws


def o_inputs(W, m, C, n, dtype, seed, kind="col_view", strided_attn=True):
    gen = torch.Generator().manual_seed(seed)
    attns = []
    for _ in range(W):
        a = torch.randn((W * m, C + (5 if strided_attn else 0)), generator=gen) + 0.1
        attns.append((a.narrow(1, 2, C) if strided_attn else a).to(dtype))
    ws = [_weight(n, W * C, dtype, gen, kind) for _ in range(W)]
    return attns, ws


def _tail_untouched(world: EmulatedWorld, nbytes: int) -> None:
    for r in range(world.world_size):
        tail = world.buffers[r][nbytes:]
        assert tail.numel() >= TAIL - 256 and bool((tail == 0xFF).all()), f"rank {r}: kernel wrote past its region"


def check_qkv(world, xs, ws, recvs, *, dtype) -> None:
    refs = qkv_reference(xs, ws)
    W = world.world_size
    blk = ws[0].shape[0] // W
    for r, (got, ref) in enumerate(zip(recvs, refs, strict=True)):
        assert got.shape == (W * xs[0].shape[0], blk) and got.dtype == dtype
        assert not got.isnan().any(), f"rank {r}: NaN in the receive buffer (an element never arrived)"
        assert_close(got, ref, dtype=dtype, name=f"rank {r} recv")
    _tail_untouched(world, qkv_workspace_bytes(xs[0].shape[0], blk, W, dtype))
    assert all(world[r].status() == 0 for r in range(W))


def check_o(world, attns, ws, outs, *, dtype) -> None:
    refs = o_proj_reference(attns, ws)
    for r, (got, ref) in enumerate(zip(outs, refs, strict=True)):
        assert not got.isnan().any(), f"rank {r}: NaN in the output"
        assert_close(got, ref, dtype=got.dtype, name=f"rank {r} out")
    W = world.world_size
    _tail_untouched(world, o_proj_workspace_bytes(attns[0].shape[0] // W, attns[0].shape[1], W, dtype))


def qkv_world(W, m, blk, dtype, **kw) -> EmulatedWorld:
    return EmulatedWorld(W, qkv_workspace_bytes(m, blk, W, dtype) + TAIL, **kw)


def o_world(W, m, C, dtype, **kw) -> EmulatedWorld:
    return EmulatedWorld(W, o_proj_workspace_bytes(m, C, W, dtype) + TAIL, **kw)


# ======================================================================== qkv_all_to_all, CPU


@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 3, 13])
def test_qkv_matches_reference(W, dtype, m):
    q, kv, hd, d = 3, 1, 8, 40  # blk = 40: ragged against 32-wide tiles; d = 40: K tail
    blk = (q + 2 * kv) * hd
    kind = ("row_view", "col_view", "transposed")[m % 3]
    xs, ws = qkv_inputs(W, m, d, blk, dtype, seed=100 * W + m, kind=kind)
    world = qkv_world(W, m, blk, dtype)
    recvs = qkv_all_to_all_emulated(world, xs, ws)
    check_qkv(world, xs, ws, recvs, dtype=dtype)
    assert [world[r].epoch() for r in range(W)] == [1] * W


@pytest.mark.parametrize("W", [2, 3, 4])
def test_qkv_registered_op_single_launch_with_live_flags(W):
    # Rank W-1 runs torch.ops.fusedpar.qkv_all_to_all: READY, wait, GEMM + peer stores, retire,
    # DONE and the final wait in ONE launch (the GPU code path); W = 3 exercises padded flag lanes.
    m, d, blk = 13, 24, 48  # hd 16: q 1, kv 1
    xs, ws = qkv_inputs(W, m, d, blk, torch.float16, seed=W)
    world = qkv_world(W, m, blk, torch.float16)
    recvs = qkv_all_to_all_emulated(world, xs, ws, schedule="staggered")
    check_qkv(world, xs, ws, recvs, dtype=torch.float16)


def test_qkv_explicit_small_tiles_many_programs():
    # 16x16x16 tiles: several N tiles per block (blk 40 = 16 + 16 + 8), M tiles ragged, every
    # interpreter "SM" runs several tiles, and GROUP_M = 3 leaves a ragged swizzle group.
    W, m, d, blk = 2, 13, 40, 40
    xs, ws = qkv_inputs(W, m, d, blk, torch.float32, seed=5, kind="col_view")
    world = qkv_world(W, m, blk, torch.float32)
    recvs = qkv_all_to_all_emulated(world, xs, ws, config=GemmConfig(16, 16, 16, group_m=3, num_stages=1))
    check_qkv(world, xs, ws, recvs, dtype=torch.float32)


@pytest.mark.parametrize("kind", ["contiguous", "col_view"])
@pytest.mark.parametrize("blk,block_n2", [(40, 8), (56, 16), (24, 16)])
def test_qkv_split_tiles(kind, blk, block_n2):
    # Split tiles (GemmConfig.block_n2): 16 + block_n2 columns per tile, two accumulators. blk 40 =
    # 24 + 16 (a ragged second tile), 56 = 32 + 24 (the second block's tail masked), 24 = one tile
    # whose second block reaches 8 columns past the block (into the next block's rows or past w).
    W, m, d = 3, 13, 40
    xs, ws = qkv_inputs(W, m, d, blk, torch.float32, seed=blk + block_n2, kind=kind)
    world = qkv_world(W, m, blk, torch.float32)
    split = GemmConfig(16, 16, 16, group_m=3, num_stages=1, block_n2=block_n2)
    recvs = qkv_all_to_all_emulated(world, xs, ws, config=split)
    check_qkv(world, xs, ws, recvs, dtype=torch.float32)


def test_qkv_split_tile_rule(monkeypatch):
    # GPU picks (the interpreter keeps its small tiles): 16-bit, TMA-able operands at 512-1024 rows per
    # rank take 64 x (256 + 64) tiles where 320 columns tile the block (blk 2560); elsewhere the
    # previous picks (one column block).
    monkeypatch.setattr(ucfg, "INTERPRETED", False)
    pick = ucfg.pick_qkv_config.__wrapped__  # uncached: the module-level cache holds interpreter picks
    for m in (512, 700, 1024):
        for k in (8192, 5120):
            cfg = pick(m, 4 * 2560, k, 2560, torch.bfloat16, 132, tma_ok=True)
            assert (cfg.block_m, cfg.block_n, cfg.block_n2, cfg.tma, cfg.flatten) == (64, 256, 64, True, False), cfg
        assert pick(m, 4 * 2560, 8192, 2560, torch.float16, 132, tma_ok=True).block_n2 == 64
        assert pick(m, 4 * 2560, 8192, 2560, torch.float32, 132, tma_ok=True).block_n2 == 0
        assert pick(m, 4 * 2560, 8192, 2560, torch.bfloat16, 132, tma_ok=False).block_n2 == 0
        assert pick(m, 4 * 2304, 8192, 2304, torch.bfloat16, 132, tma_ok=True).block_n2 == 0  # 2304 % 320
    for m in (256, 511, 1025, 2048, 4096):
        assert pick(m, 4 * 2560, 8192, 2560, torch.bfloat16, 132, tma_ok=True).block_n2 == 0, m


def test_split_tile_configs_are_refused_by_all_to_all_o_proj():
    # all_to_all_o_proj's epilogue addresses block_n-wide tiles, so a split config must fail
    # loudly, not drop its second block.
    W = 2
    split = GemmConfig(16, 16, 16, group_m=3, num_stages=1, block_n2=16)
    cfg = OProjConfig(gemm=split, comm_programs=1, copy_rows=4, copy_cols=8)
    attns, wo = o_inputs(W, 40, 16, 16, torch.float32, seed=22)
    with pytest.raises(ValueError, match="block_n2=16"):
        all_to_all_o_proj_emulated(o_world(W, 40, 16, torch.float32), attns, wo, config=cfg)


@pytest.mark.parametrize("schedule", ["phased", "staggered"])
@pytest.mark.parametrize("kind", ["contiguous", "row_view", "col_view"])
def test_qkv_tma_loads(kind, schedule, monkeypatch):
    # The TMA mainloop: blk 40 against 32-wide tiles, so a W tile reads 24 rows past its block (the
    # next block's, or zeros after the last) that the store must drop; K = 72 leaves a K tail.
    W, m, d, blk = 3, 13, 72, 40
    gen = torch.Generator().manual_seed(17)
    xs = [(torch.randn((m, d), generator=gen) + 0.1).half() for _ in range(W)]
    ws = [_weight(W * blk, d, torch.float16, gen, kind, col_offset=8) for _ in range(W)]  # 16-byte aligned view
    assert all(tma_compatible(x, w) for x, w in zip(xs, ws, strict=True))
    assert (kind == "contiguous") == (ws[0].is_contiguous() and ws[0].storage_offset() == 0)
    made = []
    real = ulaunch.tma_descriptors
    monkeypatch.setattr(ulaunch, "tma_descriptors", lambda *a: made.append(a[2:]) or real(*a))
    world = qkv_world(W, m, blk, torch.float16)
    for flatten in (True, False):  # consecutive calls on one world: epochs 1 and 2
        cfg = GemmConfig(32, 32, 32, group_m=2, num_stages=1, tma=True, flatten=flatten)
        recvs = qkv_all_to_all_emulated(world, xs, ws, schedule=schedule, config=cfg)
        check_qkv(world, xs, ws, recvs, dtype=torch.float16)
        for buf in world.buffers:  # re-poison: the second call must write every element again
            buf.fill_(0xFF)
    assert len(made) == 2 * W and set(made) == {(32, 32, 32)}, "every produce launch takes the TMA path"


@pytest.mark.parametrize("flatten", [True, False])
def test_qkv_tma_split_tiles(flatten):
    # TMA with split tiles: blk 40 against 16 + 16 columns, so the second tile's second W block reads
    # 8 rows past its block (the next block's, or zeros after the last) that the store must drop.
    W, m, d, blk = 3, 13, 72, 40
    gen = torch.Generator().manual_seed(23)
    xs = [(torch.randn((m, d), generator=gen) + 0.1).half() for _ in range(W)]
    ws = [_weight(W * blk, d, torch.float16, gen, "col_view", col_offset=8) for _ in range(W)]
    assert all(tma_compatible(x, w) for x, w in zip(xs, ws, strict=True))
    world = qkv_world(W, m, blk, torch.float16)
    cfg = GemmConfig(16, 16, 32, group_m=2, num_stages=1, tma=True, flatten=flatten, block_n2=16)
    recvs = qkv_all_to_all_emulated(world, xs, ws, config=cfg)
    check_qkv(world, xs, ws, recvs, dtype=torch.float16)


@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize("schedule", ["phased", "staggered"])
def test_qkv_rotated_tile_order(W, schedule):
    # ROTATE: rank r starts at its own block (tile columns shifted by r blocks of 3 tiles, blk 40 =
    # 16 + 16 + 8 with a ragged last tile, wrapping round past the last block); the result must not
    # change. In the staggered schedule the last rank runs the registered op unrotated (m = 13 is
    # outside QKV_ROTATE_ROWS: ranks need not agree on the order).
    m, d, blk = 13, 40, 40
    xs, ws = qkv_inputs(W, m, d, blk, torch.float32, seed=40 + W, kind="col_view")
    world = qkv_world(W, m, blk, torch.float32)
    cfg = GemmConfig(16, 16, 16, group_m=3, num_stages=1)
    recvs = qkv_all_to_all_emulated(world, xs, ws, schedule=schedule, config=cfg, rotate=True)
    check_qkv(world, xs, ws, recvs, dtype=torch.float32)


def test_qkv_rotation_rule(monkeypatch):
    # The launcher rotates at QKV_ROTATE_ROWS rows per rank unless told otherwise.
    seen = []

    class _Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append(kw["ROTATE"])

    monkeypatch.setattr(ulaunch, "_qkv_all_to_all_kernel", _Kernel())
    lo, hi = ucfg.QKV_ROTATE_ROWS
    world = EmulatedWorld(2, qkv_workspace_bytes(hi + 1, 16, 2, torch.float32))
    w = torch.randn(32, 16)
    for m, rotate in ((lo - 1, None), (lo, None), (hi, None), (hi + 1, None), (lo, False), (hi + 1, True)):
        launch_qkv_all_to_all(torch.randn(m, 16), w, world[0], use_flags=False, rotate=rotate)
    assert seen == [False, True, True, False, False, True]


def test_qkv_consecutive_calls_reuse_one_buffer_and_advance_epochs():
    W, m, d, blk = 2, 3, 24, 40
    world = qkv_world(W, m, blk, torch.float32)
    addr = None
    for c in range(1, 4):
        xs, ws = qkv_inputs(W, m, d, blk, torch.float32, seed=40 + c)
        recvs = qkv_all_to_all_emulated(world, xs, ws)
        check_qkv(world, xs, ws, recvs, dtype=torch.float32)
        if addr is None:
            addr = [v.data_ptr() for v in recvs]
        assert [v.data_ptr() for v in recvs] == addr, "the receive view must keep its address (CUDA graphs)"
        for r in range(W):
            assert world[r].epoch() == c
            flags = world.signals[r].view(-1, W)
            peer = 1 - r
            assert flags[0, peer] == c and flags[1, peer] == c, "READY / DONE words carry the epoch"
            assert flags[0, r] == 0 and flags[1, r] == 0 and not flags[2:].any(), "no other word is written"


def test_qkv_wait_false_then_explicit_wait():
    W, m, d, blk = 3, 5, 24, 40
    xs, ws = qkv_inputs(W, m, d, blk, torch.float16, seed=9)
    world = qkv_world(W, m, blk, torch.float16)
    for r in range(W):
        launch_qkv_all_to_all(xs[r], ws[r], world[r], produce=False, wait=False)
    for r in range(W - 1):
        launch_qkv_all_to_all(xs[r], ws[r], world[r], send_ready=False, wait=False)
    # The public eager entry point (all phases but the wait, one launch), then the consumer step.
    view = qkv_all_to_all(xs[W - 1], ws[W - 1], world[W - 1], options=FUSED, wait=False)
    assert view.data_ptr() == world[W - 1].buffer.data_ptr()
    qkv_all_to_all_wait(world[W - 1])
    for r in range(W - 1):
        qkv_all_to_all_wait(world[r])
    recvs = [qkv_recv_view(world[r], m, blk, torch.float16) for r in range(W)]
    check_qkv(world, xs, ws, recvs, dtype=torch.float16)


def test_qkv_ready_flag_protects_a_slow_reader():
    # Call 1 completes. Rank 0 then starts call 2 while rank 1 is still "reading" call 1 (it has
    # not entered call 2, so no READY 2): with flags rank 0's produce must not pass its READY
    # wait (the interpreter's bounded spin reports it); without flags it overwrites rank 1's
    # receive buffer under the reader.
    W, m, d, blk = 2, 3, 24, 40
    for use_flags in (True, False):
        world = qkv_world(W, m, blk, torch.float32)
        xs, ws = qkv_inputs(W, m, d, blk, torch.float32, seed=11)
        recvs = qkv_all_to_all_emulated(world, xs, ws, use_flags=use_flags)
        seen_by_reader = recvs[1].clone()
        xs2, _ = qkv_inputs(W, m, d, blk, torch.float32, seed=12)
        launch_qkv_all_to_all(xs2[0], ws[0], world[0], wait=False, use_flags=use_flags)
        if use_flags:
            assert world[0].status() == 1, "rank 0 wrote into rank 1's buffer before rank 1 entered the call"
        else:
            assert world[0].status() == 0
            assert not torch.equal(recvs[1], seen_by_reader), "without flags the reader's data is overwritten"


@pytest.mark.parametrize("use_flags", [True, False])
def test_qkv_done_flag_gates_the_consumer(use_flags):
    # Rank 0 waits before rank 1 produced: with flags the wait times out and says so; without,
    # rank 0's rows from rank 1 are still the poison.
    W, m, d, blk = 2, 3, 24, 40
    xs, ws = qkv_inputs(W, m, d, blk, torch.float32, seed=13)
    world = qkv_world(W, m, blk, torch.float32)
    for r in range(W):
        launch_qkv_all_to_all(xs[r], ws[r], world[r], produce=False, wait=False, use_flags=use_flags)
    launch_qkv_all_to_all(xs[0], ws[0], world[0], send_ready=False, use_flags=use_flags)  # produce + wait
    recv0 = qkv_recv_view(world[0], m, blk, torch.float32)
    if use_flags:
        assert world[0].status() == 1
    else:
        assert world[0].status() == 0 and recv0[m:].isnan().all() and not recv0[:m].isnan().any()


def test_qkv_flags_off_phased_is_correct_and_touches_no_flag():
    W, m, d, blk = 4, 13, 24, 48
    xs, ws = qkv_inputs(W, m, d, blk, torch.float16, seed=14)
    world = qkv_world(W, m, blk, torch.float16)
    recvs = qkv_all_to_all_emulated(world, xs, ws, use_flags=False)
    check_qkv(world, xs, ws, recvs, dtype=torch.float16)
    assert not any(s.any() for s in world.signals)


def test_qkv_emulated_driver_reports_an_epoch_mismatch():
    W, m, d, blk = 2, 3, 24, 40
    xs, ws = qkv_inputs(W, m, d, blk, torch.float32, seed=15)
    world = qkv_world(W, m, blk, torch.float32)
    world[0].counters[COUNTER_EPOCH] = 1  # as if rank 1 had skipped a call
    with pytest.raises(RuntimeError, match="never came"):
        qkv_all_to_all_emulated(world, xs, ws)


@settings(max_examples=examples(6), deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    W=st.sampled_from([2, 3, 4]),
    m=st.integers(1, 20),
    d=st.integers(8, 72),
    heads=st.tuples(st.integers(1, 4), st.integers(1, 2)),
    hd=st.sampled_from([8, 16]),
    dtype=st.sampled_from(CPU_DTYPES),
    kind=st.sampled_from(["contiguous", "row_view", "col_view", "transposed"]),
    schedule=st.sampled_from(["phased", "staggered"]),
    seed=st.integers(0, 2**16),
)
def test_qkv_property(W, m, d, heads, hd, dtype, kind, schedule, seed):
    blk = (heads[0] + 2 * heads[1]) * hd
    xs, ws = qkv_inputs(W, m, d, blk, dtype, seed=seed, kind=kind)
    world = qkv_world(W, m, blk, dtype)
    recvs = qkv_all_to_all_emulated(world, xs, ws, schedule=schedule)
    check_qkv(world, xs, ws, recvs, dtype=dtype)


# ===================================================================== all_to_all_o_proj, CPU


@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 3, 13])
def test_o_proj_matches_reference(W, dtype, m):
    C, n = 24, 40  # q 3 x hd 8: C % 32 != 0 (K tails inside every chunk); N ragged
    kind = ("col_view", "row_view", "transposed")[m % 3]
    attns, ws = o_inputs(W, m, C, n, dtype, seed=200 * W + m, kind=kind, strided_attn=m != 3)
    world = o_world(W, m, C, dtype)
    outs = [poison_(torch.empty(m, n, dtype=dtype)) for _ in range(W)]
    all_to_all_o_proj_emulated(world, attns, ws, outs=outs)
    check_o(world, attns, ws, outs, dtype=dtype)
    assert [world[r].epoch() for r in range(W)] == [1] * W


@pytest.mark.parametrize("W", [2, 3, 4])
def test_o_proj_registered_op_single_launch_with_live_flags(W):
    m, C, n = 13, 32, 24  # C = 2 x 16: EVEN_C path
    attns, ws = o_inputs(W, m, C, n, torch.float16, seed=W)
    world = o_world(W, m, C, torch.float16)
    outs = all_to_all_o_proj_emulated(world, attns, ws, schedule="staggered")
    check_o(world, attns, ws, outs, dtype=torch.float16)


def test_o_proj_many_bands_copy_steps_and_items_per_program():
    # 16-row GEMM tiles and at most 64 bands: m = 37 -> 3 bands; 4 x 8 copy tiles: several copy
    # steps per item; 2 comm programs for 3 x 3 = 9 items; fp32 output from fp16 inputs.
    W, m, C, n = 4, 37, 24, 40
    cfg = OProjConfig(gemm=GemmConfig(16, 16, 16, group_m=2, num_stages=1), comm_programs=2, copy_rows=4, copy_cols=8)
    attns, ws = o_inputs(W, m, C, n, torch.float16, seed=21)
    world = o_world(W, m, C, torch.float16)
    outs = [poison_(torch.empty(m, n)) for _ in range(W)]
    all_to_all_o_proj_emulated(world, attns, ws, outs=outs, config=cfg)
    check_o(world, attns, ws, outs, dtype=torch.float16)
    flags = world.signals[0].view(-1, W)
    assert (flags[1:4, 1:] == 1).all() and not flags[4:].any(), "one DONE row per band, from every peer"


def test_o_proj_bands_capped_by_flag_rows():
    W, m, C, n = 2, 40, 16, 16
    cfg = OProjConfig(gemm=GemmConfig(16, 16, 16, group_m=1, num_stages=1), comm_programs=1, copy_rows=4, copy_cols=8)
    attns, ws = o_inputs(W, m, C, n, torch.float32, seed=22)
    world = o_world(W, m, C, torch.float32, max_blocks=2)  # READY row + ONE band row
    outs = all_to_all_o_proj_emulated(world, attns, ws, config=cfg)
    check_o(world, attns, ws, outs, dtype=torch.float32)


def test_o_proj_consecutive_calls():
    W, m, C, n = 3, 5, 24, 40
    world = o_world(W, m, C, torch.float32)
    for c in range(1, 4):
        attns, ws = o_inputs(W, m, C, n, torch.float32, seed=30 + c)
        outs = all_to_all_o_proj_emulated(world, attns, ws)
        check_o(world, attns, ws, outs, dtype=torch.float32)
        assert [world[r].epoch() for r in range(W)] == [c] * W
        assert all(int(world[r].counters[ukernels.COUNTER_TILE]) == 0 for r in range(W)), "tile counter rewound"


@pytest.mark.parametrize("use_flags", [True, False])
def test_o_proj_gemm_waits_for_the_pushes(use_flags):
    W, m, C, n = 2, 3, 24, 16
    attns, ws = o_inputs(W, m, C, n, torch.float32, seed=23)
    world = o_world(W, m, C, torch.float32)
    out = poison_(torch.empty(m, n))
    for r in range(W):
        launch_all_to_all_o_proj(attns[r], ws[r], world[r], out, push=False, gemm=False, use_flags=use_flags)
    # Rank 0 pushes and multiplies; rank 1 never pushed.
    launch_all_to_all_o_proj(attns[0], ws[0], world[0], out, send_ready=False, use_flags=use_flags)
    if use_flags:
        assert world[0].status() == 1
    else:
        assert world[0].status() == 0 and out.isnan().all()


def test_o_proj_push_waits_for_ready():
    W, m, C, n = 2, 3, 24, 16
    attns, ws = o_inputs(W, m, C, n, torch.float32, seed=24)
    world = o_world(W, m, C, torch.float32)
    out = torch.empty(m, n)
    launch_all_to_all_o_proj(attns[0], ws[0], world[0], out, gemm=False)  # rank 1 has not entered the call
    assert world[0].status() == 1


def test_o_proj_flags_off_phased_is_correct_and_touches_no_flag():
    W, m, C, n = 4, 13, 24, 40
    attns, ws = o_inputs(W, m, C, n, torch.float16, seed=25)
    world = o_world(W, m, C, torch.float16)
    outs = all_to_all_o_proj_emulated(world, attns, ws, use_flags=False)
    check_o(world, attns, ws, outs, dtype=torch.float16)
    assert not any(s.any() for s in world.signals)


@settings(max_examples=examples(6), deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    W=st.sampled_from([2, 3, 4]),
    m=st.integers(1, 20),
    q=st.integers(1, 4),
    hd=st.sampled_from([8, 16]),
    n=st.integers(8, 72),
    dtype=st.sampled_from(CPU_DTYPES),
    kind=st.sampled_from(["contiguous", "row_view", "col_view", "transposed"]),
    schedule=st.sampled_from(["phased", "staggered"]),
    seed=st.integers(0, 2**16),
)
def test_o_proj_property(W, m, q, hd, n, dtype, kind, schedule, seed):
    C = q * hd
    attns, ws = o_inputs(W, m, C, n, dtype, seed=seed, kind=kind, strided_attn=seed % 2 == 0)
    world = o_world(W, m, C, dtype)
    outs = all_to_all_o_proj_emulated(world, attns, ws, schedule=schedule)
    check_o(world, attns, ws, outs, dtype=dtype)


# ============================================================ public API, routing, registration


def test_single_rank_fused_paths_are_linear():
    gen = torch.Generator().manual_seed(31)
    x = torch.randn(7, 24, generator=gen)
    w = _weight(40, 24, torch.float32, gen, "col_view")
    t = EmulatedWorld(1, qkv_workspace_bytes(7, 40, 1, torch.float32))[0]
    v1 = qkv_all_to_all(x, w, t, options=FUSED)
    assert v1.data_ptr() == t.buffer.data_ptr() and v1.shape == (7, 40)
    assert_close(v1, x.double() @ w.double().T, dtype=torch.float32)
    v2 = qkv_all_to_all(x * 2, w, t, options=FUSED)
    assert v2.data_ptr() == v1.data_ptr() and t.epoch() == 2
    assert_close(v2, 2 * x.double() @ w.double().T, dtype=torch.float32)

    to = EmulatedWorld(1, o_proj_workspace_bytes(7, 24, 1, torch.float32))[0]
    out = poison_(torch.empty(7, 40))
    assert all_to_all_o_proj(x, w, to, options=FUSED, out=out) is out
    assert_close(out, x.double() @ w.double().T, dtype=torch.float32)
    assert to.epoch() == 1


def test_routing_by_size(monkeypatch):
    calls = []

    def fake_seq_to_head(x, group):
        calls.append(("seq_to_head", x.shape, group.size))
        return x

    def fake_head_to_seq(x, group):
        calls.append(("head_to_seq", x.shape, group.size))
        return x

    monkeypatch.setattr(comm, "seq_to_head_all_to_all", fake_seq_to_head)
    monkeypatch.setattr(comm, "head_to_seq_all_to_all", fake_head_to_seq)
    opts = UlyssesOptions(qkv_fused_rows=((2, 4), (9, None)), o_proj_fused_rows=((1, 3),))
    group = SimpleNamespace(size=1, pg=None)  # a CommGroup-like object
    gen = torch.Generator().manual_seed(32)
    w = _weight(16, 8, torch.float32, gen, "contiguous")
    tq = EmulatedWorld(1, 4096)[0]
    to = EmulatedWorld(1, 4096)[0]
    for m, fused in ((1, False), (2, True), (4, True), (5, False), (9, True), (30, True)):
        x = torch.randn(m, 8, generator=gen)
        before = (tq.epoch(), len(calls))
        y = qkv_all_to_all(x, w, tq, group, options=opts)
        assert (tq.epoch() == before[0] + 1) == fused and (len(calls) == before[1] + 1) == (not fused), m
        assert_close(y, x.double() @ w.double().T, dtype=torch.float32)
    for m, fused in ((3, True), (4, False)):
        a = torch.randn(m, 8, generator=gen)
        before = (to.epoch(), len(calls))
        y = all_to_all_o_proj(a, w, to, group, options=opts)
        assert (to.epoch() == before[0] + 1) == fused and (len(calls) == before[1] + 1) == (not fused), m
        assert_close(y, a.double() @ w.double().T, dtype=torch.float32)
    # No workspace: plain path; unsupported dtype: plain path; no group and no workspace: error.
    x = torch.randn(2, 8, generator=gen)
    qkv_all_to_all(x, w, None, group, options=opts)
    qkv_all_to_all(x.double(), w.double(), tq, group, options=opts)
    assert [c[0] for c in calls[-2:]] == ["seq_to_head", "seq_to_head"]
    with pytest.raises(ValueError, match="needs the SP group's workspace"):
        qkv_all_to_all(x, w)
    with pytest.raises(ValueError, match="plain path needs the SP group"):
        all_to_all_o_proj(x, w, to, options=PLAIN)
    assert in_ranges(10, ((1, 4), (10, 10))) and not in_ranges(5, ((1, 4), (10, None)))
    # A step too big for the workspace takes the plain path instead of failing.
    opts = UlyssesOptions(qkv_fused_rows=((2, 4), (9, None)), o_proj_fused_rows=((1, None),))
    small = EmulatedWorld(1, 256)[0]
    n_calls = len(calls)
    x = torch.randn(30, 8, generator=gen)
    assert_close(qkv_all_to_all(x, w, small, group, options=opts), x.double() @ w.double().T, dtype=torch.float32)
    assert_close(all_to_all_o_proj(x, w, small, group, options=opts), x.double() @ w.double().T,
                 dtype=torch.float32)
    assert len(calls) == n_calls + 2 and small.epoch() == 0


def test_default_routing_reads_the_routing_table(monkeypatch):
    # Without overrides the routers take fusedpar.kernels.routing.thresholds(device, SP size).
    seen = []
    fake = Thresholds(qkv_fused_rows=((3, 3),), o_proj_fused_rows=((2, 2),), one_shot_max_rows=0,
                      two_shot_min_rows=0, all_reduce_one_shot_max_bytes=0, measured="test")

    def fake_thresholds(device, world):
        seen.append((device.type, world))
        return fake

    monkeypatch.setattr(u, "thresholds", fake_thresholds)
    monkeypatch.setattr(comm, "seq_to_head_all_to_all", lambda x, group: x)
    monkeypatch.setattr(comm, "head_to_seq_all_to_all", lambda x, group: x)
    group = SimpleNamespace(size=1, pg=None)
    w = torch.randn(16, 8)
    tq, to = EmulatedWorld(1, 4096)[0], EmulatedWorld(1, 4096)[0]
    for m in (2, 3, 4):
        qkv_all_to_all(torch.randn(m, 8), w, tq, group)
        all_to_all_o_proj(torch.randn(m, 8), w, to, group)
    assert (tq.epoch(), to.epoch()) == (1, 1) and set(seen) == {("cpu", 1)}
    assert thresholds(torch.device("cpu"), 4).qkv_fused_rows  # the real table has an entry for every device
    with pytest.raises(ValueError, match="path must be one of"):
        UlyssesOptions(path="copy_engine")


def test_plain_reference_is_the_comm_permutation():
    """The float64 references above are exactly what comm's all-to-alls do (2 gloo processes)."""
    from fusedpar.testing.dist import run_distributed

    results = run_distributed(_gloo_plain_worker, 2, timeout=120.0)
    for ok in results:
        assert ok is True, ok


def _gloo_plain_worker(rank: int, world_size: int):
    import torch.distributed as dist

    group = SimpleNamespace(size=world_size, pg=dist.group.WORLD)
    m, d, blk, C, n = 3, 8, 12, 6, 10
    xs, ws = qkv_inputs(world_size, m, d, blk, torch.float64, seed=1, kind="contiguous")
    got = qkv_all_to_all(xs[rank], ws[rank], None, group)
    if not torch.equal(got, qkv_reference(xs, ws)[rank]):
        return f"rank {rank}: plain qkv path differs from the reference permutation"
    attns, wos = o_inputs(world_size, m, C, n, torch.float64, seed=2, kind="contiguous", strided_attn=False)
    got = all_to_all_o_proj(attns[rank], wos[rank], None, group)
    ref = o_proj_reference(attns, wos)[rank]
    if not torch.allclose(got, ref, rtol=1e-12, atol=1e-12):
        return f"rank {rank}: plain o_proj path differs from the reference permutation"
    return True


def test_registered_ops_pass_opcheck():
    gen = torch.Generator().manual_seed(33)
    x = torch.randn(5, 24, generator=gen)
    w = _weight(40, 24, torch.float32, gen, "col_view")
    t = EmulatedWorld(1, 8192)[0]
    tables = (t.buffer, t.buffer_ptrs, t.signal_ptrs, t.counters, 0, 1, t.max_blocks, True)
    # test_schema is left out for the qkv op on purpose: its receive buffer is written through
    # the peer pointer table, deliberately undeclared (ulysses/ops.py: functionalization would
    # copy a stale clone over what the peers wrote); the op returns a copy instead.
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.fusedpar.qkv_all_to_all.default, (x, w, *tables, [0] * 6), test_utils=utils)
    torch.library.opcheck(torch.ops.fusedpar.qkv_all_to_all_wait.default, (t.signal_ptrs, t.counters, 0, 1))
    meta = uops.o_meta(ucfg.INTERPRETER_O_CONFIG)
    torch.library.opcheck(torch.ops.fusedpar.all_to_all_o_proj.default, (x, w, *tables, meta))
    out = torch.empty(5, 40)
    torch.library.opcheck(torch.ops.fusedpar.all_to_all_o_proj_out.default, (x, w, out, *tables, meta))


def test_torch_compile_sees_the_ops():
    gen = torch.Generator().manual_seed(34)
    x = torch.randn(5, 24, generator=gen)
    w = _weight(40, 24, torch.float32, gen, "row_view")
    w_o = _weight(16, 40, torch.float32, gen, "col_view")
    tq = EmulatedWorld(1, 8192)[0]
    to = EmulatedWorld(1, 8192)[0]

    def f(a):
        return all_to_all_o_proj(qkv_all_to_all(a, w, tq, options=FUSED), w_o, to, options=FUSED) * 2.0

    # aot_eager: the graph is captured (fullgraph: no break at the ops) but not code-generated.
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    ref = 2.0 * ((x.double() @ w.double().T) @ w_o.double().T)
    assert_close(compiled(x), ref, dtype=torch.float32)
    assert tq.epoch() == 1 and to.epoch() == 1


def test_fake_impls_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    t = EmulatedWorld(1, 1024)[0]
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(1000, 8192, dtype=torch.bfloat16)
        w = torch.empty(4 * 2560, 8192, dtype=torch.bfloat16)
        tables = (t.buffer, t.buffer_ptrs, t.signal_ptrs, t.counters, 0, 4, 64, True)
        r = torch.ops.fusedpar.qkv_all_to_all(x, w, *tables, [0] * 6)
        assert r.shape == (4000, 2560) and r.dtype == torch.bfloat16
        a = torch.empty(4000, 2048, dtype=torch.bfloat16)
        wo = torch.empty(8192, 8192, dtype=torch.bfloat16)
        o = torch.ops.fusedpar.all_to_all_o_proj(a, wo, *tables, [0] * 10)
        assert o.shape == (1000, 8192)


def test_argument_errors():
    t2 = EmulatedWorld(2, 1024)[0]
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="not a multiple of the SP size"):
        qkv_all_to_all(x, torch.randn(5, 8), t2, options=FUSED)
    with pytest.raises(ValueError, match="disagree on d"):
        qkv_all_to_all(x, torch.randn(6, 9), t2, options=FUSED)
    with pytest.raises(TypeError, match="share one dtype"):
        qkv_all_to_all(x, torch.randn(6, 8).half(), t2, options=FUSED)
    with pytest.raises(ValueError, match=r"needs \d+ bytes"):
        qkv_all_to_all(torch.randn(100, 8), torch.randn(64, 8), t2, options=FUSED)
    with pytest.raises(ValueError, match="max_blocks >= 2"):
        qkv_all_to_all(x, torch.randn(6, 8), EmulatedWorld(2, 1024, max_blocks=1)[0], options=FUSED)
    with pytest.raises(ValueError, match="not divisible by the SP size"):
        all_to_all_o_proj(torch.randn(5, 8), torch.randn(3, 16), t2, options=FUSED)
    with pytest.raises(ValueError, match="W\\*C"):
        all_to_all_o_proj(torch.randn(4, 8), torch.randn(3, 8), t2, options=FUSED)
    with pytest.raises(ValueError, match="out must be"):
        all_to_all_o_proj(torch.randn(4, 8), torch.randn(3, 16), t2, options=FUSED, out=torch.empty(3, 3))
    with pytest.raises(ValueError, match="nothing to do"):
        launch_qkv_all_to_all(x, torch.randn(6, 8), t2, send_ready=False, produce=False, wait=False)
    with pytest.raises(ValueError, match="inputs"):
        qkv_all_to_all_emulated(EmulatedWorld(2, 1024), [x], [x])
    with pytest.raises(RuntimeError, match="timed out"):
        t2.counters[2] = 1
        u.check_status(t2)


def test_timeline_argument_errors():
    t2 = EmulatedWorld(2, 4096)[0]
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    with pytest.raises(ValueError, match="int64"):
        launch_qkv_all_to_all(x, w, t2, timeline=torch.zeros(64, 4))
    with pytest.raises(ValueError, match=r"has 4 elements; this launch has \d+ programs x 4 points"):
        launch_qkv_all_to_all(x, w, t2, timeline=torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="times the produce phase"):
        launch_qkv_all_to_all(x, w, t2, send_ready=False, produce=False, wait=True,
                              timeline=torch.zeros(64, 4, dtype=torch.int64))
    assert INTERPRETED  # CPU tests run on the interpreter (tests/conftest.py)
    with pytest.raises(ValueError, match="globaltimer"):
        launch_qkv_all_to_all(x, w, t2, timeline=torch.zeros(64, 4, dtype=torch.int64))
    assert t2.epoch() == 0  # rejected before any launch


def test_timeline_summary_phases():
    # Three programs that ran (ns), one row still poisoned (-1: a program that never ran).
    rows = [
        [1_000, 51_000, 251_000, 252_000],   # waited 50 us for READY, 200 us of tiles
        [3_000, 51_000, 241_000, 400_000],   # the waiter: 159 us for the slowest peer's DONE
        [2_000, 52_000, 262_000, 263_000],
        [-1, -1, -1, -1],
    ]
    got = ulaunch.qkv_timeline_summary(torch.tensor(rows, dtype=torch.int64))
    want = {"programs": 3.0, "enter_spread_us": 2.0, "ready_wait_median_us": 50.0, "ready_wait_max_us": 50.0,
            "gemm_median_us": 200.0, "gemm_max_us": 210.0, "done_wait_us": 159.0, "total_us": 399.0}
    assert got == pytest.approx(want)
    assert ulaunch.qkv_timeline_summary(torch.tensor(rows).flatten())["programs"] == 3.0  # flat [P * 4] works too
    with pytest.raises(ValueError, match="no program wrote"):
        ulaunch.qkv_timeline_summary(torch.full((5, 4), -1, dtype=torch.int64))
    with pytest.raises(ValueError, match="out of order"):
        ulaunch.qkv_timeline_summary(torch.tensor([[5, 4, 6, 7]]))


def test_empty_step():
    t = EmulatedWorld(2, 1024)[0]
    v = qkv_all_to_all(torch.empty(0, 8), torch.randn(6, 8), t, options=FUSED)
    assert v.shape == (0, 3) and t.epoch() == 0
    o = all_to_all_o_proj(torch.empty(0, 4), torch.randn(5, 8), t, options=FUSED)
    assert o.shape == (0, 5) and t.epoch() == 0


# ================================================================================ GPU (torchrun)

LLAMA = {"hidden": 8192, "heads": 64, "kv_heads": 8, "head_dim": 128}
GPU_MAX_TOKENS = 1024


def _gpu_dims(W: int) -> dict:
    hd = LLAMA["head_dim"]
    q = LLAMA["heads"] // W
    kv = max(1, LLAMA["kv_heads"] // W)  # kv heads duplicated per block when W > h_kv
    return {"d": LLAMA["hidden"], "blk": (q + 2 * kv) * hd, "C": q * hd}


@pytest.fixture(scope="module")
def gpu_world(nccl_world):
    return world_group_or_skip(nccl_world)


@pytest.fixture(scope="module")
def gpu_ws(gpu_world):
    W = gpu_world.size()
    dims = _gpu_dims(W)
    qkv = SymmetricWorkspace(gpu_world, qkv_workspace_bytes(GPU_MAX_TOKENS, dims["blk"], W, torch.bfloat16) + 4096)
    o = SymmetricWorkspace(gpu_world, o_proj_workspace_bytes(GPU_MAX_TOKENS, dims["C"], W, torch.bfloat16) + 4096)
    return SimpleNamespace(qkv=qkv, o=o, dims=dims, W=W, group=SimpleNamespace(size=W, pg=gpu_world))


def _rank_randn(shape, salt: int, scale: float = 1.0) -> torch.Tensor:
    import torch.distributed as dist

    g = torch.Generator(device="cuda").manual_seed(7919 * dist.get_rank() + salt)
    return torch.randn(shape, generator=g, device="cuda") * scale


def _gpu_qkv_operands(ws, m: int, salt: int):
    d, blk, W = ws.dims["d"], ws.dims["blk"], ws.W
    x = (_rank_randn((m, d), salt) + 0.1).to(torch.bfloat16)
    base = _rank_randn((W * blk, d + 64), salt + 1, 1 / math.sqrt(d)).to(torch.bfloat16)
    return x, base.narrow(1, 64, d)  # a column view: stride(0) = d + 64 (shift-style strided weight)


def _gpu_o_operands(ws, m: int, salt: int):
    C, d, W = ws.dims["C"], ws.dims["d"], ws.W
    attn = (_rank_randn((W * m, C), salt) + 0.1).to(torch.bfloat16)
    w_o = _rank_randn((d, W * C), salt + 1, 1 / math.sqrt(W * C)).to(torch.bfloat16)
    return attn, w_o


def _qkv_err(got, x, w, ws, what) -> str | None:
    ref = comm.seq_to_head_all_to_all(torch.nn.functional.linear(x.double(), w.double()), ws.group)
    try:
        assert_close(got, ref, dtype=torch.bfloat16, name=what)
    except AssertionError as e:
        return str(e)
    return None


def _o_err(got, attn, w_o, ws, what) -> str | None:
    ref = torch.nn.functional.linear(comm.head_to_seq_all_to_all(attn.double(), ws.group), w_o.double())
    try:
        assert_close(got, ref, dtype=torch.bfloat16, name=what)
    except AssertionError as e:
        return str(e)
    return None


def _status_err(ws) -> str | None:
    for name in ("qkv", "o"):
        if getattr(ws, name).table.status() != 0:
            return f"{name} workspace: a flag wait timed out"
    return None


def _assert_ok_on_all_ranks(errors: list[str], ws, limit: int | None = None) -> None:
    """Add a timed-out flag wait to `errors`, then assert (every rank together) that none has any."""
    err = _status_err(ws)
    if err:
        errors.append(err)
    assert all_ranks_ok(not errors), "\n".join(errors[:limit])


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 13, 256, 1024])
def test_gpu_qkv_matches_fp64_and_plain(gpu_world, gpu_ws, m):
    errors = []
    x, w = _gpu_qkv_operands(gpu_ws, m, salt=m)
    blk, W = gpu_ws.dims["blk"], gpu_ws.W
    region = qkv_workspace_bytes(m, blk, W, torch.bfloat16)
    buf = gpu_ws.qkv.table.buffer
    buf.fill_(0xFF)  # NaN everywhere: peers write only after our READY, which follows this fill
    before = gpu_ws.qkv.table.epoch()
    got = qkv_all_to_all(x, w, gpu_ws.qkv, options=FUSED)
    torch.cuda.synchronize()
    if gpu_ws.qkv.table.epoch() != before + 1:
        errors.append(f"epoch {before} -> {gpu_ws.qkv.table.epoch()}: not the kernel path")
    if got.data_ptr() != buf.data_ptr():
        errors.append("fused path did not return the receive buffer view")
    if not bool((buf[region:] == 0xFF).all()):
        errors.append("wrote past the receive region")
    if got.isnan().any():
        errors.append(f"m={m}: NaN in the receive buffer")
    err = _qkv_err(got.clone(), x, w, gpu_ws, f"qkv m={m} vs fp64")
    if err:
        errors.append(err)
    plain = qkv_all_to_all(x, w, None, gpu_ws.group, options=PLAIN)
    rel = ((got.float() - plain.float()).abs().max() / plain.float().abs().max()).item()
    if rel > 2e-2:
        errors.append(f"qkv m={m}: rel diff {rel:.3g} vs the plain bf16 path")
    _assert_ok_on_all_ranks(errors, gpu_ws)


@pytest.mark.gpu
@pytest.mark.parametrize("flatten", [True, False], ids=["flat", "nested"])
@pytest.mark.parametrize("m", [13, 1024])
def test_gpu_qkv_tma_matches_fp64(gpu_world, gpu_ws, m, flatten):
    """The TMA mainloop (flattened or nested tile loop; one column block or split 256 + 64 tiles) on the
    shift-style column-view weight."""
    errors = []
    x, w = _gpu_qkv_operands(gpu_ws, m, salt=31 * m + flatten)
    assert tma_compatible(x, w)
    gpu_ws.qkv.table.buffer.fill_(0xFF)
    for cfg in (GemmConfig(128, 128, 64, 8, 8, 4, tma=True, flatten=flatten),
                GemmConfig(128, 256, 64, 8, 8, 3, tma=True, flatten=flatten),
                GemmConfig(64, 256, 64, 8, 4, 4, tma=True, flatten=flatten, block_n2=64)):
        got = qkv_all_to_all(x, w, gpu_ws.qkv, options=UlyssesOptions(path="fused", qkv_config=cfg))
        torch.cuda.synchronize()
        if got.isnan().any():
            errors.append(f"m={m} {cfg}: NaN in the receive buffer")
        err = _qkv_err(got.clone(), x, w, gpu_ws, f"qkv m={m} {cfg} vs fp64")
        if err:
            errors.append(err)
        gpu_ws.qkv.table.buffer.fill_(0xFF)  # the next call's READY orders this fill before peers' stores
    _assert_ok_on_all_ranks(errors, gpu_ws)


@pytest.mark.gpu
def test_gpu_qkv_timeline_stamps_every_program_and_keeps_the_result(gpu_world, gpu_ws):
    errors = []
    m = 1024
    x, w = _gpu_qkv_operands(gpu_ws, m, salt=4242)
    num_sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    timeline = torch.full((num_sms + 8, 4), -1, dtype=torch.int64, device=x.device)  # 8 rows no program owns
    gpu_ws.qkv.table.buffer.fill_(0xFF)
    launch_qkv_all_to_all(x, w, gpu_ws.qkv.table, timeline=timeline)
    got = qkv_recv_view(gpu_ws.qkv, m, gpu_ws.dims["blk"], x.dtype)
    torch.cuda.synchronize()
    err = _qkv_err(got.clone(), x, w, gpu_ws, "qkv with timeline vs fp64")
    if err:
        errors.append(err)
    written = (timeline >= 0).all(dim=1)
    if not bool((written | (timeline == -1).all(dim=1)).all()):
        errors.append("a program wrote only some of its timeline points")
    if not bool(written[:num_sms].all()) or bool(written[num_sms:].any()):
        errors.append(f"programs that stamped: {written.nonzero().flatten().tolist()}, want 0..{num_sms - 1}")
    try:
        s = ulaunch.qkv_timeline_summary(timeline)
        if s["programs"] != num_sms or not 0 < s["gemm_median_us"] <= s["total_us"] < 1e6:
            errors.append(f"implausible timeline summary {s}")
    except ValueError as e:
        errors.append(str(e))
    _assert_ok_on_all_ranks(errors, gpu_ws)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 13, 256, 1024])
def test_gpu_o_proj_matches_fp64_and_plain(gpu_world, gpu_ws, m):
    errors = []
    attn, w_o = _gpu_o_operands(gpu_ws, m, salt=100 + m)
    gpu_ws.o.table.buffer.fill_(0xFF)
    out = torch.full((m, gpu_ws.dims["d"]), float("nan"), dtype=torch.bfloat16, device="cuda")
    all_to_all_o_proj(attn, w_o, gpu_ws.o, options=FUSED, out=out)
    torch.cuda.synchronize()
    if out.isnan().any():
        errors.append(f"m={m}: NaN in the output")
    err = _o_err(out, attn, w_o, gpu_ws, f"o_proj m={m} vs fp64")
    if err:
        errors.append(err)
    plain = all_to_all_o_proj(attn, w_o, None, gpu_ws.group, options=PLAIN)
    rel = ((out.float() - plain.float()).abs().max() / plain.float().abs().max()).item()
    if rel > 2e-2:
        errors.append(f"o_proj m={m}: rel diff {rel:.3g} vs the plain bf16 path")
    _assert_ok_on_all_ranks(errors, gpu_ws)


@pytest.mark.gpu
def test_gpu_wait_false_then_wait_and_routing(gpu_world, gpu_ws):
    errors = []
    x, w = _gpu_qkv_operands(gpu_ws, 64, salt=5)
    got = qkv_all_to_all(x, w, gpu_ws.qkv, options=FUSED, wait=False)
    qkv_all_to_all_wait(gpu_ws.qkv)
    err = _qkv_err(got.clone(), x, w, gpu_ws, "qkv wait=False + qkv_all_to_all_wait")
    if err:
        errors.append(err)
    for m in (8, 512):  # whatever the routing constants pick, the answer is the same
        x, w = _gpu_qkv_operands(gpu_ws, m, salt=50 + m)
        before = gpu_ws.qkv.table.epoch()
        got = qkv_all_to_all(x, w, gpu_ws.qkv, gpu_ws.group)
        fused = gpu_ws.qkv.table.epoch() == before + 1
        if fused != in_ranges(m, thresholds(x.device, gpu_ws.W).qkv_fused_rows):
            errors.append(f"qkv m={m}: routed fused={fused} against routing.thresholds' qkv_fused_rows")
        err = _qkv_err(got.clone(), x, w, gpu_ws, f"routed qkv m={m}")
        if err:
            errors.append(err)
        attn, w_o = _gpu_o_operands(gpu_ws, m, salt=60 + m)
        err = _o_err(all_to_all_o_proj(attn, w_o, gpu_ws.o, gpu_ws.group), attn, w_o, gpu_ws, f"routed o m={m}")
        if err:
            errors.append(err)
    assert all_ranks_ok(not errors), "\n".join(errors)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay(gpu_world, gpu_ws):
    # Three qkv calls (an ODD number per replay: the single-slot design must not care) and one
    # o_proj captured once, replayed with fresh inputs; epochs advance on the device.
    m = 96
    qkv_ops = [_gpu_qkv_operands(gpu_ws, m, salt=300 + i) for i in range(3)]
    attn, w_o = _gpu_o_operands(gpu_ws, m, salt=400)
    out = torch.empty((m, gpu_ws.dims["d"]), dtype=torch.bfloat16, device="cuda")
    for x, w in qkv_ops:  # compile outside the capture
        qkv_all_to_all(x, w, gpu_ws.qkv, options=FUSED)
    all_to_all_o_proj(attn, w_o, gpu_ws.o, options=FUSED, out=out)
    torch.cuda.synchronize()
    e_q, e_o = gpu_ws.qkv.table.epoch(), gpu_ws.o.table.epoch()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        copies = [qkv_all_to_all(x, w, gpu_ws.qkv, options=FUSED).clone() for x, w in qkv_ops]
        all_to_all_o_proj(attn, w_o, gpu_ws.o, options=FUSED, out=out)
    torch.cuda.synchronize()
    errors = []
    for rep in range(3):
        for i, (x, _) in enumerate(qkv_ops):
            x.copy_((_rank_randn(x.shape, 1000 * rep + i) + 0.1).to(x.dtype))
        attn.copy_((_rank_randn(attn.shape, 1000 * rep + 7) + 0.1).to(attn.dtype))
        graph.replay()
        torch.cuda.synchronize()
        for i, ((x, w), c) in enumerate(zip(qkv_ops, copies, strict=True)):
            err = _qkv_err(c, x, w, gpu_ws, f"replay {rep} qkv call {i}")
            if err:
                errors.append(err)
        err = _o_err(out, attn, w_o, gpu_ws, f"replay {rep} o_proj")
        if err:
            errors.append(err)
        if (gpu_ws.qkv.table.epoch(), gpu_ws.o.table.epoch()) != (e_q + 3 * (rep + 1), e_o + rep + 1):
            errors.append(f"replay {rep}: epochs {gpu_ws.qkv.table.epoch()}, {gpu_ws.o.table.epoch()}")
    _assert_ok_on_all_ranks(errors, gpu_ws, limit=6)


@pytest.mark.gpu
def test_gpu_ptx_has_system_scope_flags_and_pipelined_loads(gpu_world, gpu_ws):
    m = 1024
    x, w = _gpu_qkv_operands(gpu_ws, m, salt=9)
    kq = launch_qkv_all_to_all(x, w, gpu_ws.qkv.table)
    attn, w_o = _gpu_o_operands(gpu_ws, m, salt=10)
    out = torch.empty((m, gpu_ws.dims["d"]), dtype=torch.bfloat16, device="cuda")
    ko = launch_all_to_all_o_proj(attn, w_o, gpu_ws.o.table, out)
    torch.cuda.synchronize()
    problems = []
    for name, k in (("qkv", kq), ("o_proj", ko)):
        ptx = k.asm["ptx"]
        for what, needle in (
            ("system-scope release", "sys.release"),
            ("system-scope acquire", "sys.acquire"),
            ("system-scope acq_rel retire", "sys.acq_rel"),
            ("pipelined (cp.async) operand loads", "cp.async"),
            ("wgmma", "wgmma"),
        ):
            if needle not in ptx:
                problems.append(f"{name}: PTX lacks {what}")
    assert all_ranks_ok(not problems), problems


@pytest.mark.gpu
def test_gpu_env_multicast_off(gpu_world):
    assert os.environ.get("NCCL_NVLS_ENABLE") == "0" and os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST") == "1"
