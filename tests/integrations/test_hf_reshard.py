"""model.reshard(layout) on the HF adapter: switching live between declared layouts in the middle of
generation keeps the unsharded model's logits and greedy tokens. Between SP x TP splits of one replica
nothing moves and one copy of the weights serves all; to and from data-parallel layouts (DP, DP x TP,
DP x SP) the live sequences' KV moves to the replicas that run their rows, exactly the bytes the
placements require, and no weight byte moves. Undeclared, foreign-world, impossible and non-layout
arguments are refused with their reasons."""

from __future__ import annotations

from types import SimpleNamespace

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
    # 3 * world / 2 q heads: a replica of `world` ranks cannot split them
    odd = dict(num_attention_heads=3 * world // 2, num_key_value_heads=world // 2)
    try:
        parallelize(make_model("qwen3", **odd), ParallelLayout(world, dp=world),
                    reshard_layouts=[ParallelLayout(world, tp=world)])
        refusals["impossible declared"] = None
    except ValueError as e:
        refusals["impossible declared"] = str(e)
    six = parallelize(make_model("qwen3", **odd), ParallelLayout(world, dp=world))
    try:
        six.reshard(ParallelLayout(world, tp=world))
        refusals["impossible"] = None
    except ValueError as e:
        refusals["impossible"] = str(e)
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
        for key in ("impossible declared", "impossible"):
            want = f"num_q_heads={3 * world // 2} is not divisible by sp*tp=1*{world}={world}"
            assert ref[key] and want in ref[key], ref
        assert ref["undeclared"] and "was not declared" in ref["undeclared"], ref


def _expected_kv_bytes(src, dst, rows, cached, layers, kv_heads, head_dim):
    """KV bytes a switch src -> dst must move, counted from the head placements alone: every (rank, kv
    head, sequence) the target caches that the source did not, times the sequence's k and v."""
    from fusedpar.integrations.hf.runtime import row_blocks

    q_heads = 8
    total = 0
    before, after = row_blocks(rows, src.dp), row_blocks(rows, dst.dp)
    p_from, p_to = src.head_placement(q_heads, kv_heads), dst.head_placement(q_heads, kv_heads)
    for row in range(rows):
        d_from = next(d for d, b in enumerate(before) if row in b)
        d_to = next(d for d, b in enumerate(after) if row in b)
        for rank in range(dst.world_size):
            if dst.coords(rank).dp != d_to:
                continue
            had = set(p_from.kv_heads(rank, "base")) if src.coords(rank).dp == d_from else set()
            total += len(set(p_to.kv_heads(rank, "base")) - had) * 2 * layers * cached[row] * head_dim * 4
    return total


def _expected_resident(layouts, cfg, layers, rank):
    """Bytes a rank must hold for the declared `layouts` (fp32): per replica size, the qkv and gate_up
    shard of its layout with the largest SP (their rows are ordered per replica size); the union of
    the o and down columns of every layout (each shard a contiguous range of it); the norms."""
    by_size = {}
    for lay in layouts:
        if lay.replica_size not in by_size or lay.sp > by_size[lay.replica_size].sp:
            by_size[lay.replica_size] = lay
    rows = sum(lay.weight_shards(cfg.dims).shard(rank, n).size for lay in by_size.values() for n in ("qkv", "gate_up"))
    for name in ("o", "down"):
        cols = set()
        for lay in layouts:
            for seg in lay.weight_shards(cfg.dims).shard(rank, name).base:
                cols |= set(range(seg.start, seg.stop))
        rows += len(cols)
    norms = 2 * cfg.hidden_size + (2 * cfg.head_dim if cfg.qk_norm else 0)
    return (rows * cfg.hidden_size + norms) * 4 * layers


def _dp_worker(rank, world, kv_heads):
    import torch

    from fusedpar import ParallelLayout
    from fusedpar.integrations.hf import parallelize
    from fusedpar.testing.scenarios import rel_error
    from tests.integrations.hf_models import left_padded, make_model

    L = lambda **kw: ParallelLayout(world, **kw)  # noqa: E731
    if world == 4:
        tp, sp, mixed, dp, dp_tp, dp_sp = L(tp=4), L(sp=4), L(sp=2, tp=2), L(dp=4), L(dp=2, tp=2), L(dp=2, sp=2)
        declared = [sp, mixed, dp, dp_tp, dp_sp]
        # (layout, new tokens per row): single tokens greedy, 6-token chunks teacher-forced (base mode where SP > 1)
        route = [(dp, 1), (tp, 1), (dp_tp, 1), (sp, 1), (dp_sp, 1), (mixed, 1), (dp, 1), (dp_sp, 6), (tp, 6),
                 (dp_tp, 6), (sp, 6), (dp, 6), (mixed, 1), (dp_tp, 1), (tp, 1)]
    else:
        tp, sp, dp = L(tp=2), L(sp=2), L(dp=2)
        declared = [sp, dp]
        route = [(dp, 1), (sp, 1), (dp, 1), (tp, 1), (dp, 6), (sp, 6), (dp, 1), (tp, 6), (dp, 1)]
    ref = make_model("qwen3", seed=5, num_key_value_heads=kv_heads)
    pm = parallelize(make_model("qwen3", seed=5, num_key_value_heads=kv_heads), tp, shift_threshold=4,
                     reshard_layouts=declared)
    from fusedpar.integrations.hf import resident_decoder_bytes

    resident = (resident_decoder_bytes(pm), _expected_resident([tp, *declared], pm.fusedpar_spec.decoder, 2, rank))
    ids, mask = left_padded([9, 6, 11], vocab=200, seed=8)
    b, s = ids.shape
    greedy = next(i for i, (_, n) in enumerate(route) if n != 1)  # the leading single-token steps
    with torch.no_grad():
        ref_gen = ref.generate(ids, attention_mask=mask, max_new_tokens=greedy, do_sample=False, pad_token_id=0)
    errors, results, tokens = [], [], []
    out = pm(ids, attention_mask=mask, use_cache=True)  # prefill in TP
    logits, past, seq, m = [out.logits], out.past_key_values, ids, mask
    chunk_gen = torch.Generator().manual_seed(9)
    cached = mask.sum(1).tolist()
    for step, (lay, n) in enumerate(route):
        res = pm.reshard(lay)
        want_kv = _expected_kv_bytes(results[-1][0] if results else tp, lay, b, cached, 2, kv_heads, 16)
        results.append((lay, res, want_kv))
        if pm.fusedpar_stack.ctx.layout != lay:
            errors.append(f"step {step}: after reshard({lay!r}) the stack runs {pm.fusedpar_stack.ctx.layout!r}")
        if n == 1 and len(tokens) == step:  # greedy while every step so far was a single token
            nxt = logits[-1][:, -1].argmax(-1, keepdim=True)
            tokens.append(nxt)
        else:
            nxt = torch.randint(5, 200, (b, n), generator=chunk_gen)
        seq, m = torch.cat([seq, nxt], 1), torch.cat([m, torch.ones_like(nxt)], 1)
        out = pm(nxt, attention_mask=m, past_key_values=past, use_cache=True)
        logits.append(out.logits)
        past = out.past_key_values
        cached = [c + n for c in cached]
    with torch.no_grad():
        want = ref(seq, attention_mask=m, use_cache=False).logits
    real = mask.bool()
    errs = [rel_error(logits[0][real], want[:, :s][real])]
    col = s
    for got in logits[1:]:
        errs.append(rel_error(got, want[:, col:col + got.shape[1]]))
        col += got.shape[1]
    gen = torch.cat([ids, *tokens], 1)
    if resident_decoder_bytes(pm) != resident[0]:
        errors.append(f"the decoder holds {resident_decoder_bytes(pm)} bytes after the switches, {resident[0]} before")
    return {"errors": errors, "max_err": max(errs), "greedy": len(tokens), "resident": resident,
            "greedy_equal": torch.equal(gen, ref_gen[:, :gen.shape[1]]),
            "switches": [(repr(lay), r["weight_bytes_moved"], r["kv_bytes_moved"], r["kv_bytes_received"], want_kv,
                          lay.replica_size) for lay, r, want_kv in results],
            "logits": torch.cat([x.reshape(-1) for x in logits]).numpy().tobytes()}


@pytest.mark.parametrize("world,kv_heads", [(4, 2)])
def test_reshard_among_dp_tp_sp_and_mixed_layouts_moves_the_kv_it_must(world, kv_heads):
    res = run_distributed(_dp_worker, world, kv_heads, timeout=600)
    prev_size = world  # the first layout is TP over the whole world
    for rank, out in enumerate(res):
        assert not out["errors"], f"rank {rank}: {out['errors']}"
        assert out["max_err"] < RTOL, (rank, out["max_err"])
        assert out["greedy"] >= 3 and out["greedy_equal"], (rank, out["greedy"])
        assert out["logits"] == res[0]["logits"], f"rank {rank}'s logits differ from rank 0's"
        assert out["resident"][0] == out["resident"][1], (rank, out["resident"])
    for i, (name, w_bytes, kv_bytes, _, want_kv, size) in enumerate(res[0]["switches"]):
        received = sum(r["switches"][i][3] for r in res)
        assert w_bytes == 0, name
        assert kv_bytes == want_kv == received, (i, name, kv_bytes, want_kv, received)
        assert (kv_bytes > 0) == (size != prev_size), (i, name, kv_bytes)  # KV moves iff the replica size changes
        assert all(r["switches"][i][2] == kv_bytes for r in res), name
        prev_size = size


class _PrefillDPDecodeTP:
    """A policy object of the duck type parallelize accepts: steps that start rows run DP, the rest TP."""

    def __init__(self, dp, tp):
        self.dp, self.tp = dp, tp
        self.layouts = (dp, tp)
        self.facts = []

    def decide(self, facts, current):
        self.facts.append(facts)
        return self.dp if facts.waiting else self.tp


def _policy_worker(rank, world):
    import torch

    from fusedpar import ParallelLayout
    from fusedpar.integrations.hf import parallelize
    from fusedpar.layers.layout_policy import LoadPolicy
    from fusedpar.testing.scenarios import rel_error
    from tests.integrations.hf_models import left_padded, make_model

    dp, tp = ParallelLayout(world, dp=world), ParallelLayout(world, tp=world)
    ref = make_model("qwen3", seed=2)
    ids3, mask3 = left_padded([7, 4, 9], vocab=200, seed=6)
    ids1, mask1 = left_padded([5], vocab=200, seed=7)
    greedy = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want3, want1 = ref.generate(ids3, attention_mask=mask3, **greedy), ref.generate(ids1, attention_mask=mask1,
                                                                                        **greedy)
    out = {}
    custom = _PrefillDPDecodeTP(dp, tp)
    pm = parallelize(make_model("qwen3", seed=2), tp, shift_threshold=4, policy=custom)
    gen = pm.generate(ids3, attention_mask=mask3, **greedy)
    out["custom"] = {"equal": torch.equal(gen, want3), "layouts": [r["layout"] for r in pm.fusedpar_reshards],
                     "kv": [r["kv_bytes_moved"] for r in pm.fusedpar_reshards],
                     "first": (custom.facts[0].scheduled_tokens, custom.facts[0].running, custom.facts[0].waiting,
                               custom.facts[0].waiting_prefill_tokens),
                     "second": (custom.facts[1].scheduled_tokens, custom.facts[1].running, custom.facts[1].waiting)}
    load = LoadPolicy(dp, tp, low=1, high=3)
    pm = parallelize(make_model("qwen3", seed=2), tp, shift_threshold=4, policy=load)
    gen3 = pm.generate(ids3, attention_mask=mask3, **greedy)  # 3 rows: load 3 >= high, DP
    after3 = repr(pm.fusedpar_stack.ctx.layout)
    gen1 = pm.generate(ids1, attention_mask=mask1, **greedy)  # 1 row: load 1 <= low, back to TP
    out["load"] = {"equal": torch.equal(gen3, want3) and torch.equal(gen1, want1), "after3": after3,
                   "after1": repr(pm.fusedpar_stack.ctx.layout), "switches": len(pm.fusedpar_reshards)}
    try:
        parallelize(make_model("qwen3", seed=2), tp, policy=object())
        out["bad"] = None
    except ValueError as e:
        out["bad"] = str(e)
    try:
        parallelize(make_model("qwen3", seed=2), ParallelLayout(world, sp=world), policy=load)
        out["outside"] = None
    except ValueError as e:
        out["outside"] = str(e)
    out["fork"] = _fork_across_switches(ref, make_model("qwen3", seed=2), dp, tp, ids3, mask3)
    # one row on dp=2: the second replica never ran a step (no cache yet) and still takes part in the switch
    pm = parallelize(make_model("qwen3", seed=2), dp, shift_threshold=4, reshard_layouts=[tp])
    past = pm(ids1, attention_mask=mask1, use_cache=True).past_key_values
    res = pm.reshard(tp)
    nxt = torch.tensor([[17]])
    m = torch.cat([mask1, torch.ones_like(nxt)], 1)
    got = pm(nxt, attention_mask=m, past_key_values=past, use_cache=True).logits
    with torch.no_grad():
        want = ref(torch.cat([ids1, nxt], 1), attention_mask=m, use_cache=False).logits[:, -1:]
    out["idle replica"] = {"err": rel_error(got, want), "kv": res["kv_bytes_moved"]}
    return out


def _fork_across_switches(ref, model, dp, tp, ids, mask):
    """A copy.deepcopy of the live cache (HF's prompt reuse) made in TP, continued after TP -> DP -> TP
    switches, as is the original: both give the unsharded model's logits."""
    import copy

    import torch

    from fusedpar.integrations.hf import parallelize
    from fusedpar.testing.scenarios import rel_error

    pm = parallelize(model, tp, shift_threshold=4, reshard_layouts=[dp])
    past = pm(ids, attention_mask=mask, use_cache=True).past_key_values
    fork = copy.deepcopy(past)
    gen = torch.Generator().manual_seed(12)
    a, b = torch.randint(5, 200, (3, 2), generator=gen), torch.randint(5, 200, (3, 1), generator=gen)
    errs, kv = [], []
    kv.append(pm.reshard(dp)["kv_bytes_moved"])
    m = torch.cat([mask, torch.ones_like(a)], 1)
    got_a = pm(a, attention_mask=m, past_key_values=past, use_cache=True).logits
    kv.append(pm.reshard(tp)["kv_bytes_moved"])
    m_b = torch.cat([mask, torch.ones_like(b)], 1)
    got_b = pm(b, attention_mask=m_b, past_key_values=fork, use_cache=True).logits
    with torch.no_grad():
        want_a = ref(torch.cat([ids, a], 1), attention_mask=m, use_cache=False).logits[:, -2:]
        want_b = ref(torch.cat([ids, b], 1), attention_mask=m_b, use_cache=False).logits[:, -1:]
    errs = [rel_error(got_a, want_a), rel_error(got_b, want_b)]
    return {"errs": errs, "kv": kv}


def test_a_policy_switches_layouts_by_itself_and_copied_caches_survive_switches():
    res = run_distributed(_policy_worker, 2, timeout=600)
    for out in res:
        c = out["custom"]
        assert c["equal"], c
        # the prefill (3 rows starting, 7 + 4 + 9 real tokens) in DP, then TP for the decode steps, moving KV
        assert c["first"] == (20, 0, 3, 20) and c["second"] == (3, 3, 0), c
        assert c["layouts"] == [repr(_dp(2)), repr(_tp(2))] and c["kv"][0] == 0 and c["kv"][1] > 0, c
        ld = out["load"]
        assert ld["equal"] and ld["after3"] == repr(_dp(2)) and ld["after1"] == repr(_tp(2)) and ld["switches"] == 2
        assert out["bad"] and "decide(facts, current)" in out["bad"], out["bad"]
        assert out["outside"] and "the model starts in ParallelLayout(world_size=2, sp=2" in out["outside"], out
        f = out["fork"]
        assert all(e < RTOL for e in f["errs"]) and all(k > 0 for k in f["kv"]), f
        idle = out["idle replica"]
        assert idle["err"] < RTOL and idle["kv"] > 0, idle


def _dp(world):
    from fusedpar import ParallelLayout

    return ParallelLayout(world, dp=world)


def _tp(world):
    from fusedpar import ParallelLayout

    return ParallelLayout(world, tp=world)


def _graphs_worker(rank, world):
    from fusedpar import ParallelLayout
    from fusedpar.integrations.hf import parallelize
    from tests.integrations.hf_models import left_padded, make_model

    tp, sp, dp = ParallelLayout(world, tp=world), ParallelLayout(world, sp=world), ParallelLayout(world, dp=world)
    pm = parallelize(make_model("qwen3"), tp, shift_threshold=4, reshard_layouts=[sp, dp])
    rt = pm._fusedpar
    ids, mask = left_padded([5, 7], vocab=200, seed=1)
    pm(ids, attention_mask=mask, use_cache=True)
    pool = rt.kv

    def on_pool(cache):
        return cache.k.untyped_storage().data_ptr() == pool.k.untyped_storage().data_ptr()

    # stand-ins for captured decode graphs (CPU: none); tp's say they were captured on other memory
    marks = {lay: SimpleNamespace(shares_memory=(lambda c: False) if lay == tp else on_pool) for lay in rt.stacks}
    head = object()
    for lay, (_, stack) in rt.stacks.items():
        stack.graphs = marks[lay]
    rt.heads[1] = head
    out = {"kept": [], "dropped": None}
    for lay in (sp, tp, sp):  # one replica size: the pool and every graph stay
        pm.reshard(lay)
        out["kept"].append(rt.kv is pool and all(st.graphs is marks[lay2] for lay2, (_, st) in rt.stacks.items())
                           and rt.heads.get(1) is head)
    try:
        pm.reshard(sp if rank == 0 else tp)
        out["disagree"] = None
    except ValueError as exc:
        out["disagree"] = str(exc)
    out["unchanged"] = rt.ctx.layout == sp and rt.kv is pool
    pm.reshard(dp)  # the pool is reinterpreted: graphs on its memory stay (to rebind), others go; head graphs stay
    out["dropped"] = (rt.kv is not pool and on_pool(rt.kv) and rt.heads.get(1) is head
                      and all(st.graphs is (None if lay == tp else marks[lay]) for lay, (_, st) in rt.stacks.items()))
    rt.heads.clear()
    return out


def test_switches_keep_graphs_on_the_same_pool_and_refuse_disagreeing_ranks():
    res = run_distributed(_graphs_worker, 2, timeout=300)
    for rank, out in enumerate(res):
        assert out["kept"] == [True, True, True], (rank, out)
        assert out["disagree"] and "the ranks disagree on the layout" in out["disagree"], (rank, out)
        assert out["unchanged"] and out["dropped"], (rank, out)
