"""Per-rank bodies of the HF adapter tests (module-level: run_distributed spawns processes).

`run_cases(rank, world, cases)` runs many cases in one spawn (transformers takes seconds to
import per process) and returns plain data per case: errors against the unsharded HF model,
token equality, step counts per mode, byte counts, and a fingerprint for cross-rank equality.
A case that raises records its traceback instead of stopping the others.
"""

from __future__ import annotations

import gc
import math
import traceback
import weakref
from typing import ClassVar

import torch

from fusedpar.layouts import ParallelLayout
from fusedpar.testing.scenarios import rel_error
from tests.integrations.hf_models import left_padded, make_model, right_padded

GREEDY = dict(do_sample=False, pad_token_id=0)


def expected_bytes(spec, layout: ParallelLayout, rank: int, element_size: int) -> int:
    """Base shards (core WeightShardMap arithmetic) + replicated norms + q/k/v bias rows, all layers."""
    cfg = spec.decoder
    shard_map = layout.weight_shards(cfg.dims)
    per_layer = shard_map.base_bytes(rank, cfg.hidden_size, element_size) + 2 * cfg.hidden_size * element_size
    if cfg.qk_norm:
        per_layer += 2 * cfg.head_dim * element_size
    if spec.qkv_bias:
        per_layer += shard_map.shard(rank, "qkv").size * element_size
    return per_layer * spec.num_layers


class _CountingSlice:
    def __init__(self, sl, name, record):
        self._sl, self._name, self._record = sl, name, record

    def get_shape(self):
        return self._sl.get_shape()

    def __getitem__(self, index):
        return self._record(self._name, self._sl[index])


class _CountingOpen:
    """safetensors.safe_open stand-in that records the bytes of every tensor handed out."""

    reads: ClassVar[dict[str, int]] = {}

    def __init__(self, *args, **kwargs):
        import safetensors

        self._f = safetensors._fusedpar_real_safe_open(*args, **kwargs)

    @classmethod
    def _record(cls, name, t):
        cls.reads[name] = cls.reads.get(name, 0) + t.numel() * t.element_size()
        return t

    def __enter__(self):
        self._f.__enter__()
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)

    def keys(self):
        return self._f.keys()

    def get_tensor(self, name):
        return self._record(name, self._f.get_tensor(name))

    def get_slice(self, name):
        return _CountingSlice(self._f.get_slice(name), name, self._record)


def _load_counting_reads(path, layout, **kwargs):
    """load_parallel with safetensors reads counted independently of the loader's own stats."""
    import safetensors

    from fusedpar.integrations.hf import load_parallel

    safetensors._fusedpar_real_safe_open = safetensors.safe_open
    safetensors.safe_open = _CountingOpen
    _CountingOpen.reads = {}
    try:
        model = load_parallel(path, layout, **kwargs)
    finally:
        safetensors.safe_open = safetensors._fusedpar_real_safe_open
    layer_bytes = sum(v for k, v in _CountingOpen.reads.items() if k.startswith("model.layers."))
    return model, layer_bytes


def _reference(model, prompt_sets, new_tokens):
    """Unsharded logits (left and right padded), greedy generate (with and without an eos that stops
    rows early), cached calls."""
    refs = []
    for ids, mask in prompt_sets:
        r = {"logits": model(ids, attention_mask=mask, use_cache=False).logits}
        r["right_logits"] = model(*right_padded(ids, mask), use_cache=False).logits
        r["gen"] = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, **GREEDY)
        r["eos"] = int(r["gen"][0, ids.shape[1] + 1])  # row 0's second new token: stops it (and maybe others)
        r["gen_eos"] = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, eos_token_id=r["eos"],
                                      **GREEDY)
        r["cached"] = _cached_calls(model, ids, mask, r["gen"])
        refs.append(r)
    return refs


