"""fusedpar.integrations.hf on gloo CPU processes vs the unsharded transformers model (fp32).

Two spawns (4 ranks, 2 ranks) run every distributed case; each test below checks one case's
results: logits within 1e-4 relative error at every real position (plain call, and prefill +
two cached single-token calls) and at every padded one (plain calls, left and right padded), identical greedy
generate (also with an eos that stops rows early), outputs bit-identical across ranks and real
positions unaffected by what the padding holds, the expected number of base / shift steps, and
resident decoder bytes equal to the base shards. Supported and refused models: test_hf_spec.py.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from fusedpar.layers import DEFAULT_SHIFT_THRESHOLD  # noqa: E402
from fusedpar.testing.dist import run_distributed  # noqa: E402
from tests.integrations.hf_models import LLAMA3_ROPE, make_model  # noqa: E402
from tests.integrations.hf_workers import run_cases  # noqa: E402

REL_TOL = 1e-4
ALWAYS_SHIFT = 10**9

# Prompt sets: batch 3 left-padded with lengths 7, 5, 10 and batch 1 with 13 tokens (22 and 13:
# not multiples of SP=4, so base mode pads). Threshold 8: prefill runs base, decode (3 or 1) shift.
MIXED = [[7, 5, 10], [13]]
CASES_4 = [
    dict(name="llama_sp4_kvrep_mixed", family="llama", sp=4, tp=1, threshold=8, prompts=MIXED, api=True),
    dict(name="llama_tp4_kvrep", family="llama", sp=1, tp=4, threshold=8, prompts=MIXED),
    dict(name="llama_sp2tp2_force_base", family="llama", sp=2, tp=2, threshold=0, prompts=MIXED),
    dict(name="llama_sp2tp2_mqa_llama3rope", family="llama", sp=2, tp=2, threshold=8, prompts=[[9, 3, 6]],
         overrides=dict(num_key_value_heads=1, rope_parameters=LLAMA3_ROPE)),
    dict(name="qwen3_sp2tp2_force_shift", family="qwen3", sp=2, tp=2, threshold=ALWAYS_SHIFT, prompts=MIXED),
    dict(name="qwen3_sp4_mixed", family="qwen3", sp=4, tp=1, threshold=8, prompts=[[11, 6]],
         overrides=dict(num_attention_heads=8, num_key_value_heads=4)),
    dict(name="qwen2_bias_sp2tp2_mixed", family="qwen2", sp=2, tp=2, threshold=8, prompts=MIXED),
    dict(name="mistral_window_sp2_dp2", family="mistral", sp=2, tp=1, threshold=4, prompts=[[7, 5]],
         overrides=dict(sliding_window=32), too_long=33),  # limit 32 = the window, by default
]
CASES_2 = [
    dict(name="llama_sp2_default_threshold", family="llama", sp=2, tp=1, threshold=None, prompts=MIXED),
    dict(name="llama_tp2_8kv", family="llama", sp=1, tp=2, threshold=8, prompts=[[7, 5, 10]],
         overrides=dict(num_key_value_heads=8)),
    dict(name="qwen3_sp2_mixed", family="qwen3", sp=2, tp=1, threshold=8, prompts=MIXED),
    # one-token pages: the paged cache (16 blocks at first) must grow during generate; threshold 1
    # sends the 2-token decode steps to base mode too (the 5-token prefill pads to 6)
    dict(name="llama_sp2_page_growth_base_decode", family="llama", sp=2, tp=1, threshold=1, prompts=[[3, 2]],
         new_tokens=12, parallel_kwargs=dict(block_size=1), min_kv_blocks=32),
]
LOADER_4 = dict(loader=True, name="loader_qwen2_sp2tp2", family="qwen2", sp=2, tp=2, threshold=8,
                prompts=[[7, 5, 10]])
LOADER_2 = dict(loader=True, name="loader_qwen3_tied_sp2", family="qwen3", sp=2, tp=1, threshold=8,
                prompts=[[7, 5, 10]])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Tiny random checkpoints saved as several safetensors shards (model.safetensors.index.json)."""
    paths = {}
    for case in (LOADER_4, LOADER_2):
        path = tmp_path_factory.mktemp(case["name"])
        make_model(case["family"], seed=3).save_pretrained(path, max_shard_size="60KB")
        assert (path / "model.safetensors.index.json").is_file()
        assert len(list(path.glob("*.safetensors"))) >= 3
        paths[case["name"]] = str(path)
    return paths


def _with_checkpoint(case, checkpoints):
    return {**case, "checkpoint": checkpoints[case["name"]]}


@pytest.fixture(scope="module")
def world4(checkpoints):
    return run_distributed(run_cases, 4, [*CASES_4, _with_checkpoint(LOADER_4, checkpoints)], timeout=400)


@pytest.fixture(scope="module")
def world2(checkpoints):
    return run_distributed(run_cases, 2, [*CASES_2, _with_checkpoint(LOADER_2, checkpoints)], timeout=300)


