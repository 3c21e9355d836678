"""fusedpar.integrations.hf: HF usage patterns beyond test_hf.py's (gloo, 2 CPU ranks, fp32).

One spawn runs every case against the unsharded transformers model; each test checks one case:
- generate under torch.inference_mode(), then plain calls outside it (the paged cache must not
  be made of inference tensors);
- HF's prompt-reuse recipe: continue `copy.deepcopy(prompt_cache)` once per request (a fork of
  the sequences; freed again when the copy is dropped), and the original cache afterwards;
- generate(cache_implementation="static") (HF would hand the first step a static cache and 4D
  masks); "quantized" (other numerics) is refused;
- a sliding-window model whose attention_mask has masked columns between real tokens: HF's
  window counts columns, so a row spanning more columns than the window must raise, and one
  spanning fewer must match;
- bf16 / fp16 models on CPU (gloo, reference path): greedy tokens equal the unsharded half model's,
  logits off it by no more than that model's own rounding (its error against the fp32 model).
"""

from __future__ import annotations

import copy
import gc
import traceback

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fusedpar.layouts import ParallelLayout  # noqa: E402
from fusedpar.testing.dist import run_distributed  # noqa: E402
from fusedpar.testing.scenarios import rel_error  # noqa: E402
from tests.integrations.hf_models import left_padded, make_model  # noqa: E402
from tests.integrations.hf_workers import GREEDY  # noqa: E402

REL_TOL = 1e-4
THRESHOLD = 4  # prefills run base (SP=2), decode steps of 1-3 rows shift (TP=2)


def _pair(family: str, **overrides):
    """(unsharded reference, parallelized copy) of the same seeded model."""
    from fusedpar.integrations.hf import parallelize

    ref = make_model(family, **overrides)
    pm = parallelize(make_model(family, **overrides), ParallelLayout(2, sp=2), shift_threshold=THRESHOLD)
    return ref, pm


def _half(ref, pm) -> dict:
    """ref / pm are half-precision; the fp32 model of the same seed measures the half model's own rounding."""
    fp32 = make_model(type(ref).__name__.removesuffix("ForCausalLM").lower())
    ids, mask = left_padded([7, 5, 10], ref.config.vocab_size, seed=1)
    real = mask.bool()
    with torch.no_grad():
        got, want = pm(ids, attention_mask=mask).logits[real], ref(ids, attention_mask=mask).logits[real]
        exact = fp32(ids, attention_mask=mask).logits[real]
    gen_want = ref.generate(ids, attention_mask=mask, max_new_tokens=6, **GREEDY)
    gen_got = pm.generate(ids, attention_mask=mask, max_new_tokens=6, **GREEDY)
    return {"err": rel_error(got, want), "own_rounding": rel_error(want, exact), "gen": torch.equal(gen_got, gen_want),
            "dtype": str(got.dtype)}


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


def _window_columns(ref, pm) -> dict:
    """sliding_window=8; positions numbered over real tokens only (as generate numbers them)."""
    out = {}
    for name, (cols, holes) in {"inside": (8, (2, 4)), "outside": (10, (2, 4))}.items():
        ids = torch.randint(1, ref.config.vocab_size, (1, cols), generator=torch.Generator().manual_seed(3))
        mask = torch.ones_like(ids)
        mask[0, holes[0]:holes[1]] = 0  # 6 real tokens over 8 columns / 8 over 10
        pos = (mask.cumsum(1) - 1).masked_fill(mask == 0, 0)
        real = mask.bool()
        with torch.no_grad():
            want = ref(ids, attention_mask=mask, position_ids=pos).logits[real]
            try:
                out[name] = rel_error(pm(ids, attention_mask=mask, position_ids=pos).logits[real], want)
            except ValueError as e:
                out[name] = str(e)
    return out


CASES = {
    "inference_mode": ("llama", {}, _inference_mode),
    "prompt_reuse": ("qwen3", {}, _prompt_reuse),
    "static_cache": ("llama", {}, _static_cache),
    "window_columns": ("mistral", {"sliding_window": 8}, _window_columns),
    "fp16_llama": ("llama", {"dtype": torch.float16}, _half),
    "bf16_qwen2": ("qwen2", {"dtype": torch.bfloat16}, _half),
}


def run_review_cases(rank: int, world: int) -> dict:
    out = {}
    for name, (family, overrides, fn) in CASES.items():
        try:
            torch.manual_seed(0)
            out[name] = fn(*_pair(family, **overrides))
        except Exception:
            out[name] = {"error": f"rank {rank}:\n{traceback.format_exc()}"}
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(run_review_cases, 2, timeout=300)


def _case(results, name) -> list[dict]:
    per_rank = [r[name] for r in results]
    for res in per_rank:
        assert "error" not in res, res.get("error")
    return per_rank


def test_generate_under_inference_mode_then_outside(results):
    for res in _case(results, "inference_mode"):
        assert res["gen_inside"], res
        assert res["logits_after"] < REL_TOL, res
        assert res["gen_after"], res


def test_prompt_cache_deepcopy_reuse(results):
    for res in _case(results, "prompt_reuse"):
        assert all(res["equal"]) and len(res["equal"]) == 3, res
        assert res["free_blocks_restored"], "dropped copies of the prompt cache still hold KV blocks when needed"


def test_generate_with_static_cache_implementation(results):
    for res in _case(results, "static_cache"):
        assert res["equal"], res
        assert "cache_implementation='quantized'" in (res["quantized"] or ""), res


def test_sliding_window_counts_mask_columns(results):
    for res in _case(results, "window_columns"):
        assert isinstance(res["inside"], float) and res["inside"] < REL_TOL, res
        assert isinstance(res["outside"], str), f"a row spanning 10 columns with window 8 was accepted: {res}"
        assert "span 10 attention_mask columns" in res["outside"] and "sliding_window=8" in res["outside"], res


@pytest.mark.parametrize("name", ["fp16_llama", "bf16_qwen2"])
def test_half_precision_on_cpu(results, name):
    """Contract point (fp16/bf16 on CPU: gloo + reference path) that test_hf.py runs only in fp32."""
    for res in _case(results, name):
        assert res["dtype"] == ("torch.float16" if name.startswith("fp16") else "torch.bfloat16"), res
        assert res["err"] <= 2 * res["own_rounding"], res
        assert res["gen"], res
