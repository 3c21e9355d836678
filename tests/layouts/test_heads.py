"""Head placement: base and shift mode derived independently must agree (KV-cache invariance)."""

from __future__ import annotations

import math
import re
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusedpar import HeadPlacement, ParallelLayout
from fusedpar.layouts import MODES, check_head_counts, check_mode, head_count_problems
from tests.profile import examples


def mentions(msg: str, *numbers: int) -> bool:
    """True if every number appears in msg as a whole number (not as part of a longer one)."""
    return all(re.search(rf"(?<!\d){n}(?!\d)", msg) for n in numbers)


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


@st.composite
def accepted_head_configs(draw, max_sp: int = 6, max_tp: int = 6, max_dp: int = 2):
    """(dp, sp, tp, h, h_kv) built to satisfy every constraint, covering the whole accepted set
    within the bounds: h_kv a multiple or a divisor of P (whatever tp); h a multiple of h_kv and of P."""
    sp = draw(st.integers(1, max_sp))
    tp = draw(st.integers(1, max_tp))
    dp = draw(st.integers(1, max_dp))
    P = sp * tp
    big = [P * m for m in (1, 2, 3)]
    h_kv = draw(st.sampled_from(sorted(set(divisors(P) + big))))
    g_unit = P // math.gcd(P, h_kv)  # smallest GQA group size that makes h divisible by P
    h = h_kv * g_unit * draw(st.integers(1, 3))
    return dp, sp, tp, h, h_kv


