"""Rank grid: groups, coordinates and argument checks of ParallelLayout."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusedpar import ParallelLayout, RankCoords
from tests.profile import examples

MAX_WORLD = 64


def mentions(msg: str, *numbers: int) -> bool:
    """True if every number appears in msg as a whole number (not as part of a longer one)."""
    return all(re.search(rf"(?<!\d){n}(?!\d)", msg) for n in numbers)


@st.composite
def grids(draw, max_world: int = MAX_WORLD):
    sp = draw(st.integers(1, max_world))
    tp = draw(st.integers(1, max_world // sp))
    dp = draw(st.integers(1, max_world // (sp * tp)))
    return dp, sp, tp


def assert_partition(groups: list[list[int]], world: int, n_groups: int, size: int) -> None:
    assert len(groups) == n_groups
    assert all(len(g) == size for g in groups)
    flat = [r for g in groups for r in g]
    assert sorted(flat) == list(range(world)), "groups must cover every rank exactly once"


# --------------------------------------------------------------------------- properties


@settings(max_examples=examples(150), deadline=None)
@given(grids())
def test_groups_partition_the_world(cfg):
    dp, sp, tp = cfg
    P, world = sp * tp, dp * sp * tp
    lay = ParallelLayout(world, sp=sp, tp=tp)
    assert (lay.dp, lay.sp, lay.tp, lay.world_size, lay.replica_size) == (dp, sp, tp, world, P)
    assert_partition(lay.sp_groups, world, dp * tp, sp)
    assert_partition(lay.tp_groups, world, dp * sp, tp)
    assert_partition(lay.shift_groups, world, dp, P)
    assert_partition(lay.dp_groups, world, P, dp)


@settings(max_examples=examples(150), deadline=None)
@given(grids())
def test_group_shapes_follow_canonical_order(cfg):
    dp, sp, tp = cfg
    P, world = sp * tp, dp * sp * tp
    lay = ParallelLayout(world, sp=sp, tp=tp)
    for g in lay.sp_groups:  # contiguous, aligned to sp, inside one replica
        assert g[0] % sp == 0
        assert g == list(range(g[0], g[0] + sp))
        assert len({r // P for r in g}) == 1
    for g in lay.tp_groups:  # stride sp, inside one replica
        assert g == [g[0] + i * sp for i in range(tp)]
        assert g[0] % P < sp
        assert len({r // P for r in g}) == 1
    assert lay.shift_groups == [list(range(d * P, (d + 1) * P)) for d in range(dp)]
    assert lay.dp_groups == [[d * P + local for d in range(dp)] for local in range(P)]


@settings(max_examples=examples(150), deadline=None)
@given(grids())
def test_coords_formulas_and_round_trip(cfg):
    dp, sp, tp = cfg
    P, world = sp * tp, dp * sp * tp
    lay = ParallelLayout(world, sp=sp, tp=tp)
    seen = set()
    for rank in range(world):
        c = lay.coords(rank)
        assert isinstance(c, RankCoords)
        local = rank % P
        assert (c.dp, c.local, c.sp, c.tp) == (rank // P, local, local % sp, local // sp)
        assert c.pp == 0
        assert all(isinstance(v, int) for v in (c.dp, c.sp, c.tp, c.local))
        assert lay.rank_of(dp=c.dp, sp=c.sp, tp=c.tp) == rank
        seen.add((c.dp, c.sp, c.tp))
    assert len(seen) == world  # coords is a bijection onto dp x sp x tp
    for d in range(dp):
        for s in range(sp):
            for t in range(tp):
                assert lay.coords(lay.rank_of(dp=d, sp=s, tp=t)) == RankCoords(
                    dp=d, sp=s, tp=t, local=t * sp + s)


@settings(max_examples=examples(150), deadline=None)
@given(grids())
def test_each_rank_sits_where_its_coords_say(cfg):
    dp, sp, tp = cfg
    world = dp * sp * tp
    lay = ParallelLayout(world, sp=sp, tp=tp)
    for rank in range(world):
        c = lay.coords(rank)
        spg, tpg = lay.sp_group_of(rank), lay.tp_group_of(rank)
        shg, dpg = lay.shift_group_of(rank), lay.dp_group_of(rank)
        assert spg in lay.sp_groups and tpg in lay.tp_groups
        assert shg in lay.shift_groups and dpg in lay.dp_groups
        # the position inside each group is the matching coordinate (= rank in that process group)
        assert spg.index(rank) == c.sp
        assert tpg.index(rank) == c.tp
        assert shg.index(rank) == c.local
        assert dpg.index(rank) == c.dp
        assert set(spg) & set(tpg) == {rank}
        assert set(spg) <= set(shg) and set(tpg) <= set(shg)
        assert set(dpg) & set(shg) == {rank}
        # SP peers share (dp, tp): the same TP weight shard; TP peers share (dp, sp)
        assert all((lay.coords(p).dp, lay.coords(p).tp) == (c.dp, c.tp) for p in spg)
        assert all((lay.coords(p).dp, lay.coords(p).sp) == (c.dp, c.sp) for p in tpg)
        assert all(lay.coords(p).local == c.local for p in dpg)


@settings(max_examples=examples(150), deadline=None)
@given(grids())
def test_default_and_explicit_dp_agree(cfg):
    dp, sp, tp = cfg
    world = dp * sp * tp
    implicit = ParallelLayout(world, sp=sp, tp=tp)
    explicit = ParallelLayout(world, sp=sp, tp=tp, dp=dp)
    assert implicit.dp == explicit.dp == dp
    assert implicit == explicit and hash(implicit) == hash(explicit)
    assert implicit.sp_groups == explicit.sp_groups
    assert implicit.tp_groups == explicit.tp_groups


@settings(max_examples=examples(300), deadline=None)
@given(
    world=st.integers(1, 64),
    sp=st.integers(1, 9),
    tp=st.integers(1, 9),
    dp=st.one_of(st.none(), st.integers(1, 12)),
)
def test_arbitrary_grid_is_built_or_rejected_with_numbers(world, sp, tp, dp):
    P = sp * tp
    divisible = world % P == 0
    dp_ok = dp is None or dp * P == world
    if divisible and dp_ok:
        lay = ParallelLayout(world, sp=sp, tp=tp, dp=dp)
        assert lay.dp == world // P
        assert_partition(lay.sp_groups, world, lay.dp * tp, sp)
        assert_partition(lay.tp_groups, world, lay.dp * sp, tp)
        return
    with pytest.raises(ValueError) as err:
        ParallelLayout(world, sp=sp, tp=tp, dp=dp)
    msg = str(err.value)
    broken = []  # the numbers each violated constraint must be reported with
    if not divisible:
        broken.append((world, P))
    if not dp_ok:
        broken.append((dp, world))
    assert any(mentions(msg, *nums) for nums in broken), (msg, broken)


# --------------------------------------------------------------------------- written-out examples


def test_example_world8_sp2_tp2():
    lay = ParallelLayout(8, sp=2, tp=2)
    assert lay.dp == 2
    assert lay.sp_groups == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.tp_groups == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.shift_groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lay.dp_groups == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.coords(6) == RankCoords(dp=1, sp=0, tp=1, local=2)
    assert lay.coords(3) == RankCoords(dp=0, sp=1, tp=1, local=3)
    assert lay.rank_of(dp=1, sp=1, tp=0) == 5


def test_example_paper_sp3_tp2():
    # The paper's SP=3, TP=2 replica in our canonical order (it labels ranks the other way round).
    lay = ParallelLayout(6, sp=3, tp=2)
    assert lay.dp == 1
    assert lay.sp_groups == [[0, 1, 2], [3, 4, 5]]
    assert lay.tp_groups == [[0, 3], [1, 4], [2, 5]]
    assert lay.shift_groups == [[0, 1, 2, 3, 4, 5]]
    assert lay.dp_groups == [[0], [1], [2], [3], [4], [5]]
    assert [(c.sp, c.tp) for c in map(lay.coords, range(6))] == [
        (0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    two = ParallelLayout(12, sp=3, tp=2)
    assert two.sp_groups == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert two.tp_groups == [[0, 3], [1, 4], [2, 5], [6, 9], [7, 10], [8, 11]]
    assert two.shift_groups == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
    assert two.dp_groups == [[0, 6], [1, 7], [2, 8], [3, 9], [4, 10], [5, 11]]


def test_example_pure_tp_and_pure_sp_and_pure_dp():
    tp4 = ParallelLayout(4, tp=4)
    assert tp4.sp_groups == [[0], [1], [2], [3]]
    assert tp4.tp_groups == [[0, 1, 2, 3]] == tp4.shift_groups
    sp4 = ParallelLayout(4, sp=4)
    assert sp4.sp_groups == [[0, 1, 2, 3]] == sp4.shift_groups
    assert sp4.tp_groups == [[0], [1], [2], [3]]
    dp4 = ParallelLayout(4)
    assert (dp4.dp, dp4.replica_size) == (4, 1)
    assert dp4.dp_groups == [[0, 1, 2, 3]]
    assert dp4.shift_groups == [[0], [1], [2], [3]]


# --------------------------------------------------------------------------- rejections


def test_rejects_world_not_divisible_by_sp_tp():
    with pytest.raises(ValueError, match=r"world_size=6.*sp\*tp=2\*2=4"):
        ParallelLayout(6, sp=2, tp=2)
    with pytest.raises(ValueError, match=r"world_size=10.*3"):
        ParallelLayout(10, sp=3)


def test_rejects_disagreeing_dp():
    with pytest.raises(ValueError, match=r"dp=3.*world_size=8"):
        ParallelLayout(8, sp=2, tp=2, dp=3)
    with pytest.raises(ValueError, match=r"dp"):
        ParallelLayout(8, sp=2, tp=2, dp=0)


def test_rejects_pipeline_parallelism():
    with pytest.raises(ValueError, match=r"pp=2"):
        ParallelLayout(8, pp=2)
    assert ParallelLayout(8, pp=1).dp == 8


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"world_size": 0}, r"world_size.*0"),
        ({"world_size": -4}, r"world_size.*-4"),
        ({"world_size": 4, "sp": 0}, r"sp.*0"),
        ({"world_size": 4, "tp": -2}, r"tp.*-2"),
        ({"world_size": 8.0}, r"world_size.*8\.0"),
        ({"world_size": "8"}, r"world_size.*'8'"),
        ({"world_size": 4, "sp": 2.0}, r"sp.*2\.0"),
        ({"world_size": 4, "tp": None}, r"tp.*None"),
        ({"world_size": 4, "sp": True}, r"sp.*True"),
        ({"world_size": 8, "sp": 2, "dp": 4.0}, r"dp.*4\.0"),
    ],
)
def test_rejects_bad_sizes(kwargs, pattern):
    world = kwargs.pop("world_size")
    with pytest.raises(ValueError, match=pattern):
        ParallelLayout(world, **kwargs)


def test_rejects_ranks_and_coords_outside_the_grid():
    lay = ParallelLayout(8, sp=2, tp=2)
    for bad in (-1, 8, 100):
        with pytest.raises(ValueError, match=r"rank"):
            lay.coords(bad)
        with pytest.raises(ValueError, match=r"rank"):
            lay.sp_group_of(bad)
    with pytest.raises(ValueError, match=r"rank"):
        lay.coords(1.0)
    for kw in ({"dp": 2}, {"sp": 2}, {"tp": 2}, {"sp": -1}):
        with pytest.raises(ValueError, match=r"coords"):
            lay.rank_of(**kw)


def test_layouts_do_not_import_torch():
    code = (
        "import sys, fusedpar, fusedpar.layouts\n"
        "fusedpar.ParallelLayout(8, sp=2, tp=2).weight_shards("
        "fusedpar.ModelDims(8, 2, 4, 16)).shard(3, 'qkv')\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton'))\n"
        "assert not bad, bad\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
