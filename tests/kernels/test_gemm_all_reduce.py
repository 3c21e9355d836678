"""Row-parallel GEMM + all-reduce (fusedpar.kernels.gemm_all_reduce): CPU emulation and GPU.

CPU: every emulated rank (EmulatedWorld, Triton interpreter, fp16/fp32) runs the real kernel,
phase by phase; random inputs, odd shapes (M = 1, 7, 33; N and K not multiples of the tiles),
column-view (strided) weights, NaN-poisoned outputs and workspaces, a float64 reference of the
full sum with a per-element bound derived from the kernel's roundings, bitwise-identical outputs
on every rank, and the protocol itself: flag waits that really gate, double buffering against a
slow rank, epochs that advance once per launch, row chunking, the router's choices.
GPU: `torchrun --nproc-per-node 4 -m pytest -m gpu tests/kernels/test_gemm_all_reduce.py`:
bf16 on a real SymmetricWorkspace, Llama-like shapes, eager and CUDA-graph replay, against
F.linear + dist.all_reduce in fp32; every wait is bounded (a hang becomes a failed check).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fusedpar.collectives.symmetric import COUNTER_EPOCH, EmulatedWorld, SymmetricWorkspace
from fusedpar.kernels import gemm_all_reduce as gar
from fusedpar.kernels import routing
from fusedpar.kernels._host import INTERPRETED
from fusedpar.kernels.gemm import GemmConfig, pick_config
from fusedpar.kernels.gemm_all_reduce import (
    FusedConfig,
    GemmAllReduceOptions,
    choose_path,
    fused_plan,
    gemm_all_reduce,
    launch_gemm_all_reduce,
)
from fusedpar.testing.dist import TwinRankGroup
from fusedpar.testing.gemm_all_reduce_emulation import gemm_all_reduce_emulated
from fusedpar.testing.gpu import all_ranks_ok, world_group_or_skip
from fusedpar.testing.numerics import poison_
from tests.profile import examples

CPU_DTYPES = (torch.float16, torch.float32)
# Unit roundoff (half an ulp, relative) of each dtype: the bound of one round-to-nearest.
_U = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or INTERPRETED),
    reason="no CUDA and fusedpar.kernels.gemm_all_reduce was imported without TRITON_INTERPRET=1",
)


def _forced(path: str, **kw) -> GemmAllReduceOptions:
    """Options that force the router onto `path`."""
    return GemmAllReduceOptions(path=path, **kw)


def _weight(kind: str, n: int, k: int, dtype, gen, blocks: int = 3) -> torch.Tensor:
    """[n, k] with entries ~ N(0, 1/k), stored as `kind` (col_view: the row-parallel shift view)."""
    scale = 1.0 / math.sqrt(max(k, 1))
    if kind == "contiguous":
        return (torch.randn((n, k), generator=gen) * scale).to(dtype)
    if kind == "col_view":  # columns [k, 2k) of [n, blocks*k]: stride(0) = blocks*k
        return (torch.randn((n, blocks * k), generator=gen) * scale).to(dtype).narrow(1, k, k)
    if kind == "row_view":
        return (torch.randn((blocks * n, k), generator=gen) * scale).to(dtype).narrow(0, n, n)
    if kind == "transposed":
        return (torch.randn((k, n), generator=gen) * scale).to(dtype).T
    raise ValueError(kind)


def _inputs(world: int, m: int, n: int, k: int, dtype, seed: int, kind: str = "col_view"):
    g = torch.Generator().manual_seed(seed)
    xs = [(torch.randn((m, k), generator=g) + 0.1).to(dtype) for _ in range(world)]
    ws = [_weight(kind, n, k, dtype, g) for _ in range(world)]
    return xs, ws


def _poisoned(xs, ws):
    return [poison_(torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype)) for x, w in zip(xs, ws, strict=True)]


def check_sum(outs, xs, ws, *, partial_dtype=None, name="gemm_all_reduce", k_ranges=None, out_dtype=None) -> None:
    """Every rank: finite, identical bits, and |out - sum_r x_r w_r^T| within the kernel's rounding bound.

    Per element, with p_r = x_r w_r^T exact (float64), s = sum_r p_r and A = sum_r |x_r| |w_r|^T:
        u_p * sum_r |p_r|        rounding each fp32 partial to the partial dtype
      + (K + W + 2) 2^-24 A      fp32 accumulation of the GEMM (K terms) and of the rank sum (W)
      + u_o * (|s| + the above)  the final rounding to the output dtype
    (times 1.01 for the bound's own rounding), the textbook worst case of the kernel's arithmetic.
    out_dtype: the outputs' dtype where it is not xs's (FP8: xs and ws are the dequantised e4m3 operands).
    k_ranges: split-K's K ranges [(start, stop)]: each range's partial is rounded (sum_r sum_range
    |p_r,range| in the first term) and the rank sum has W x len(k_ranges) terms.
    """
    dtype = out_dtype or xs[0].dtype
    pdt = partial_dtype or dtype
    parts = [x.double() @ w.double().T for x, w in zip(xs, ws, strict=True)]
    ref = torch.stack(parts).sum(0)
    if k_ranges is None:
        abs_parts = torch.stack([p.abs() for p in parts]).sum(0)
    else:
        abs_parts = sum((x[:, a:b].double() @ w[:, a:b].double().T).abs()
                        for x, w in zip(xs, ws, strict=True) for a, b in k_ranges)
    a = sum(x.double().abs() @ w.double().abs().T for x, w in zip(xs, ws, strict=True))
    k, world = xs[0].shape[1], len(xs)
    inner = _U[pdt] * abs_parts + (k + world * len(k_ranges or [0]) + 2) * 2.0**-24 * a
    allowed = 1.01 * (inner + _U[dtype] * (ref.abs() + inner)) + 1e-30
    for r, out in enumerate(outs):
        assert out.shape == ref.shape and out.dtype == dtype, (out.shape, out.dtype)
        assert not out.isnan().any(), f"{name}: rank {r} has NaN (an element never written, or a stale read)"
        assert torch.equal(out, outs[0]), f"{name}: rank {r}'s result differs from rank 0's: ranks would diverge"
    err = (outs[0].double() - ref).abs()
    bad = err > allowed
    if bad.any():
        i = int((err - allowed).argmax())
        idx = tuple(int(v) for v in torch.unravel_index(torch.tensor(i), ref.shape))
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {ref.numel()} elements outside the bound; worst at {idx}: "
            f"got {outs[0].reshape(-1)[i].item()!r}, want {ref.reshape(-1)[i].item()!r}, "
            f"|err| {err.reshape(-1)[i].item():.3g} > {allowed.reshape(-1)[i].item():.3g}"
        )


def _world(world_size: int, nbytes: int = 1 << 20, max_blocks: int = 64) -> EmulatedWorld:
    return EmulatedWorld(world_size, nbytes, max_blocks=max_blocks)


# Shapes against 32x32x32 interpreter tiles: M = 1, 7, 33; N and K ragged (K = 64: the even-K path).
# Every shape has >= 4 tiles, so two-shot runs on 4 ranks too.
SHAPES = [(1, 100, 40), (7, 130, 24), (33, 72, 64)]


# --------------------------------------------------------------------------- CPU emulation


@pytest.mark.parametrize("path", ["one_shot", "two_shot"])
@pytest.mark.parametrize(("world_size", "dtype"), [(2, torch.float16), (4, torch.float16), (3, torch.float32)],
                         ids=str)
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_fused_paths_sum_over_ranks(path, world_size, dtype, m, n, k):
    world = _world(world_size)
    xs, ws = _inputs(world_size, m, n, k, dtype, seed=m * 1000 + n + k + world_size)
    outs = gemm_all_reduce_emulated(world, xs, ws, path=path, outs=_poisoned(xs, ws))
    check_sum(outs, xs, ws, name=f"{path} W={world_size} [{m},{n}] K={k} {dtype}")
    assert all(world[r].epoch() == 1 and world[r].status() == 0 for r in range(world_size))


@pytest.mark.parametrize("path", ["one_shot", "two_shot"])
def test_fp32_partials_on_three_ranks(path):
    # World 3: not a power of two (masked peer lanes); fp32 partials: only the final rounding of
    # the fp16 output remains (the bound drops the partial-rounding term to fp32's).
    world = _world(3)
    xs, ws = _inputs(3, 33, 100, 40, torch.float16, seed=5)
    outs = gemm_all_reduce_emulated(world, xs, ws, path=path, outs=_poisoned(xs, ws), partial_dtype=torch.float32)
    check_sum(outs, xs, ws, partial_dtype=torch.float32)


@pytest.mark.parametrize("path", ["one_shot", "two_shot"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_staggered_schedule_multi_phase_launches(path, world_size):
    # one_shot: the last rank runs torch.ops.fusedpar.gemm_all_reduce_out, GEMM + flags + wait +
    # reduce in one launch (the GPU code path); two_shot: the last rank reduces and copies in one
    # launch with live flags.
    world = _world(world_size)
    xs, ws = _inputs(world_size, 33, 72, 40, torch.float16, seed=11)
    outs = gemm_all_reduce_emulated(world, xs, ws, path=path, outs=_poisoned(xs, ws), schedule="staggered")
    check_sum(outs, xs, ws)


@pytest.mark.parametrize(("path", "kind"), [("one_shot", "transposed"), ("two_shot", "row_view"),
                                            ("two_shot", "contiguous")])
def test_other_weight_layouts_strided_x_and_out_window(path, kind):
    m, n, k = 20, 70, 40
    g = torch.Generator().manual_seed(3)
    xs = [(torch.randn((m, 2 * k + 3), generator=g)).to(torch.float32).narrow(1, 3, k) for _ in range(2)]
    ws = [_weight(kind, n, k, torch.float32, g) for _ in range(2)]
    bigs = [poison_(torch.empty((m + 2, 3 * n))) for _ in range(2)]
    outs = [b[1 : m + 1, n : 2 * n] for b in bigs]
    gemm_all_reduce_emulated(_world(2), xs, ws, path=path, outs=outs)
    check_sum(outs, xs, ws)
    for b in bigs:
        outside = torch.ones_like(b, dtype=torch.bool)
        outside[1 : m + 1, n : 2 * n] = False
        assert b[outside].isnan().all(), "kernel wrote outside its [M, N] output window"


def test_two_shot_row_chunks_and_epochs():
    # 4 tile rows x 2 tile columns; a 16 KiB slot holds 2 tile rows (8 KiB of fp16 partials + 8 KiB of
    # results), so the call runs as 2 launches (2 epochs); a second call alternates the slots again.
    m, n, k, W = 100, 64, 40, 2
    world = EmulatedWorld(W, 32 * 1024, max_blocks=64)
    plan, why = fused_plan("two_shot", m, n, k, torch.float16, world[0])
    assert plan is not None, why
    assert plan.chunks == ((0, 64), (64, 36))
    for call in (1, 2):
        xs, ws = _inputs(W, m, n, k, torch.float16, seed=call)
        outs = gemm_all_reduce_emulated(world, xs, ws, path="two_shot", outs=_poisoned(xs, ws))
        check_sum(outs, xs, ws, name=f"chunked call {call}")
        assert [world[r].epoch() for r in range(W)] == [2 * call] * W
    with pytest.raises(ValueError, match="one-chunk plan"):
        launch_gemm_all_reduce(xs[0], ws[0], world[0], outs[0], reduce=False, copy=False)


@pytest.mark.parametrize("path", ["one_shot", "two_shot"])
def test_double_buffering_protects_a_slow_rank(path):
    # Rank 0 finishes call 1 and starts call 2 (pushing partials into rank 1's workspace) before
    # rank 1 has finished reading call 1. Epoch-parity slots must keep call 1 intact for rank 1.
    W, m, n, k = 2, 33, 72, 40
    world = _world(W)
    c1 = _inputs(W, m, n, k, torch.float16, seed=21)
    c2 = _inputs(W, m, n, k, torch.float16, seed=22)
    o1, o2 = _poisoned(*c1), _poisoned(*c2)

    def run(call, r, **phases):
        xs, ws = call
        outs = o1 if call is c1 else o2
        flags = {"gemm": False, "reduce": False, "copy": False, **phases}
        launch_gemm_all_reduce(xs[r], ws[r], world[r], outs[r], path=path, **flags)

    last = "copy" if path == "two_shot" else "reduce"
    run(c1, 0, gemm=True)
    run(c1, 1, gemm=True)
    if path == "two_shot":
        run(c1, 0, reduce=True)
        run(c1, 1, reduce=True)
    run(c1, 0, **{last: True})  # rank 0 done with call 1
    run(c2, 0, gemm=True)  # ... and already pushing call 2
    run(c1, 1, **{last: True})  # slow rank 1 finishes call 1
    check_sum(o1, *c1, name="call 1")
    run(c2, 1, gemm=True)
    if path == "two_shot":
        run(c2, 1, reduce=True)
        run(c2, 0, reduce=True)
    run(c2, 1, **{last: True})
    run(c2, 0, **{last: True})
    check_sum(o2, *c2, name="call 2")
    assert [world[r].status() for r in range(W)] == [0, 0]
    assert [world[r].epoch() for r in range(W)] == [2, 2]


@pytest.mark.parametrize("path", ["one_shot", "two_shot"])
@pytest.mark.parametrize("use_flags", [True, False])
def test_flag_wait_really_gates_the_reduce(path, use_flags):
    # Rank 0 reduces before rank 1 ran its GEMM. With flags the interpreter's bounded spin times
    # out and says so; without flags rank 0 silently sums rank 1's poisoned (NaN) workspace.
    world = _world(2)
    xs, ws = _inputs(2, 33, 72, 40, torch.float32, seed=5)
    out = poison_(torch.empty((33, 72)))
    launch_gemm_all_reduce(xs[0], ws[0], world[0], out, path=path, reduce=False, copy=False, use_flags=use_flags)
    launch_gemm_all_reduce(xs[0], ws[0], world[0], out, path=path, gemm=False, copy=False, use_flags=use_flags)
    if use_flags:
        assert world[0].status() == 1, "rank 0 passed its flag wait although rank 1 never signalled"
    else:
        assert world[0].status() == 0 and out.isnan().any()


def test_copy_waits_for_the_owner():
    # Two-shot phase C must wait for the owner's reduce: rank 1 copies before rank 0 reduced.
    world = _world(2)
    xs, ws = _inputs(2, 33, 72, 40, torch.float32, seed=6)
    outs = _poisoned(xs, ws)
    for r in range(2):
        launch_gemm_all_reduce(xs[r], ws[r], world[r], outs[r], reduce=False, copy=False)
    launch_gemm_all_reduce(xs[1], ws[1], world[1], outs[1], gemm=False, copy=False)
    launch_gemm_all_reduce(xs[1], ws[1], world[1], outs[1], gemm=False, reduce=False)
    assert world[1].status() == 1


def test_emulated_driver_reports_a_missing_flag():
    world = _world(2)
    xs, ws = _inputs(2, 7, 72, 40, torch.float32, seed=7)
    # Ranks that disagree on the epoch (as if rank 1 had skipped a call) must not pass the waits.
    world[0].counters[COUNTER_EPOCH] = 1
    with pytest.raises(RuntimeError, match="never came"):
        gemm_all_reduce_emulated(world, xs, ws, path="one_shot")


@pytest.mark.parametrize("path", ["one_shot", "two_shot"])
def test_flags_off_is_correct_when_phased_and_touches_no_flag(path):
    world = _world(3)
    xs, ws = _inputs(3, 33, 100, 40, torch.float16, seed=8)
    outs = gemm_all_reduce_emulated(world, xs, ws, path=path, outs=_poisoned(xs, ws), use_flags=False)
    check_sum(outs, xs, ws)
    assert not any(s.any() for s in world.signals), "USE_FLAGS=False must not touch flag words"


def test_explicit_tilings_and_single_program():
    # GROUP_M=3 swizzle with ragged groups, 16x16 tiles, and num_sms=1 (one program does every
    # tile, then every reduce/copy step).
    xs, ws = _inputs(2, 40, 70, 40, torch.float16, seed=9)
    for cfg in (
        FusedConfig(GemmConfig(16, 16, 16, group_m=3, num_warps=4, num_stages=1), num_sms=4, comm_rows=4),
        FusedConfig(GemmConfig(32, 32, 32, group_m=2, num_warps=4, num_stages=1), num_sms=1, comm_rows=32),
    ):
        for path in ("one_shot", "two_shot"):
            outs = gemm_all_reduce_emulated(_world(2, 1 << 21, 256), xs, ws, path=path, outs=_poisoned(xs, ws),
                                            config=cfg)
            check_sum(outs, xs, ws, name=f"{path} {cfg}")


def test_gpu_tile_shapes_run_in_the_interpreter():
    # The GPU's decode and prefill tilings (16x64x256 and 128x256x64 with 16-row comm steps),
    # interpreted: index math of big tiles, ragged edges inside one tile, several comm steps.
    cases = [
        ("one_shot", (8, 150, 512), FusedConfig(GemmConfig(16, 64, 256, 8, 4, 5), num_sms=3, comm_rows=16)),
        ("two_shot", (150, 600, 64), FusedConfig(GemmConfig(128, 256, 64, 8, 8, 3), num_sms=3, comm_rows=16)),
    ]
    for path, (m, n, k), cfg in cases:
        xs, ws = _inputs(2, m, n, k, torch.float16, seed=m)
        outs = gemm_all_reduce_emulated(_world(2, 8 << 20), xs, ws, path=path, outs=_poisoned(xs, ws), config=cfg)
        check_sum(outs, xs, ws, name=f"{path} {cfg.gemm}")


# ------------------------------------------------------------------------------ split-K (one-shot)


def _k_ranges(k: int, block_k: int, split: int) -> list[tuple[int, int]]:
    """The kernel's K ranges: cdiv(k_tiles, split) steps of block_k each; ranges past K are empty."""
    per = math.ceil(math.ceil(k / block_k) / split) * block_k
    return [(a, min(k, a + per)) for a in range(0, k, per)]


# (m, n, k, split) against 32x32x32 tiles and 4 interpreter "SMs" (units wrap around the programs):
# K = 40 has 2 K steps, so split 3 leaves an empty third range; M = 33 has two tile rows.
def test_split_tile_gemm_config_is_refused():
    # GemmConfig.block_n2 (split tiles) is fusedpar.matmul's alone; the fused epilogue would drop it.
    cfg = FusedConfig(GemmConfig(32, 32, 32, 8, 4, 1, block_n2=16), num_sms=4, comm_rows=8)
    world = _world(2, 4 << 20, 64)
    xs, ws = _inputs(2, 7, 72, 64, torch.float32, seed=3)
    with pytest.raises(ValueError, match="block_n2=16"):
        gemm_all_reduce_emulated(world, xs, ws, path="two_shot", config=cfg)


SPLIT_CASES = [(1, 100, 40, 3), (7, 130, 96, 2), (33, 72, 64, 3), (16, 200, 160, 4)]


# The default profile runs each split case at one world size (all three sizes covered); --deep all pairs.
@pytest.mark.parametrize(("world_size", "dtype", "m", "n", "k", "split"), [
    pytest.param(world, dtype, *case, marks=() if (i + j) % 3 == 0 else pytest.mark.deep)
    for i, case in enumerate(SPLIT_CASES)
    for j, (world, dtype) in enumerate([(2, torch.float16), (3, torch.float32), (4, torch.float16)])], ids=str)
def test_split_k_one_shot_sums_every_range_of_every_rank(world_size, dtype, m, n, k, split):
    cfg = FusedConfig(GemmConfig(32, 32, 32, 8, 4, 1), num_sms=4, comm_rows=8, split_k=split)
    world = _world(world_size, 4 << 20, 64)
    xs, ws = _inputs(world_size, m, n, k, dtype, seed=m + n + k + split)
    outs = gemm_all_reduce_emulated(world, xs, ws, path="one_shot", outs=_poisoned(xs, ws), config=cfg)
    check_sum(outs, xs, ws, name=f"split {split} W={world_size} [{m},{n}] K={k}", k_ranges=_k_ranges(k, 32, split))
    assert all(world[r].epoch() == 1 and world[r].status() == 0 for r in range(world_size))
    # The residual epilogue on the split path: the same bits as the separate add.
    g = torch.Generator().manual_seed(k)
    res = (torch.randn((m, n), generator=g)).to(dtype)
    plain = gemm_all_reduce_emulated(world, xs, ws, path="one_shot", config=cfg)
    got = gemm_all_reduce_emulated(world, xs, ws, path="one_shot", outs=_poisoned(xs, ws), config=cfg,
                                   residuals=[res.clone() for _ in range(world_size)])
    for r in range(world_size):
        assert torch.equal(got[r], res + plain[r]), f"rank {r}"


def test_split_k_flag_wait_gates_every_range():
    # Rank 1 skipped its GEMM: rank 0's reducers must not pass (every tile waits for S x W words).
    cfg = FusedConfig(GemmConfig(32, 32, 32, 8, 4, 1), num_sms=4, comm_rows=8, split_k=2)
    world = _world(2, 4 << 20, 64)
    xs, ws = _inputs(2, 7, 72, 96, torch.float32, seed=3)
    out = poison_(torch.empty((7, 72)))
    launch_gemm_all_reduce(xs[0], ws[0], world[0], out, path="one_shot", reduce=False, config=cfg)
    launch_gemm_all_reduce(xs[0], ws[0], world[0], out, path="one_shot", gemm=False, config=cfg)
    assert world[0].status() == 1


def test_split_k_needs_separate_phases_in_the_interpreter():
    cfg = FusedConfig(GemmConfig(32, 32, 32, 8, 4, 1), num_sms=4, comm_rows=8, split_k=2)
    world = _world(1, 4 << 20, 64)
    xs, ws = _inputs(1, 7, 72, 96, torch.float32, seed=4)
    with pytest.raises(ValueError, match="separate launches"):
        launch_gemm_all_reduce(xs[0], ws[0], world[0], torch.empty((7, 72)), path="one_shot", config=cfg)
    plan, why = fused_plan("two_shot", 64, 72, 96, torch.float32, world[0], config=cfg)
    assert plan is None and "only on the one_shot path" in why


@pytest.mark.parametrize("split", [1, 3])
def test_one_shot_pushes_only_the_real_rows(split):
    # M = 5 rows in a 32-row tile: every peer's partial region must keep rows 5..31 untouched
    # (poisoned), i.e. only real rows crossed "NVLink".
    m, n, k, W = 5, 64, 96, 2
    cfg = FusedConfig(GemmConfig(32, 32, 32, 8, 4, 1), num_sms=4, comm_rows=8, split_k=split)
    world = _world(W, 4 << 20, 64)
    xs, ws = _inputs(W, m, n, k, torch.float32, seed=split)
    out = torch.empty((m, n))
    launch_gemm_all_reduce(xs[0], ws[0], world[0], out, path="one_shot", reduce=False, config=cfg)
    tiles = math.ceil(n / 32)
    slot = gar.slot_bytes_of(world[0])  # launch epoch 1: slot 1
    for q in range(W):
        region = world.buffers[q][slot:].view(torch.float32)[: W * split * tiles * 32 * 32]
        mine = region.view(W, split, tiles, 32, 32)[0]  # rank 0's partials in rank q's workspace
        assert mine[:, :, :m].isfinite().all(), "a real row was not pushed"
        assert mine[:, :, m:].isnan().all(), "a padding row was pushed"


def test_decode_split_rule():
    # Qwen3-32B's down (hidden 5120, K 6400): 80 tiles of 64 columns -> 40 x 3 units of 128 columns
    # at 1-2 rows; its o (K 2048) would get < 1024 of K per range at 3 and ties at 2; Llama's 8192
    # fills 128 SMs unsplit; larger steps, two-shot and the interpreter never split.
    qwen = gar.default_config("one_shot", 1, 5120, 6400, torch.bfloat16, torch.bfloat16, 132, interpret=False)
    assert (qwen.gemm.block_n, qwen.split_k) == (128, 3)
    assert gar.default_config("one_shot", 2, 5120, 6400, torch.bfloat16, torch.bfloat16, 132,
                              interpret=False).split_k == 3
    for args in (("one_shot", 8, 8192, 7168), ("one_shot", 1, 8192, 7168), ("one_shot", 1, 5120, 2048),
                 ("one_shot", 4, 5120, 6400), ("two_shot", 8, 5120, 6400)):
        assert gar.default_config(*args, torch.bfloat16, torch.bfloat16, 132, interpret=False).split_k == 1, args
    assert gar.default_config("one_shot", 1, 5120, 6400, torch.float16, torch.float16, 132,
                              interpret=True).split_k == 1
    assert FusedConfig.from_list(qwen.as_list()) == qwen
    assert FusedConfig.from_list(qwen.as_list()[:8]).split_k == 1


def test_decode_deep_k_rule():
    # One-shot decode of 17-32 rows on 16-bit inputs streams 256-deep K steps (as <= 16 rows do), with
    # the stages that fit; 33+ rows, fp32 inputs, the two-shot and the interpreter keep their tiling.
    def cfg(path, m, n=5120, k=6400, dtype=torch.bfloat16, interpret=False):
        return gar.default_config(path, m, n, k, dtype, dtype, 132, interpret=interpret).gemm

    for m in (17, 24, 32):
        for n, k in ((5120, 6400), (8192, 2048), (5120, 2048), (8192, 7168)):
            g = cfg("one_shot", m, n, k)
            assert (g.block_m, g.block_n, g.block_k, g.num_stages) == (32, 64, 256, 4), (m, n, k, g)
        assert cfg("one_shot", m, dtype=torch.float16).block_k == 256
        assert cfg("one_shot", m, dtype=torch.float32).block_k == 64
        assert cfg("two_shot", m).block_k == 128
        assert cfg("one_shot", m, dtype=torch.float16, interpret=True).block_k == 32
    for m in (16, 33, 64):
        assert cfg("one_shot", m) == pick_config(m, 5120, 6400, dtype=torch.bfloat16, out_dtype=torch.bfloat16,
                                                 num_sms=132, interpret=False), m


# ------------------------------------------------------------------------ residual epilogue


@pytest.mark.parametrize("path", ["one_shot", "two_shot"])
@pytest.mark.parametrize(("world_size", "dtype"), [(2, torch.float16), (3, torch.float32), (4, torch.float16)],
                         ids=str)
# The default profile runs every path, world size and schedule on the odd 7 x 130 x 24 shape; --deep all shapes.
@pytest.mark.parametrize(("m", "n", "k"), [pytest.param(*shape, marks=() if shape == SHAPES[1] else pytest.mark.deep)
                                           for shape in SHAPES])
@pytest.mark.parametrize("schedule", ["phased", "staggered"])
def test_residual_epilogue_equals_the_separate_add(path, world_size, dtype, m, n, k, schedule):
    """Fused: out = residual + sum_r x_r @ w_r^T in one call. Separate: the same fused GEMM +
    all-reduce, then torch's add. The epilogue rounds the sum first, as that path does: same bits."""
    xs, ws = _inputs(world_size, m, n, k, dtype, seed=m * 31 + n + world_size)
    g = torch.Generator().manual_seed(m + 5)
    residual = (torch.randn((m, n + 3), generator=g) * 3.0).to(dtype)[:, 1 : n + 1]  # a strided view
    world = _world(world_size)
    fused = gemm_all_reduce_emulated(world, xs, ws, path=path, outs=_poisoned(xs, ws), schedule=schedule,
                                     residuals=[residual] * world_size)
    plain = gemm_all_reduce_emulated(_world(world_size), xs, ws, path=path, outs=_poisoned(xs, ws))
    check_sum(plain, xs, ws, name=f"plain {path} W={world_size}")
    want = residual + plain[0]
    for r, out in enumerate(fused):
        assert not out.isnan().any(), f"rank {r}: unwritten output elements"
        assert torch.equal(out, want), (
            f"rank {r}: the residual epilogue differs from sum-then-add by "
            f"{(out.double() - want.double()).abs().max().item():.3g}")
    assert all(world[r].status() == 0 for r in range(world_size))


def test_router_adds_the_residual_on_every_path():
    """One rank: one_shot / two_shot (fused epilogue), local and unfused (a torch add after)."""
    t = _world(1)[0]
    m, n, k = 9, 72, 40
    xs, ws = _inputs(1, m, n, k, torch.float32, seed=4)
    res = torch.randn((m, n), generator=torch.Generator().manual_seed(5))
    plain = torch.nn.functional.linear(xs[0], ws[0])
    for path in ("one_shot", "two_shot", "local"):
        got = gemm_all_reduce(xs[0], ws[0], None, t, options=_forced(path), residual=res)
        torch.testing.assert_close(got, res + plain, rtol=1e-5, atol=1e-5, msg=lambda msg, p=path: f"{p}: {msg}")
    got = gemm_all_reduce(xs[0], ws[0], SimpleNamespace(size=2, pg=TwinRankGroup()), None, residual=res)
    assert torch.equal(got, res + 2.0 * plain)  # unfused: cuBLAS, all_reduce, then the add
    out = poison_(torch.empty((m, n)))
    assert gemm_all_reduce(xs[0], ws[0], None, t, options=_forced("one_shot"), residual=res, out=out) is out
    torch.testing.assert_close(out, res + plain, rtol=1e-5, atol=1e-5)
    # leading dims flatten for x and the residual alike
    got3 = gemm_all_reduce(xs[0].reshape(3, 3, k), ws[0], None, t, options=_forced("one_shot"),
                           residual=res.reshape(3, 3, n))
    assert got3.shape == (3, 3, n) and torch.allclose(got3.reshape(m, n), res + plain, rtol=1e-5, atol=1e-5)


def test_residual_argument_errors():
    t = _world(1)[0]
    x, w = torch.ones(4, 8, dtype=torch.float16), torch.ones(6, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="residual must be"):
        gemm_all_reduce(x, w, None, t, options=_forced("one_shot"), residual=torch.ones(4, 5, dtype=torch.float16))
    with pytest.raises(ValueError, match="residual must be"):
        launch_gemm_all_reduce(x, w, t, torch.empty(4, 6, dtype=torch.float16), path="one_shot",
                               residual=torch.ones(4, 6, dtype=torch.float32))


def test_registered_ops_with_residual_pass_opcheck():
    t = _world(1)[0]
    xs, ws = _inputs(1, 9, 40, 24, torch.float32, seed=22)
    res = torch.randn(9, 40)
    plan, _ = fused_plan("one_shot", 9, 40, 24, torch.float32, t)
    meta = (0, 1, t.buffer_bytes, t.max_blocks, "one_shot", False, plan.config.as_list(), True, res)
    args = (xs[0], ws[0], t.buffer_ptrs, t.signal_ptrs, t.counters)
    torch.library.opcheck(torch.ops.fusedpar.gemm_all_reduce.default, (*args, *meta))
    torch.library.opcheck(torch.ops.fusedpar.gemm_all_reduce_out.default, (*args, torch.empty((9, 40)), *meta))


# ---------------------------------------------------- one rank: the registered ops, one launch


@pytest.mark.parametrize("path", ["one_shot", "two_shot"])
def test_single_rank_public_api_runs_every_phase_in_one_launch(path):
    t = _world(1)[0]
    xs, ws = _inputs(1, 33, 72, 40, torch.float16, seed=12)
    out = gemm_all_reduce(xs[0], ws[0], None, t, options=_forced(path))
    check_sum([out], xs, ws)
    dst = poison_(torch.empty_like(out))
    assert gemm_all_reduce(xs[0], ws[0], None, t, options=_forced(path), out=dst) is dst
    assert torch.equal(dst, out)
    # Leading dims flatten; out keeps them.
    x3 = xs[0].reshape(3, 11, 40)
    out3 = gemm_all_reduce(x3, ws[0], None, t, options=_forced(path))
    assert out3.shape == (3, 11, 72) and torch.equal(out3.reshape(33, 72), out)
    assert t.epoch() == 3 and t.status() == 0
    assert gemm_all_reduce(xs[0][:0], ws[0], None, t, options=_forced(path)).shape == (0, 72) and t.epoch() == 3


@pytest.mark.parametrize("path", ["one_shot", "two_shot"])
def test_registered_ops_pass_opcheck(path):
    t = _world(1)[0]
    xs, ws = _inputs(1, 9, 40, 24, torch.float32, seed=13)
    plan, _ = fused_plan(path, 9, 40, 24, torch.float32, t)
    meta = (0, 1, t.buffer_bytes, t.max_blocks, path, False, plan.config.as_list(), True)
    args = (xs[0], ws[0], t.buffer_ptrs, t.signal_ptrs, t.counters)
    torch.library.opcheck(torch.ops.fusedpar.gemm_all_reduce.default, (*args, *meta))
    out = torch.empty((9, 40))
    torch.library.opcheck(torch.ops.fusedpar.gemm_all_reduce_out.default, (*args, out, *meta))


def test_traces_into_one_graph_node():
    t = _world(1)[0]
    xs, ws = _inputs(1, 9, 40, 24, torch.float32, seed=14)
    f = torch.compile(lambda x, w: gemm_all_reduce(x, w, None, t, options=_forced("two_shot")) * 2.0,
                      backend="aot_eager",
                      fullgraph=True)
    got = f(xs[0], ws[0])
    check_sum([got / 2.0], xs, ws)


def test_fake_impl_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    t = _world(1)[0]
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty((1000, 2048), dtype=torch.bfloat16)
        w = torch.empty((8192, 4 * 2048), dtype=torch.bfloat16).narrow(1, 2048, 2048)
        out = torch.ops.fusedpar.gemm_all_reduce(x, w, t.buffer_ptrs, t.signal_ptrs, t.counters, 0, 1,
                                                 t.buffer_bytes, t.max_blocks, "two_shot", False,
                                                 [128, 256, 64, 8, 8, 3, 132, 16], True)
        assert out.shape == (1000, 8192) and out.dtype == torch.bfloat16


# --------------------------------------------------------------------------- routing


def test_choose_path_by_size_and_room():
    big = _world(2, 1 << 22, max_blocks=512)[0]
    tiny = _world(2, 1024)[0]
    kw = {"options": GemmAllReduceOptions(one_shot_max_rows=8, two_shot_min_rows=64)}
    assert choose_path(4, 72, 40, torch.float16, 1, None, **kw) == "local"
    assert choose_path(4, 72, 40, torch.float16, 2, None, **kw) == "unfused"
    assert choose_path(4, 72, 40, torch.float16, 2, big, **kw) == "one_shot"
    assert choose_path(8, 72, 40, torch.float16, 2, big, **kw) == "one_shot"
    assert choose_path(9, 72, 40, torch.float16, 2, big, **kw) == "unfused"
    assert choose_path(64, 72, 40, torch.float16, 2, big, **kw) == "two_shot"
    assert choose_path(64, 72, 40, torch.float16, 2, tiny, **kw) == "unfused"  # no room: fall back
    assert choose_path(4, 72, 40, torch.float16, 4, big, **kw) == "unfused"  # workspace of another size
    assert choose_path(64, 72, 40, torch.int32, 2, big, **kw) == "unfused"
    # The routing table's thresholds are what the router uses by default.
    limit = routing.thresholds(big.device, 2).one_shot_max_rows
    assert choose_path(limit, 72, 40, torch.float16, 2, big) == "one_shot"


def test_auto_route_runs_the_fused_one_shot_with_a_live_peer():
    world = _world(2)
    xs, ws = _inputs(2, 7, 72, 40, torch.float16, seed=15)
    outs = _poisoned(xs, ws)
    launch_gemm_all_reduce(xs[1], ws[1], world[1], outs[1], path="one_shot", reduce=False)  # the peer's GEMM
    group = SimpleNamespace(size=2, pg=None)
    outs[0] = gemm_all_reduce(xs[0], ws[0], group, world[0])  # auto -> one_shot (7 <= 64 rows)
    launch_gemm_all_reduce(xs[1], ws[1], world[1], outs[1], path="one_shot", gemm=False)
    check_sum(outs, xs, ws)
    assert world[0].epoch() == 1


def test_fallback_is_cublas_plus_nccl():
    pg = TwinRankGroup()
    group = SimpleNamespace(size=2, pg=pg)
    xs, ws = _inputs(1, 20, 72, 40, torch.float32, seed=16)
    want = 2.0 * torch.nn.functional.linear(xs[0], ws[0])
    tiny = _world(2, 1024)[0]  # too small for the fused paths and for the one-shot all-reduce
    for workspace in (None, tiny):
        got = gemm_all_reduce(xs[0], ws[0], group, workspace)
        assert torch.equal(got, want)
    out = poison_(torch.empty((20, 72)))
    assert gemm_all_reduce(xs[0], ws[0], group, None, out=out) is out and torch.equal(out, want)
    assert pg.calls[1::2] == ["waited"] * 3 and tiny.epoch() == 0  # three allreduces, each waited on
    # A group of one never communicates.
    assert torch.equal(gemm_all_reduce(xs[0], ws[0], SimpleNamespace(size=1, pg=pg)), want / 2.0)
    assert len(pg.calls) == 6


def test_short_eager_path_is_the_plain_path_or_declines():
    """gar._eager_plain_or_none (what an eager CUDA "auto" call below the two-shot range runs; CPU
    tensors here, which gemm_all_reduce itself never sends to it): F.linear + the group's allreduce
    [+ residual], or None wherever the full router must decide."""
    pg = TwinRankGroup(returns_work=False)
    group = SimpleNamespace(size=2, pg=pg)
    xs, ws = _inputs(1, 9, 72, 40, torch.float32, seed=17)
    x, w = xs[0], ws[0]
    want = 2.0 * torch.nn.functional.linear(x, w)
    res = torch.randn(9, 72)
    assert torch.equal(gar._eager_plain_or_none(x, w, group, None, None, 4096), want)
    assert torch.equal(gar._eager_plain_or_none(x, w, group, _world(2, 1024)[0], res, 4096), res + want)
    assert len(pg.calls) == 2
    declined = [gar._eager_plain_or_none(x, w, group, None, None, 9),  # at the two-shot threshold
                gar._eager_plain_or_none(x, w, SimpleNamespace(size=1, pg=pg), None, None, 4096),
                gar._eager_plain_or_none(x, w, group, _world(4, 1024)[0], None, 4096),  # workspace of 4
                gar._eager_plain_or_none(x, w, group, None, res[:, :8], 4096)]  # residual of another shape
    assert declined == [None] * 4 and len(pg.calls) == 2
    with pytest.raises(ValueError, match="inner dims differ"):
        gar._eager_plain_or_none(x, ws[0][:, :8], group, None, None, 4096)


def test_short_eager_path_keeps_its_answer_per_group_on_the_workspace():
    """A SymmetricWorkspace remembers the short path's group lookup (eager_route) for the group object
    it was last called with; another group object, or an answer of None, is looked up again."""
    def workspace(world: int):  # the two attributes the router reads (a real one needs CUDA peers)
        ws = object.__new__(SymmetricWorkspace)
        ws.table, ws.eager_route = _world(world, 1024)[0], None
        return ws

    pg = TwinRankGroup(returns_work=False)
    group, alone = SimpleNamespace(size=2, pg=pg), SimpleNamespace(size=1, pg=pg)
    xs, ws = _inputs(1, 5, 24, 16, torch.float32, seed=18)
    want = 2.0 * torch.nn.functional.linear(xs[0], ws[0])
    two, four = workspace(2), workspace(4)
    assert torch.equal(gar._eager_plain_or_none(xs[0], ws[0], group, two, None, 4096), want)
    assert two.eager_route == (group, pg)
    assert gar._eager_plain_or_none(xs[0], ws[0], alone, two, None, 4096) is None
    assert two.eager_route == (alone, None)
    assert torch.equal(gar._eager_plain_or_none(xs[0], ws[0], group, two, None, 4096), want)
    assert two.eager_route[0] is group and len(pg.calls) == 2
    for _ in range(2):  # a workspace over 4 ranks never serves a group of 2, cached or not
        assert gar._eager_plain_or_none(xs[0], ws[0], group, four, None, 4096) is None
        assert four.eager_route == (group, None)
    assert len(pg.calls) == 2


def test_leading_dims_flatten_and_come_back():
    """x [..., K] (and residual / out [..., N]) behave as the flattened rows: the 2-D fast path and the
    reshaping path give the same numbers, on the fallback and on the fused one-shot."""
    twins = SimpleNamespace(size=2, pg=TwinRankGroup())
    xs, ws = _inputs(1, 6, 72, 40, torch.float32, seed=21)
    res = torch.randn((6, 72), generator=torch.Generator().manual_seed(22))
    flat = gemm_all_reduce(xs[0], ws[0], twins, residual=res)
    got = gemm_all_reduce(xs[0].view(2, 3, 40), ws[0], twins, residual=res.view(2, 3, 72))
    assert got.shape == (2, 3, 72) and torch.equal(got.reshape(6, 72), flat)
    out = poison_(torch.empty((2, 3, 72)))
    assert gemm_all_reduce(xs[0].view(2, 3, 40), ws[0], twins, out=out) is out
    assert torch.equal(out.reshape(6, 72), 2.0 * torch.nn.functional.linear(xs[0], ws[0]))
    t1 = _world(1)[0]  # a one-rank table: the fused one-shot in one launch
    one = gemm_all_reduce(xs[0], ws[0], None, t1, options=_forced("one_shot"))
    three = gemm_all_reduce(xs[0].view(3, 2, 40), ws[0], None, t1, options=_forced("one_shot"))
    assert three.shape == (3, 2, 72) and torch.equal(three.reshape(6, 72), one)


def test_argument_errors():
    t2 = _world(2)[0]
    x, w = torch.ones(4, 8, dtype=torch.float16), torch.ones(6, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="path must be"):
        gemm_all_reduce(x, w, None, t2, options=_forced("bogus"))
    with pytest.raises(ValueError, match="inner dims"):
        gemm_all_reduce(x, torch.ones(6, 9, dtype=torch.float16), None, t2, options=_forced("one_shot"))
    with pytest.raises(TypeError, match="share one dtype"):
        gemm_all_reduce(x, w.float(), None, t2, options=_forced("one_shot"))
    with pytest.raises(ValueError, match="spans 2 ranks"):
        gemm_all_reduce(x, w, SimpleNamespace(size=4, pg=None), t2)
    with pytest.raises(ValueError, match="group=None"):
        gemm_all_reduce(x, w, None, t2)
    with pytest.raises(ValueError, match="tiles < world size"):  # 1 tile, 2 ranks
        gemm_all_reduce(x, w, None, t2, options=_forced("two_shot"))
    with pytest.raises(ValueError, match="slot"):
        gemm_all_reduce(torch.ones(40, 8, dtype=torch.float16), w, None, _world(2, 1024)[0],
                        options=_forced("one_shot"))
    with pytest.raises(ValueError, match="nothing to do"):
        launch_gemm_all_reduce(x, w, t2, torch.empty(4, 6, dtype=torch.float16), gemm=False, reduce=False,
                               copy=False)
    with pytest.raises(ValueError, match="out must be"):
        gemm_all_reduce(x, w, None, t2, options=_forced("one_shot"), out=torch.empty(4, 5, dtype=torch.float16))
    plan, why = fused_plan("one_shot", 4, 6, 8, torch.float32, t2, partial_dtype=torch.float16)
    assert plan is None and "partial dtype" in why
    with pytest.raises(ValueError, match="unknown path"):
        fused_plan("three_shot", 4, 6, 8, torch.float32, t2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("m", [1, 8, 17, 32, 64, 333, 2048, 16384])
def test_gpu_tilings_are_legal(m, dtype):
    """The GPU tilings (not runnable here): tl.dot-legal blocks, shared memory within 227 KiB,
    comm steps that divide the tile, and a one-launch workspace size that a layer can afford."""
    esize = torch.empty((), dtype=dtype).element_size()
    for n, k in ((8192, 2048), (8192, 7168), (5120, 2048), (5120, 6400)):
        for path in ("one_shot", "two_shot"):
            cfg = gar.default_config(path, m, n, k, dtype, dtype, 132, interpret=False)
            g = cfg.gemm
            for block in (g.block_m, g.block_n, g.block_k):
                assert block >= 16 and block & (block - 1) == 0, cfg
            smem = g.num_stages * (g.block_m + g.block_n) * g.block_k * esize + g.block_m * g.block_n * esize
            assert smem <= 227 * 1024, (cfg, smem)
            assert g.block_m % cfg.comm_rows == 0 and cfg.comm_rows * g.block_n <= 4096
            if path == "one_shot" and m <= 64:
                nbytes, flag_rows = gar.required_workspace(path, m, n, k, dtype, 4, num_sms=132)
                assert nbytes <= 32 << 20 and flag_rows <= 132


@settings(max_examples=examples(6), deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    m=st.integers(1, 70),
    n=st.integers(1, 100),
    k=st.integers(1, 70),
    world_size=st.sampled_from([2, 3, 4]),
    dtype=st.sampled_from(CPU_DTYPES),
    path=st.sampled_from(["one_shot", "two_shot"]),
    schedule=st.sampled_from(["phased", "staggered"]),
    kind=st.sampled_from(["col_view", "contiguous", "transposed"]),
    seed=st.integers(0, 2**16),
)
def test_property_over_shapes(m, n, k, world_size, dtype, path, schedule, kind, seed):
    world = _world(world_size, 1 << 20)
    plan, _ = fused_plan(path, m, n, k, dtype, world[0])
    assume(plan is not None)  # two-shot needs >= world_size tiles
    xs, ws = _inputs(world_size, m, n, k, dtype, seed=seed, kind=kind)
    outs = gemm_all_reduce_emulated(world, xs, ws, path=path, outs=_poisoned(xs, ws), schedule=schedule)
    check_sum(outs, xs, ws, name=f"{path} {schedule} W={world_size} [{m},{n}] K={k} {kind} {dtype}")


# --------------------------------------------------------------------------- GPU (torchrun)

# (d_out, K_local): Llama-70B o and down shards at TP=4, Qwen3-32B down (decode splits K: 40 x 3 units)
GPU_SHAPES = [(8192, 2048), (8192, 7168), (5120, 6400)]
GPU_TOKENS = [1, 8, 24, 64, 333, 2048]  # 24: the 256-deep one-shot tiling of 17-32 rows (DEEP_K_ROWS)


@pytest.fixture(scope="module")
def gpu_world(nccl_world):
    return world_group_or_skip(nccl_world)


@pytest.fixture(scope="module")
def gpu_workspace(gpu_world):
    # 2 x 128 MiB slots: two-shot at 2048 x 8192 bf16 (64 MiB) in one launch; 16384 rows in chunks.
    return SymmetricWorkspace(gpu_world, 256 << 20, max_blocks=1024)


def _gpu_x(m, k, salt):
    import torch.distributed as dist

    g = torch.Generator(device="cuda").manual_seed(1000 * dist.get_rank() + salt)
    return (torch.randn((m, k), generator=g, device="cuda") + 0.1).to(torch.bfloat16)


def _gpu_operands(m, n, k, salt):
    """Rank-specific x [m, k] and w [n, k], w the shift view: block 1 of a 4-block row-parallel base."""
    import torch.distributed as dist

    g = torch.Generator(device="cuda").manual_seed(1000 * dist.get_rank() + salt + 7)
    base = torch.randn((n, 4 * k), generator=g, device="cuda").div_(math.sqrt(k)).to(torch.bfloat16)
    return _gpu_x(m, k, salt), base.narrow(1, k, k)


def _gpu_check(out, x, w, what, k_ranges=None) -> str | None:
    """None if `out` is right on this rank and identical on every rank, else a message.

    Reference: F.linear in fp32 + dist.all_reduce in fp32. Bound per element: u_bf16 (2^-8) for the
    bf16 partials (sum_r |p_r|, all-reduced; with split-K the sum over each K range's partial) and for
    the final rounding, + 2^-14 sum_r |x_r||w_r|^T for fp32 accumulation-order differences (tensor
    cores vs cuBLAS), times 1.05.
    """
    import torch.distributed as dist

    p = torch.nn.functional.linear(x.float(), w.float())
    ref, abs_p = p.clone(), p.abs()
    if k_ranges is not None:
        abs_p = sum(torch.nn.functional.linear(x[:, a:b].float(), w[:, a:b].float()).abs() for a, b in k_ranges)
    dist.all_reduce(ref)
    dist.all_reduce(abs_p)
    a = torch.nn.functional.linear(x.float().abs(), w.float().abs())
    dist.all_reduce(a)
    allowed = 1.05 * (2.0**-8 * (abs_p + ref.abs()) + 2.0**-14 * a)
    outs = [torch.empty_like(out) for _ in range(dist.get_world_size())]
    dist.all_gather(outs, out.contiguous())
    if out.isnan().any():
        return f"{what}: NaN in the output"
    if not all(torch.equal(o, outs[0]) for o in outs):
        return f"{what}: ranks differ"
    err = (out.float() - ref).abs()
    if (err > allowed).any():
        i = int((err - allowed).argmax())
        return (f"{what}: {int((err > allowed).sum())} elements out of bound; worst {i}: got "
                f"{out.reshape(-1)[i].item()} want {ref.reshape(-1)[i].item()} "
                f"allowed {allowed.reshape(-1)[i].item():.3g}")
    return None


def _split_ranges(m: int, n: int, k: int, table) -> list[tuple[int, int]] | None:
    """K ranges of the one-shot plan for [m, k] x [n, k] if it splits K, else None."""
    plan, _ = fused_plan("one_shot", m, n, k, torch.bfloat16, table)
    if plan is None or plan.config.split_k == 1:
        return None
    return _k_ranges(k, plan.config.gemm.block_k, plan.config.split_k)


def _paths_for(m: int) -> list[str]:
    paths = ["auto"]
    if m <= 64:
        paths.append("one_shot")
    if m >= 64:
        paths.append("two_shot")
    return paths


@pytest.mark.gpu
def test_gpu_eager_matches_fp32_reference(gpu_world, gpu_workspace):
    errors = []
    for n, k in GPU_SHAPES:
        for m in GPU_TOKENS:
            x, w = _gpu_operands(m, n, k, salt=m + k)
            for path in _paths_for(m):
                out = gemm_all_reduce(x, w, gpu_world, gpu_workspace, options=_forced(path))
                torch.cuda.synchronize()
                if gpu_workspace.table.status() != 0:
                    errors.append(f"[{m},{n}] K={k} {path}: a flag wait timed out (STATUS=1)")
                    break
                # eager "auto" never takes the one-shot (it only pays inside CUDA graphs)
                eager_route = choose_path(m, n, k, x.dtype, gpu_world.size(), gpu_workspace.table,
                                          options=GemmAllReduceOptions(one_shot_max_rows=0))
                if path == "auto" and eager_route == "unfused":
                    # The router's fallback is cuBLAS + all_reduce (NCCL above the one-shot size,
                    # accumulating in bf16): no fp32 bound applies; it must equal that plain path.
                    ref = gar.gemm_all_reduce_reference(x, w, gpu_world, gpu_workspace)
                    same = torch.equal(out, ref)
                    err = None if same else f"[{m},{n}] K={k} auto: unfused route != cuBLAS + all_reduce"
                else:
                    ranges = _split_ranges(m, n, k, gpu_workspace.table) if path == "one_shot" else None
                    err = _gpu_check(out, x, w, f"[{m},{n}] K={k} {path}", ranges)
                if err:
                    errors.append(err)
        if errors:
            break
    assert all_ranks_ok(not errors), "\n".join(errors[:6])


@pytest.mark.gpu
def test_gpu_fp32_partials_and_chunked_prefill(gpu_world, gpu_workspace):
    errors = []
    x, w = _gpu_operands(333, 8192, 2048, salt=7)
    out = gemm_all_reduce(x, w, gpu_world, gpu_workspace, options=_forced("two_shot", partial_dtype=torch.float32))
    err = _gpu_check(out, x, w, "two_shot fp32 partials")
    if err:
        errors.append(err)
    x, w = _gpu_operands(16384, 8192, 2048, salt=8)  # 256 MiB of partials+results: several chunks
    plan, why = fused_plan("two_shot", 16384, 8192, 2048, torch.bfloat16, gpu_workspace.table)
    if plan is None or len(plan.chunks) < 2:
        errors.append(f"expected a chunked plan for 16384 rows: {plan} {why}")
    before = gpu_workspace.table.epoch()
    out = gemm_all_reduce(x, w, gpu_world, gpu_workspace, options=_forced("two_shot"))
    torch.cuda.synchronize()
    if plan is not None and gpu_workspace.table.epoch() != before + len(plan.chunks):
        errors.append("epoch did not advance once per chunk")
    err = _gpu_check(out, x, w, "two_shot chunked 16384 rows")
    if err:
        errors.append(err)
    if gpu_workspace.table.status() != 0:
        errors.append("a flag wait timed out (STATUS=1)")
    assert all_ranks_ok(not errors), "\n".join(errors)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay(gpu_world, gpu_workspace):
    # Decode calls (one-shot) and a prefill call (two-shot) captured once, replayed with fresh
    # inputs: the device-side epoch advances per launch and every output is right every time.
    # (rows, path, n, k); the 5120-wide ones take split-K (FusedConfig.split_k 3)
    cases = [(8, "one_shot", 8192, 2048), (1, "auto", 8192, 2048), (64, "one_shot", 8192, 2048),
             (2048, "two_shot", 8192, 2048), (8, "auto", 8192, 2048), (1, "one_shot", 5120, 6400),
             (8, "auto", 5120, 2048), (24, "one_shot", 5120, 6400)]
    xs, ws, outs = [], [], []
    for i, (m, path, n, k) in enumerate(cases):
        x, w = _gpu_operands(m, n, k, salt=50 + i)
        xs.append(x)
        ws.append(w)
        outs.append(gemm_all_reduce(x, w, gpu_world, gpu_workspace, options=_forced(path)))  # compile outside capture
    torch.cuda.synchronize()
    launches = sum(
        len(fused_plan("two_shot" if p == "two_shot" else "one_shot", m, n, k, torch.bfloat16,
                       gpu_workspace.table)[0].chunks)
        for m, p, n, k in cases
    )
    epoch0 = gpu_workspace.table.epoch()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for (_, path, _, _), x, w, out in zip(cases, xs, ws, outs, strict=True):
            gemm_all_reduce(x, w, gpu_world, gpu_workspace, options=_forced(path), out=out)
    torch.cuda.synchronize()
    errors = []
    for rep in range(3):
        for i, ((m, _, _, k), x) in enumerate(zip(cases, xs, strict=True)):
            x.copy_(_gpu_x(m, k, salt=100 * (rep + 1) + i))
            poison_(outs[i])
        graph.replay()
        torch.cuda.synchronize()
        for i, ((m, path, n, k), x, w, out) in enumerate(zip(cases, xs, ws, outs, strict=True)):
            ranges = _split_ranges(m, n, k, gpu_workspace.table) if path != "two_shot" else None
            err = _gpu_check(out, x, w, f"replay {rep} call {i} [{m}] {path}", ranges)
            if err:
                errors.append(err)
        want = epoch0 + launches * (rep + 1)
        if gpu_workspace.table.epoch() != want or gpu_workspace.table.status() != 0:
            errors.append(f"after replay {rep}: epoch {gpu_workspace.table.epoch()} (want {want}), "
                          f"status {gpu_workspace.table.status()}")
    assert all_ranks_ok(not errors), "\n".join(errors[:6])


@pytest.mark.gpu
def test_gpu_kernel_pipelines_and_uses_system_scope_flags(gpu_world, gpu_workspace):
    # The GEMM loop must still be software-pipelined (async copies in the
    # TTGIR, as in the plain GEMM kernel) with the fused epilogue; flags must be sys-scope acq/rel.
    from fusedpar.kernels.gemm import kernels as gemm_kernels

    x, w = _gpu_operands(2048, 8192, 2048, salt=9)
    out = torch.empty((2048, 8192), dtype=torch.bfloat16, device="cuda")
    handle = launch_gemm_all_reduce(x, w, gpu_workspace.table, out, path="two_shot")
    torch.cuda.synchronize()
    ttgir, ptx = handle.asm["ttgir"], handle.asm["ptx"]
    cfg = gar.default_config("two_shot", 2048, 8192, 2048, torch.bfloat16, torch.bfloat16, 132, interpret=False).gemm
    plain = gemm_kernels._persistent_matmul_kernel.warmup(  # the pointer-load build, as the fused loop
        x, w, out, a_desc=None, w_desc=None, w2_desc=None, M=2048, N=8192, K=2048, stride_am=x.stride(0),
        stride_ak=x.stride(1),
        stride_wn=w.stride(0), stride_wk=w.stride(1), stride_cm=out.stride(0), stride_cn=out.stride(1),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        NUM_SMS=torch.cuda.get_device_properties(0).multi_processor_count, EVEN_K=True, INPUT_PRECISION="tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, grid=(1,),
    )
    needle = "async_copy_global_to_local"
    ours, theirs = ttgir.count(needle), plain.asm["ttgir"].count(needle)
    problems = [what for what, ok in (
        (f"pipelined loads ({needle}: fused {ours}, plain GEMM {theirs})", ours >= theirs),
        ("system-scope atomics", ".sys" in ptx),
        ("acquire", "acquire" in ptx),
        ("release", "release" in ptx),
    ) if not ok]
    assert all_ranks_ok(not problems), f"fused kernel: {problems}"


@pytest.mark.gpu
def test_gpu_router_fallback_is_the_plain_path(gpu_world, gpu_workspace):
    # Eager "auto" below the two-shot range -> cuBLAS + the process group's allreduce: bit for bit
    # what stock F.linear + dist.all_reduce return (333 rows: between the thresholds; 8 rows: decode,
    # which only a CUDA graph sends to the one-shot), with a residual and an out= too.
    import torch.distributed as dist

    assert choose_path(333, 8192, 2048, torch.bfloat16, gpu_workspace.world_size, gpu_workspace.table) == "unfused"
    errors = []
    for m in (333, 8):
        x, w = _gpu_operands(m, 8192, 2048, salt=10 + m)
        want = torch.nn.functional.linear(x, w)
        dist.all_reduce(want)
        before = gpu_workspace.table.epoch()
        got = gemm_all_reduce(x, w, gpu_world, gpu_workspace)
        res = _gpu_x(m, 8192, salt=3)
        dist.broadcast(res, 0)
        out = poison_(torch.empty_like(want))
        got_res = gemm_all_reduce(x, w, gpu_world, gpu_workspace, residual=res, out=out)
        got_res2 = gemm_all_reduce(x, w, gpu_world, gpu_workspace, residual=res)  # the short eager path
        torch.cuda.synchronize()
        if gpu_workspace.table.epoch() != before:
            errors.append(f"[{m}] eager auto launched a fused kernel (epoch {before} -> {gpu_workspace.table.epoch()})")
        if not torch.equal(got, want):
            errors.append(f"[{m}] eager auto differs from F.linear + dist.all_reduce")
        if got_res is not out or not torch.equal(out, res + want):
            errors.append(f"[{m}] eager auto with residual/out differs from res + (F.linear + dist.all_reduce)")
        if not torch.equal(got_res2, res + want):
            errors.append(f"[{m}] eager auto with residual differs from res + (F.linear + dist.all_reduce)")
    assert all_ranks_ok(not errors), "\n".join(errors)


@pytest.mark.gpu
def test_gpu_residual_epilogue_matches_the_separate_add(gpu_world, gpu_workspace):
    # bf16, Llama-70B down shard: the fused one-shot (eager and replayed in a CUDA graph) and
    # two-shot with the residual epilogue vs the same path + torch's add, bit for bit.
    import torch.distributed as dist

    n, k = 8192, 7168
    errors = []
    for m, path in ((1, "one_shot"), (8, "one_shot"), (64, "one_shot"), (2048, "two_shot")):
        x, w = _gpu_operands(m, n, k, salt=500 + m)
        res = _gpu_x(m, n, salt=7).mul_(3.0)
        dist.broadcast(res, 0)  # the same on every rank, like a residual stream
        plain = gemm_all_reduce(x, w, gpu_world, gpu_workspace, options=_forced(path))
        err = _gpu_check(plain, x, w, f"[{m}] {path} plain")
        if err:
            errors.append(err)
        want = res + plain
        got = gemm_all_reduce(x, w, gpu_world, gpu_workspace, options=_forced(path), residual=res)
        if not torch.equal(got, want):
            errors.append(f"[{m}] {path} eager: fused differs by {(got.float() - want.float()).abs().max().item()}")
        if path == "one_shot":
            out = torch.empty_like(want)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                gemm_all_reduce(x, w, gpu_world, gpu_workspace, options=_forced(path), residual=res, out=out)
            poison_(out)
            graph.replay()
            torch.cuda.synchronize()
            if not torch.equal(out, want):
                errors.append(f"[{m}] graph replay differs by {(out.float() - want.float()).abs().max().item()}")
        if gpu_workspace.table.status() != 0:
            errors.append(f"[{m}] {path}: a flag wait timed out")
            break
    assert all_ranks_ok(not errors), "\n".join(errors[:6])
