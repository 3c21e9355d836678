"""Weight shard maps: base shards and zero-copy shift views.

Every expectation is computed here from first principles (plain tensor parallelism of degree n
over global [out, in] weights), never taken from fusedpar.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusedpar import ModelDims, ParallelLayout, WeightShardMap
from fusedpar.layouts import WEIGHT_NAMES, Segment, WeightShard
from tests.layouts.test_heads import (
    CONTRACT,
    STRADDLING,
    accepted_head_configs,
    plain_tp_kv_heads,
    tp_shard_kv_heads,
)
from tests.profile import examples

Row = tuple[str, int]

DIM_OF = {"qkv": "out", "gate_up": "out", "o": "in", "down": "in"}
SOURCES_OF = {"qkv": {"q", "k", "v"}, "gate_up": {"gate", "up"}, "o": {"o"}, "down": {"down"}}


@st.composite
def shard_configs(draw, max_sp: int = 5, max_tp: int = 5, sp_one: bool = False):
    dp, sp, tp, h, h_kv = draw(accepted_head_configs(max_sp=1 if sp_one else max_sp, max_tp=max_tp))
    head_dim = draw(st.integers(1, 3))
    intermediate = sp * tp * draw(st.integers(1, 4))
    return ParallelLayout(dp * sp * tp, sp=sp, tp=tp), ModelDims(h, h_kv, head_dim, intermediate)


@st.composite
def contract_shard_configs(draw, pool=tuple(CONTRACT)):
    """A configuration the contract accepts (world <= 8, heads <= 64) with a head_dim and MLP size."""
    world, sp, tp, h, h_kv = draw(st.sampled_from(pool))
    head_dim = draw(st.integers(1, 2))
    intermediate = sp * tp * draw(st.integers(1, 3))
    return ParallelLayout(world, sp=sp, tp=tp), ModelDims(h, h_kv, head_dim, intermediate)


def global_sizes(dims: ModelDims) -> dict[str, int]:
    """Length along the sharded dim of every global source weight."""
    d, I = dims.head_dim, dims.intermediate_size
    qd, kvd = dims.num_q_heads * d, dims.num_kv_heads * d
    return {"q": qd, "k": kvd, "v": kvd, "o": qd, "gate": I, "up": I, "down": I}


def rows(segments) -> list[Row]:
    return [(seg.source, i) for seg in segments for i in range(seg.start, seg.stop)]


def head_rows(source: str, heads, head_dim: int) -> list[Row]:
    return [(source, i) for x in heads for i in range(x * head_dim, (x + 1) * head_dim)]


def span(source: str, start: int, stop: int) -> list[Row]:
    return [(source, i) for i in range(start, stop)]


def plain_tp_rows(name: str, dims: ModelDims, n: int, r: int) -> list[Row]:
    """Ordered rows (qkv, gate_up) or columns (o, down) rank r holds under plain TP of degree n.

    q/o: heads [r*h/n, (r+1)*h/n); k/v: vLLM's kv split/replication; gate/up rows and down
    columns: [r*I/n, (r+1)*I/n). Fused weights are [q | k | v] and [gate | up].
    """
    h, h_kv, d, I = dims.num_q_heads, dims.num_kv_heads, dims.head_dim, dims.intermediate_size
    qh, ich = h // n, I // n
    if name == "qkv":
        kv = plain_tp_kv_heads(h_kv, n, r)
        return span("q", r * qh * d, (r + 1) * qh * d) + head_rows("k", kv, d) + head_rows("v", kv, d)
    if name == "gate_up":
        return span("gate", r * ich, (r + 1) * ich) + span("up", r * ich, (r + 1) * ich)
    if name == "o":
        return span("o", r * qh * d, (r + 1) * qh * d)
    assert name == "down"
    return span("down", r * ich, (r + 1) * ich)


def all_shards(lay: ParallelLayout, wsm: WeightShardMap) -> dict[tuple[int, str], WeightShard]:
    return {(rank, name): wsm.shard(rank, name) for rank in range(lay.world_size) for name in WEIGHT_NAMES}


# --------------------------------------------------------------------------- properties


@settings(max_examples=examples(120), deadline=None)
@given(shard_configs())
def test_shift_view_is_plain_tp_over_the_replica(cfg):
    check_shift_view_is_plain_tp(*cfg)


def check_shift_view_is_plain_tp(lay: ParallelLayout, dims: ModelDims) -> None:
    P, sizes = lay.replica_size, global_sizes(dims)
    wsm = lay.weight_shards(dims)
    for (rank, name), sh in all_shards(lay, wsm).items():
        assert sh.name == name and sh.dim == DIM_OF[name]
        assert sh.torch_dim == (0 if DIM_OF[name] == "out" else 1)
        for seg in sh.base:  # every base segment is a real piece of a real source weight
            assert isinstance(seg, Segment)
            assert seg.source in SOURCES_OF[name]
            assert 0 <= seg.start < seg.stop <= sizes[seg.source]
        assert sh.size == sum(seg.stop - seg.start for seg in sh.base)
        lo, hi = sh.shift
        assert 0 <= lo < hi <= sh.size, "the shift view must lie inside the base tensor"
        base_rows = rows(sh.base)
        expected = plain_tp_rows(name, dims, P, lay.coords(rank).local)
        assert base_rows[lo:hi] == expected, (rank, name)
        assert rows(sh.shift_segments()) == expected, (rank, name)


@settings(max_examples=examples(120), deadline=None)
@given(shard_configs())
def test_base_shard_is_chunked_for_the_all_to_all(cfg):
    check_base_shard_is_chunked(*cfg)


def check_base_shard_is_chunked(lay: ParallelLayout, dims: ModelDims) -> None:
    # SP peers share one base tensor; block j of it is exactly SP peer j's shift view.
    wsm = lay.weight_shards(dims)
    shards = all_shards(lay, wsm)
    sp = lay.sp
    for rank in range(lay.world_size):
        c = lay.coords(rank)
        peers = lay.sp_group_of(rank)
        for name in WEIGHT_NAMES:
            sh = shards[rank, name]
            lo, hi = sh.shift
            block = hi - lo
            assert sh.size == sp * block
            assert (lo, hi) == (c.sp * block, (c.sp + 1) * block)
            base_rows = rows(sh.base)
            for j, peer in enumerate(peers):
                assert rows(shards[peer, name].base) == base_rows
                assert base_rows[j * block:(j + 1) * block] == rows(shards[peer, name].shift_segments())
            # dp peers hold identical shards
            assert shards[rank, name] == shards[c.local, name]
            assert wsm.shard(rank, name) == sh  # deterministic


@settings(max_examples=examples(120), deadline=None)
@given(shard_configs())
def test_base_covers_tp_shard_and_tp_group_covers_weight(cfg):
    check_base_covers_tp_shard_and_tp_group_covers_weight(*cfg)


def check_base_covers_tp_shard_and_tp_group_covers_weight(lay: ParallelLayout, dims: ModelDims) -> None:
    tp, sizes = lay.tp, global_sizes(dims)
    h, h_kv, d = dims.num_q_heads, dims.num_kv_heads, dims.head_dim
    wsm = lay.weight_shards(dims)
    shards = all_shards(lay, wsm)
    # one SP group = one TP shard t of the weights
    for g in lay.sp_groups:
        t = lay.coords(g[0]).tp
        for name in WEIGHT_NAMES:
            got = Counter(rows(shards[g[0], name].base))
            want = Counter(plain_tp_rows(name, dims, tp, t))
            if name == "qkv":
                q_got = Counter({k: v for k, v in got.items() if k[0] == "q"})
                q_want = Counter({k: v for k, v in want.items() if k[0] == "q"})
                assert q_got == q_want, "each q row of the TP shard exactly once"
                # k/v: the kv heads the shard's q heads read (plain TP's whenever tp fits h_kv)
                for src in "kv":
                    assert {k for k in got if k[0] == src} == set(head_rows(src, tp_shard_kv_heads(h, h_kv, tp, t), d))
            else:
                assert got == want, name
    # a TP group (fixed dp, sp) holds every row/column of every weight
    for g in lay.tp_groups:
        for name in WEIGHT_NAMES:
            got = Counter(r for rank in g for r in rows(shards[rank, name].base))
            full = Counter(r for src in sorted(SOURCES_OF[name]) for r in span(src, 0, sizes[src]))
            if name == "qkv":
                assert Counter({k: v for k, v in got.items() if k[0] == "q"}) == Counter(
                    {k: v for k, v in full.items() if k[0] == "q"})
                assert set(got) == set(full), "every k and v row reaches the TP group"
            else:
                assert got == full, name
    assert all(seg.size % d == 0 for (_, n), sh in shards.items() if n in ("qkv", "o") for seg in sh.base)


@settings(max_examples=examples(120), deadline=None)
@given(shard_configs())
def test_qkv_shift_block_is_q_then_k_then_v_of_the_rank_heads(cfg):
    lay, dims = cfg
    d = dims.head_dim
    wsm = lay.weight_shards(dims)
    hp = lay.head_placement(dims.num_q_heads, dims.num_kv_heads)
    for rank in range(lay.world_size):
        segs = wsm.shard(rank, "qkv").shift_segments()
        srcs = [seg.source for seg in segs]
        order = {"q": 0, "k": 1, "v": 2}
        assert srcs == sorted(srcs, key=order.__getitem__)
        assert set(srcs) == {"q", "k", "v"}
        rr = rows(segs)
        heads = hp.q_heads(rank, "shift")
        kv = hp.kv_heads(rank, "shift")
        assert [r for r in rr if r[0] == "q"] == head_rows("q", heads, d)
        assert [r for r in rr if r[0] == "k"] == head_rows("k", kv, d)
        assert [r for r in rr if r[0] == "v"] == head_rows("v", kv, d)
        o_cols = rows(wsm.shard(rank, "o").shift_segments())
        assert o_cols == head_rows("o", heads, d), "o columns follow the rank's q heads"


def check_shift_views_cover_each_weight(lay: ParallelLayout, dims: ModelDims) -> None:
    """Over one replica the shift views hold every element once, the k/v rows once per kv replica."""
    sizes, wsm = global_sizes(dims), lay.weight_shards(dims)
    rep = max(1, lay.replica_size // dims.num_kv_heads)
    for g in lay.shift_groups:
        for name in WEIGHT_NAMES:
            got = Counter(r for rank in g for r in rows(wsm.shard(rank, name).shift_segments()))
            want = Counter({r: rep if src in "kv" else 1 for src in SOURCES_OF[name] for r in span(src, 0, sizes[src])})
            assert got == want, name


def check_kv_invariance(lay: ParallelLayout, dims: ModelDims) -> None:
    """Each rank's base and shift qkv blocks carry the same heads, the ones HeadPlacement assigns it."""
    hp, wsm, d = lay.head_placement(dims.num_q_heads, dims.num_kv_heads), lay.weight_shards(dims), dims.head_dim
    for rank in range(lay.world_size):
        kv = hp.kv_heads(rank, "base")
        assert kv == hp.kv_heads(rank, "shift") and hp.q_heads(rank, "base") == hp.q_heads(rank, "shift")
        sh = wsm.shard(rank, "qkv")
        lo, hi = sh.shift
        block = rows(sh.base)[lo:hi]  # what this rank receives in base mode = its shift weight
        assert block == (head_rows("q", hp.q_heads(rank, "base"), d) + head_rows("k", kv, d) + head_rows("v", kv, d))


