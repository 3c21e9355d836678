"""fusedpar.integrations.hf: forward steps whose token counts cross the shift threshold, in every order, against
the unsharded transformers model (gloo CPU ranks, fp32).

One spawn per world size (2 ranks: SP=2; 4 ranks: SP=2 x TP=2, and SP=4 on Qwen2 with q/k/v bias) replays one
PLAN on each layout with one parallelized model, so every episode runs on the paged cache (block size 4) its
predecessors left. An episode is either a left-padded prefill continued by all-real chunks of the same rows (cached
steps with context), with use_cache=False calls in between, or a greedy generate. PLAN = FORCED episodes (base ->
shift and shift -> base on one cache, a multi-token shift-mode prefill right after a base step, single-token steps,
long and short prompts mixed, real-token counts T - 1 / T / T + 1 in prefills and chunks, base-mode decode) + seeded
random episodes around the threshold.

Checked per forward call: logits at every real position within REL_TOL of HF's (cached calls against HF's
DynamicCache; generate's per-step logits), and exactly one step, in the mode the call's real-token count asks
for. Also: greedy tokens equal, every rank's logits bit-identical. Before every call, the paged cache's slots that
hold no live token are set to NaN and padding columns hold random token ids, so a step that reads a stale slot
or a padding token fails.
"""

from __future__ import annotations

import hashlib
import itertools
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fusedpar.layouts import ParallelLayout  # noqa: E402
from fusedpar.testing.dist import run_distributed  # noqa: E402
from fusedpar.testing.scenarios import rel_error  # noqa: E402
from tests.integrations.hf_models import left_padded, make_model  # noqa: E402
from tests.integrations.hf_workers import GREEDY, case_results, run_named  # noqa: E402

REL_TOL = 1e-4
T = 8  # shift threshold: a call with at most T real tokens runs in shift mode, a larger one in base mode
LAYOUTS = {"sp2": (2, "llama", 2, 1), "sp2tp2": (4, "llama", 2, 2), "sp4": (4, "qwen2", 4, 1)}


def chunks(name, prompt, *steps):
    """A prefill of `prompt` (left padded), then per step: an int w, w all-real columns in every row (cached,
    with context); a list of lengths, a use_cache=False call of those prompts."""
    return {"name": name, "prompt": list(prompt), "steps": list(steps)}


def gen(name, prompt, new):
    return {"name": name, "prompt": list(prompt), "new": new}


# Real tokens per call in the comments (B base, S shift); the order of the episodes matters (a prefill right
# after a base step).
FORCED = [
    chunks("base_then_shift", [6, 5], 3, 1, 5, 1),  # 11B 6S 2S 10B 2S
    chunks("shift_then_base", [4], 9, 2, 12),  # 4S 9B 2S 12B
    chunks("shift_prefill_after_base", [3, 4], [10], 2, [2, 3], 3),  # 7S, 10B temporary, 4S, 5S temporary, 6S
    chunks("single_tokens", [1], 1, [9], 1, 1),  # 1S 1S, 9B temporary, 1S 1S
    chunks("around_threshold", [T - 1], T, T + 1, T - 1, 1),  # 7S 8S 9B 7S 1S
    chunks("mix_at_threshold", [5, 3], 4, [6, 3], 1),  # 8S 8S, 9B temporary, 2S
    chunks("mix_over_threshold", [6, 1, 2], 3, [4, 2, 1], 1),  # 9B 9B, 7S temporary, 3S
    chunks("long_short_mix", [14, 1, 3], 1, 3, 2),  # 18B 3S 9B 6S
    gen("gen_prompt_over_threshold", [T + 1], 4),  # 9B 1S 1S 1S
    gen("gen_base_decode", [2] * 5 + [1] * 4, 3),  # 14B 9B 9B
    gen("gen_shift_prefill_after_base", [3, 4], 3),  # 7S 2S 2S
    gen("gen_mix", [10, 1, 3], 3),  # 14B 3S 3S
]


