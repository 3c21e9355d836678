"""Plain collectives and ParallelContext on gloo CPU processes."""

import pytest
import torch

from fusedpar import ParallelLayout
from fusedpar.collectives import (
    CommGroup,
    ParallelContext,
    all_gather_rows,
    all_reduce_sum,
    head_to_seq_all_to_all,
    seq_to_head_all_to_all,
)
from fusedpar.testing.dist import run_distributed


def _inputs(world, m, cols, dtype=torch.float32):
    """Every rank's input, generated identically everywhere so each rank can build the expectation."""
    g = torch.Generator().manual_seed(7)
    return [torch.randn(m, cols, generator=g, dtype=dtype) for _ in range(world)]


def _exchange_worker(rank, world, sp, tp, m, c):
    ctx = ParallelContext(ParallelLayout(world, sp=sp, tp=tp))
    G, peers = ctx.sp.size, ctx.sp.ranks
    xs = _inputs(world, m, G * c)
    out = seq_to_head_all_to_all(xs[rank], ctx.sp)
    # peer g's rows, column block of my SP index, stacked in peer order
    expected = torch.cat([xs[p][:, ctx.sp.rank * c:(ctx.sp.rank + 1) * c] for p in peers])
    back = head_to_seq_all_to_all(out, ctx.sp)
    gathered = all_gather_rows(xs[rank], ctx.tp)
    summed = all_reduce_sum(xs[rank].clone(), ctx.shift)
    return {
        "a2a": torch.equal(out, expected),
        "roundtrip": torch.equal(back, xs[rank]),
        "gather": torch.equal(gathered, torch.cat([xs[p] for p in ctx.tp.ranks])),
        "reduce": torch.allclose(summed, sum(xs[p] for p in ctx.shift.ranks), rtol=1e-6, atol=1e-6),
        "groups": (ctx.sp.ranks, ctx.tp.ranks, ctx.shift.ranks, ctx.dp.ranks),
    }


@pytest.mark.parametrize(("world", "sp", "tp", "m", "c"), [(4, 2, 2, 3, 5), (4, 4, 1, 1, 7), (4, 2, 1, 5, 3)])
def test_ulysses_exchange_gather_reduce(world, sp, tp, m, c):
    layout = ParallelLayout(world, sp=sp, tp=tp)
    for rank, res in enumerate(run_distributed(_exchange_worker, world, sp, tp, m, c)):
        assert res["a2a"], f"rank {rank}: seq_to_head_all_to_all wrong"
        assert res["roundtrip"], f"rank {rank}: head_to_seq_all_to_all does not invert it"
        assert res["gather"] and res["reduce"], f"rank {rank}"
        expected = tuple(tuple(f(rank)) for f in (layout.sp_group_of, layout.tp_group_of,
                                                  layout.shift_group_of, layout.dp_group_of))
        assert res["groups"] == expected


def _errors_worker(rank, world):
    ctx = ParallelContext(ParallelLayout(world, sp=2, tp=1))
    msgs = []
    for fn, x in ((seq_to_head_all_to_all, torch.randn(3, 5)), (head_to_seq_all_to_all, torch.randn(3, 4)),
                  (seq_to_head_all_to_all, torch.randn(4))):
        try:
            fn(x, ctx.sp)
            msgs.append(None)
        except ValueError as e:
            msgs.append(str(e))
    try:
        ParallelContext(ParallelLayout(4, sp=2, tp=2))
        msgs.append(None)
    except ValueError as e:
        msgs.append(str(e))
    return msgs


def test_shape_errors_name_the_numbers():
    cols, tokens, rank1, world = run_distributed(_errors_worker, 2)[0]
    assert "5 columns" in cols and "group size 2" in cols
    assert "3 tokens" in tokens and "pad" in tokens
    assert "[tokens, columns]" in rank1
    assert "world_size=4" in world and "2" in world


def test_size_one_groups_are_shortcuts():
    single = CommGroup(ranks=(0,), rank=0, pg=None)
    x = torch.randn(3, 4)
    for fn in (seq_to_head_all_to_all, head_to_seq_all_to_all, all_gather_rows, all_reduce_sum):
        assert fn(x, single) is x


def test_context_needs_initialised_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        ParallelContext(ParallelLayout(1))