def _expected_gen_steps(case, lengths, new_tokens=6) -> dict:
    """One prefill of sum(lengths) tokens, then new_tokens-1 decode steps of len(lengths) tokens."""
    threshold = DEFAULT_SHIFT_THRESHOLD if case["threshold"] is None else case["threshold"]

    def mode(n):
        return "shift" if case["sp"] == 1 or n <= threshold else "base"

    steps = {"base": 0, "shift": 0}
    steps[mode(sum(lengths))] += 1
    steps[mode(len(lengths))] += new_tokens - 1
    return steps


def _check(per_rank: list[dict], case: dict) -> None:
    name = case["name"]
    results = [r[name] for r in per_rank]
    for rank, res in enumerate(results):
        assert "error" not in res, res.get("error")
        where = f"{name} rank {rank}"
        within = lambda key, res=res: all(e < REL_TOL for e in res[key])  # noqa: E731  (a NaN is never within)
        assert within("errs"), f"{where}: logits rel error {res['errs']}"
        assert within("pad_errs"), f"{where}: logits at padded positions, rel error {res['pad_errs']}"
        assert within("right_errs"), f"{where}: right-padded call, rel error {res['right_errs']}"
        assert within("cached_errs"), f"{where}: cached-call logits rel error {res['cached_errs']}"
        assert all(res["gen_equal"]), f"{where}: greedy tokens {res['tokens']} != unsharded {res['ref_tokens']}"
        assert all(res["gen_eos_equal"]), f"{where}: greedy tokens with eos differ"
        assert all(res["poison_equal"]), f"{where}: padding tokens changed real logits"
        for lengths, steps in zip(case["prompts"], res["gen_steps"], strict=True):
            expected = _expected_gen_steps(case, lengths, case.get("new_tokens", 6))
            assert steps == expected, f"{where}: modes {steps} for prompts {lengths}, expected {expected}"
        if "min_kv_blocks" in case:
            assert res["kv_blocks"] >= case["min_kv_blocks"], f"{where}: paged cache did not grow"
        assert res["resident_bytes"] == res["expected_bytes"], f"{where}: decoder weights not exactly the base shards"
        if case["tp"] > 1:  # pure SP keeps whole layers by design (its TP shard is everything)
            assert res["resident_bytes"] < 0.6 * res["full_layer_bytes"], f"{where}: TP shard not smaller"
        assert res["hf_layer_params"] == 0, f"{where}: HF decoder layers still hold weights"
        assert res["hf_weights_freed"], f"{where}: the full HF layer weights are still alive after parallelize"
        assert res["base_model_guarded"], f"{where}: the emptied base model still runs"
        if case.get("loader"):
            # Never read more of a decoder layer than this rank's base shard (+ norms / bias rows):
            # counted at safetensors' safe_open, and by the loader's own stats.
            assert res["layer_bytes_read"] == res["expected_bytes"], f"{where}: read {res['layer_bytes_read']}"
            assert res["load_stats"]["layers"] == res["expected_bytes"], res["load_stats"]
        if case.get("api"):
            api = res["api"]
            assert api.pop("loss_rel_error") < REL_TOL
            assert all(api.values()), (api, res["messages"])
        if "too_long" in case:
            assert res["too_long_rejected"], res["messages"]
    # Poison-style cross-rank check: every rank returns bit-identical logits and tokens.
    for rank, res in enumerate(results[1:], 1):
        assert res["fingerprint"] == results[0]["fingerprint"], f"{name}: rank {rank} logits differ"
        assert res["tokens"] == results[0]["tokens"], f"{name}: rank {rank} tokens differ"


@pytest.mark.parametrize("case", [*CASES_4, LOADER_4], ids=lambda c: c["name"])
def test_four_ranks(world4, case):
    _check(world4, case)


@pytest.mark.parametrize("case", [*CASES_2, LOADER_2], ids=lambda c: c["name"])
def test_two_ranks(world2, case):
    _check(world2, case)


def test_layer_paths(world4, world2):
    """Every model runs the core layer; bias / non-default RoPE are DecoderConfig fields."""
    for res in (world4[0], world2[0]):
        assert {r["layer_class"] for r in res.values()} == {"ShiftParallelDecoderLayer"}
    qwen2, llama3 = world4[0]["qwen2_bias_sp2tp2_mixed"], world4[0]["llama_sp2tp2_mqa_llama3rope"]
    assert qwen2["decoder"] == dict(qkv_bias=True, rope_table=False, rope_attention_scaling=1.0)
    assert llama3["decoder"] == dict(qkv_bias=False, rope_table=True, rope_attention_scaling=1.0)
    assert world4[0]["llama_tp4_kvrep"]["decoder"] == dict(qkv_bias=False, rope_table=False,
                                                           rope_attention_scaling=1.0)
    assert world4[0]["loader_qwen2_sp2tp2"]["decoder"]["qkv_bias"]
    # kv replication: 2 kv heads over 4 ranks, rank r caches head r*2//4
    assert [r["llama_sp4_kvrep_mixed"]["kv_heads"] for r in world4] == [(0,), (0,), (1,), (1,)]
