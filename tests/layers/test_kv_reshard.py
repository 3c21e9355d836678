"""KV reshard plans carried out on 4 gloo ranks: after a switch every rank of each sequence's target
replica caches exactly its target kv heads' values, on the same pool memory, with the bytes the plan
moves (none between SP x TP splits of one replica size)."""

from __future__ import annotations

import pytest

from fusedpar.testing.dist import run_distributed

LAYERS, HEAD_DIM, BLOCK, BLOCKS = 3, 4, 4, 64
SEQS = {7: 5, 8: 17, 9: 33}  # seq -> tokens
# (sp, tp) source -> target on 4 ranks, and each sequence's replica in both
CASES = {
    "sp4->tp4": ((4, 1), (1, 4), lambda s, dp: 0, lambda s, dp: 0),
    "tp4->dp4": ((1, 4), (1, 1), lambda s, dp: 0, lambda s, dp: s % dp),
    "dp4->tp4": ((1, 1), (1, 4), lambda s, dp: s % dp, lambda s, dp: 0),
    "dp2xsp2->tp4": ((2, 1), (1, 4), lambda s, dp: s % dp, lambda s, dp: 0),
    "tp2->sp2": ((1, 2), (2, 1), lambda s, dp: (s + 1) % dp, lambda s, dp: s % dp),
}


def _values(seq, heads, n):
    import torch

    layer = torch.arange(LAYERS).view(-1, 1, 1, 1)
    pos = torch.arange(n).view(1, -1, 1, 1)
    head = torch.tensor(heads).view(1, 1, -1, 1)
    d = torch.arange(HEAD_DIM).view(1, 1, 1, -1)
    k = (seq * 1000 + layer * 100 + head * 10 + pos * 0.01 + d * 0.001).float()
    return k, -k


def _worker(rank, world):
    import torch

    from fusedpar.layers.kv_cache import PagedKVCache
    from fusedpar.layers.kv_reshard import migrate_kv
    from fusedpar.layouts import ModelDims, ParallelLayout, kv_plan

    dims = ModelDims(8, 2, HEAD_DIM, 16)
    out = {}
    for name, ((s_sp, s_tp), (d_sp, d_tp), src_rep, dst_rep) in CASES.items():
        src, dst = ParallelLayout(world, sp=s_sp, tp=s_tp), ParallelLayout(world, sp=d_sp, tp=d_tp)
        ps, pd = src.head_placement(8, 2), dst.head_placement(8, 2)
        reps = {s: (src_rep(s, src.dp), dst_rep(s, dst.dp)) for s in SEQS}
        plan = kv_plan(src, dst, dims, reps)
        heads = ps.kv_heads(rank, "base")
        cache = PagedKVCache(num_layers=LAYERS, kv_heads=heads, head_dim=HEAD_DIM, block_size=BLOCK,
                             num_blocks=BLOCKS, dtype=torch.float32)
        for seq, n in SEQS.items():
            if src.coords(rank).dp == reps[seq][0]:
                cache.fill(seq, *_values(seq, heads, n))
        sequences = {s: (src.coords(rank).dp == reps[s][0], dst.coords(rank).dp == reps[s][1], n)
                     for s, n in SEQS.items()}
        target_heads = pd.kv_heads(rank, "base")
        new, received = migrate_kv(cache, rank, plan, target_heads, sequences)
        ok, held = True, []
        for seq, n in SEQS.items():
            if not sequences[seq][1]:
                continue
            held.append(seq)
            want_k, want_v = _values(seq, target_heads, n)
            for layer in range(LAYERS):
                k, v = new.gather(layer, seq)
                ok &= bool(torch.equal(k, want_k[layer]) and torch.equal(v, want_v[layer]))
        expect = sum(2 * LAYERS * SEQS[m.seq] * HEAD_DIM * 4 for m in plan if m.dst == rank)
        out[name] = {"ok": ok, "held": held, "received": received, "expect": expect,
                     "same_memory": new.k.untyped_storage().data_ptr() == cache.k.untyped_storage().data_ptr(),
                     "moves": len(plan)}
    return out