CONTRACT_CHECKS = (check_shift_view_is_plain_tp, check_base_shard_is_chunked,
                   check_base_covers_tp_shard_and_tp_group_covers_weight, check_shift_views_cover_each_weight,
                   check_kv_invariance)


@settings(max_examples=examples(150), deadline=None)
@given(contract_shard_configs())
def test_every_contract_config_shards_every_weight(cfg):
    """world <= 8, heads <= 64: KV invariance, shift views inside the base shards, full coverage."""
    for check in CONTRACT_CHECKS:
        check(*cfg)


@settings(max_examples=examples(60), deadline=None)
@given(contract_shard_configs(pool=tuple(STRADDLING)))
def test_straddling_kv_heads_shard_every_weight(cfg):
    for check in CONTRACT_CHECKS:
        check(*cfg)


@settings(max_examples=examples(80), deadline=None)
@given(shard_configs(sp_one=True))
def test_base_is_plain_tp_when_sp_is_one(cfg):
    lay, dims = cfg
    assert lay.sp == 1
    wsm = lay.weight_shards(dims)
    for rank in range(lay.world_size):
        t = lay.coords(rank).tp
        for name in WEIGHT_NAMES:
            sh = wsm.shard(rank, name)
            assert rows(sh.base) == plain_tp_rows(name, dims, lay.tp, t), (rank, name)
            assert sh.shift == (0, sh.size)


