"""Collectives on strided views, and the argument checks of the collectives' helpers (gloo CPU processes)."""

from __future__ import annotations

import pytest
import torch

from fusedpar import ParallelLayout
from fusedpar.collectives import ParallelContext, all_gather_rows, all_reduce_sum
from fusedpar.collectives.symmetric import EmulatedWorld
from fusedpar.kernels.allreduce import all_reduce, sum_over_group_
from fusedpar.testing.dist import run_distributed


def _base(rank: int) -> torch.Tensor:
    return torch.arange(24, dtype=torch.float32).view(4, 6) + 100 * rank


def _views_worker(rank, world):
    ctx = ParallelContext(ParallelLayout(world, sp=world, tp=1))
    reducers = {
        "all_reduce_sum": lambda v: all_reduce_sum(v, ctx.sp),
        "all_reduce(inplace=True)": lambda v: all_reduce(v, ctx.sp, None, inplace=True),
        "all_reduce": lambda v: all_reduce(v, ctx.sp, None),
        "sum_over_group_": lambda v: sum_over_group_(v, ctx.sp.pg),
    }
    views = {"columns": lambda b: b[:, 1:4], "transposed": lambda b: b.t(), "every other row": lambda b: b[::2]}
    res = {}
    for rname, reduce in reducers.items():
        for vname, view in views.items():
            base = _base(rank)
            keep = base.clone()
            v = view(base)
            got = reduce(v)
            want = sum(view(_base(r)) for r in range(world))
            outside = torch.ones_like(base, dtype=torch.bool)
            view(outside).fill_(False)
            in_place = rname != "all_reduce"
            res[(rname, vname)] = (
                torch.equal(got, want),
                (got is v) == in_place,
                torch.equal(v, want if in_place else view(keep)),
                torch.equal(base[outside], keep[outside]),
            )
    try:
        all_gather_rows(torch.tensor(1.0), ctx.sp)
        res["gather 0-d"] = "no error"
    except ValueError as e:
        res["gather 0-d"] = str(e)
    return res


def test_reductions_of_strided_views_are_correct_and_stay_inside_the_view():
    for rank, res in enumerate(run_distributed(_views_worker, 2)):
        assert ">= 1 dim" in res.pop("gather 0-d"), f"rank {rank}: all_gather_rows accepted a 0-d tensor"
        for (rname, vname), (ok, same, in_view, outside) in res.items():
            assert ok, f"rank {rank}: {rname} of a {vname} view: wrong sum"
            assert same, f"rank {rank}: {rname} of a {vname} view: wrong result object"
            assert in_view, f"rank {rank}: {rname} of a {vname} view: the view itself holds the wrong values"
            assert outside, f"rank {rank}: {rname} of a {vname} view wrote outside the view"


def _mode_worker(rank, world):
    ctx = ParallelContext(ParallelLayout(world, sp=1, tp=world))
    out = {"base": ctx.attention_group("base") is ctx.tp, "shift": ctx.attention_group("shift") is ctx.shift}
    for bad in ("Base", "tp", ""):
        try:
            ctx.attention_group(bad)
            out[bad] = "no error"
        except ValueError as e:
            out[bad] = str(e)
    return out


def test_attention_group_refuses_unknown_modes():
    for res in run_distributed(_mode_worker, 2):
        assert res["base"] and res["shift"]
        for bad in ("Base", "tp", ""):
            assert f"mode must be one of ('base', 'shift'), got {bad!r}" in res[bad]


def test_peer_table_view_bounds():
    t = EmulatedWorld(1, 512)[0]
    assert t.buffer_bytes == 512
    with pytest.raises(ValueError, match="numel -4 must be >= 0"):
        t.view(torch.float32, -4)
    with pytest.raises(ValueError, match=r"bytes \[1024, .*512-byte buffer"):
        t.view(torch.float32, None, 1024)
    with pytest.raises(ValueError, match="do not fit"):
        t.view(torch.float32, 1, 512)
    with pytest.raises(ValueError, match="do not fit"):
        t.view(torch.float64, 1, -8)
    assert t.view(torch.float32, None, 512).shape == (0,)  # an empty view at the end is in bounds
    assert t.view(torch.float32, 0).shape == (0,)
    assert t.view(torch.float32, None, 256).shape == (64,)
    assert t.view(torch.float16, 3, 2).shape == (3,)
