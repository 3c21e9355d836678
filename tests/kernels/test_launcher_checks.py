"""The launchers' argument checks: every case here ran silently wrong (or died inside Triton) before.

Refusals assert the error type and the phrase that names the constraint; the accepted neighbours
(out=x for rms_norm, out=residual for gemm_all_reduce, every config the repo builds) still run.
CPU, Triton interpreter, tiny shapes.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fusedpar.collectives.symmetric import EmulatedWorld
from fusedpar.kernels._host import has_internal_overlap, overlaps
from fusedpar.kernels.allreduce import OneShotConfig, all_reduce, launch_one_shot_all_reduce, one_shot_all_reduce
from fusedpar.kernels.gemm import GemmConfig, matmul
from fusedpar.kernels.gemm_all_reduce import FusedConfig, GemmAllReduceOptions, gemm_all_reduce
from fusedpar.kernels.rmsnorm import add_rms_norm, rms_norm
from fusedpar.kernels.ulysses import OProjConfig, o_proj_workspace_bytes, qkv_workspace_bytes
from fusedpar.testing.allreduce_emulation import one_shot_all_reduce_emulated
from fusedpar.testing.gemm_all_reduce_emulation import gemm_all_reduce_emulated
from fusedpar.testing.ulysses_emulation import all_to_all_o_proj_emulated, qkv_all_to_all_emulated

EPS = 1e-6
_G = GemmConfig(32, 32, 32, group_m=2, num_warps=4, num_stages=1)


def _rms_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w.double()


# ---- _host overlap helpers ------------------------------------------------------------------------


def test_overlaps_by_byte_range():
    base = torch.zeros(6, 8)
    assert overlaps(base, base) and overlaps(base[1:3], base[2:5])
    assert not overlaps(base[:2], base[2:]) and not overlaps(base, torch.zeros(6, 8))
    assert overlaps(base[:, :4], base[:, 4:])  # interleaved rows: conservative, counted as overlapping
    assert not overlaps(base[:0], base) and not overlaps(base, base[3:3])  # empty tensors overlap nothing
    assert overlaps(base.view(torch.int32), base[5, 7:])  # by address: other dtypes / views alike


def test_has_internal_overlap_sees_expanded_views():
    assert has_internal_overlap(torch.zeros(1, 5).expand(3, 5))
    assert not has_internal_overlap(torch.zeros(1, 5).expand(1, 5))  # size-1 dims may have any stride
    assert not has_internal_overlap(torch.zeros(3, 5).t())


# ---- rmsnorm (findings 1, 2) --------------------------------------------------------------------


def test_rms_norm_refuses_strided_weight():
    x, d = torch.randn(5, 24), torch.randn(5, 24)
    w = torch.randn(48)[::2]
    with pytest.raises(ValueError, match="weight must be contiguous"):
        rms_norm(x, w, EPS)
    with pytest.raises(ValueError, match="weight must be contiguous"):
        add_rms_norm(x, d, w, EPS)


@pytest.mark.parametrize(
    "make_out",
    [
        lambda: torch.empty(24, 5).t(),  # right shape, strided columns
        lambda: torch.empty(5, 24, dtype=torch.float16),  # wrong dtype
        lambda: torch.empty(100)[:60].view(5, 12),  # too narrow: the kernel would write past it
        lambda: torch.empty(3, 24),  # too few rows
    ],
    ids=["transposed", "dtype", "narrow", "rows"],
)
def test_rms_norm_refuses_bad_out(make_out):
    with pytest.raises(ValueError, match="out must be"):
        rms_norm(torch.randn(5, 24), torch.randn(24), EPS, out=make_out())


def test_rms_norm_refuses_out_overlapping_x_or_itself():
    base = torch.randn(6, 24)
    with pytest.raises(ValueError, match="overlaps x"):
        rms_norm(base[:5], torch.randn(24), EPS, out=base[1:])
    with pytest.raises(ValueError, match="sharing memory"):
        rms_norm(torch.randn(5, 24), torch.randn(24), EPS, out=torch.empty(1, 24).expand(5, 24))


def test_rms_norm_in_place_and_strided_rows_still_work():
    w = torch.randn(24)
    x = torch.randn(5, 24)
    want = _rms_ref(x, w)
    assert rms_norm(x, w, EPS, out=x) is x
    torch.testing.assert_close(x.double(), want, rtol=1e-5, atol=1e-5)
    big = torch.full((5, 40), float("nan"))
    out = big[:, 8:32]  # row stride 40, contiguous columns
    xs = torch.randn(5, 24)
    rms_norm(xs, w, EPS, out=out)
    torch.testing.assert_close(out.double(), _rms_ref(xs, w), rtol=1e-5, atol=1e-5)
    assert big[:, :8].isnan().all() and big[:, 32:].isnan().all()


# ---- matmul (finding 3) ------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["a", "w"])
def test_matmul_refuses_out_aliasing_an_operand(which):
    a, w = torch.randn(40, 40), torch.randn(40, 40)
    with pytest.raises(ValueError, match=f"out overlaps {which}"):
        matmul(a, w, out=a if which == "a" else w)


def test_matmul_refuses_out_overlapping_operand_partially():
    base = torch.randn(80, 16)
    a, w = base[:40], torch.randn(16, 16)
    with pytest.raises(ValueError, match="out overlaps a"):
        matmul(a, w, out=base[30:70])


def test_matmul_refuses_self_overlapping_out():
    with pytest.raises(ValueError, match="sharing memory"):
        matmul(torch.randn(3, 8), torch.randn(5, 8), out=torch.zeros(1, 5).expand(3, 5))


def test_matmul_out_view_of_other_storage_still_works():
    a, w = torch.randn(7, 16), torch.randn(9, 16)
    big = torch.full((7, 20), float("nan"))
    got = matmul(a, w, out=big[:, 5:14])
    torch.testing.assert_close(got.double(), a.double() @ w.double().t(), rtol=1e-5, atol=1e-5)


# ---- gemm_all_reduce (findings 4, 6) --------------------------------------------------------------


def _forced(path: str) -> GemmAllReduceOptions:
    return GemmAllReduceOptions(path=path)


@pytest.mark.parametrize("path", ["one_shot", "two_shot"])
def test_gemm_all_reduce_refuses_out_aliasing_x_or_w(path):
    x, w = torch.randn(40, 64), torch.randn(64, 64)  # K == N, so out may be x itself
    with pytest.raises(ValueError, match="out overlaps x"):
        gemm_all_reduce(x, w, None, EmulatedWorld(1, 1 << 20)[0], options=_forced(path), out=x)
    with pytest.raises(ValueError, match="out overlaps w"):
        gemm_all_reduce(torch.randn(64, 64), w, None, EmulatedWorld(1, 1 << 20)[0], options=_forced(path), out=w)
    xs = [torch.randn(40, 64) for _ in range(2)]
    with pytest.raises(ValueError, match="out overlaps x"):
        gemm_all_reduce_emulated(EmulatedWorld(2, 1 << 20), xs, [w, w.clone()], path=path, outs=list(xs))


@pytest.mark.parametrize("path", ["one_shot", "two_shot"])
def test_gemm_all_reduce_out_may_be_residual_but_no_other_view_of_it(path):
    x, w = torch.randn(9, 16), torch.randn(40, 16)
    res = torch.randn(9, 40)
    want = x.double() @ w.double().t() + res.double()
    got = gemm_all_reduce(x, w, None, EmulatedWorld(1, 1 << 20)[0], options=_forced(path), out=res, residual=res)
    assert got is res
    torch.testing.assert_close(res.double(), want, rtol=1e-5, atol=1e-4)
    base = torch.randn(10, 40)
    with pytest.raises(ValueError, match="overlaps residual"):
        gemm_all_reduce(x, w, None, EmulatedWorld(1, 1 << 20)[0], options=_forced(path), out=base[1:],
                        residual=base[:9])


@pytest.mark.parametrize(
    ("kwargs", "phrase"),
    [
        ({"num_sms": 0, "comm_rows": 8}, "num_sms=0"),
        ({"num_sms": 4, "comm_rows": 64}, "comm_rows=64 must divide block_m=32"),
        ({"num_sms": 4, "comm_rows": 3}, "comm_rows=3 must be a power of two"),
        ({"num_sms": 4, "comm_rows": 0}, "comm_rows=0 must be a power of two"),
    ],
)
def test_fused_config_is_validated(kwargs, phrase):
    with pytest.raises(ValueError, match=phrase):
        FusedConfig(_G, **kwargs)


@pytest.mark.parametrize(
    ("args", "kwargs", "phrase"),
    [
        ((32, 24, 32), {}, "block_n=24"),
        ((48, 32, 32), {}, "block_m=48"),
        ((32, 32, 0), {}, "block_k=0"),
        ((32, 32, 32), {"block_n2": 24}, "block_n2=24"),
        ((32, 32, 32), {"num_warps": 3}, "num_warps=3"),
        ((32, 32, 32), {"group_m": 0}, "group_m=0"),
        ((32, 32, 32), {"num_stages": 0}, "num_stages=0"),
    ],
)
def test_gemm_config_is_validated(args, kwargs, phrase):
    with pytest.raises(ValueError, match=phrase):
        GemmConfig(*args, **kwargs)


def test_gemm_config_accepts_what_the_repo_builds():
    # group_m need not be a power of two (the tests use 3); block_n2=0 means no second block
    GemmConfig(16, 16, 16, group_m=3, num_stages=1)
    GemmConfig(64, 256, 64, 16, 4, 4, tma=True, flatten=False, block_n2=64)
    FusedConfig(GemmConfig(16, 16, 16, group_m=1, num_stages=1), num_sms=1, comm_rows=16)


# ---- one-shot all-reduce and o_proj configs (finding 7) ----------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "phrase"),
    [({"max_blocks": 0}, "max_blocks=0"), ({"block": 100}, "block=100"), ({"num_warps": 3}, "num_warps=3")],
)
def test_one_shot_config_is_validated(kwargs, phrase):
    with pytest.raises(ValueError, match=phrase):
        OneShotConfig(**{"block": 256, "num_warps": 1, "max_blocks": 4, **kwargs})


@pytest.mark.parametrize(("kwargs", "phrase"), [({"copy_rows": 3}, "copy_rows=3"), ({"copy_cols": 24}, "copy_cols=24")])
def test_o_proj_config_is_validated(kwargs, phrase):
    with pytest.raises(ValueError, match=phrase):
        OProjConfig(**{"comm_programs": 2, "copy_rows": 8, "copy_cols": 16, **kwargs})


# ---- emulated drivers (finding 8) --------------------------------------------------------------------


def test_one_shot_emulated_refuses_mismatched_ranks():
    with pytest.raises(ValueError, match=r"rank 0 has \(300,\).*rank 1 has \(200,\)"):
        one_shot_all_reduce_emulated(EmulatedWorld(2, 1 << 16), [torch.randn(300), torch.randn(200)])
    with pytest.raises(ValueError, match="one shape and dtype"):
        one_shot_all_reduce_emulated(EmulatedWorld(2, 1 << 16), [torch.randn(30), torch.randn(30).half()])


def test_one_shot_emulated_takes_a_transposed_input():
    xs = [torch.randn(13, 7).t() for _ in range(2)]
    outs = one_shot_all_reduce_emulated(EmulatedWorld(2, 1 << 14), xs)
    for o in outs:
        assert o.shape == (7, 13) and o.is_contiguous()
        torch.testing.assert_close(o, xs[0] + xs[1])
    assert torch.equal(one_shot_all_reduce(xs[0], EmulatedWorld(1, 1 << 14)[0]), xs[0])


def test_gemm_all_reduce_emulated_refuses_mismatched_ranks():
    ws = [torch.randn(40, 16), torch.randn(40, 16)]
    with pytest.raises(ValueError, match=r"x of one shape.*rank 1 has \(5, 16\)"):
        gemm_all_reduce_emulated(EmulatedWorld(2, 1 << 20), [torch.randn(9, 16), torch.randn(5, 16)], ws,
                                 path="one_shot")
    with pytest.raises(ValueError, match=r"w of one shape.*rank 1 has \(32, 16\)"):
        gemm_all_reduce_emulated(EmulatedWorld(2, 1 << 20), [torch.randn(9, 16)] * 2,
                                 [torch.randn(40, 16), torch.randn(32, 16)], path="one_shot")


def test_ulysses_emulated_refuse_mismatched_ranks():
    ws = [torch.randn(2 * 24, 16) for _ in range(2)]
    world = EmulatedWorld(2, qkv_workspace_bytes(5, 24, 2, torch.float32))
    with pytest.raises(ValueError, match=r"qkv_all_to_all_emulated.*rank 1 has \(3, 16\)"):
        qkv_all_to_all_emulated(world, [torch.randn(5, 16), torch.randn(3, 16)], ws)
    world = EmulatedWorld(2, o_proj_workspace_bytes(5, 16, 2, torch.float32))
    with pytest.raises(ValueError, match=r"all_to_all_o_proj_emulated.*rank 1 has \(8, 16\)"):
        all_to_all_o_proj_emulated(world, [torch.randn(10, 16), torch.randn(8, 16)],
                                   [torch.randn(20, 32) for _ in range(2)])


def test_all_reduce_in_place_on_a_strided_view_through_the_one_shot():
    # Rank 1 publishes first, so rank 0's all_reduce (both phases in one launch) finds its data.
    world = EmulatedWorld(2, 1 << 14)
    bases = [torch.randn(4, 6) for _ in range(2)]
    keeps = [b.clone() for b in bases]
    views = [b[:, 1:4] for b in bases]
    want = keeps[0][:, 1:4] + keeps[1][:, 1:4]
    out1 = torch.empty(views[1].shape)
    launch_one_shot_all_reduce(views[1], world[1], out1, reduce=False)
    group = SimpleNamespace(size=2, pg=None)  # never reached: the one-shot takes the call
    got = all_reduce(views[0], group, world[0], inplace=True)
    launch_one_shot_all_reduce(views[1], world[1], out1, copy_in=False)
    assert got is views[0]
    torch.testing.assert_close(views[0], want)
    torch.testing.assert_close(out1, want)
    assert torch.equal(bases[0][:, [0, 4, 5]], keeps[0][:, [0, 4, 5]])