def contract_configs(max_world: int = 8, max_heads: int = 64) -> list[tuple[int, int, int, int, int]]:
    """Every (world, sp, tp, h, h_kv) the contract accepts with world <= max_world and h <= max_heads:
    sp*tp | world, h_kv | h, sp*tp | h, and h_kv | sp*tp or sp*tp | h_kv."""
    out = []
    for world in range(1, max_world + 1):
        for sp in divisors(world):
            for tp in divisors(world // sp):
                P = sp * tp
                for h_kv in range(1, max_heads + 1):
                    if P % h_kv and h_kv % P:
                        continue
                    out += [(world, sp, tp, h, h_kv) for h in range(h_kv, max_heads + 1, h_kv) if h % P == 0]
    return out


CONTRACT = contract_configs()
# kv heads neither a multiple nor a divisor of tp: a base-mode TP shard straddles kv groups
STRADDLING = [c for c in CONTRACT if c[4] % c[2] and c[2] % c[4]]


def tp_shard_kv_heads(h: int, h_kv: int, tp: int, t: int) -> tuple[int, ...]:
    """The kv heads the q heads of TP shard t read (plain TP's kv heads whenever tp fits h_kv)."""
    return tuple(sorted({x // (h // h_kv) for x in plain_tp_q_heads(h, tp, t)}))


def plain_tp_q_heads(h: int, n: int, r: int) -> tuple[int, ...]:
    """q heads of rank r under plain tensor parallelism of degree n (from first principles)."""
    return tuple(range(r * h // n, (r + 1) * h // n))


def plain_tp_kv_heads(h_kv: int, n: int, r: int) -> tuple[int, ...]:
    """kv heads of rank r under plain TP of degree n: split when n <= h_kv, else each kv head is
    replicated on n / h_kv consecutive ranks (vLLM's rule)."""
    if n <= h_kv:
        return tuple(range(r * h_kv // n, (r + 1) * h_kv // n))
    return (r // (n // h_kv),)


def check_placement(lay: ParallelLayout, hp: HeadPlacement, h: int, h_kv: int) -> None:
    P, tp = lay.replica_size, lay.tp
    group = h // h_kv
    rep = max(1, P // h_kv)
    assert (hp.num_q_heads, hp.num_kv_heads) == (h, h_kv)
    assert hp.group_size == group
    assert hp.q_heads_per_rank == h // P
    assert hp.kv_heads_per_rank == max(1, h_kv // P)
    assert hp.kv_replication == rep
    assert all(hp.kv_head_of(q) == q // group for q in range(h))

    for d in range(lay.dp):
        for mode in MODES:
            q_count: Counter[int] = Counter()
            kv_count: Counter[int] = Counter()
            for local in range(P):
                rank = d * P + local
                q, kv = hp.q_heads(rank, mode), hp.kv_heads(rank, mode)
                assert isinstance(q, tuple) and isinstance(kv, tuple)
                assert all(isinstance(x, int) and 0 <= x < h for x in q)
                assert all(isinstance(x, int) and 0 <= x < h_kv for x in kv)
                assert len(q) == h // P == len(set(q))
                assert len(kv) == max(1, h_kv // P) == len(set(kv))
                # GQA groups stay together: every q head finds its kv head on the same rank, and the
                # rank caches no kv head that none of its q heads reads (in ascending order)
                needed = {x // group for x in q}
                assert needed <= set(kv)
                assert kv == tuple(sorted(needed))
                idx = hp.q_to_kv_index(rank, mode)
                assert len(idx) == len(q)
                assert tuple(kv[i] for i in idx) == tuple(x // group for x in q)
                q_count.update(q)
                kv_count.update(kv)
            assert q_count == Counter(range(h)), "each q head exactly once per replica"
            assert kv_count == Counter({k: rep for k in range(h_kv)}), "kv head replication"

    for rank in range(lay.world_size):
        c = lay.coords(rank)
        base_q, base_kv = hp.q_heads(rank, "base"), hp.kv_heads(rank, "base")
        shift_q, shift_kv = hp.q_heads(rank, "shift"), hp.kv_heads(rank, "shift")
        # KV-cache invariance: same heads, same order, on the same rank in both modes
        assert base_q == shift_q
        assert base_kv == shift_kv
        assert hp.q_to_kv_index(rank, "base") == hp.q_to_kv_index(rank, "shift") == hp.q_to_kv_index(rank)
        # shift mode is plain TP=P over the replica, natural order
        assert shift_q == plain_tp_q_heads(h, P, c.local)
        assert shift_kv == plain_tp_kv_heads(h_kv, P, c.local)
        # base mode only uses heads that the rank's TP=tp weight shard t holds
        assert set(base_q) <= set(plain_tp_q_heads(h, tp, c.tp))
        assert set(base_kv) <= set(tp_shard_kv_heads(h, h_kv, tp, c.tp))
        if h_kv % tp == 0 or tp % h_kv == 0:
            assert tp_shard_kv_heads(h, h_kv, tp, c.tp) == plain_tp_kv_heads(h_kv, tp, c.tp)
        # dp peers hold the same heads
        peer = c.local
        for mode in MODES:
            assert hp.q_heads(rank, mode) == hp.q_heads(peer, mode)
            assert hp.kv_heads(rank, mode) == hp.kv_heads(peer, mode)

    # the SP group of TP shard t shares out exactly that shard's q heads, in SP order
    for g in lay.sp_groups:
        t = lay.coords(g[0]).tp
        joined = tuple(x for r in g for x in hp.q_heads(r, "base"))
        assert joined == plain_tp_q_heads(h, tp, t)
        assert {x for r in g for x in hp.kv_heads(r, "base")} == set(tp_shard_kv_heads(h, h_kv, tp, t))


# --------------------------------------------------------------------------- properties


@settings(max_examples=examples(200), deadline=None)
@given(accepted_head_configs())
def test_accepted_configs_place_every_head_consistently(cfg):
    dp, sp, tp, h, h_kv = cfg
    lay = ParallelLayout(dp * sp * tp, sp=sp, tp=tp)
    check_head_counts(h, h_kv, sp, tp)  # must not raise
    hp = lay.head_placement(h, h_kv)
    assert isinstance(hp, HeadPlacement)
    check_placement(lay, hp, h, h_kv)


@settings(max_examples=examples(300), deadline=None)
@given(st.sampled_from(CONTRACT))
def test_every_contract_config_places_every_head_consistently(cfg):
    world, sp, tp, h, h_kv = cfg
    lay = ParallelLayout(world, sp=sp, tp=tp)
    check_placement(lay, lay.head_placement(h, h_kv), h, h_kv)


@settings(max_examples=examples(100), deadline=None)
@given(st.sampled_from(STRADDLING))
def test_straddling_kv_heads_are_placed_consistently(cfg):
    world, sp, tp, h, h_kv = cfg
    lay = ParallelLayout(world, sp=sp, tp=tp)
    check_placement(lay, lay.head_placement(h, h_kv), h, h_kv)


def test_no_contract_config_is_rejected():
    """Every configuration of world <= 8, <= 64 heads that the contract accepts is placed, with
    KV-cache invariance on every rank; among them the ones whose kv heads straddle TP shards."""
    assert len(CONTRACT) == 4866
    assert {(w, sp, tp, h_kv) for w, sp, tp, _, h_kv in STRADDLING} == {(6, 2, 3, 2), (6, 3, 2, 3)}
    assert len(STRADDLING) == 20
    for world, sp, tp, h, h_kv in CONTRACT:
        assert head_count_problems(h, h_kv, sp, tp) == []
        hp = ParallelLayout(world, sp=sp, tp=tp).head_placement(h, h_kv)
        for rank in range(world):
            assert hp.q_heads(rank, "base") == hp.q_heads(rank, "shift")
            assert hp.kv_heads(rank, "base") == hp.kv_heads(rank, "shift")
    # one written out for each kind: q heads of each world=6, SP x TP replica, kv heads per rank
    for rank in range(6):
        assert ParallelLayout(6, sp=2, tp=3).head_placement(6, 2).kv_heads(rank, "base") == (rank // 3,)
        assert ParallelLayout(6, sp=3, tp=2).head_placement(6, 3).kv_heads(rank, "base") == (rank // 2,)


def violations(sp: int, tp: int, h: int, h_kv: int) -> list[tuple[int, ...]]:
    """The constraints (h, h_kv) break on an sp x tp replica, each as the numbers to be named."""
    P = sp * tp
    out = []
    if h % h_kv:
        out.append((h, h_kv))
    if h % P:
        out.append((h, P))
    if h_kv % P and P % h_kv:
        out.append((h_kv, P))
    return out


@settings(max_examples=examples(400), deadline=None)
@given(
    sp=st.integers(1, 6),
    tp=st.integers(1, 6),
    h=st.integers(1, 48),
    h_kv=st.integers(1, 16),
)
def test_arbitrary_head_counts_are_placed_or_rejected_with_numbers(sp, tp, h, h_kv):
    lay = ParallelLayout(sp * tp, sp=sp, tp=tp)
    broken = violations(sp, tp, h, h_kv)
    if not broken:
        check_placement(lay, lay.head_placement(h, h_kv), h, h_kv)
        return
    with pytest.raises(ValueError) as err:
        lay.head_placement(h, h_kv)
    msg = str(err.value)
    assert all(mentions(msg, *nums) for nums in broken), (msg, broken)
    assert len(head_count_problems(h, h_kv, sp, tp)) == len(broken) == msg.count(";") + 1
    with pytest.raises(ValueError):
        check_head_counts(h, h_kv, sp, tp)


# --------------------------------------------------------------------------- written-out examples


def test_example_sp2_tp2_h12_kv4():
    hp = ParallelLayout(8, sp=2, tp=2).head_placement(12, 4)
    for rank in range(8):
        r = rank % 4
        for mode in MODES:
            assert hp.q_heads(rank, mode) == (3 * r, 3 * r + 1, 3 * r + 2)
            assert hp.kv_heads(rank, mode) == (r,)
            assert hp.q_to_kv_index(rank, mode) == (0, 0, 0)


def test_example_paper_sp3_tp2_replicated_kv():
    # P=6 > h_kv=2: each kv head is cached by 3 ranks
    hp = ParallelLayout(6, sp=3, tp=2).head_placement(12, 2)
    assert hp.kv_replication == 3
    for mode in MODES:
        assert [hp.q_heads(r, mode) for r in range(6)] == [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11)]
        assert [hp.kv_heads(r, mode) for r in range(6)] == [(0,), (0,), (0,), (1,), (1,), (1,)]


def test_example_kv_split_inside_sp_group():
    # sp=2, tp=1, h=8, h_kv=4: rank 0 caches kv 0,1 and rank 1 kv 2,3
    hp = ParallelLayout(2, sp=2).head_placement(8, 4)
    for mode in MODES:
        assert hp.q_heads(0, mode) == (0, 1, 2, 3)
        assert hp.kv_heads(0, mode) == (0, 1)
        assert hp.kv_heads(1, mode) == (2, 3)
        assert hp.q_to_kv_index(1, mode) == (0, 0, 1, 1)


def test_example_tp_larger_than_kv_heads():
    # tp=4 > h_kv=2 with sp=2: P=8, each kv head on 4 ranks
    hp = ParallelLayout(8, sp=2, tp=4).head_placement(16, 2)
    for mode in MODES:
        assert [hp.kv_heads(r, mode) for r in range(8)] == [(0,)] * 4 + [(1,)] * 4
        assert [hp.q_heads(r, mode) for r in range(8)] == [(2 * r, 2 * r + 1) for r in range(8)]


# --------------------------------------------------------------------------- rejections


def test_rejects_q_heads_not_multiple_of_kv_heads():
    lay = ParallelLayout(4, sp=2, tp=2)
    with pytest.raises(ValueError, match=r"num_q_heads=8.*num_kv_heads=3"):
        lay.head_placement(8, 3)


def test_rejects_q_heads_not_divisible_by_replica():
    lay = ParallelLayout(4, sp=2, tp=2)
    with pytest.raises(ValueError, match=r"num_q_heads=6.*sp\*tp=2\*2=4"):
        lay.head_placement(6, 2)
    with pytest.raises(ValueError, match=r"num_q_heads=10.*6"):
        ParallelLayout(6, sp=3, tp=2).head_placement(10, 2)


def test_rejects_kv_heads_incompatible_with_replica():
    # 6 kv heads on P=4: neither a multiple nor a divisor
    with pytest.raises(ValueError, match=r"num_kv_heads=6.*sp\*tp=4\*1=4"):
        ParallelLayout(4, sp=4).head_placement(24, 6)
    with pytest.raises(ValueError, match=r"num_kv_heads=4.*6"):
        ParallelLayout(6, sp=3, tp=2).head_placement(12, 4)


def test_example_kv_heads_straddling_tp_shards():
    # h_kv=2 divides P=6 but not TP=3: TP shard 1 (ranks 2, 3) holds q heads 2 and 3, which read
    # kv heads 0 and 1; each SP rank receives its own chunk's kv head
    hp = ParallelLayout(6, sp=2, tp=3).head_placement(6, 2)
    assert hp.kv_replication == 3
    for mode in MODES:
        assert [hp.q_heads(r, mode) for r in range(6)] == [(r,) for r in range(6)]
        assert [hp.kv_heads(r, mode) for r in range(6)] == [(0,), (0,), (0,), (1,), (1,), (1,)]
        assert all(hp.q_to_kv_index(r, mode) == (0,) for r in range(6))
    # h_kv=3 divides P=6 but TP=2 does not divide it: TP shard 0 (ranks 0-2) reads kv heads 0 and 1
    hp = ParallelLayout(12, sp=3, tp=2).head_placement(12, 3)
    for mode in MODES:
        assert [hp.q_heads(r, mode) for r in range(12)] == [(2 * r, 2 * r + 1) for r in range(6)] * 2
        assert [hp.kv_heads(r, mode) for r in range(12)] == [(r // 2,) for r in range(6)] * 2
    # the tp rule is gone; the replica rule still names its numbers
    with pytest.raises(ValueError, match=r"num_kv_heads=4 is neither a multiple nor a divisor of sp\*tp=2\*3=6"):
        ParallelLayout(6, sp=2, tp=3).head_placement(12, 4)


@pytest.mark.parametrize(
    ("h", "h_kv", "pattern"),
    [
        (0, 1, r"num_q_heads.*0"),
        (-4, 2, r"num_q_heads.*-4"),
        (8, 0, r"num_kv_heads.*0"),
        (8.0, 2, r"num_q_heads.*8\.0"),
        (8, "2", r"num_kv_heads.*'2'"),
        (8, None, r"num_kv_heads.*None"),
    ],
)
def test_rejects_bad_head_counts(h, h_kv, pattern):
    with pytest.raises(ValueError, match=pattern):
        ParallelLayout(2, sp=2).head_placement(h, h_kv)


def test_rejects_bad_mode_and_rank():
    hp = ParallelLayout(4, sp=2, tp=2).head_placement(8, 4)
    for bad in ("tp", "sp", "Base", "", None):
        with pytest.raises(ValueError, match=r"mode"):
            hp.q_heads(0, bad)
        with pytest.raises(ValueError, match=r"mode"):
            hp.kv_heads(0, bad)
        with pytest.raises(ValueError, match=r"mode"):
            check_mode(bad)
    assert MODES == ("base", "shift")
    assert all(check_mode(m) == m for m in MODES)
    for bad_rank in (-1, 4):
        with pytest.raises(ValueError, match=r"rank"):
            hp.q_heads(bad_rank, "base")
        with pytest.raises(ValueError, match=r"rank"):
            hp.kv_heads(bad_rank, "shift")


def test_every_broken_constraint_is_named():
    """head_count_problems / check_head_counts name every constraint a head count breaks, not the first."""
    assert head_count_problems(16, 4, 2, 2) == []
    problems = head_count_problems(9, 3, 2, 2)  # 9 q heads on 4 ranks; 3 kv heads vs P=4
    assert len(problems) == 2
    assert "num_q_heads=9 is not divisible by sp*tp=2*2=4" in problems[0]
    assert "num_kv_heads=3 is neither a multiple nor a divisor of sp*tp=2*2=4" in problems[1]
    with pytest.raises(ValueError, match=r"not divisible by sp\*tp=2\*2=4: .*; num_kv_heads=3 .*sp\*tp=2\*2=4"):
        ParallelLayout(4, sp=2, tp=2).head_placement(9, 3)
    problems = head_count_problems(10, 4, 2, 3)  # all three: 10 % 4, 10 % 6, 4 vs 6
    assert len(problems) == 3
    assert "num_q_heads=10 is not a multiple of num_kv_heads=4" in problems[0]
    assert "num_q_heads=10 is not divisible by sp*tp=2*3=6" in problems[1]
    assert "num_kv_heads=4 is neither a multiple nor a divisor of sp*tp=2*3=6" in problems[2]


@pytest.mark.parametrize(("sp", "tp", "needle"), [(-2, -2, "sp must be >= 1, got -2"), (2, 0, "tp must be >= 1, got 0"),
                                                  (0, 2, "sp must be >= 1, got 0"), (1.5, 2, "sp must be an int"),
                                                  (True, 2, "sp must be an int, got True")])
def test_head_count_checks_refuse_bad_sizes(sp, tp, needle):
    """The exported checks validate sp and tp themselves (no negative size is placeable, sp=0 is no
    ZeroDivisionError)."""
    for call in (head_count_problems, check_head_counts):
        with pytest.raises(ValueError, match=needle):
            call(8, 2, sp, tp)