def test_kv_plans_carried_out_on_gloo_leave_every_target_head_cached():
    res = run_distributed(_worker, 4, timeout=300)
    for rank, out in enumerate(res):
        for name, r in out.items():
            assert r["ok"], f"rank {rank}, {name}: cached values differ from the sequence's"
            assert r["received"] == r["expect"], f"rank {rank}, {name}: {r}"
            assert r["same_memory"], f"rank {rank}, {name}: the target cache left the pool"
    assert all(out["sp4->tp4"]["moves"] == 0 for out in res)
    assert all(out["sp4->tp4"]["received"] == 0 for out in res)
    assert sum(out["tp4->dp4"]["received"] for out in res) > 0
    # tp4 -> dp4 spreads the sequences over the replicas: each rank ends with the ones assigned to it
    assert sorted(s for out in res for s in out["tp4->dp4"]["held"]) == sorted(SEQS)


# random values, a fragmented source pool, the target checked against a plain reference
RAND_SEQS = {3: 1, 4: 6, 5: 13, 6: 4, 11: 9}  # odd counts ending mid-block (block 4), one full block
RAND_CASES = {
    2: [((1, 2), (1, 1)), ((1, 1), (1, 2)), ((2, 1), (1, 2)), ((1, 2), (2, 1))],
    4: [((1, 4), (1, 1)), ((1, 1), (1, 4)), ((4, 1), (1, 4)), ((1, 4), (4, 1)), ((2, 1), (1, 4)),
        ((1, 4), (1, 2)), ((1, 2), (2, 1)), ((1, 1), (2, 2))],
}


def _rand_values(seq, n, kv_heads, trial):
    import torch

    g = torch.Generator().manual_seed(1000 * trial + seq)
    return tuple(torch.randn(LAYERS, n, kv_heads, HEAD_DIM, generator=g) for _ in range(2))


def _reference_target(target_heads, num_blocks, sequences, kv_heads, trial):
    """A fresh pool of the same size filled in increasing sequence order: the expected tables and values."""
    import torch

    from fusedpar.layers.kv_cache import PagedKVCache

    ref = PagedKVCache(num_layers=LAYERS, kv_heads=target_heads, head_dim=HEAD_DIM, block_size=BLOCK,
                       num_blocks=num_blocks, dtype=torch.float32)
    idx = torch.tensor(target_heads)
    for seq, (_, there, n) in sorted(sequences.items()):
        if there:
            k, v = _rand_values(seq, n, kv_heads, trial)
            ref.fill(seq, k.index_select(2, idx), v.index_select(2, idx))
    return ref


