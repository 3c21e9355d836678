"""KV reshard plans carried out on 4 gloo ranks: after a switch every rank of each sequence's target
replica caches exactly its target kv heads' values, on the same pool memory, with the bytes the plan
moves (none between SP x TP splits of one replica size)."""

from __future__ import annotations

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
    from fusedpar.layers.reshard import migrate_kv
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
