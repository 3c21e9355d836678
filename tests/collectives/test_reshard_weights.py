"""Weight reshard plans carried out on 4 gloo ranks: every target shard equals the one cut from the full
weights, views stay views (no bytes moved), and the bytes received are the plan's moved pieces."""

from __future__ import annotations

from fusedpar.testing.dist import run_distributed

DIMS = (8, 2, 4, 48)  # q heads, kv heads, head dim, MLP width: kv heads replicated at P = 4
HIDDEN = 6
PAIRS = [((1, 4), (4, 1)), ((4, 1), (1, 4)), ((2, 2), (1, 4)), ((1, 2), (2, 2)), ((2, 1), (1, 4)),
         ((1, 1), (2, 2)), ((4, 1), (1, 1)), ((2, 2), (2, 2))]  # (sp, tp) of source and target, world 4


def _full(dims, seed):
    import torch

    from fusedpar.layouts.shards import ModelDims

    d: ModelDims = dims
    g = torch.Generator().manual_seed(seed)
    q, kv = d.num_q_heads * d.head_dim, d.num_kv_heads * d.head_dim
    rows = {"q": q, "k": kv, "v": kv, "gate": d.intermediate_size, "up": d.intermediate_size}
    full = {k: torch.randn(n, HIDDEN, generator=g) for k, n in rows.items()}  # [out, in] rows
    full["o"] = torch.randn(HIDDEN, q, generator=g)  # [out, in]: columns are sharded
    full["down"] = torch.randn(HIDDEN, d.intermediate_size, generator=g)
    return full


def _cut(full, shard):
    import torch

    dim = shard.torch_dim
    return torch.cat([full[s.source].narrow(dim, s.start, s.size) for s in shard.base], dim=dim)


def _worker(rank, world):
    import torch.distributed as dist

    from fusedpar.collectives.weight_reshard import Held, reshard_weight
    from fusedpar.layouts import ModelDims, ParallelLayout, weight_plan
    from fusedpar.layouts.shards import WEIGHT_NAMES

    dims = ModelDims(*DIMS)
    full = _full(dims, seed=5)
    out = []
    for (s_sp, s_tp), (d_sp, d_tp) in PAIRS:
        src, dst = ParallelLayout(world, sp=s_sp, tp=s_tp), ParallelLayout(world, sp=d_sp, tp=d_tp)
        plan = weight_plan(src, dst, dims)
        smap, dmap = src.weight_shards(dims), dst.weight_shards(dims)
        for name in WEIGHT_NAMES:
            have = smap.shard(rank, name)
            held = Held(_cut(full, have), have.base, have.torch_dim)
            want = dmap.shard(rank, name)
            got, received = reshard_weight(name, rank, held, want.base, plan)
            expect = _cut(full, want)
            moved = sum(p.size for p in plan if p.name == name and p.rank == rank and p.moves)
            out.append({"pair": ((s_sp, s_tp), (d_sp, d_tp)), "name": name, "equal": bool((got == expect).all()),
                        "shape": tuple(got.shape) == tuple(expect.shape),
                        "view": got.untyped_storage().data_ptr() == held.tensor.untyped_storage().data_ptr(),
                        "received": received, "moved_bytes": moved * HIDDEN * got.element_size()})
    dist.barrier()
    return out


def test_weight_plans_carried_out_on_gloo_give_the_target_shards():
    res = run_distributed(_worker, 4, timeout=300)
    for rank, rows in enumerate(res):
        for r in rows:
            where = f"rank {rank}, {r['pair']}, {r['name']}"
            assert r["shape"] and r["equal"], where
            assert r["received"] == r["moved_bytes"], where
            if r["moved_bytes"] == 0 and r["pair"][0][0] * r["pair"][0][1] == 4 and r["pair"][1] == (1, 4):
                assert r["view"], f"{where}: TP=4 from an SP x TP = 4 shard should be a narrow of it"
    # SP=4 -> TP=4 moves nothing at all; TP=4 -> SP=4 must fetch rows (its base shard is the full weight)
    first = [r for rows in res for r in rows if r["pair"] == ((4, 1), (1, 4))]
    assert first and all(r["received"] == 0 and r["view"] for r in first)
    back = [r for rows in res for r in rows if r["pair"] == ((1, 4), (4, 1))]
    assert sum(r["received"] for r in back) > 0