def _rand_worker(rank, world, kv_heads, groups, directory=None):
    import torch

    from fusedpar.layers import kv_reshard
    from fusedpar.layers.kv_cache import PagedKVCache
    from fusedpar.layers.kv_reshard import migrate_kv
    from fusedpar.layouts import ModelDims, ParallelLayout, kv_plan

    if groups == "per-layer":  # tiny shapes fit one group: force one exchange per layer
        kv_reshard._GROUP_BYTES = 1
    elif groups == "two":
        kv_reshard._GROUP_BYTES, kv_reshard._MAX_GROUPS = 1, 2
    elif groups == "staging regions":  # a push per layer, each into its own region of the staging
        kv_reshard._PUSH_GROUPS = LAYERS
    q_heads = 8
    dims = ModelDims(q_heads, kv_heads, HEAD_DIM, 16)
    out = []
    base = PagedKVCache(num_layers=LAYERS, kv_heads=(0,), head_dim=HEAD_DIM, block_size=BLOCK,
                        num_blocks=4 * 24, dtype=torch.float32)  # one pool, viewed per layout
    for trial, ((s_sp, s_tp), (d_sp, d_tp)) in enumerate(RAND_CASES[world]):
        src, dst = ParallelLayout(world, sp=s_sp, tp=s_tp), ParallelLayout(world, sp=d_sp, tp=d_tp)
        g = torch.Generator().manual_seed(trial)
        reps = {s: (int(torch.randint(src.dp, (1,), generator=g)), int(torch.randint(dst.dp, (1,), generator=g)))
                for s in RAND_SEQS}
        heads = src.head_placement(q_heads, kv_heads).kv_heads(rank, "base")
        target_heads = dst.head_placement(q_heads, kv_heads).kv_heads(rank, "base")
        cache = base.reinterpret(heads)
        cache.k.normal_()  # stale junk everywhere
        cache.v.normal_()
        idx = torch.tensor(heads)
        for seq, n in RAND_SEQS.items():  # interleaved with junk sequences freed after: fragmented tables
            cache.fill(100 + seq, *(torch.randn(LAYERS, 3, len(heads), HEAD_DIM) for _ in range(2)))
            if src.coords(rank).dp == reps[seq][0]:
                k, v = _rand_values(seq, n, kv_heads, trial)
                cache.fill(seq, k.index_select(2, idx), v.index_select(2, idx))
        for seq in RAND_SEQS:
            cache.free(100 + seq)
        sequences = {s: (src.coords(rank).dp == reps[s][0], dst.coords(rank).dp == reps[s][1], n)
                     for s, n in RAND_SEQS.items()}
        plan = kv_plan(src, dst, dims, reps)
        min_blocks = 4 * 24 // len(target_heads) + (trial % 2) * 8  # odd trials grow the pool
        staging = None
        if groups.startswith("staging"):  # pushed through peers' buffers: every layer at once, or one per half
            from fusedpar.testing.staging import FileStaging

            per_layer = max(sum(2 * RAND_SEQS[m.seq] * HEAD_DIM * 4 for m in plan if m.dst == r) for r in range(world))
            nbytes = 2 * per_layer + 512 if groups == "staging per layer" else LAYERS * per_layer
            staging = FileStaging(directory, nbytes, tag=f"trial{trial}")
            staging.view(torch.uint8).fill_(0x7F)  # junk where nothing was pushed
        pushes = []
        push = kv_reshard.push_kv_rows
        kv_reshard.push_kv_rows = lambda *a, pushes=pushes, push=push, **kw: (pushes.append(1), push(*a, **kw))
        try:
            new, received = migrate_kv(cache, rank, plan, target_heads, sequences, min_blocks=min_blocks,
                                       staging=staging)
        finally:
            kv_reshard.push_kv_rows = push
        ref = _reference_target(target_heads, new.num_blocks, sequences, kv_heads, trial)
        ok = new.block_tables == ref.block_tables and new.lengths == ref.lengths and new.kv_heads == target_heads
        for seq in ref.block_tables:
            for layer in range(LAYERS):
                ok &= all(torch.equal(a, b) for a, b in zip(new.gather(layer, seq), ref.gather(layer, seq),
                                                            strict=True))
        expect = sum(2 * LAYERS * RAND_SEQS[m.seq] * HEAD_DIM * 4 for m in plan if m.dst == rank)
        out.append({"case": f"{src!r}->{dst!r}", "ok": bool(ok), "received": received, "expect": expect,
                    "moves": len(plan), "free": new.free_blocks == ref.free_blocks,
                    "blocks": new.num_blocks == max(min_blocks, 4 * 24 // len(target_heads)),
                    "aliases": new.k.untyped_storage().data_ptr() == base.k.untyped_storage().data_ptr(),
                    "grown": min_blocks > 4 * 24 // len(target_heads), "pushes": len(pushes),
                    "same_p": src.replica_size == dst.replica_size and all(a == b for a, b in reps.values())})
    return out


@pytest.mark.parametrize("world,kv_heads,groups", [(2, 2, "one"), (4, 2, "one"), (4, 4, "one"), (2, 1, "one"),
                                                   (4, 2, "per-layer"), (2, 2, "two"), (4, 2, "staging"),
                                                   (2, 1, "staging"), (4, 4, "staging per layer"),
                                                   (2, 2, "staging per layer"), (4, 2, "staging regions")])
def test_migrate_kv_matches_a_fresh_fill_on_random_values(world, kv_heads, groups, tmp_path):
    """Random KV in a fragmented pool full of junk, migrated onto views of the same memory (the target
    reinterprets the source's bytes) or a grown pool: every target sequence's values, block tables and
    free count are those of a fresh pool filled in sequence order; received bytes are the plan's; SP x TP
    splits of one replica size move nothing; kv-head replication (4 ranks, 2 kv heads) included; the
    layers in one exchange, one per layer, or in two uneven groups (layers 0-1 | 2); or pushed through
    peers' staging buffers (fusedpar.testing.staging: shared files, the Triton interpreter's stores at
    raw addresses), every layer in one push, one layer per region of a staging that holds them all, or
    one layer per half of a short staging."""
    res = run_distributed(_rand_worker, world, kv_heads, groups, str(tmp_path), timeout=300)
    for rank, out in enumerate(res):
        for r in out:
            where = f"rank {rank}, {r['case']}"
            assert r["ok"] and r["free"] and r["blocks"], f"{where}: {r}"
            assert r["received"] == r["expect"], f"{where}: {r}"
            assert r["aliases"] != r["grown"], f"{where}: {r}"
            if r["same_p"]:
                assert r["moves"] == 0 and r["received"] == 0, f"{where}: {r}"
            pushes = 0 if not (r["moves"] and groups.startswith("staging")) else 1 if groups == "staging" else LAYERS
            assert r["pushes"] == pushes, f"{where}: {r['pushes']} pushes, expected {pushes}"
    assert any(r["received"] for out in res for r in out)


def test_layer_groups_cover_every_layer_once():
    from fusedpar.layers.kv_reshard import _GROUP_BYTES, _MAX_GROUPS, _layer_groups

    assert _layer_groups(32, 0) == [(0, 32)]
    assert _layer_groups(32, 3 * _GROUP_BYTES) == [(0, 8), (8, 24), (24, 32)]  # the outer groups half size
    assert _layer_groups(32, 100 * _GROUP_BYTES) == [(0, 5), (5, 16), (16, 27), (27, 32)]
    assert len(_layer_groups(32, 100 * _GROUP_BYTES)) == _MAX_GROUPS
    assert _layer_groups(3, 100 * _GROUP_BYTES) == [(0, 1), (1, 2), (2, 3)]
    for layers in (1, 5, 31):
        for nbytes in (1, _GROUP_BYTES, 7 * _GROUP_BYTES, 10**12):
            groups = _layer_groups(layers, nbytes)
            assert [layer for a, b in groups for layer in range(a, b)] == list(range(layers))


def _errors_worker(rank, world):
    import torch

    from fusedpar.layers.kv_cache import PagedKVCache
    from fusedpar.layers.kv_reshard import migrate_kv

    out = {}
    small = PagedKVCache(num_layers=LAYERS, kv_heads=(rank,), head_dim=HEAD_DIM, block_size=BLOCK, num_blocks=1,
                         dtype=torch.float32)
    small.fill(1, torch.ones(LAYERS, 3, 1, HEAD_DIM), -torch.ones(LAYERS, 3, 1, HEAD_DIM))
    # two heads per token where one block of one head was: a new pool, grown to min_blocks
    new, received = migrate_kv(small, rank, [], (0, 1), {}, min_blocks=3)
    out["new_pool"] = (new.num_blocks, new.k.data_ptr() != small.k.data_ptr(), received)
    # a target sequence whose other head nobody sends: every rank raises, after the (empty) exchange
    cache = PagedKVCache(num_layers=LAYERS, kv_heads=(rank,), head_dim=HEAD_DIM, block_size=BLOCK, num_blocks=4,
                         dtype=torch.float32)
    cache.fill(1, torch.ones(LAYERS, 3, 1, HEAD_DIM), -torch.ones(LAYERS, 3, 1, HEAD_DIM))
    try:
        migrate_kv(cache, rank, [], (0, 1), {1: (True, True, 3)})
    except RuntimeError as exc:
        out["missing"] = str(exc)
    return out


def test_migrate_kv_new_pool_and_missing_heads():
    res = run_distributed(_errors_worker, 2, timeout=120)
    for out in res:
        assert out["new_pool"] == (3, True, 0), out
        assert "brings no KV of sequence 1" in out.get("missing", ""), out


@pytest.mark.parametrize("seed", range(3))
def test_row_index_matches_the_slots_of_begin_step(seed):
    """_row_index (block tables and one line per piece uploaded, rows built by paged_rows) gives every
    piece's pool rows exactly as begin_step's slots say, on fragmented tables with sequences ending
    mid-block, empty chunks included, for two sides in one upload; reserve() takes the blocks
    begin_step would."""
    import random

    import torch

    from fusedpar.layers.kv_cache import PagedKVCache
    from fusedpar.layers.kv_reshard import _row_index
    from fusedpar.layers.step_plan import StepBatch

    rng = random.Random(seed)
    heads, bs = (3, 5, 6), 4
    caches = [PagedKVCache(num_layers=1, kv_heads=heads, head_dim=2, block_size=bs, num_blocks=80,
                           dtype=torch.float32) for _ in range(2)]
    lengths = {s: rng.randrange(1, 30) for s in range(6)}
    slots = {}
    for step in range(3):  # interleaved chunks: each sequence's blocks scattered over the pool
        for s in lengths:
            n = lengths[s] // 3 + (lengths[s] % 3 if step == 2 else 0)
            if not n:
                continue
            batch = StepBatch((s,), (n,), (caches[0].seq_len(s),))
            slots[s] = torch.cat([slots.get(s, torch.empty(0, dtype=torch.int64)), caches[0].begin_step(batch)])
            caches[1].reserve(batch)
    assert caches[1].block_tables == caches[0].block_tables and caches[1]._free == caches[0]._free
    index_of = {h: i for i, h in enumerate(heads)}
    chunks = [[(s, rng.choice(heads)) for s in rng.sample(sorted(lengths), rng.randrange(0, 4))] for _ in range(4)]
    sides = [(chunks, {s: caches[0].block_tables[s] for s in lengths}, len(heads), index_of),
             (chunks[::-1], {s: caches[0].block_tables[s] for s in lengths}, len(heads), index_of)]
    got = _row_index(sides, lengths, bs, torch.device("cpu"))
    sizes = [sum(lengths[s] for s, _ in chunk) for chunk in chunks]
    assert [t.numel() for t in got] == [sum(sizes)] * 2
    for chunk, rows, back in zip(chunks, got[0].split(sizes), got[1].split(sizes[::-1])[::-1], strict=True):
        assert torch.equal(rows, back), "a second side in the same upload must index the same way"
        want = [slots[s] * len(heads) + index_of[h] for s, h in chunk]
        assert torch.equal(rows, torch.cat(want) if want else torch.empty(0, dtype=torch.int64)), chunk


@pytest.mark.gpu
def test_gpu_migrate_kv_through_staging_and_all_to_all_match_a_fresh_fill(nccl_world):
    """NCCL ranks, bf16, 8 kv heads of 128, 4 layers, 6 sequences ending mid-block: DP <-> TP (and DP2 x TP2
    <-> TP on 4 GPUs) through the all-to-all, through a staging that holds every layer (one push, or one
    per layer into its own region), and through one that holds one layer per half (a push per layer, the
    halves alternating). The pool is
    poisoned with NaN and the staging with junk before each migration; every target sequence's k and v
    must equal its values bit for bit, and the received bytes the plan's."""
    import torch

    from fusedpar.collectives.symmetric import SymmetricWorkspace
    from fusedpar.layers import kv_reshard
    from fusedpar.layers.kv_cache import PagedKVCache
    from fusedpar.layers.kv_reshard import migrate_kv
    from fusedpar.layouts import ModelDims, ParallelLayout, kv_plan
    from fusedpar.testing.gpu import all_ranks_ok

    rank, world = nccl_world
    default_groups = kv_reshard._PUSH_GROUPS
    if world < 2:
        pytest.skip("a migration needs 2 or more GPUs")
    layers, kv_heads, hd, block = 4, 8, 128, 16
    dev = torch.device("cuda", torch.cuda.current_device())
    lengths = {s: 37 + 61 * s for s in range(6)}
    dims = ModelDims(32, kv_heads, hd, 256)

    def values(seq, heads):
        g = torch.Generator(device=dev).manual_seed(100 + seq)
        kv = torch.randn(2, layers, lengths[seq], kv_heads, hd, generator=g, device=dev).to(torch.bfloat16)
        return kv[:, :, :, list(heads)]

    lays = [ParallelLayout(world, dp=world), ParallelLayout(world, tp=world)]
    if world == 4:
        lays.append(ParallelLayout(4, dp=2, tp=2))
    base = PagedKVCache(num_layers=layers, kv_heads=(0,), head_dim=hd, block_size=block,
                        num_blocks=2 * kv_heads * sum(-(-n // block) for n in lengths.values()), dtype=torch.bfloat16,
                        device=dev)
    errors = []
    for src in lays:
        for dst in lays:
            if src is dst:
                continue
            reps = {s: (s % src.dp, (s + 1) % dst.dp) for s in lengths}
            plan = kv_plan(src, dst, dims, reps)
            heads = src.head_placement(32, kv_heads).kv_heads(rank, "base")
            target = dst.head_placement(32, kv_heads).kv_heads(rank, "base")
            sequences = {s: (src.coords(rank).dp == reps[s][0], dst.coords(rank).dp == reps[s][1], n)
                         for s, n in lengths.items()}
            expect = sum(2 * layers * lengths[m.seq] * hd * 2 for m in plan if m.dst == rank)
            per_layer = max(sum(2 * lengths[m.seq] * hd * 2 for m in plan if m.dst == r) for r in range(world))
            full = SymmetricWorkspace(torch.distributed.group.WORLD, layers * per_layer)
            short = SymmetricWorkspace(torch.distributed.group.WORLD, 2 * per_layer + 512)
            stagings = {"all-to-all": (None, 1),  # one group, one group per layer in regions, one layer per half
                        "staging": (full, 1), "staging regions": (full, layers), "staging per layer": (short, 1)}
            for name, (staging, least) in stagings.items():
                kv_reshard._PUSH_GROUPS = least
                base.k.fill_(float("nan"))
                base.v.fill_(float("nan"))
                if staging is not None:
                    staging.view(torch.uint8).fill_(0x7F)
                cache = base.reinterpret(heads)
                for s, (here, _, _) in sequences.items():
                    if here:
                        k, v = values(s, heads)
                        cache.fill(s, k, v)
                try:
                    new, received = migrate_kv(cache, rank, plan, target, sequences, staging=staging)
                finally:
                    kv_reshard._PUSH_GROUPS = default_groups
                where = f"{src!r} -> {dst!r} via {name}"
                if received != expect:
                    errors.append(f"{where}: received {received} bytes, the plan moves {expect}")
                for s, (_, there, _) in sequences.items():
                    if not there:
                        continue
                    k, v = values(s, target)
                    for layer in range(layers):
                        gk, gv = new.gather(layer, s)
                        if not (torch.equal(gk, k[layer]) and torch.equal(gv, v[layer])):
                            errors.append(f"{where}: sequence {s} layer {layer} differs")
    assert all_ranks_ok(not errors), "\n".join(errors[:8])


def test_push_groups_fit_the_staging_or_decline(monkeypatch):
    """_PUSH_GROUPS groups, each in its own region, when the staging holds every layer of the busiest
    receiver; else as few groups as fit half of it each, a group reusing a region only after the one
    before it there; None (migrate_kv then takes the all-to-all) when half of it holds no layer."""
    from fusedpar.layers import kv_reshard
    from fusedpar.layers.kv_reshard import _push_groups

    mib = 1 << 20
    monkeypatch.setattr(kv_reshard, "_PUSH_GROUPS", 1)
    assert _push_groups(32, mib, 32 * mib) == ([(0, 32)], [0], [None])
    assert _push_groups(32, mib, 16 * mib) == ([(0, 8), (8, 16), (16, 24), (24, 32)], [0, 8 * mib] * 2,
                                              [None, None, 0, 1])  # halves of 8 layers
    assert _push_groups(5, mib, 4 * mib) == ([(0, 1), (1, 3), (3, 5)], [0, 2 * mib, 0], [None, None, 0])
    assert _push_groups(32, mib, 2 * mib - 1) is None
    monkeypatch.setattr(kv_reshard, "_PUSH_GROUPS", 4)  # a region each where they all fit
    assert _push_groups(32, mib, 32 * mib) == ([(0, 8), (8, 16), (16, 24), (24, 32)], [0, 8 * mib, 16 * mib, 24 * mib],
                                              [None] * 4)
    assert _push_groups(3, mib, 3 * mib)[0] == [(0, 1), (1, 2), (2, 3)]  # at most a group per layer
    for least in (1, 3):
        monkeypatch.setattr(kv_reshard, "_PUSH_GROUPS", least)
        for layers, per_layer, cap in ((7, 300, 4000), (31, 4096, 50000), (3, 1, 10**9), (5, 512, 5 * 512 + 100)):
            groups, regions, reuse = _push_groups(layers, per_layer, cap)
            assert [x for a, b in groups for x in range(a, b)] == list(range(layers))
            assert len(groups) >= min(least, layers)
            spans = [(r, r + (b - a) * per_layer) for r, (a, b) in zip(regions, groups, strict=True)]
            assert all(r % 256 == 0 and 0 <= r < e <= cap for r, e in spans), spans
            for i, j in ((a, b) for a in range(len(spans)) for b in range(a)):  # overlapping regions: a reuse
                if spans[i][0] < spans[j][1] and spans[j][0] < spans[i][1]:
                    assert reuse[i] is not None and reuse[i] >= j, (spans, reuse)