def _cached_calls(model, ids, mask, gen):
    """Prefill with use_cache, then two single-token calls with past_key_values (HF positions implicit)."""
    out = model(ids, attention_mask=mask, use_cache=True)
    logits, past, m = [out.logits], out.past_key_values, mask
    s = ids.shape[1]
    for k in range(2):
        m = torch.cat([m, torch.ones_like(m[:, :1])], dim=1)
        out = model(gen[:, s + k:s + k + 1], attention_mask=m, past_key_values=past, use_cache=True)
        logits.append(out.logits)
        past = out.past_key_values
    return logits


def loss_labels(ids, mask):
    """Labels for real-to-real predictions only. HF shifts labels by one, so a left-padded row's
    first real token would be predicted from a padding position (meaningless logits)."""
    first_real = mask.cumsum(1) == 1
    return ids.masked_fill((mask == 0) | first_real, -100)


def _right_padded_continuation(pm, ids):
    """A right-padded row followed by a new token: HF gives the new token position 4 after 3 real
    tokens (a gap fusedpar cannot reproduce), so the call must raise."""
    mask = torch.tensor([[1, 1, 1, 0]])
    out = pm(ids[:1, :4], attention_mask=mask, use_cache=True)
    pm(ids[:1, :1], attention_mask=torch.tensor([[1, 1, 1, 0, 1]]), past_key_values=out.past_key_values)


def _api_checks(pm, ids, mask, ref_model_loss, errors: dict) -> dict:
    """Contract details beyond logits/generate; each entry True when the behaviour is right."""
    out: dict = {}
    labels = loss_labels(ids, mask)
    loss = pm(ids, attention_mask=mask, labels=labels, use_cache=False).loss
    out["loss_rel_error"] = abs(loss.item() - ref_model_loss) / abs(ref_model_loss)
    tup = pm(ids, attention_mask=mask, use_cache=False, return_dict=False)
    out["tuple_output"] = isinstance(tup, tuple) and torch.is_tensor(tup[0])

    first = pm(ids, attention_mask=mask, use_cache=True)
    pm(ids, attention_mask=mask, use_cache=False)  # a temporary call must not release `first`
    m2 = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    nxt = ids[:, -1:]
    pm(nxt, attention_mask=m2, past_key_values=first.past_key_values)
    out["temporary_keeps_live_cache"] = True
    pm(ids, attention_mask=mask, use_cache=True)  # a fresh call releases `first`
    m3 = torch.cat([m2, torch.ones_like(mask[:, :1])], dim=1)
    for key, call, exc, text in [
        ("released_cache_rejected", lambda: pm(nxt, attention_mask=m3, past_key_values=first.past_key_values),
         ValueError, "released"),
        ("batch_change_rejected", lambda: pm(ids[:1], attention_mask=mask[:1],
                                             past_key_values=pm(ids, attention_mask=mask).past_key_values),
         ValueError, "rows"),
        ("gapped_positions_rejected", lambda: pm(ids, attention_mask=mask, use_cache=False,
                                                 position_ids=(torch.arange(ids.shape[1]) * 2)[None]),
         NotImplementedError, "not consecutive"),
        ("right_padding_continuation_rejected", lambda: _right_padded_continuation(pm, ids), NotImplementedError,
         "shift by 1"),
        ("beam_search_rejected", lambda: pm.generate(ids, attention_mask=mask, max_new_tokens=2, num_beams=2,
                                                     **GREEDY),
         NotImplementedError, "beam search"),
    ]:
        try:
            call()
            out[key] = False
        except exc as e:
            out[key] = text in str(e)
            errors[key] = str(e)
    return out