def random_episodes(seed: int, count: int) -> list[dict]:
    rng = random.Random(seed)

    def prompt():
        rows = rng.randint(1, 4)
        return [rng.randint(1, 2 * T // rows + 1) for _ in range(rows)]

    plan = []
    for i in range(count):
        p = prompt()
        if rng.random() < 0.3:
            plan.append(gen(f"random{i}", p, rng.randint(2, 4)))
            continue
        near = [1, T // len(p), T // len(p) + 1, rng.randint(1, T)]  # chunk widths: rows * w around T
        plan.append(chunks(f"random{i}", p, *(prompt() if rng.random() < 0.25 else rng.choice(near)
                                              for _ in range(rng.randint(1, 3)))))
    return plan


PLAN = FORCED + random_episodes(seed=2024, count=8)


def planned_calls(plan: list[dict]) -> list[tuple[str, str, int]]:
    """(episode, kind, real tokens) of every forward call the plan makes, in order."""
    calls = []
    for ep in plan:
        calls.append((ep["name"], "prefill", sum(ep["prompt"])))
        rows = len(ep["prompt"])
        calls += [(ep["name"], "decode", rows)] * (ep.get("new", 1) - 1)
        calls += [(ep["name"], "temporary", sum(s)) if isinstance(s, list) else (ep["name"], "chunk", rows * s)
                  for s in ep.get("steps", ())]
    return calls


def mode(n: int) -> str:
    return "base" if n > T else "shift"


# ---- per-rank bodies ------------------------------------------------------------------------------
def _poison_free_slots(module, args, kwargs) -> None:
    """NaN in every paged-cache slot that holds no live token (freed blocks, unwritten block tails)."""
    kv = module._fusedpar.kv
    if kv is None:
        return
    bs = kv.block_size
    free = torch.ones(kv.num_blocks * bs, dtype=torch.bool)
    for sid, table in kv.block_tables.items():
        pos = torch.arange(kv.seq_len(sid))
        free[torch.tensor(table, dtype=torch.long)[pos // bs] * bs + pos % bs] = False
    for t in (kv.k, kv.v):
        t.view(t.shape[0], -1, *t.shape[3:])[:, free] = float("nan")


def _prompt(lengths, vocab, gen):
    ids, mask = left_padded(lengths, vocab, seed=int(torch.randint(1 << 30, (1,), generator=gen)))
    ids[mask == 0] = torch.randint(1, vocab, (int((mask == 0).sum()),), generator=gen)
    return ids, mask


def _episode(ref, pm, ep, gen, logits):
    """The episode on both models; per-call errors (one for a whole generate) and token equality."""
    vocab = ref.config.vocab_size
    ids, mask = _prompt(ep["prompt"], vocab, gen)
    if "new" in ep:
        kw = dict(attention_mask=mask, max_new_tokens=ep["new"], min_new_tokens=ep["new"],
                  return_dict_in_generate=True, output_logits=True, **GREEDY)
        want, got = ref.generate(ids, **kw), pm.generate(ids, **kw)
        logits.append(torch.stack(got.logits))
        return [rel_error(logits[-1], torch.stack(want.logits))], torch.equal(got.sequences, want.sequences)
    errs, past, ref_past = [], None, None
    for step in [0, *ep["steps"]]:
        if isinstance(step, list):
            x, m = _prompt(step, vocab, gen)
            got, want = pm(x, attention_mask=m, use_cache=False), ref(x, attention_mask=m, use_cache=False)
        else:
            if step:
                ids = torch.randint(1, vocab, (len(ep["prompt"]), step), generator=gen)
                mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
            x, m = ids, mask
            got = pm(x, attention_mask=m, past_key_values=past, use_cache=True)
            want = ref(x, attention_mask=m, past_key_values=ref_past, use_cache=True)
            past, ref_past = got.past_key_values, want.past_key_values
        real = m[:, -x.shape[1]:].bool()
        logits.append(got.logits)
        errs.append(rel_error(got.logits[real], want.logits[real]))
    return errs, None


def _replay(family: str, layout: ParallelLayout, plan: list[dict]) -> dict:
    from fusedpar.integrations.hf import parallelize

    ref = make_model(family)
    pm = parallelize(make_model(family), layout, shift_threshold=T, block_size=4)
    steps, calls = [], []  # per forward call: the stack's step counts before it; (real new tokens, modes run)

    def after(module, args, kwargs, output):
        ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")  # generate may leave out an all-ones mask
        n = ids.numel() if mask is None else int(mask[:, -ids.shape[1]:].sum())
        before, now = steps.pop(), module.fusedpar_stack.steps
        calls.append((n, [m for m in now for _ in range(now[m] - before[m])]))

    pm.register_forward_pre_hook(_poison_free_slots, with_kwargs=True)
    pm.register_forward_pre_hook(lambda module, *_: steps.append(dict(module.fusedpar_stack.steps)))
    pm.register_forward_hook(after, with_kwargs=True)
    gen, logits, episodes = torch.Generator().manual_seed(0), [], []
    with torch.no_grad():
        for ep in plan:
            start = len(calls)
            errs, tokens_equal = _episode(ref, pm, ep, gen, logits)
            episodes.append({"name": ep["name"], "errs": errs, "tokens_equal": tokens_equal, "calls": calls[start:]})
    digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in logits)).hexdigest()
    return {"episodes": episodes, "digest": digest}


def run_plan(rank: int, world: int, plan: list[dict]) -> dict:
    return run_named({name: lambda f=family, sp=sp, tp=tp: _replay(f, ParallelLayout(world, sp=sp, tp=tp), plan)
                      for name, (w, family, sp, tp) in LAYOUTS.items() if w == world}, rank)


@pytest.fixture(scope="module")
def world2():
    return run_distributed(run_plan, 2, PLAN, timeout=300)


@pytest.fixture(scope="module")
def world4():
    return run_distributed(run_plan, 4, PLAN, timeout=300)


# ---- tests ---------------------------------------------------------------------------------------
def test_plan_covers_the_orders():
    """The transitions FORCED makes, whatever the random episodes (the replay checks each call's mode)."""
    calls = planned_calls(FORCED)
    seen = {(mode(a[2]), mode(b[2]), b[1], b[2] > 1) for a, b in itertools.pairwise(calls)}
    need = {("base", "shift", "chunk", True), ("base", "shift", "chunk", False), ("shift", "base", "chunk", True),
            ("base", "shift", "prefill", True), ("base", "shift", "temporary", True),
            ("shift", "base", "temporary", True), ("base", "shift", "decode", False), ("base", "base", "decode", True),
            ("shift", "shift", "chunk", False), ("shift", "shift", "prefill", True)}
    assert need <= seen, need - seen
    for kind in ("prefill", "chunk"):
        assert {T - 1, T, T + 1} <= {n for _, k, n in calls if k == kind}, kind
    assert 1 in {n for _, k, n in calls if k == "prefill"}, "a one-token prefill"
    assert any(len(ep["prompt"]) > 1 and max(ep["prompt"]) > T > min(ep["prompt"]) for ep in FORCED), "a batch mix"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_step_orders_match_unsharded(request, layout):
    per_rank = case_results(request.getfixturevalue(f"world{LAYOUTS[layout][0]}"), layout)
    planned = planned_calls(PLAN)
    for rank, res in enumerate(per_rank):
        ran = [(ep["name"], *call) for ep in res["episodes"] for call in ep["calls"]]
        assert [(name, n) for name, n, _ in ran] == [(name, n) for name, _, n in planned], f"rank {rank}: calls"
        for (name, kind, n), (_, _, modes) in zip(planned, ran, strict=True):
            assert modes == [mode(n)], f"{layout} rank {rank} {name}: a {kind} call of {n} real tokens ran {modes}"
        for ep in res["episodes"]:
            where = f"{layout} rank {rank} {ep['name']} (calls {[c[0] for c in ep['calls']]})"
            # all(), not max(): a NaN fails
            assert all(e < REL_TOL for e in ep["errs"]), f"{where}: logits rel error per call {ep['errs']}"
            assert ep["tokens_equal"] in (None, True), f"{where}: greedy tokens differ from the unsharded model's"
    assert len({res["digest"] for res in per_rank}) == 1, f"{layout}: the ranks' logits differ"
