"""Data-parallel layouts in the HF adapter: replica d runs the contiguous row block row_blocks(b, dp)[d]
of every call, and every rank returns the whole batch's logits, equal to the unsharded model's (fp32,
left-padded batches, batches with fewer rows than replicas, kv heads replicated inside a replica),
with identical greedy tokens and hidden states; the per-call check spans the world."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from fusedpar.testing.dist import run_distributed

RTOL = 1e-4  # fp32 against the unsharded model
GREEDY = dict(do_sample=False, pad_token_id=0)


def test_row_blocks_are_contiguous_balanced_and_cover_the_batch():
    from fusedpar.integrations.hf.runtime import row_blocks

    for rows in range(0, 12):
        for dp in range(1, 6):
            blocks = row_blocks(rows, dp)
            assert len(blocks) == dp
            assert [i for b in blocks for i in b] == list(range(rows))
            sizes = [len(b) for b in blocks]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True), (rows, dp, sizes)


def _worker(rank, world):
    import torch

    from fusedpar import ParallelLayout
    from fusedpar.integrations.hf import parallelize
    from fusedpar.testing.scenarios import rel_error
    from tests.integrations.hf_models import left_padded, make_model

    # (name, layout kwargs, kv heads, prompt lengths): kv heads 1 on DP2 x TP2 / DP2 x SP2 replicates the one kv
    # head on both ranks of a replica; 1 row on dp=4 leaves three replicas idle
    cases = [("dp4", dict(dp=4), 2, [9, 6, 11]), ("dp4-one-row", dict(dp=4), 2, [7]),
             ("dp2xtp2", dict(tp=2), 1, [9, 6, 11]), ("dp2xsp2", dict(sp=2), 1, [5, 12, 8, 3, 10])]
    out = {}
    for name, kw, kv_heads, lengths in cases:
        torch.manual_seed(0)
        ref = make_model("qwen3", seed=11, num_key_value_heads=kv_heads)
        layout = ParallelLayout(world, **kw)
        pm = parallelize(make_model("qwen3", seed=11, num_key_value_heads=kv_heads), layout, shift_threshold=4)
        ids, mask = left_padded(lengths, vocab=200, seed=len(lengths) + kv_heads)
        real = mask.bool()
        with torch.no_grad():
            want = ref(ids, attention_mask=mask, use_cache=False, output_hidden_states=True)
            want_gen = ref.generate(ids, attention_mask=mask, max_new_tokens=5, **GREEDY)
        got = pm(ids, attention_mask=mask, use_cache=False, output_hidden_states=True)
        hidden_err = max(rel_error(a[real], b[real]) for a, b in zip(got.hidden_states, want.hidden_states,
                                                                     strict=True))
        steps = dict(pm.fusedpar_stack.steps)
        gen = pm.generate(ids, attention_mask=mask, max_new_tokens=5, **GREEDY)
        gen_steps = {m: pm.fusedpar_stack.steps[m] - steps[m] for m in steps}
        out[name] = {"err": rel_error(got.logits[real], want.logits[real]),
                     "pad_err": rel_error(got.logits[~real], want.logits[~real]) if bool((~real).any()) else 0.0,
                     "hidden_err": hidden_err, "gen_equal": torch.equal(gen, want_gen), "gen_steps": gen_steps,
                     "logits": got.logits.numpy().tobytes(), "replica": layout.coords(rank).dp}
    # the per-call check spans the world: another prompt on one replica is refused on every rank
    lay = ParallelLayout(world, dp=4)
    pm = parallelize(make_model("qwen3", seed=11), lay)
    ids, mask = left_padded([5, 7], vocab=200, seed=1)
    if rank == world - 1:
        ids = ids.flip(0)
    try:
        pm(ids, attention_mask=mask)
        out["mismatch"] = None
    except ValueError as e:
        out["mismatch"] = str(e)
    return out


def test_dp_layouts_give_the_unsharded_logits_on_every_rank():
    res = run_distributed(_worker, 4, timeout=600)
    for rank, out in enumerate(res):
        for name, r in out.items():
            if name == "mismatch":
                continue
            assert r["err"] < RTOL and r["pad_err"] < RTOL and r["hidden_err"] < RTOL, (rank, name, r)
            assert r["gen_equal"], (rank, name)
        assert out["mismatch"] and "different calls" in out["mismatch"] and "input ids" in out["mismatch"], out
    for name in res[0]:
        if name == "mismatch":
            continue
        # every rank returns the same (whole-batch) logits, whichever replica ran which rows
        assert all(r[name]["logits"] == res[0][name]["logits"] for r in res), name
    # rows run where row_blocks puts them: 1 row on dp=4 steps replica 0 only, 3 rows replicas 0-2
    for name, busy in (("dp4-one-row", [True, False, False, False]), ("dp4", [True, True, True, False])):
        assert [sum(r[name]["gen_steps"].values()) > 0 for r in res] == busy, name
