"""fusedpar.integrations.hf: padded columns, positions and cached columns against HF (padding.py).

One spawn (gloo, 2 CPU ranks, SP=2, fp32, threshold 4) runs every case against the unsharded
transformers model; each test checks one case:
- a sliding-window model whose attention_mask has masked columns between real tokens: HF's window
  counts columns, so a row spanning more columns than the window must raise, and one spanning
  fewer must match;
- continuing a cache with an attention_mask that differs from the one its columns were cached
  under (none, or all ones, after a left-padded prompt; a cached token masked later): an HF cache
  holds every column and re-masks per call, the paged cache only the real tokens, so such a call
  must raise naming the row and columns and leave the cache usable;
- padded positions (right padding under a sliding window, a padding-only row, a continuing call
  whose new column is padding) get HF's SDPA values.
Left padding at every padded position, per family and layout: test_hf.py.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fusedpar.layouts import ParallelLayout  # noqa: E402
from fusedpar.testing.dist import run_distributed  # noqa: E402
from fusedpar.testing.scenarios import rel_error  # noqa: E402
from tests.integrations.hf_models import left_padded  # noqa: E402
from tests.integrations.hf_workers import case_results, parallel_pair, raises, run_named  # noqa: E402

REL_TOL = 1e-4
LENGTHS = [7, 5, 10]  # 22 real tokens (not a multiple of SP): base-mode prefill; decode 3 rows: shift


# ---- per-rank bodies ------------------------------------------------------------------------------
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
            out[name] = raises(lambda: pm(nxt, past_key_values=past, **kwargs))  # noqa: B023
            try:
                got = pm(nxt, attention_mask=extended, past_key_values=past).logits
                out[f"{name}_after"] = rel_error(got, want)
            except Exception as e:  # the refused call must not have changed the cache
                out[f"{name}_after"] = f"{type(e).__name__}: {e}"
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


def run_padding_cases(rank: int, world: int) -> dict:
    layout = ParallelLayout(world, sp=2)
    return run_named({
        "window_columns": lambda: _window_columns(*parallel_pair("mistral", layout, sliding_window=8)),
        "cached_columns": lambda: _cached_columns(*parallel_pair("llama", layout)),
        "padding": lambda: _padding(*parallel_pair("mistral", layout, sliding_window=4)),
    }, rank)


@pytest.fixture(scope="module")
def results():
    return run_distributed(run_padding_cases, 2, timeout=300)


# ---- tests ---------------------------------------------------------------------------------------
def test_sliding_window_counts_mask_columns(results):
    for res in case_results(results, "window_columns"):
        assert isinstance(res["inside"], float) and res["inside"] < REL_TOL, res
        assert isinstance(res["outside"], str), f"a row spanning 10 columns with window 8 was accepted: {res}"
        assert "span 10 attention_mask columns" in res["outside"] and "sliding_window=8" in res["outside"], res


def test_continuation_mask_must_match_the_cached_columns(results):
    """Each of these calls would attend to other cached columns in HF: refused, naming row and columns."""
    for res in case_results(results, "cached_columns"):
        for key, fragment in [("no_mask", "marks cached padding column(s) [0, 1, 2] as real"),
                              ("all_ones", "marks cached padding column(s) [0, 1, 2] as real"),
                              ("masked_cached", "masks cached real token column(s) [8]")]:
            assert res[key] is not None, f"{key}: accepted (HF attends to other cached columns)"
            assert res[key].startswith("NotImplementedError:") and fragment in res[key] and "row 0" in res[key], \
                (key, res[key])
            assert isinstance(res[f"{key}_after"], float) and res[f"{key}_after"] < REL_TOL, (key, res)
        assert "no attention_mask" in res["no_mask"], res["no_mask"]


def test_padded_positions_match_hf(results):
    """Padded positions get HF's SDPA values, not zeros."""
    for res in case_results(results, "padding"):
        assert res["right"] < REL_TOL and res["continued"] < REL_TOL, res
        assert len(res["hidden"]) == 3 and max(res["hidden"]) < REL_TOL, res
