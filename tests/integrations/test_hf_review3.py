"""fusedpar.integrations.hf: HF call forms beyond test_hf.py / test_hf_review*.py (third review; gloo, fp32).

One spawn of 2 ranks (SP=2, threshold 4: prefills run base, decode steps of 1-3 rows shift) and
one of 4 ranks (SP=2 x TP=2, Qwen3: q/k norm, tied embeddings, 2 kv heads replicated over 4
ranks) run every case against the unsharded transformers model; each test checks one case:
- continuing a cache with an attention_mask that differs from the one its columns were cached
  under (none, or all ones, after a left-padded prompt; a cached token masked later): an HF cache
  holds every column and re-masks per call, the paged cache only the real tokens, so such a call
  must raise naming the row and columns (it silently gave other logits) and leave the cache usable;
- output_hidden_states (keyword, config default, generate(return_dict_in_generate=True)): the
  L + 1 hidden states at every real and every left-padded position, in base and shift steps (it
  raised);
- padded positions (right padding under a sliding window, a padding-only row, a continuing call
  whose new column is padding): HF's SDPA values (they were zeros);
- generate(past_key_values=StaticCache(...)) as HF's docs show it (it raised on the 4D masks
  generate builds for a static cache); an HF QuantizedCache is refused like
  cache_implementation="quantized"; generate(max_time=...) and a MaxTimeCriteria are refused (each
  rank's own clock could stop it at another step than its replica's other ranks: a hang);
- save_pretrained (wrote a checkpoint without the decoder layers) and .half() / .to(dtype) (cast
  only the replicated modules: a mixed-precision model) are refused, naming why;
- call forms that already worked and no other test covers: positional arguments, logits_to_keep
  (int and tensor), a prompt prefilled in two base-mode calls, generate with use_cache=False,
  logits processors (repetition penalty, min_new_tokens with eos, no-repeat n-grams), a streamer,
  and continuing generate's returned past_key_values with more tokens.
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.generation.streamers import BaseStreamer  # noqa: E402

from fusedpar.layouts import ParallelLayout  # noqa: E402
from fusedpar.testing.dist import run_distributed  # noqa: E402
from fusedpar.testing.scenarios import rel_error  # noqa: E402
from tests.integrations.hf_models import left_padded, make_model  # noqa: E402
from tests.integrations.hf_workers import GREEDY  # noqa: E402

REL_TOL = 1e-4
THRESHOLD = 4
LENGTHS = [7, 5, 10]  # 22 real tokens (not a multiple of SP): base-mode prefill; decode 3 rows: shift


def _pair(family: str, layout: ParallelLayout, **overrides):
    from fusedpar.integrations.hf import parallelize

    ref = make_model(family, **overrides)
    return ref, parallelize(make_model(family, **overrides), layout, shift_threshold=THRESHOLD)


def _raises(fn) -> str | None:
    """'ExceptionType: message' of what fn raised, None when it returned."""
    try:
        fn()
    except Exception as e:  # the tests name the type they expect
        return f"{type(e).__name__}: {e}"
    return None


# ---- per-rank bodies ------------------------------------------------------------------------------
def _cached_columns(ref, pm) -> dict:
    """Each refused call on a fresh prefill; then that cache, continued right, must still match HF."""
    ids, mask = left_padded(LENGTHS, ref.config.vocab_size, seed=1)
    nxt = torch.randint(1, ref.config.vocab_size, (3, 1), generator=torch.Generator().manual_seed(2))
    extended = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    dropped = extended.clone()
    dropped[:, 8] = 0  # a real cached token of every row
    calls = {"no_mask": {}, "all_ones": {"attention_mask": torch.ones_like(extended)},
             "masked_cached": {"attention_mask": dropped}}
    out = {}
    with torch.no_grad():
        ref_past = ref(ids, attention_mask=mask, use_cache=True).past_key_values
        want = ref(nxt, attention_mask=extended, past_key_values=ref_past).logits
        for name, kwargs in calls.items():
            past = pm(ids, attention_mask=mask, use_cache=True).past_key_values
            out[name] = _raises(lambda: pm(nxt, past_key_values=past, **kwargs))  # noqa: B023
            try:
                got = pm(nxt, attention_mask=extended, past_key_values=past).logits
                out[f"{name}_after"] = rel_error(got, want)
            except Exception as e:  # the refused call must not have changed the cache
                out[f"{name}_after"] = f"{type(e).__name__}: {e}"
    return out


def _hidden_errors(got, want, real) -> list[float]:
    """Per hidden state: the real positions' error, then the padded ones' (HF: MLP-only values)."""
    errs = []
    for g, w in zip(got, want, strict=True):
        errs.append(rel_error(g[real], w[real]))
        if bool((~real).any()):
            errs.append(rel_error(g[~real], w[~real]))
    return errs


def _hidden_states(ref, pm) -> dict:
    ids, mask = left_padded(LENGTHS, ref.config.vocab_size, seed=3)
    real = mask.bool()
    out: dict = {}
    with torch.no_grad():
        want = ref(ids, attention_mask=mask, output_hidden_states=True).hidden_states
        got = pm(ids, attention_mask=mask, output_hidden_states=True, use_cache=False).hidden_states
        out["count"] = (len(got), len(want))
        out["forward"] = _hidden_errors(got, want, real)
        tup = pm(ids, attention_mask=mask, output_hidden_states=True, use_cache=False, return_dict=False)
        out["tuple"] = isinstance(tup[-1], tuple) and len(tup[-1]) == len(want)
        for m in (ref, pm):
            m.config.output_hidden_states = True  # the config's default, as HF reads it
        try:
            cfg = pm(ids, attention_mask=mask, use_cache=False).hidden_states
            out["config"] = None if cfg is None else _hidden_errors(cfg, want, real)
        finally:
            for m in (ref, pm):
                m.config.output_hidden_states = False
    kw = dict(attention_mask=mask, max_new_tokens=3, return_dict_in_generate=True, output_hidden_states=True,
              **GREEDY)
    before = dict(pm.fusedpar_stack.steps)
    g_got, g_want = pm.generate(ids, **kw), ref.generate(ids, **kw)
    out["gen_modes"] = {k: pm.fusedpar_stack.steps[k] - before[k] for k in before}
    out["gen_tokens"] = torch.equal(g_got.sequences, g_want.sequences)
    errs = []
    for step, (hs_got, hs_want) in enumerate(zip(g_got.hidden_states, g_want.hidden_states, strict=True)):
        errs += _hidden_errors(hs_got, hs_want, real if step == 0 else torch.ones(3, 1, dtype=torch.bool))
    out["gen"] = errs
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

    out["max_time"] = _raises(lambda: pm.generate(ids, attention_mask=mask, max_new_tokens=4, max_time=30.0,
                                                  **GREEDY))
    out["max_time_criteria"] = _raises(lambda: pm.generate(
        ids, attention_mask=mask, max_new_tokens=4, stopping_criteria=StoppingCriteriaList([MaxTimeCriteria(30.0)]),
        **GREEDY))
    out["after_refusals"] = torch.equal(pm.generate(ids, attention_mask=mask, max_new_tokens=4, **GREEDY),
                                        ref.generate(ids, attention_mask=mask, max_new_tokens=4, **GREEDY))
    # QuantizedCache needs optimum-quanto / hqq to be built; the adapter refuses it by type, before use
    quantized = QuantizedCache.__new__(QuantizedCache)
    with torch.no_grad():
        out["quantized"] = _raises(lambda: pm(ids, attention_mask=mask, past_key_values=quantized))
    return out


def _save_and_cast(ref, pm, path) -> dict:
    ids, mask = left_padded(LENGTHS, ref.config.vocab_size, seed=5)
    real = mask.bool()
    out = {"save": _raises(lambda: pm.save_pretrained(path)), "saved_files": os.listdir(path) if os.path.isdir(path)
           else []}
    out["half"] = _raises(lambda: pm.half())
    out["to_bf16"] = _raises(lambda: pm.to(torch.bfloat16))
    out["noop"] = _raises(lambda: (pm.float(), pm.to("cpu"), pm.to(torch.float32)))  # same dtype and device: fine
    with torch.no_grad():
        got = pm(ids, attention_mask=mask).logits
        out["dtype"] = str(got.dtype)
        out["err"] = rel_error(got[real], ref(ids, attention_mask=mask).logits[real])
    return out


def _forward_forms(ref, pm) -> dict:
    ids, mask = left_padded(LENGTHS, ref.config.vocab_size, seed=6)
    real = mask.bool()
    keep = torch.tensor([7, 9])  # columns real in every row
    x = torch.randint(1, ref.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(7))
    out = {}
    with torch.no_grad():
        out["positional"] = rel_error(pm(ids, mask).logits[real], ref(ids, mask).logits[real])
        out["keep_1"] = rel_error(pm(ids, attention_mask=mask, logits_to_keep=1).logits,
                                  ref(ids, attention_mask=mask, logits_to_keep=1).logits)
        out["keep_tensor"] = rel_error(pm(ids, attention_mask=mask, logits_to_keep=keep).logits,
                                       ref(ids, attention_mask=mask, logits_to_keep=keep).logits)
        # a prompt prefilled in two calls of 12 and 14 tokens (base mode, the second with context)
        before = dict(pm.fusedpar_stack.steps)
        p1 = pm(x[:, :6], use_cache=True).past_key_values
        got = pm(x[:, 6:], past_key_values=p1).logits
        out["chunk_modes"] = {k: pm.fusedpar_stack.steps[k] - before[k] for k in before}
        r1 = ref(x[:, :6], use_cache=True).past_key_values
        out["chunked"] = rel_error(got, ref(x[:, 6:], past_key_values=r1).logits)
    return out


class _Streamer(BaseStreamer):
    def __init__(self):
        self.chunks = []

    def put(self, value):
        self.chunks.append(value.clone())

    def end(self):
        self.chunks.append(None)


def _generate_forms(ref, pm) -> dict:
    ids, mask = left_padded(LENGTHS, ref.config.vocab_size, seed=8)
    out = {}

    def same(**kw):
        return torch.equal(pm.generate(ids, attention_mask=mask, **kw, **GREEDY),
                           ref.generate(ids, attention_mask=mask, **kw, **GREEDY))

    out["use_cache_false"] = same(max_new_tokens=4, use_cache=False)
    out["repetition_penalty"] = same(max_new_tokens=6, repetition_penalty=1.5)
    first = ref.generate(ids, attention_mask=mask, max_new_tokens=1, **GREEDY)[0, -1].item()
    out["min_new_tokens_eos"] = same(max_new_tokens=6, min_new_tokens=3, eos_token_id=first)
    out["no_repeat_ngram"] = same(max_new_tokens=8, no_repeat_ngram_size=2)
    streams = []
    for m in (pm, ref):
        s = _Streamer()
        m.generate(ids[2:], max_new_tokens=4, streamer=s, **GREEDY)
        streams.append(s.chunks)
    out["streamer"] = len(streams[0]) == len(streams[1]) == 6 and all(
        (a is None and b is None) or torch.equal(a, b) for a, b in zip(*streams, strict=True))
    # continue generate's own past_key_values with two more tokens per row
    kw = dict(attention_mask=mask, max_new_tokens=3, return_dict_in_generate=True, **GREEDY)
    a, b = pm.generate(ids, **kw), ref.generate(ids, **kw)
    more = torch.randint(1, ref.config.vocab_size, (3, 2), generator=torch.Generator().manual_seed(9))
    mask2 = torch.cat([mask, torch.ones(3, 5, dtype=mask.dtype)], dim=1)
    out["continue_past"] = torch.equal(
        pm.generate(torch.cat([a.sequences, more], 1), attention_mask=mask2, past_key_values=a.past_key_values,
                    max_new_tokens=3, **GREEDY),
        ref.generate(torch.cat([b.sequences, more], 1), attention_mask=mask2, past_key_values=b.past_key_values,
                     max_new_tokens=3, **GREEDY))
    return out


def _padding(ref, pm) -> dict:
    """Every padded position against HF's SDPA: right padding under a 4-column sliding window (a
    padding query sees only the real tokens of the last 3 columns before it, or none), a row of
    padding only, padding ids that differ, and a continuing call whose new column is padding."""
    gen = torch.Generator().manual_seed(11)
    lengths = [4, 2, 3, 0]
    ids = torch.randint(1, ref.config.vocab_size, (4, 8), generator=gen)
    mask = torch.zeros((4, 8), dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    out = {}
    with torch.no_grad():
        want, got = ref(ids, attention_mask=mask), pm(ids, attention_mask=mask)
        out["right"] = rel_error(got.logits, want.logits)
        hs = [ref(ids, attention_mask=mask, output_hidden_states=True).hidden_states,
              pm(ids, attention_mask=mask, output_hidden_states=True).hidden_states]
        out["hidden"] = [rel_error(g, w) for g, w in zip(hs[1], hs[0], strict=True)]
        first = [m(ids[:3, :4], attention_mask=mask[:3, :4], use_cache=True) for m in (ref, pm)]
        m2 = torch.cat([mask[:3, :4], torch.zeros((3, 1), dtype=torch.long)], dim=1)
        nxt = [m(ids[:3, 4:5], attention_mask=m2, past_key_values=f.past_key_values).logits
               for m, f in zip((ref, pm), first, strict=True)]
        out["continued"] = rel_error(nxt[1], nxt[0])
    return out


def run_world2(rank: int, world: int, tmp: str) -> dict:
    layout = ParallelLayout(world, sp=2)
    cases = {
        "cached_columns": lambda: _cached_columns(*_pair("llama", layout)),
        "hidden_states": lambda: _hidden_states(*_pair("llama", layout)),
        "user_caches": lambda: _user_caches(*_pair("llama", layout)),
        "save_and_cast": lambda: _save_and_cast(*_pair("qwen2", layout), os.path.join(tmp, f"rank{rank}")),
        "forward_forms": lambda: _forward_forms(*_pair("qwen3", layout)),
        "generate_forms": lambda: _generate_forms(*_pair("llama", layout)),
        "padding": lambda: _padding(*_pair("mistral", layout, sliding_window=4)),
    }
    return _run(cases, rank)


def run_world4(rank: int, world: int) -> dict:
    layout = ParallelLayout(world, sp=2, tp=2)
    return _run({"hidden_states": lambda: _hidden_states(*_pair("qwen3", layout))}, rank)


def _run(cases, rank) -> dict:
    out = {}
    for name, fn in cases.items():
        try:
            torch.manual_seed(0)
            out[name] = fn()
        except Exception:
            out[name] = {"error": f"rank {rank}:\n{traceback.format_exc()}"}
    return out


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_distributed(run_world2, 2, str(tmp_path_factory.mktemp("review3")), timeout=300)


@pytest.fixture(scope="module")
def world4():
    return run_distributed(run_world4, 4, timeout=300)


def _case(results, name) -> list[dict]:
    per_rank = [r[name] for r in results]
    for res in per_rank:
        assert "error" not in res, res.get("error")
    return per_rank


# ---- tests ---------------------------------------------------------------------------------------
def test_continuation_mask_must_match_the_cached_columns(world2):
    """Before: each of these calls returned logits 0.3-0.7 (relative) off HF's, without a word."""
    for res in _case(world2, "cached_columns"):
        for key, fragment in [("no_mask", "marks cached padding column(s) [0, 1, 2] as real"),
                              ("all_ones", "marks cached padding column(s) [0, 1, 2] as real"),
                              ("masked_cached", "masks cached real token column(s) [8]")]:
            assert res[key] is not None, f"{key}: accepted (HF attends to other cached columns)"
            assert res[key].startswith("NotImplementedError:") and fragment in res[key] and "row 0" in res[key], \
                (key, res[key])
            assert isinstance(res[f"{key}_after"], float) and res[f"{key}_after"] < REL_TOL, (key, res)
        assert "no attention_mask" in res["no_mask"], res["no_mask"]


