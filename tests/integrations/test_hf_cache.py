"""fusedpar.integrations.hf: generation state (ShiftParallelCache on the paged cache) against HF's caches.

One spawn (gloo, 2 CPU ranks, SP=2, fp32, threshold 4: prefills run base, decode steps shift) runs
every case against the unsharded transformers model; each test checks one case:
- generate under torch.inference_mode(), then plain calls outside it (the paged cache must not
  be made of inference tensors);
- HF's prompt-reuse recipe: continue `copy.deepcopy(prompt_cache)` once per request (a fork of
  the sequences; freed again when the copy is dropped), and the original cache afterwards;
- generate(cache_implementation="static") (HF would hand the first step a static cache and 4D
  masks); "quantized" (other numerics) is refused;
- generate(past_key_values=StaticCache(...) / DynamicCache()) as HF's docs show it; an HF
  QuantizedCache is refused; generate(max_time=...) and a MaxTimeCriteria are refused (each rank's
  own clock could stop it at another step than its replica's other ranks: a hang).
The pools of forks across ranks: test_hf_graphs.py.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fusedpar.layouts import ParallelLayout  # noqa: E402
from fusedpar.testing.dist import run_distributed  # noqa: E402
from fusedpar.testing.scenarios import rel_error  # noqa: E402
from tests.integrations.hf_models import left_padded  # noqa: E402
from tests.integrations.hf_workers import GREEDY, case_results, parallel_pair, raises, run_named  # noqa: E402

REL_TOL = 1e-4
LENGTHS = [7, 5, 10]


# ---- per-rank bodies ------------------------------------------------------------------------------
def _inference_mode(ref, pm) -> dict:
    ids, mask = left_padded([7, 5, 10], ref.config.vocab_size, seed=1)
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=4, **GREEDY)
    with torch.inference_mode():
        inside = pm.generate(ids, attention_mask=mask, max_new_tokens=4, **GREEDY)
    real = mask.bool()
    with torch.no_grad():
        err = rel_error(pm(ids, attention_mask=mask).logits[real], ref(ids, attention_mask=mask).logits[real])
    after = pm.generate(ids, attention_mask=mask, max_new_tokens=4, **GREEDY)
    return {"gen_inside": torch.equal(inside, want), "logits_after": err, "gen_after": torch.equal(after, want)}


def _prompt_reuse(ref, pm) -> dict:
    """HF's recipe (docs: "Re-use Cache to continue generation"): cache a shared prefix once, then
    generate from prefix + suffix with a deep copy of that cache per request."""
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(11)
    prefix = torch.randint(1, ref.config.vocab_size, (2, 6), generator=gen)
    suffixes = [torch.randint(1, ref.config.vocab_size, (2, n), generator=gen) for n in (3, 1)]
    out = {"equal": [], "free_blocks_restored": None}
    with torch.no_grad():
        ref_cache = ref(prefix, past_key_values=DynamicCache(), use_cache=True).past_key_values
        pm_cache = pm(prefix, past_key_values=DynamicCache(), use_cache=True).past_key_values
    free_before = pm._fusedpar.kv.free_blocks
    for suffix in suffixes:
        ids = torch.cat([prefix, suffix], dim=1)
        want = ref.generate(ids, past_key_values=copy.deepcopy(ref_cache), max_new_tokens=4, **GREEDY)
        got = pm.generate(ids, past_key_values=copy.deepcopy(pm_cache), max_new_tokens=4, **GREEDY)
        out["equal"].append(torch.equal(got, want))
    gc.collect()
    # the collected copies' blocks go back to the pool at the next step that would otherwise grow the
    # cache (together on every rank): a step needing every block the prefix left free fits without a grow
    from fusedpar.layers import StepBatch

    rt = pm._fusedpar
    blocks = rt.kv.num_blocks
    rt._reserve(StepBatch((10**9,), (free_before * rt.block_size,), (0,)))
    out["free_blocks_restored"] = rt.kv.free_blocks == free_before and rt.kv.num_blocks == blocks
    # the prompt cache itself is untouched by its copies: continue it directly
    ids = torch.cat([prefix, suffixes[0]], dim=1)
    want = ref.generate(ids, past_key_values=ref_cache, max_new_tokens=3, **GREEDY)
    out["equal"].append(torch.equal(pm.generate(ids, past_key_values=pm_cache, max_new_tokens=3, **GREEDY), want))
    return out


def _static_cache(ref, pm) -> dict:
    ids, mask = left_padded([7, 5], ref.config.vocab_size, seed=2)
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=4, cache_implementation="static", **GREEDY)
    got = pm.generate(ids, attention_mask=mask, max_new_tokens=4, cache_implementation="static", **GREEDY)
    out = {"equal": torch.equal(got, want), "quantized": None}
    try:  # a quantized HF cache changes the logits: refused, naming it
        pm.generate(ids, attention_mask=mask, max_new_tokens=2, cache_implementation="quantized", **GREEDY)
    except NotImplementedError as e:
        out["quantized"] = str(e)
    return out


def _user_caches(ref, pm) -> dict:
    from transformers import DynamicCache, QuantizedCache, StaticCache

    ids, mask = left_padded(LENGTHS, ref.config.vocab_size, seed=4)
    out = {}
    for name, make in {"static": lambda m: StaticCache(config=m.config, max_cache_len=32),
                       "dynamic": lambda m: DynamicCache()}.items():
        kw = dict(attention_mask=mask, max_new_tokens=4, **GREEDY)
        try:
            out[name] = torch.equal(pm.generate(ids, past_key_values=make(pm), **kw),
                                    ref.generate(ids, past_key_values=make(ref), **kw))
        except Exception as e:  # recorded for the test's message
            out[name] = f"{type(e).__name__}: {e}"
    # max_time stops each rank by its own clock: refused (before any step) as an argument and as a criterion
    from transformers.generation.stopping_criteria import MaxTimeCriteria, StoppingCriteriaList

    out["max_time"] = raises(lambda: pm.generate(ids, attention_mask=mask, max_new_tokens=4, max_time=30.0,
                                                 **GREEDY))
    out["max_time_criteria"] = raises(lambda: pm.generate(
        ids, attention_mask=mask, max_new_tokens=4, stopping_criteria=StoppingCriteriaList([MaxTimeCriteria(30.0)]),
        **GREEDY))
    out["after_refusals"] = torch.equal(pm.generate(ids, attention_mask=mask, max_new_tokens=4, **GREEDY),
                                        ref.generate(ids, attention_mask=mask, max_new_tokens=4, **GREEDY))
    # QuantizedCache needs optimum-quanto / hqq to be built; the adapter refuses it by type, before use
    quantized = QuantizedCache.__new__(QuantizedCache)
    with torch.no_grad():
        out["quantized"] = raises(lambda: pm(ids, attention_mask=mask, past_key_values=quantized))
    return out


def run_cache_cases(rank: int, world: int) -> dict:
    layout = ParallelLayout(world, sp=2)
    return run_named({
        "inference_mode": lambda: _inference_mode(*parallel_pair("llama", layout)),
        "prompt_reuse": lambda: _prompt_reuse(*parallel_pair("qwen3", layout)),
        "static_cache": lambda: _static_cache(*parallel_pair("llama", layout)),
        "user_caches": lambda: _user_caches(*parallel_pair("llama", layout)),
    }, rank)


@pytest.fixture(scope="module")
def results():
    return run_distributed(run_cache_cases, 2, timeout=300)


# ---- tests ---------------------------------------------------------------------------------------
def test_generate_under_inference_mode_then_outside(results):
    for res in case_results(results, "inference_mode"):
        assert res["gen_inside"], res
        assert res["logits_after"] < REL_TOL, res
        assert res["gen_after"], res


def test_prompt_cache_deepcopy_reuse(results):
    for res in case_results(results, "prompt_reuse"):
        assert all(res["equal"]) and len(res["equal"]) == 3, res
        assert res["free_blocks_restored"], "dropped copies of the prompt cache still hold KV blocks when needed"


def test_generate_with_static_cache_implementation(results):
    for res in case_results(results, "static_cache"):
        assert res["equal"], res
        assert "cache_implementation='quantized'" in (res["quantized"] or ""), res


def test_generate_with_a_user_made_hf_cache(results):
    """generate(past_key_values=StaticCache(...)) runs on the paged cache (no 4D masks)."""
    for res in case_results(results, "user_caches"):
        assert res["static"] is True, res
        assert res["dynamic"] is True, res
        assert (res["quantized"] or "").startswith("NotImplementedError:") and "QuantizedCache" in res["quantized"], res
        for key in ("max_time", "max_time_criteria"):  # each rank's own clock: refused before any step
            assert (res[key] or "").startswith("NotImplementedError:") and "max_time" in res[key], (key, res)
        assert res["after_refusals"] is True, res
