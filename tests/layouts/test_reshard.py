"""Reshard plans (fusedpar.layouts.reshard_plan), proven over random layouts and model shapes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusedpar.layouts import ModelDims, ParallelLayout
from fusedpar.layouts.reshard_plan import holdings, kv_plan, union, view_range, weight_plan
from fusedpar.layouts.shards import WEIGHT_NAMES, Segment, merge_segments
from tests.profile import examples


@st.composite
def world_and_dims(draw):
    """A world, a model that fits every SP x TP split of every replica size used, and two layouts."""
    world = draw(st.sampled_from([1, 2, 4, 6, 8]))
    sizes = [p for p in range(1, world + 1) if world % p == 0]
    kv = draw(st.sampled_from([1, 2, 4]))
    q = kv * draw(st.sampled_from([1, 2, 3])) * 24  # divisible by every replica size up to 8 but 5, 7
    dims = ModelDims(q, kv, draw(st.sampled_from([2, 4])), 24 * draw(st.integers(1, 3)))

    def layout():
        P = draw(st.sampled_from([p for p in sizes if (kv % p == 0 or p % kv == 0)]))
        sp = draw(st.sampled_from([s for s in range(1, P + 1) if P % s == 0]))
        return ParallelLayout(world, sp=sp, tp=P // sp)

    return world, dims, layout(), layout()


def _rows(segments) -> set[tuple[str, int]]:
    return {(seg.source, i) for seg in segments for i in range(seg.start, seg.stop)}


@settings(max_examples=examples(150), deadline=None)
@given(world_and_dims())
def test_every_target_row_is_provided_exactly_once_by_a_holder(case):
    world, dims, src, dst = case
    held = holdings([src], dims)
    plan = weight_plan(src, dst, dims)
    target = dst.weight_shards(dims)
    for rank in range(world):
        for name in WEIGHT_NAMES:
            want = [(seg.source, i) for seg in merge_segments(target.shard(rank, name).base)
                    for i in range(seg.start, seg.stop)]
            got = [(p.source, i) for p in plan if p.rank == rank and p.name == name for i in range(p.start, p.stop)]
            assert sorted(got) == sorted(want), (rank, name)
            for p in plan:
                if p.rank == rank and p.name == name:
                    assert _rows([Segment(p.source, p.start, p.stop)]) <= _rows(held[p.provider][name]), p
                    if p.moves:  # a peer sends only what the receiver does not hold
                        assert not _rows([Segment(p.source, p.start, p.stop)]) & _rows(held[rank][name]), p


@settings(max_examples=examples(80), deadline=None)
@given(world_and_dims())
def test_identity_plan_moves_nothing(case):
    _, dims, src, _ = case
    assert not [p for p in weight_plan(src, src, dims) if p.moves]
    seqs = {s: (s % src.dp, s % src.dp) for s in range(5)}
    assert kv_plan(src, src, dims, seqs) == []


@settings(max_examples=examples(80), deadline=None)
@given(world_and_dims())
def test_sp_tp_splits_of_one_replica_size_move_no_kv(case):
    world, dims, src, _ = case
    P = src.replica_size
    for sp in (s for s in range(1, P + 1) if P % s == 0):
        dst = ParallelLayout(world, sp=sp, tp=P // sp)
        seqs = {s: (s % src.dp, s % src.dp) for s in range(3)}
        assert kv_plan(src, dst, dims, seqs) == [], dst


@settings(max_examples=examples(150), deadline=None)
@given(world_and_dims())
def test_kv_plan_gives_every_target_rank_its_heads_from_a_holder(case):
    _, dims, src, dst = case
    seqs = {s: (s % src.dp, (s * 7) % dst.dp) for s in range(4)}
    moves = kv_plan(src, dst, dims, seqs)
    ps, pd = src.head_placement(dims.num_q_heads, dims.num_kv_heads), dst.head_placement(dims.num_q_heads,
                                                                                        dims.num_kv_heads)
    for seq, (d_src, d_dst) in seqs.items():
        has = {(r, h) for r in range(d_src * src.replica_size, (d_src + 1) * src.replica_size)
               for h in ps.kv_heads(r, "base")}
        got = {(m.dst, m.head) for m in moves if m.seq == seq}
        assert len(got) == len([m for m in moves if m.seq == seq])  # one sender per (rank, head)
        for m in (m for m in moves if m.seq == seq):
            assert (m.src, m.head) in has and (m.dst, m.head) not in has, m
        for r in range(d_dst * dst.replica_size, (d_dst + 1) * dst.replica_size):
            for h in pd.kv_heads(r, "base"):
                assert (r, h) in has or (r, h) in got, (seq, r, h)


@settings(max_examples=examples(80), deadline=None)
@given(world_and_dims())
def test_holding_the_union_of_declared_layouts_makes_each_of_them_free(case):
    _, dims, a, b = case
    for dst in (a, b):
        assert not [p for p in weight_plan([a, b], dst, dims) if p.moves], dst


def test_shift_view_and_tp_from_full_weights_are_views():
    dims = ModelDims(8, 2, 4, 48)
    sp4, tp4 = ParallelLayout(4, sp=4, tp=1), ParallelLayout(4, sp=1, tp=4)
    src, dst = sp4.weight_shards(dims), tp4.weight_shards(dims)
    for rank in range(4):
        for name in WEIGHT_NAMES:
            held, want = src.shard(rank, name), dst.shard(rank, name)
            # TP=4's shard is SP=4 x TP=1's shift view of the same rank: a narrow of the base tensor
            assert view_range(held.base, want.base) == held.shift, (rank, name)
            assert view_range(want.base, held.base) is None, (rank, name)  # the full weight is no view of a shard


def test_view_range_refuses_what_is_not_one_contiguous_range():
    held = (Segment("q", 0, 8), Segment("k", 0, 4))
    assert view_range(held, (Segment("q", 4, 8), Segment("k", 0, 2))) == (4, 10)
    assert view_range(held, (Segment("q", 0, 2), Segment("k", 0, 2))) is None  # a gap
    assert view_range(held, (Segment("k", 0, 2), Segment("q", 0, 2))) is None  # another order
    assert view_range(held, (Segment("v", 0, 2),)) is None


def test_union_merges_overlaps_and_neighbours():
    assert union([Segment("q", 4, 8), Segment("q", 0, 4), Segment("k", 2, 3), Segment("q", 6, 10)]) == (
        Segment("k", 2, 3), Segment("q", 0, 10))


def test_plans_refuse_another_world_and_unknown_replicas():
    dims = ModelDims(8, 2, 4, 48)
    with pytest.raises(ValueError, match="one world"):
        kv_plan(ParallelLayout(4, tp=4), ParallelLayout(2, tp=2), dims, {})
    with pytest.raises(ValueError, match="sequence 3: replicas"):
        kv_plan(ParallelLayout(4, tp=2), ParallelLayout(4, tp=4), dims, {3: (1, 1)})