@pytest.mark.parametrize("world", ["world2", "world4"])
def test_output_hidden_states(world, request):
    """Before: NotImplementedError (keyword / generate) and None (the config's default)."""
    results = request.getfixturevalue(world)
    for res in _case(results, "hidden_states"):
        assert res["count"] == (3, 3), res  # embeddings, layer 0's output, final norm's output (2 layers)
        assert len(res["forward"]) == 6 and max(res["forward"]) < REL_TOL, res  # padded positions too
        assert res["tuple"], res
        assert res["config"] is not None and max(res["config"]) < REL_TOL, res
        assert res["gen_modes"] == {"base": 1, "shift": 2}, res
        # 3 hidden states x (real, padded) for the prompt step, 3 x real for each of the 2 decode steps
        assert res["gen_tokens"] and len(res["gen"]) == 12 and max(res["gen"]) < REL_TOL, res


def test_padded_positions_match_hf(world2):
    """Before: padded positions returned zero logits (HF's SDPA gives them values)."""
    for res in _case(world2, "padding"):
        assert res["right"] < REL_TOL and res["continued"] < REL_TOL, res
        assert len(res["hidden"]) == 3 and max(res["hidden"]) < REL_TOL, res


def test_generate_with_a_user_made_hf_cache(world2):
    """Before: generate(past_key_values=StaticCache(...)) raised about 4D attention masks."""
    for res in _case(world2, "user_caches"):
        assert res["static"] is True, res
        assert res["dynamic"] is True, res
        assert (res["quantized"] or "").startswith("NotImplementedError:") and "QuantizedCache" in res["quantized"], res
        for key in ("max_time", "max_time_criteria"):  # each rank's own clock: refused before any step
            assert (res[key] or "").startswith("NotImplementedError:") and "max_time" in res[key], (key, res)
        assert res["after_refusals"] is True, res


def test_save_pretrained_and_casts_refused(world2):
    """Before: save_pretrained wrote embeddings / norm / lm_head only; .half() converted those and left
    the decoder shards in fp32 (a model of mixed precision)."""
    for res in _case(world2, "save_and_cast"):
        assert (res["save"] or "").startswith("NotImplementedError:"), res
        assert "save the model before parallelize" in res["save"], res
        assert res["saved_files"] == [], res
        for key, dtype in (("half", "torch.float16"), ("to_bf16", "torch.bfloat16")):
            assert (res[key] or "").startswith("NotImplementedError:"), (key, res)
            assert f"from torch.float32 on cpu to {dtype}" in res[key], (key, res)
        assert res["noop"] is None, res
        assert res["dtype"] == "torch.float32" and res["err"] < REL_TOL, res


def test_forward_call_forms(world2):
    for res in _case(world2, "forward_forms"):
        assert res["chunk_modes"] == {"base": 2, "shift": 0}, res
        for key in ("positional", "keep_1", "keep_tensor", "chunked"):
            assert res[key] < REL_TOL, (key, res)


def test_generate_call_forms(world2):
    for res in _case(world2, "generate_forms"):
        assert all(v is True for v in res.values()), res