def _run_case(rank: int, world: int, case: dict) -> dict:
    from fusedpar.integrations.hf import parallelize, resident_decoder_bytes

    torch.manual_seed(0)
    layout = ParallelLayout(world, sp=case["sp"], tp=case["tp"])
    new_tokens = case.get("new_tokens", 6)
    kwargs = dict(case.get("parallel_kwargs", {}))
    if "checkpoint" in case:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(case["checkpoint"], dtype=torch.float32).eval()
    else:
        model = make_model(case["family"], seed=case.get("seed", 0), **case.get("overrides", {}))
    vocab = model.config.vocab_size
    prompt_sets = [left_padded(lengths, vocab, seed=100 + j) for j, lengths in enumerate(case["prompts"])]
    with torch.no_grad():  # no autograd graph may keep the full weights alive
        refs = _reference(model, prompt_sets, new_tokens)
    ref_loss = ref_embeds_gen = None
    if case.get("api"):
        ids, mask = prompt_sets[0]
        with torch.no_grad():
            ref_loss = model(ids, attention_mask=mask, labels=loss_labels(ids, mask)).loss.item()
            ref_embeds_gen = model.generate(inputs_embeds=model.model.embed_tokens(ids), attention_mask=mask,
                                            max_new_tokens=4, **GREEDY)
    full_layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers.parameters())

    if "checkpoint" in case:
        del model
        pm, layer_bytes_read = _load_counting_reads(case["checkpoint"], layout, dtype=torch.float32, device="cpu",
                                                    shift_threshold=case["threshold"], progress=rank == 0, **kwargs)
    else:
        probe = weakref.ref(model.model.layers[-1].mlp.down_proj.weight)
        pm = parallelize(model, layout, shift_threshold=case["threshold"], **kwargs)
        gc.collect()
        res_freed = probe() is None
    spec = pm.fusedpar_spec
    res: dict = {"errs": [], "pad_errs": [], "right_errs": [], "cached_errs": [], "gen_equal": [],
                 "gen_eos_equal": [], "gen_steps": [], "poison_equal": [], "tokens": [], "ref_tokens": [],
                 "messages": {}}
    for (ids, mask), r in zip(prompt_sets, refs, strict=True):
        real = mask.bool()
        logits = pm(ids, attention_mask=mask, use_cache=False).logits
        res["errs"].append(rel_error(logits[real], r["logits"][real]))
        # left padding: HF's SDPA gives a padding query a zero attention output (its MLP-only value)
        res["pad_errs"].append(rel_error(logits[~real], r["logits"][~real]) if bool((~real).any()) else 0.0)
        # right padding: HF's SDPA attends a padding query to the row's earlier real tokens
        r_ids, r_mask = right_padded(ids, mask)
        right = pm(r_ids, attention_mask=r_mask, use_cache=False).logits
        r_real = r_mask.bool()
        res["right_errs"].append(max(rel_error(right[r_real], r["right_logits"][r_real]),
                                     rel_error(right[~r_real], r["right_logits"][~r_real]) if bool((~r_real).any())
                                     else 0.0))
        if not res["tokens"]:
            # bytes, not a tensor: tensors cross the result queue through shared-memory file
            # descriptors that die with the (already finished) worker process
            res["fingerprint"] = logits.numpy().tobytes()
        # Poison the padding: other token ids there must not change any real position's logits.
        poisoned = ids.clone()
        poisoned[~real] = torch.randint(1, vocab, (int((~real).sum()),), generator=torch.Generator().manual_seed(7))
        res["poison_equal"].append(torch.equal(pm(poisoned, attention_mask=mask, use_cache=False).logits[real],
                                               logits[real]))
        before = dict(pm.fusedpar_stack.steps)
        gen = pm.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, **GREEDY)
        res["gen_steps"].append({m: pm.fusedpar_stack.steps[m] - before[m] for m in before})
        res["gen_equal"].append(torch.equal(gen, r["gen"]))
        res["tokens"].append(gen.tolist())
        res["ref_tokens"].append(r["gen"].tolist())
        gen_eos = pm.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, eos_token_id=r["eos"], **GREEDY)
        res["gen_eos_equal"].append(torch.equal(gen_eos, r["gen_eos"]))
        cached = _cached_calls(pm, ids, mask, r["gen"])
        errs = [rel_error(cached[0][real], r["cached"][0][real])]
        errs += [rel_error(a, b) for a, b in zip(cached[1:], r["cached"][1:], strict=True)]
        res["cached_errs"].append(max(errs, key=lambda e: math.inf if math.isnan(e) else e))  # NaN wins
    if case.get("api"):
        ids, mask = prompt_sets[0]
        res["api"] = _api_checks(pm, ids, mask, ref_loss, res["messages"])
        gen = pm.generate(inputs_embeds=pm.model.embed_tokens(ids), attention_mask=mask, max_new_tokens=4, **GREEDY)
        res["api"]["inputs_embeds_generate"] = torch.equal(gen, ref_embeds_gen)
    if "too_long" in case:
        ids, mask = left_padded([case["too_long"]], vocab, seed=5)
        try:
            pm(ids, attention_mask=mask)
            res["too_long_rejected"] = False
        except ValueError as e:
            res["too_long_rejected"] = "max_seq_len" in str(e)
            res["messages"]["too_long"] = str(e)

    element = 4
    res["resident_bytes"] = resident_decoder_bytes(pm)
    res["expected_bytes"] = expected_bytes(spec, layout, rank, element)
    res["full_layer_bytes"] = full_layer_bytes
    res["hf_layer_params"] = sum(1 for _ in pm.model.layers.parameters())
    res["hf_weights_freed"] = res_freed if "checkpoint" not in case else True
    res["load_stats"] = dict(getattr(pm, "fusedpar_load_stats", {}))
    if "checkpoint" in case:
        res["layer_bytes_read"] = layer_bytes_read
    res["kv_heads"] = pm.fusedpar_stack.layers[0].kv_heads
    res["kv_blocks"] = pm._fusedpar.kv.num_blocks
    res["layer_class"] = type(pm.fusedpar_stack.layers[0]).__name__
    layer_cfg = pm.fusedpar_stack.layers[0].cfg
    res["decoder"] = dict(qkv_bias=layer_cfg.qkv_bias, rope_table=layer_cfg.rope_inv_freq is not None,
                          rope_attention_scaling=layer_cfg.rope_attention_scaling)
    try:
        pm.model(prompt_sets[0][0])
        res["base_model_guarded"] = False
    except RuntimeError:
        res["base_model_guarded"] = True
    return res