@settings(max_examples=examples(120), deadline=None)
@given(shard_configs(), st.integers(1, 64), st.sampled_from([1, 2, 4]))
def test_memory_is_plain_tp_plus_only_duplicated_kv(cfg, hidden, bpe):
    lay, dims = cfg
    wsm = lay.weight_shards(dims)
    assert wsm.kv_plan == "duplicate_columns"
    h, h_kv, d, I = dims.num_q_heads, dims.num_kv_heads, dims.head_dim, dims.intermediate_size
    P, sp, tp = lay.replica_size, lay.sp, lay.tp
    kv_per_rank = max(1, h_kv // P)
    for rank in range(lay.world_size):
        size = {n: wsm.shard(rank, n).size for n in WEIGHT_NAMES}
        assert size["o"] == h // tp * d
        assert size["gate_up"] == 2 * I // tp
        assert size["down"] == I // tp
        assert size["qkv"] == h // tp * d + 2 * sp * kv_per_rank * d
        assert wsm.base_bytes(rank, hidden, bpe) == sum(size.values()) * hidden * bpe
    if h_kv >= P:  # no replication: exactly plain TP=tp memory, zero shift overhead
        for rank in range(lay.world_size):
            t = lay.coords(rank).tp
            assert wsm.shard(rank, "qkv").size == len(plain_tp_rows("qkv", dims, tp, t))


# --------------------------------------------------------------------------- torch: zero-copy views


@pytest.mark.parametrize(
    ("world", "sp", "tp", "dims"),
    [
        (8, 2, 2, ModelDims(8, 2, 3, 8)),  # kv replicated inside the SP group
        (4, 2, 2, ModelDims(8, 8, 2, 12)),  # kv split
        (6, 3, 2, ModelDims(12, 2, 2, 6)),  # the paper's SP=3, TP=2
        (8, 2, 4, ModelDims(16, 2, 2, 16)),  # tp > h_kv
        (4, 4, 1, ModelDims(8, 4, 2, 8)),
        (3, 1, 3, ModelDims(6, 3, 2, 9)),
        (6, 2, 3, ModelDims(6, 2, 2, 6)),  # TP shards straddle the 2 kv heads
        (6, 3, 2, ModelDims(12, 3, 2, 12)),  # TP shards straddle the 3 kv heads
    ],
)
def test_shift_view_is_a_narrow_of_the_base_tensor(world, sp, tp, dims):
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(0)
    lay = ParallelLayout(world, sp=sp, tp=tp)
    wsm = lay.weight_shards(dims)
    hidden = 5
    sizes = global_sizes(dims)
    glob = {  # [out, in]: o and down are sharded along their input columns
        src: torch.randn(*((hidden, n) if src in ("o", "down") else (n, hidden)), generator=gen)
        for src, n in sizes.items()
    }
    for rank in range(world):
        local = lay.coords(rank).local
        for name in WEIGHT_NAMES:
            sh = wsm.shard(rank, name)
            dim = sh.torch_dim
            base = torch.cat([glob[s.source].narrow(dim, s.start, s.size) for s in sh.base], dim=dim)
            lo, hi = sh.shift
            view = base.narrow(dim, lo, hi - lo)
            assert view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
            ref_rows = plain_tp_rows(name, dims, sp * tp, local)
            ref = torch.cat([glob[src].narrow(dim, i, 1) for src, i in ref_rows], dim=dim)
            assert torch.equal(view, ref), (rank, name)


# --------------------------------------------------------------------------- written-out example


def test_example_sp2_tp2_h8_kv2():
    lay = ParallelLayout(4, sp=2, tp=2)
    wsm = lay.weight_shards(ModelDims(num_q_heads=8, num_kv_heads=2, head_dim=2, intermediate_size=8))
    S = Segment
    qkv1 = wsm.shard(1, "qkv")
    assert qkv1.base == (S("q", 0, 4), S("k", 0, 2), S("v", 0, 2), S("q", 4, 8), S("k", 0, 2), S("v", 0, 2))
    assert qkv1.shift == (8, 16)
    assert qkv1.shift_segments() == (S("q", 4, 8), S("k", 0, 2), S("v", 0, 2))
    qkv2 = wsm.shard(2, "qkv")
    assert qkv2.base == (
        S("q", 8, 12), S("k", 2, 4), S("v", 2, 4), S("q", 12, 16), S("k", 2, 4), S("v", 2, 4))
    assert qkv2.shift == (0, 8)
    gu1 = wsm.shard(1, "gate_up")
    assert gu1.base == (S("gate", 0, 2), S("up", 0, 2), S("gate", 2, 4), S("up", 2, 4))
    assert gu1.shift == (4, 8)
    assert gu1.shift_segments() == (S("gate", 2, 4), S("up", 2, 4))
    o3 = wsm.shard(3, "o")
    assert (o3.dim, o3.base, o3.shift) == ("in", (S("o", 8, 16),), (4, 8))
    assert o3.shift_segments() == (S("o", 12, 16),)
    down3 = wsm.shard(3, "down")
    assert (down3.dim, down3.base, down3.shift) == ("in", (S("down", 4, 8),), (2, 4))
    assert down3.shift_segments() == (S("down", 6, 8),)


def test_example_sp2_tp3_h6_kv2():
    # TP shard 1 = ranks 2, 3 holds q heads 2 and 3, which read kv heads 0 and 1: each SP block
    # carries its own chunk's kv head
    lay = ParallelLayout(6, sp=2, tp=3)
    wsm = lay.weight_shards(ModelDims(num_q_heads=6, num_kv_heads=2, head_dim=2, intermediate_size=6))
    S = Segment
    qkv2 = wsm.shard(2, "qkv")
    assert qkv2.base == (S("q", 4, 6), S("k", 0, 2), S("v", 0, 2), S("q", 6, 8), S("k", 2, 4), S("v", 2, 4))
    assert (qkv2.shift, wsm.shard(3, "qkv").shift) == ((0, 6), (6, 12))
    assert wsm.shard(3, "qkv").shift_segments() == (S("q", 6, 8), S("k", 2, 4), S("v", 2, 4))
    assert wsm.shard(0, "qkv").base == (
        S("q", 0, 2), S("k", 0, 2), S("v", 0, 2), S("q", 2, 4), S("k", 0, 2), S("v", 0, 2))
    o3 = wsm.shard(3, "o")
    assert (o3.base, o3.shift, o3.shift_segments()) == ((S("o", 4, 8),), (2, 4), (S("o", 6, 8),))


# --------------------------------------------------------------------------- rejections


def test_rejects_intermediate_size_not_divisible_by_replica():
    lay = ParallelLayout(4, sp=2, tp=2)
    with pytest.raises(ValueError, match=r"intermediate_size=6.*sp\*tp=2\*2=4"):
        lay.weight_shards(ModelDims(8, 2, 4, 6))
    with pytest.raises(ValueError, match=r"intermediate_size=9.*6"):
        ParallelLayout(6, sp=3, tp=2).weight_shards(ModelDims(12, 2, 4, 9))


@pytest.mark.parametrize(
    ("dims", "pattern"),
    [
        (ModelDims(8, 2, 0, 8), r"head_dim.*0"),
        (ModelDims(8, 2, -1, 8), r"head_dim.*-1"),
        (ModelDims(8, 2, 2.0, 8), r"head_dim.*2\.0"),
        (ModelDims(8, 2, 4, 0), r"intermediate_size.*0"),
        (ModelDims(8, 2, 4, "8"), r"intermediate_size.*'8'"),
        (ModelDims(6, 2, 4, 8), r"num_q_heads=6.*4"),
        (ModelDims(8, 3, 4, 8), r"num_q_heads=8.*num_kv_heads=3"),
        (ModelDims(0, 2, 4, 8), r"num_q_heads.*0"),
    ],
)
def test_rejects_bad_model_dims(dims, pattern):
    with pytest.raises(ValueError, match=pattern):
        ParallelLayout(4, sp=2, tp=2).weight_shards(dims)


def test_rejects_bad_weight_name_and_rank():
    wsm = ParallelLayout(4, sp=2, tp=2).weight_shards(ModelDims(8, 2, 4, 8))
    for bad in ("q_proj", "gate", "QKV", ""):
        with pytest.raises(ValueError, match=r"weight name"):
            wsm.shard(0, bad)
    for bad_rank in (-1, 4):
        with pytest.raises(ValueError, match=r"rank"):
            wsm.shard(bad_rank, "qkv")


def test_shard_problems_names_the_mlp_and_every_head_problem():
    from fusedpar.layouts import shard_problems

    layout = ParallelLayout(3, sp=3)
    assert shard_problems(layout, ModelDims(6, 3, 4, 12)) == []
    problems = shard_problems(layout, ModelDims(8, 2, 4, 128))
    assert len(problems) == 3
    assert "intermediate_size=128 is not divisible by sp*tp=3*1=3" in problems[0]
    assert "num_q_heads=8 is not divisible by sp*tp=3*1=3" in problems[1]
    assert "num_kv_heads=2 is neither a multiple nor a divisor of sp*tp=3*1=3" in problems[2]
    with pytest.raises(ValueError, match=r"intermediate_size=128 .*; num_q_heads=8 .*; num_kv_heads=2"):
        WeightShardMap(layout, ModelDims(8, 2, 4, 128))
