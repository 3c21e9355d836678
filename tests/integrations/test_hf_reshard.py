"""model.reshard(layout) on the HF adapter: switching live between declared layouts of one replica, in
the middle of generation, keeps the unsharded model's logits, moves no bytes and keeps one copy of
the weights; undeclared, foreign-world and data-parallel layouts are refused with their reasons."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from fusedpar.testing.dist import run_distributed

RTOL = 1e-4  # fp32 against the unsharded model


def _worker(rank, world):
    import torch

    from fusedpar import ParallelLayout
    from fusedpar.integrations.hf import parallelize, resident_decoder_bytes
    from tests.integrations.hf_models import left_padded, make_model

    sp_all = ParallelLayout(world, sp=world)
    others = [ParallelLayout(world, tp=world)] + ([ParallelLayout(world, sp=2, tp=world // 2)] if world == 4 else [])
    ref = make_model("qwen3")
    pm = parallelize(make_model("qwen3"), others[0], shift_threshold=4, reshard_layouts=[sp_all, *others[1:]])
    held = resident_decoder_bytes(pm)
    ids, mask = left_padded([9, 6, 11], vocab=200, seed=3)
    full = torch.cat([ids, torch.randint(5, 200, (3, 20), generator=torch.Generator().manual_seed(4))], dim=1)
    full_mask = torch.cat([mask, torch.ones(3, 20, dtype=mask.dtype)], dim=1)
    want = ref(full, attention_mask=full_mask, use_cache=False).logits
    errors, results = [], []

    def check(got, lo, hi, what):
        err = ((got - want[:, lo:hi]).abs().max() / want[:, lo:hi].abs().max()).item()
        if err > RTOL:
            errors.append(f"{what}: rel err {err:.2e}")

    s = ids.shape[1]
    out = pm(ids, attention_mask=mask, use_cache=True)  # prefill in the first layout (TP)
    check(out.logits[:, -1:], s - 1, s, "prefill")
    past, pos = out.past_key_values, s
    # switch between every declared layout, decoding single tokens and a 6-token chunk (base mode) between
    for step, (lay, chunk) in enumerate([(sp_all, 1), (others[0], 6), (sp_all, 6), *[(o, 1) for o in others[1:]],
                                         (others[0], 1)]):
        results.append(pm.reshard(lay))
        stack = pm.fusedpar_stack
        if stack.ctx.layout != lay:
            errors.append(f"step {step}: after reshard({lay!r}) the stack runs {stack.ctx.layout!r}")
        before = dict(stack.steps)
        out = pm(full[:, pos:pos + chunk], attention_mask=full_mask[:, :pos + chunk], past_key_values=past,
                 use_cache=True)
        mode = "base" if chunk * 3 > 4 and lay.sp > 1 else "shift"  # 3 rows x chunk tokens vs threshold 4
        if stack.steps[mode] != before[mode] + 1:
            errors.append(f"step {step}: {lay!r} ran {stack.steps} (before {before}), expected one {mode} step")
        check(out.logits, pos, pos + chunk, f"step {step} in {lay!r}")
        past, pos = out.past_key_values, pos + chunk
        if resident_decoder_bytes(pm) != held:
            errors.append(f"step {step}: the decoder holds {resident_decoder_bytes(pm)} bytes, {held} before")
    refusals = {}
    for name, bad in (("undeclared", ParallelLayout(world, sp=world // 2)),  # dp = 2
                      ("world", ParallelLayout(world * 2, tp=world * 2)), ("type", "tp")):
        try:
            pm.reshard(bad)
            refusals[name] = None
        except ValueError as e:
            refusals[name] = str(e)
    try:
        parallelize(make_model("qwen3"), sp_all, reshard_layouts=[ParallelLayout(world, dp=world)])
        refusals["dp"] = None
    except ValueError as e:
        refusals["dp"] = str(e)
    return {"errors": errors, "results": results, "refusals": refusals, "modes": dict(pm.fusedpar_stack.steps)}


@pytest.mark.parametrize("world", [2, 4])
def test_reshard_mid_generation_keeps_logits_and_moves_nothing(world):
    res = run_distributed(_worker, world, timeout=600)
    for rank, out in enumerate(res):
        assert not out["errors"], f"rank {rank}: {out['errors']}"
        for r in out["results"]:
            assert r["weight_bytes_moved"] == 0 and r["kv_bytes_moved"] == 0 and r["seconds"] >= 0, r
        ref = out["refusals"]
        assert ref["world"] and f"has {2 * world} ranks" in ref["world"], ref
        assert ref["type"] and "needs a ParallelLayout" in ref["type"], ref
        assert ref["dp"] and "data-parallel layouts" in ref["dp"], ref
        assert ref["undeclared"] and "was not declared" in ref["undeclared"], ref
