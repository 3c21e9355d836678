"""fusedpar.integrations.hf: the parallelized model's HF API (forward, generate, save, casts; model.py).

One spawn of 2 ranks (SP=2, threshold 4: prefills run base, decode steps of 1-3 rows shift) and
one of 4 ranks (SP=2 x TP=2, Qwen3: q/k norm, tied embeddings, 2 kv heads replicated over 4
ranks) run every case against the unsharded transformers model (gloo, CPU); each test checks one case:
- output_hidden_states (keyword, config default, generate(return_dict_in_generate=True)): the
  L + 1 hidden states at every real and every left-padded position, in base and shift steps;
- save_pretrained (the checkpoint would lack the decoder layers) and .half() / .to(dtype) (they
  would cast only the replicated modules) are refused, naming why;
- call forms: positional arguments, logits_to_keep (int and tensor), a prompt prefilled in two
  base-mode calls, generate with use_cache=False, logits processors (repetition penalty,
  min_new_tokens with eos, no-repeat n-grams), a streamer, and continuing generate's returned
  past_key_values with more tokens;
- bf16 / fp16 models on CPU (reference path): greedy tokens equal the unsharded half model's,
  logits off it by no more than that model's own rounding (its error against the fp32 model).
"""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.generation.streamers import BaseStreamer  # noqa: E402

from fusedpar.layouts import ParallelLayout  # noqa: E402
from fusedpar.testing.dist import run_distributed  # noqa: E402
from fusedpar.testing.scenarios import rel_error  # noqa: E402
from tests.integrations.hf_models import left_padded, make_model  # noqa: E402
from tests.integrations.hf_workers import GREEDY, case_results, parallel_pair, raises, run_named  # noqa: E402

REL_TOL = 1e-4
LENGTHS = [7, 5, 10]  # 22 real tokens (not a multiple of SP): base-mode prefill; decode 3 rows: shift


# ---- per-rank bodies ------------------------------------------------------------------------------
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


def _save_and_cast(ref, pm, path) -> dict:
    ids, mask = left_padded(LENGTHS, ref.config.vocab_size, seed=5)
    real = mask.bool()
    out = {"save": raises(lambda: pm.save_pretrained(path)), "saved_files": os.listdir(path) if os.path.isdir(path)
           else []}
    out["half"] = raises(lambda: pm.half())
    out["to_bf16"] = raises(lambda: pm.to(torch.bfloat16))
    out["noop"] = raises(lambda: (pm.float(), pm.to("cpu"), pm.to(torch.float32)))  # same dtype and device: fine
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


def run_world2(rank: int, world: int, tmp: str) -> dict:
    layout = ParallelLayout(world, sp=2)
    return run_named({
        "hidden_states": lambda: _hidden_states(*parallel_pair("llama", layout)),
        "save_and_cast": lambda: _save_and_cast(*parallel_pair("qwen2", layout), os.path.join(tmp, f"rank{rank}")),
        "forward_forms": lambda: _forward_forms(*parallel_pair("qwen3", layout)),
        "generate_forms": lambda: _generate_forms(*parallel_pair("llama", layout)),
        "fp16_llama": lambda: _half(*parallel_pair("llama", layout, dtype=torch.float16)),
        "bf16_qwen2": lambda: _half(*parallel_pair("qwen2", layout, dtype=torch.bfloat16)),
    }, rank)


def run_world4(rank: int, world: int) -> dict:
    layout = ParallelLayout(world, sp=2, tp=2)
    return run_named({"hidden_states": lambda: _hidden_states(*parallel_pair("qwen3", layout))}, rank)


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_distributed(run_world2, 2, str(tmp_path_factory.mktemp("save")), timeout=300)


@pytest.fixture(scope="module")
def world4():
    return run_distributed(run_world4, 4, timeout=300)


# ---- tests ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", ["world2", "world4"])
def test_output_hidden_states(world, request):
    """Keyword, config default and generate all give HF's L + 1 hidden states."""
    results = request.getfixturevalue(world)
    for res in case_results(results, "hidden_states"):
        assert res["count"] == (3, 3), res  # embeddings, layer 0's output, final norm's output (2 layers)
        assert len(res["forward"]) == 6 and max(res["forward"]) < REL_TOL, res  # padded positions too
        assert res["tuple"], res
        assert res["config"] is not None and max(res["config"]) < REL_TOL, res
        assert res["gen_modes"] == {"base": 1, "shift": 2}, res
        # 3 hidden states x (real, padded) for the prompt step, 3 x real for each of the 2 decode steps
        assert res["gen_tokens"] and len(res["gen"]) == 12 and max(res["gen"]) < REL_TOL, res


def test_save_pretrained_and_casts_refused(world2):
    """save_pretrained would write embeddings / norm / lm_head only; .half() would convert those and leave
    the decoder shards in fp32 (a model of mixed precision)."""
    for res in case_results(world2, "save_and_cast"):
        assert (res["save"] or "").startswith("NotImplementedError:"), res
        assert "save the model before parallelize" in res["save"], res
        assert res["saved_files"] == [], res
        for key, dtype in (("half", "torch.float16"), ("to_bf16", "torch.bfloat16")):
            assert (res[key] or "").startswith("NotImplementedError:"), (key, res)
            assert f"from torch.float32 on cpu to {dtype}" in res[key], (key, res)
        assert res["noop"] is None, res
        assert res["dtype"] == "torch.float32" and res["err"] < REL_TOL, res


def test_forward_call_forms(world2):
    for res in case_results(world2, "forward_forms"):
        assert res["chunk_modes"] == {"base": 2, "shift": 0}, res
        for key in ("positional", "keep_1", "keep_tensor", "chunked"):
            assert res[key] < REL_TOL, (key, res)


def test_generate_call_forms(world2):
    for res in case_results(world2, "generate_forms"):
        assert all(v is True for v in res.values()), res


@pytest.mark.parametrize("name", ["fp16_llama", "bf16_qwen2"])
def test_half_precision_on_cpu(world2, name):
    """fp16/bf16 on CPU (gloo + reference path); test_hf.py runs every family in fp32."""
    for res in case_results(world2, name):
        assert res["dtype"] == ("torch.float16" if name.startswith("fp16") else "torch.bfloat16"), res
        assert res["err"] <= 2 * res["own_rounding"], res
        assert res["gen"], res
