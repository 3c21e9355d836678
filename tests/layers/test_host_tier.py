"""The host KV tier against a plain reference copy of every sequence's KV.

Single process: random orders of prefill, decode, swap out, swap in and drop keep every resident
sequence's cache and every host copy bit-exact (caches and pool poisoned with NaN first, so a value
never written cannot pass); writers of replicated kv heads rotate and each head is kept once; capacity
errors name the numbers and change nothing. On gloo (2 and 4 processes): a sequence swapped out under
one layout and swapped in under another (SP <-> TP, DP <-> TP, with kv-head replication) leaves every
rank with exactly the cache a fresh prefill in the target layout holds (values and block tables),
the node keeps one host copy of the KV, and a swap that one rank cannot take is refused by all.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fusedpar.layers.host_tier import HostKVTier
from fusedpar.layers.kv_cache import PagedKVCache
from fusedpar.layers.step_plan import StepBatch
from fusedpar.layouts import ParallelLayout
from fusedpar.testing.dist import run_distributed
from tests.profile import examples

LAYERS, HEAD_DIM = 3, 4
NAN = float("nan")


def _cache(heads, block_size=4, num_blocks=64, dtype=torch.float32):
    c = PagedKVCache(num_layers=LAYERS, kv_heads=tuple(heads), head_dim=HEAD_DIM, block_size=block_size,
                     num_blocks=num_blocks, dtype=dtype)
    c.k.fill_(NAN)
    c.v.fill_(NAN)
    return c


def _tier(rank=0, world=1, q_heads=8, kv_heads=2, block_size=3, num_blocks=64, dtype=torch.float32):
    t = HostKVTier(rank=rank, world_size=world, num_layers=LAYERS, num_q_heads=q_heads, num_kv_heads=kv_heads,
                   head_dim=HEAD_DIM, block_size=block_size, num_blocks=num_blocks, dtype=dtype)
    t.pool.fill_(NAN)
    return t


def _kv(seq, n, kv_heads, dtype=torch.float32):
    """The full KV of a sequence, k and v [layers, n, kv_heads, head_dim], the same on every rank."""
    g = torch.Generator().manual_seed(1000 + seq)
    return (torch.randn(LAYERS, n, kv_heads, HEAD_DIM, generator=g).to(dtype),
            torch.randn(LAYERS, n, kv_heads, HEAD_DIM, generator=g).to(dtype))


def _cached_equals(cache, seq, k, v):
    """The cache holds exactly k, v [layers, n, local heads, hd] for seq."""
    if cache.seq_len(seq) != k.shape[1]:
        return False
    return all(torch.equal(cache.gather(layer, seq)[0], k[layer]) and torch.equal(cache.gather(layer, seq)[1], v[layer])
               for layer in range(LAYERS))


def _one(seq, cache):
    """A decode step of one token for seq."""
    return StepBatch((seq,), (1,), (cache.seq_len(seq),))


# ---- one process ------------------------------------------------------------------------------------
OPS = st.lists(st.tuples(st.sampled_from(["prefill", "prefill", "decode", "out", "out", "in", "in", "drop"]),
                         st.integers(0, 1000), st.integers(1, 11)), min_size=6, max_size=30)


@settings(max_examples=examples(40), deadline=None)
@given(ops=OPS, host_block=st.sampled_from([1, 3, 4, 8]), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_random_swap_orders_round_trip_bit_exact(ops, host_block, dtype):
    """op, pick, n: `pick` chooses among the sequences the op applies to (a new id for prefill)."""
    lay = ParallelLayout(1)
    cache = _cache((0, 1), block_size=4, num_blocks=48, dtype=dtype)
    tier = _tier(block_size=host_block, num_blocks=200, dtype=dtype)
    ref: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # seq -> its whole KV, resident or not
    gen = torch.Generator().manual_seed(len(ops))
    for op, pick, n in ops:
        resident = sorted(cache.block_tables)
        out = sorted(tier.sequences)
        if op == "prefill" and cache.free_blocks >= -(-n // 4):
            seq = max(ref, default=-1) + 1 + pick % 3
            k, v = (torch.randn(LAYERS, n, 2, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
            cache.fill(seq, k, v)
            ref[seq] = (k, v)
        elif op == "decode" and resident:
            seq = resident[pick % len(resident)]
            if cache.blocks_needed(_one(seq, cache)) > cache.free_blocks:
                continue
            k, v = (torch.randn(LAYERS, 1, 2, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
            slots = cache.begin_step(_one(seq, cache))
            for layer in range(LAYERS):
                cache.write(layer, slots, k[layer], v[layer])
            ref[seq] = (torch.cat([ref[seq][0], k], 1), torch.cat([ref[seq][1], v], 1))
        elif op == "out" and resident:
            chosen = resident[pick % len(resident):][:1 + pick % 2]  # one or two sequences in one call
            free_before = cache.free_blocks
            tier.swap_out({s: (0, cache.seq_len(s)) for s in chosen}, cache, lay).synchronize()
            assert not set(chosen) & set(cache.block_tables) and cache.free_blocks > free_before
        elif op == "in" and out:
            chosen = out[pick % len(out):][:1 + pick % 2]
            if sum(-(-tier.sequences[s] // 4) for s in chosen) > cache.free_blocks:
                continue
            tier.swap_in({s: 0 for s in chosen}, cache, lay).wait()
            assert not any(tier.holds(s) for s in chosen)
        elif op == "drop" and out:
            seq = out[pick % len(out)]
            tier.drop([seq])
            del ref[seq]
        else:
            continue
        for s, (k, v) in ref.items():
            if s in cache.block_tables:
                assert _cached_equals(cache, s, k, v), f"resident sequence {s} after {op}"
            else:
                assert tier.holds(s), f"sequence {s} is neither resident nor in the tier"
                for h in (0, 1):
                    hk, hv = tier.read(s, h)
                    assert torch.equal(hk, k[:, :, h]) and torch.equal(hv, v[:, :, h]), f"host copy of {s}, head {h}"
        used = sum(2 * tier.blocks_for(t) for t in tier.sequences.values())
        assert tier.free_blocks() == tier.num_blocks - used


def test_swap_in_into_an_emptied_pool_gives_the_block_tables_and_values_of_a_fresh_prefill():
    lay = ParallelLayout(1)
    seqs = {3: 5, 9: 13, 4: 8}
    cache, fresh = _cache((0, 1)), _cache((0, 1))
    tier = _tier()
    for s, n in seqs.items():
        cache.fill(s, *_kv(s, n, 2))
    handle = tier.swap_out({s: (0, n) for s, n in seqs.items()}, cache, lay)
    assert handle.ready()  # CPU: synchronous, done on return
    assert cache.free_blocks == cache.num_blocks
    target = cache.reinterpret((0, 1))  # the same memory, blocks handed out afresh
    target.k.fill_(NAN)
    target.v.fill_(NAN)
    tier.swap_in({s: 0 for s in seqs}, target, lay)
    for s in sorted(seqs):  # swap_in fills in sequence order
        fresh.fill(s, *_kv(s, seqs[s], 2))
    assert target.block_tables == fresh.block_tables
    for s, n in seqs.items():
        assert _cached_equals(target, s, *_kv(s, n, 2))
    assert tier.free_blocks() == tier.num_blocks and not tier.sequences


def test_a_pool_that_fits_one_sequence_serves_it_again_and_again():
    """Blocks released by swap_in and drop go back to the pool (its every block used each round)."""
    lay = ParallelLayout(1)
    cache, tier = _cache((0, 1)), _tier(block_size=4, num_blocks=6)  # 2 heads x 3 blocks of 4 tokens
    for round_ in range(4):
        k, v = _kv(round_, 12, 2)
        cache.fill(round_, k, v)
        tier.swap_out({round_: (0, 12)}, cache, lay)
        assert tier.free_blocks() == 0
        if round_ % 2:
            tier.drop([round_])
        else:
            tier.swap_in({round_: 0}, cache, lay)
            assert _cached_equals(cache, round_, k, v)
            cache.free(round_)
        assert tier.free_blocks() == 6 and not tier.sequences


def test_replicated_heads_are_written_once_rotating_over_their_holders():
    """TP=4 with 2 kv heads: ranks (0, 1) cache head 0, (2, 3) head 1. Every rank runs swap_out (no
    communication), so four tiers in one process stand for the node."""
    lay = ParallelLayout(4, tp=4)
    pl = lay.head_placement(8, 2)
    tiers = [_tier(rank=r, world=4) for r in range(4)]
    caches = [_cache(pl.kv_heads(r, "base")) for r in range(4)]
    seqs = {10: 7, 11: 9, 12: 2, 13: 16}
    for r in range(4):
        for s, n in seqs.items():
            k, v = _kv(s, n, 2)
            heads = list(pl.kv_heads(r, "base"))
            caches[r].fill(s, k[:, :, heads], v[:, :, heads])
    for r in range(4):
        tiers[r].swap_out({s: (0, n) for s, n in seqs.items()}, caches[r], lay)
    for s, n in seqs.items():
        want = {0: (0, 1)[s % 2], 1: (2, 3)[s % 2]}
        assert all(t.writers(s) == want for t in tiers), s
        k, v = _kv(s, n, 2)
        for h in (0, 1):
            keepers = [r for r in range(4) if (s, h) in tiers[r]._kept]
            assert keepers == [want[h]]
            hk, hv = tiers[want[h]].read(s, h)
            assert torch.equal(hk, k[:, :, h]) and torch.equal(hv, v[:, :, h])
    used = [t.num_blocks - t.free_blocks() for t in tiers]
    assert all([tiers[0].free_blocks(r) for r in range(4)] == [t.free_blocks(r) for r in range(4)] for t in tiers)
    assert sum(used) == sum(2 * tiers[0].blocks_for(n) for n in seqs.values())  # one copy of each head
    assert all(c.free_blocks == c.num_blocks for c in caches)


def test_host_capacity_error_names_the_numbers_on_every_rank_and_changes_nothing():
    lay = ParallelLayout(2, tp=2)  # 2 kv heads: rank r writes head r
    tiers = [_tier(rank=r, world=2, block_size=4, num_blocks=5) for r in range(2)]
    caches = [_cache((r,)) for r in range(2)]
    for r in range(2):
        caches[r].fill(1, *(x[:, :, [r]] for x in _kv(1, 9, 2)))  # 3 host blocks per head
        caches[r].fill(2, *(x[:, :, [r]] for x in _kv(2, 9, 2)))
    for r in range(2):
        tiers[r].swap_out({1: (0, 9)}, caches[r], lay)
    for r in range(2):
        with pytest.raises(RuntimeError, match=r"host KV tier out of blocks: rank 0 needs 3 more .* 2 free of 5 "
                                               r"\(block_size 4"):
            tiers[r].swap_out({2: (0, 9)}, caches[r], lay)
        assert tiers[r].sequences == {1: 9} and caches[r].seq_len(2) == 9 and tiers[r].free_blocks() == 2


def test_swap_in_refuses_a_cache_without_room_and_keeps_the_host_copy():
    lay = ParallelLayout(1)
    cache, tier = _cache((0, 1), num_blocks=8), _tier()
    cache.fill(1, *_kv(1, 20, 2))
    tier.swap_out({1: (0, 20)}, cache, lay)
    cache.fill(2, *_kv(2, 16, 2))  # 4 of 8 blocks left, sequence 1 needs 5
    with pytest.raises(RuntimeError, match=r"needs 5 blocks for sequences \[1\], 4 free of 8 \(block_size 4\)"):
        tier.swap_in({1: 0}, cache, lay)
    assert tier.sequences == {1: 20} and 1 not in cache.block_tables
    cache.free(2)
    tier.swap_in({1: 0}, cache, lay)
    assert _cached_equals(cache, 1, *_kv(1, 20, 2))


def test_misuse_is_refused_with_the_numbers():
    lay = ParallelLayout(1)
    cache, tier = _cache((0, 1)), _tier()
    cache.fill(1, *_kv(1, 6, 2))
    with pytest.raises(ValueError, match="caches 6 tokens of sequence 1, the call says 7"):
        tier.swap_out({1: (0, 7)}, cache, lay)
    with pytest.raises(ValueError, match=r"cache holds kv heads \(0,\), .* places \(0, 1\)"):
        tier.swap_out({1: (0, 6)}, _cache((0,)), lay)
    with pytest.raises(ValueError, match="covers 2 ranks, the tier's world has 1"):
        tier.swap_out({1: (0, 6)}, cache, ParallelLayout(2))
    tier.swap_out({1: (0, 6)}, cache, lay)
    cache.fill(1, *_kv(1, 6, 2))
    with pytest.raises(ValueError, match="sequence 1 is already in the host tier"):
        tier.swap_out({1: (0, 6)}, cache, lay)
    with pytest.raises(ValueError, match=r"already holds sequences \[1\]"):
        tier.swap_in({1: 0}, cache, lay)
    with pytest.raises(KeyError, match="sequence 5 is not in the host KV tier"):
        tier.swap_in({5: 0}, cache, lay)
    with pytest.raises(ValueError, match="num_blocks must be an int >= 1, got 0"):
        HostKVTier(rank=0, world_size=1, num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=4, block_size=4,
                   num_blocks=0, dtype=torch.float32)


# ---- gloo ---------------------------------------------------------------------------------------------
# (sp, tp) source -> target, each sequence's replica in both; 8 q / 2 kv heads (replicated at P = 4)
CASES4 = {
    "sp4->tp4": ((4, 1), (1, 4), lambda s, dp: 0, lambda s, dp: 0),
    "tp4->sp4": ((1, 4), (4, 1), lambda s, dp: 0, lambda s, dp: 0),
    "tp4->dp4": ((1, 4), (1, 1), lambda s, dp: 0, lambda s, dp: s % dp),
    "dp4->tp4": ((1, 1), (1, 4), lambda s, dp: s % dp, lambda s, dp: 0),
    "dp2xsp2->dp2xtp2": ((2, 1), (1, 2), lambda s, dp: s % dp, lambda s, dp: (s + 1) % dp),
    "dp2xtp2->sp4": ((1, 2), (4, 1), lambda s, dp: (s + 1) % dp, lambda s, dp: 0),
    "sp2xtp2->dp4": ((2, 2), (1, 1), lambda s, dp: 0, lambda s, dp: (s + 3) % dp),
}
SEQS = {7: 5, 8: 17, 9: 33, 12: 1}


def _switch(rank, world, q_heads, kv_heads, spec, seqs, host_block, cache_block=4):
    """Prefill `seqs` under the source layout, swap all out, swap all in under the target layout on the
    same pool memory (reinterpret); compare with a fresh prefill in the target layout."""
    (s_sp, s_tp), (d_sp, d_tp), src_rep, dst_rep = spec
    src, dst = ParallelLayout(world, sp=s_sp, tp=s_tp), ParallelLayout(world, sp=d_sp, tp=d_tp)
    heads = src.head_placement(q_heads, kv_heads).kv_heads(rank, "base")
    target_heads = dst.head_placement(q_heads, kv_heads).kv_heads(rank, "base")
    cache = _cache(heads, block_size=cache_block, num_blocks=96)
    tier = _tier(rank, world, q_heads, kv_heads, block_size=host_block, num_blocks=400)
    reps = {s: (src_rep(s, src.dp), dst_rep(s, dst.dp)) for s in seqs}
    for s, n in sorted(seqs.items()):
        if src.coords(rank).dp == reps[s][0]:
            k, v = _kv(s, n, kv_heads)
            cache.fill(s, k[:, :, list(heads)], v[:, :, list(heads)])
    tier.swap_out({s: (reps[s][0], n) for s, n in seqs.items()}, cache, src)
    emptied = cache.free_blocks == cache.num_blocks
    used = [tier.num_blocks - tier.free_blocks(r) for r in range(world)]
    target = cache.reinterpret(target_heads)
    target.k.fill_(NAN)
    target.v.fill_(NAN)
    tier.swap_in({s: reps[s][1] for s in seqs}, target, dst).synchronize()
    fresh = _cache(target_heads, block_size=cache_block, num_blocks=target.num_blocks)
    ok, held = True, []
    for s, n in sorted(seqs.items()):
        if dst.coords(rank).dp != reps[s][1]:
            ok &= s not in target.block_tables
            continue
        held.append(s)
        k, v = _kv(s, n, kv_heads)
        fresh.fill(s, k[:, :, list(target_heads)], v[:, :, list(target_heads)])
        ok &= _cached_equals(target, s, k[:, :, list(target_heads)], v[:, :, list(target_heads)])
    return {"ok": ok and target.block_tables == fresh.block_tables, "held": held, "emptied": emptied,
            "used": used, "tier_empty": not tier.sequences and tier.free_blocks() == tier.num_blocks,
            "host_blocks": sum(kv_heads * tier.blocks_for(n) for n in seqs.values()), "P": dst.replica_size,
            "seqs": sorted(seqs)}


def _worker4(rank, world):
    out = {}
    for i, (name, spec) in enumerate(CASES4.items()):
        host_block = 4 if i % 2 else 5  # the cache's block size, or another
        out[(name, host_block)] = _switch(rank, world, 8, 2, spec, SEQS, host_block)
    # seeded random rounds: random layouts, replicas and sequence lengths, the same on every rank
    rng = random.Random(20)
    splits = [(1, 1), (1, 2), (2, 1), (1, 4), (4, 1), (2, 2)]
    for i in range(4):
        a, b = rng.choice(splits), rng.choice(splits)
        seqs = {rng.randrange(100): rng.randrange(1, 40) for _ in range(rng.randrange(1, 5))}
        ra, rb = rng.randrange(4), rng.randrange(4)
        spec = (a, b, lambda s, dp, ra=ra: (s + ra) % dp, lambda s, dp, rb=rb: (s + rb) % dp)
        out[(f"random{i} {a}->{b}", 3)] = _switch(rank, world, 8, 2, spec, seqs, 3)
    return out


def test_swap_in_under_another_layout_on_4_gloo_ranks_matches_a_fresh_prefill():
    res = run_distributed(_worker4, 4, timeout=300)
    for key in res[0]:
        for rank, out in enumerate(res):
            r = out[key]
            assert r["ok"], f"rank {rank}, {key}: swapped-in cache differs from a fresh prefill"
            assert r["emptied"] and r["tier_empty"], f"rank {rank}, {key}: {r}"
            assert r["used"] == res[0][key]["used"], f"rank {rank}, {key}: directories disagree"
        assert sum(res[0][key]["used"]) == res[0][key]["host_blocks"], f"{key}: not one host copy of the KV"
        for s in res[0][key]["seqs"]:  # each sequence on every rank of one target replica, nowhere else
            assert sum(s in out[key]["held"] for out in res) == res[0][key]["P"], f"{key}: sequence {s}"
    # every sequence lands on the ranks of exactly one replica: tp4->dp4 spreads them over the ranks
    assert sorted(s for out in res for s in out[("tp4->dp4", 5)]["held"]) == sorted(SEQS)
    assert all(sorted(out[("dp4->tp4", 4)]["held"]) == sorted(SEQS) for out in res)


def _worker2(rank, world):
    out = {}
    dp_tp = ((1, 1), (1, 2), lambda s, dp: s % dp, lambda s, dp: 0)
    tp_dp = ((1, 2), (1, 1), lambda s, dp: 0, lambda s, dp: (s + 1) % dp)
    sp_tp = ((2, 1), (1, 2), lambda s, dp: 0, lambda s, dp: 0)
    for name, spec in {"dp2->tp2": dp_tp, "tp2->dp2": tp_dp, "sp2->tp2": sp_tp}.items():
        for q, kv in ((4, 2), (4, 1)):  # 1 kv head: replicated on both ranks of TP=2 / SP=2
            out[(name, kv)] = _switch(rank, world, q, kv, spec, SEQS, 4)
    # a target cache without room on rank 1 only: both ranks refuse, nothing moves, the tier keeps all
    lay = ParallelLayout(2, tp=2)
    cache, tier = _cache((rank,)), _tier(rank, 2, 4, 2, block_size=4)
    cache.fill(3, *(x[:, :, [rank]] for x in _kv(3, 12, 2)))
    tier.swap_out({3: (0, 12)}, cache, lay)
    cache = _cache((rank,), num_blocks=64 if rank == 0 else 2)
    out["refused"] = ""
    try:
        tier.swap_in({3: 0}, cache, lay)
    except (RuntimeError, KeyError) as exc:
        out["refused"] = str(exc)
    out["kept"] = tier.sequences
    return out


def test_swap_in_on_2_gloo_ranks_with_and_without_replication_and_refusing_together():
    res = run_distributed(_worker2, 2, timeout=300)
    for key in [k for k in res[0] if isinstance(k, tuple)]:
        for rank, out in enumerate(res):
            assert out[key]["ok"] and out[key]["emptied"] and out[key]["tier_empty"], f"rank {rank}, {key}"
        assert sum(res[0][key]["used"]) == res[0][key]["host_blocks"], key
    assert "refused on another rank" in res[0]["refused"]
    assert "needs 3 blocks for sequences [3], 2 free of 2" in res[1]["refused"]
    assert res[0]["kept"] == res[1]["kept"] == {3: 12}


# ---- GPU (torchrun, NCCL): pinned pool, side stream, transfers through the writers' devices ---------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swap_through_pinned_memory_on_nccl_matches_a_fresh_prefill(nccl_world, dtype):
    from fusedpar.testing.gpu import all_ranks_ok, local_device

    rank, world = nccl_world
    dev = local_device()
    seqs = {5: 300, 6: 17, 11: 1, 20: 129}
    splits = [(world, 1), (1, world), (1, 1)] + ([(2, world // 2)] if world >= 4 else [])
    for a in splits:
        for b in splits:
            src, dst = ParallelLayout(world, sp=a[0], tp=a[1]), ParallelLayout(world, sp=b[0], tp=b[1])
            heads = src.head_placement(8, 2).kv_heads(rank, "base")
            target_heads = dst.head_placement(8, 2).kv_heads(rank, "base")
            cache = PagedKVCache(num_layers=LAYERS, kv_heads=heads, head_dim=HEAD_DIM, block_size=16, num_blocks=128,
                                 dtype=dtype, device=dev)
            tier = HostKVTier(rank=rank, world_size=world, num_layers=LAYERS, num_q_heads=8, num_kv_heads=2,
                              head_dim=HEAD_DIM, block_size=16, num_blocks=256, dtype=dtype, device=dev)
            reps = {s: (s % src.dp, (s + 1) % dst.dp) for s in seqs}
            for s, n in seqs.items():
                if src.coords(rank).dp == reps[s][0]:
                    k, v = (x[:, :, list(heads)].to(dev) for x in _kv(s, n, 2, dtype))
                    cache.fill(s, k, v)
            tier.swap_out({s: (reps[s][0], n) for s, n in seqs.items()}, cache, src)
            target = cache.reinterpret(target_heads)  # the freed blocks are overwritten only after the gather
            target.k.fill_(NAN)
            target.v.fill_(NAN)
            handle = tier.swap_in({s: reps[s][1] for s in seqs}, target, dst)
            handle.wait()
            ok = tier.pool.is_pinned()
            for s, n in seqs.items():
                if dst.coords(rank).dp == reps[s][1]:
                    k, v = (x[:, :, list(target_heads)].to(dev) for x in _kv(s, n, 2, dtype))
                    ok &= _cached_equals(target, s, k, v)
            torch.cuda.synchronize()
            ok &= handle.ready() and not tier.sequences
            assert all_ranks_ok(bool(ok)), f"rank {rank}: {a} -> {b}, {dtype}"