def run_cases(rank: int, world: int, cases: list[dict]) -> dict:
    out = {}
    for case in cases:
        try:
            out[case["name"]] = _run_case(rank, world, case)
        except Exception:
            out[case["name"]] = {"error": f"rank {rank}:\n{traceback.format_exc()}"}
    return out


# ---- helpers of the per-subject test files (test_hf_cache / _padding / _model / _loader) ----------
def parallel_pair(family: str, layout: ParallelLayout, threshold: int = 4, **overrides):
    """(unsharded reference, parallelized copy) of the same seeded model; threshold 4 on 2 ranks: prefills
    run base (SP=2), decode steps of 1-3 rows shift."""
    from fusedpar.integrations.hf import parallelize

    ref = make_model(family, **overrides)
    return ref, parallelize(make_model(family, **overrides), layout, shift_threshold=threshold)


def raises(fn) -> str | None:
    """'ExceptionType: message' of what fn raised, None when it returned."""
    try:
        fn()
    except Exception as e:  # the tests name the type they expect
        return f"{type(e).__name__}: {e}"
    return None


def run_named(cases: dict, rank: int, seed: int | None = 0) -> dict:
    """Run every case (name -> no-argument callable) in this rank's process; a case that raises records
    its traceback instead of stopping the others. seed: torch.manual_seed before each case."""
    out = {}
    for name, fn in cases.items():
        try:
            if seed is not None:
                torch.manual_seed(seed)
            out[name] = fn()
        except Exception:
            out[name] = {"error": f"rank {rank}:\n{traceback.format_exc()}"}
    return out


def case_results(results: list[dict], name: str) -> list[dict]:
    """One case's result on every rank, after checking that no rank recorded an error."""
    per_rank = [r[name] for r in results]
    for res in per_rank:
        assert "error" not in res, res.get("error")
    return per_rank
