"""fusedpar.integrations.hf on gloo CPU processes vs the unsharded transformers model (fp32).

Two spawns (4 ranks, 2 ranks) run every distributed case; each test below checks one case's
results: logits within 1e-4 relative error at every real position (plain call, and prefill +
two cached single-token calls) and at every padded one (plain calls, left and right padded), identical greedy
generate (also with an eos that stops rows early), outputs bit-identical across ranks and real
positions unaffected by what the padding holds, the expected number of base / shift steps, and
resident decoder bytes equal to the base shards.
Unsupported configs are checked in-process (parallelize rejects them before any collective).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from fusedpar.layers import DEFAULT_SHIFT_THRESHOLD  # noqa: E402
from fusedpar.layouts import ParallelLayout  # noqa: E402
from fusedpar.testing.dist import run_distributed  # noqa: E402
from tests.integrations.hf_models import make_model  # noqa: E402
from tests.integrations.hf_workers import run_cases  # noqa: E402

REL_TOL = 1e-4
ALWAYS_SHIFT = 10**9
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

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
        assert max(res["errs"]) < REL_TOL, f"{where}: logits rel error {res['errs']}"
        assert max(res["pad_errs"]) < REL_TOL, f"{where}: logits at padded positions, rel error {res['pad_errs']}"
        assert max(res["right_errs"]) < REL_TOL, f"{where}: right-padded call, rel error {res['right_errs']}"
        assert max(res["cached_errs"]) < REL_TOL, f"{where}: cached-call logits rel error {res['cached_errs']}"
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


@pytest.mark.parametrize(("rope", "scaled"), [
    (LLAMA3_ROPE, False),
    ({"rope_type": "linear", "rope_theta": 500.0, "factor": 4.0}, False),
    ({"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 64}, True),
])
def test_rope_table_is_the_hf_rotary_modules(rope, scaled):
    """DecoderConfig carries the HF rotary module's inv_freq and attention_scaling, and the core's
    cos/sin equal HF's (fp32 angles in HF, fp64 in the core: ~1 ulp)."""
    from fusedpar.integrations.hf import inspect_model

    from fusedpar.kernels.reference import rope_cos_sin

    model = make_model("llama", rope_parameters=rope)
    cfg = inspect_model(model, LAYOUT4).decoder
    rot = model.model.rotary_emb
    assert cfg.rope_inv_freq == tuple(rot.inv_freq.tolist())
    assert cfg.rope_attention_scaling == rot.attention_scaling and (cfg.rope_attention_scaling != 1.0) == scaled
    assert not cfg.rope_is_default
    pos = torch.arange(200)
    hf_cos, hf_sin = rot(torch.zeros(1, 200, cfg.head_dim), pos[None])
    cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta, torch.float32, cfg.rope_inv_freq,
                            cfg.rope_attention_scaling)
    torch.testing.assert_close(cos, hf_cos[0], atol=2e-5, rtol=0)
    torch.testing.assert_close(sin, hf_sin[0], atol=2e-5, rtol=0)


# ---- unsupported models fail at parallelize time, naming what is unsupported -------------------
def _rejects(model, layout, match, **kw):
    from fusedpar.integrations.hf import UnsupportedModelError, parallelize

    with pytest.raises(UnsupportedModelError, match=match):
        parallelize(model, layout, **kw)


LAYOUT4 = ParallelLayout(4, sp=2, tp=2)


@pytest.mark.parametrize(
    ("family", "overrides", "match"),
    [
        ("llama", dict(attention_bias=True), r"o_proj\.bias"),
        ("llama", dict(mlp_bias=True), "MLP bias"),
        ("llama", dict(hidden_act="gelu"), "hidden_act='gelu'"),
        ("llama", dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
         "rope type 'dynamic'"),
        ("llama", dict(num_attention_heads=6, num_key_value_heads=2, hidden_size=48),
         "num_q_heads=6 is not divisible by sp\\*tp=2\\*2=4"),
        ("llama", dict(intermediate_size=130), "intermediate_size=130 is not divisible"),
    ],
)
def test_unsupported_configs_rejected(family, overrides, match):
    _rejects(make_model(family, **overrides), LAYOUT4, match)


def test_every_layout_problem_is_named_at_once():
    """A layout that breaks several constraints names them all in one error, not the first alone."""
    from fusedpar.integrations.hf import UnsupportedModelError, inspect_model

    model = make_model("qwen3", num_attention_heads=8, num_key_value_heads=2, intermediate_size=128)
    with pytest.raises(UnsupportedModelError) as err:
        inspect_model(model, ParallelLayout(3, sp=3))
    for needle in ("intermediate_size=128 is not divisible by sp*tp=3*1=3", "num_q_heads=8 is not divisible",
                   "num_kv_heads=2 is neither a multiple nor a divisor"):
        assert needle in str(err.value), str(err.value)


def test_llama_ignores_a_stray_sliding_window_in_its_config():
    """HF's Llama attention is always full causal, whatever sliding_window its config carries: no
    per-sequence limit (it refused sequences past the stray window); Mistral's window still limits."""
    from fusedpar.integrations.hf import inspect_model

    assert inspect_model(make_model("llama", sliding_window=8), LAYOUT4).max_seq_len is None
    assert inspect_model(make_model("mistral", sliding_window=8), LAYOUT4).max_seq_len == 8


def test_sliding_window_limits_sequences_to_the_window():
    """MistralConfig's default sliding_window=4096 is accepted with a per-sequence limit of 4096 tokens
    (inside the window it equals full attention); a larger explicit max_seq_len is rejected. Qwen2's
    per-layer windows: the smallest one is the limit."""
    from fusedpar.integrations.hf import inspect_model

    model = make_model("mistral")
    assert model.config.sliding_window == 4096
    spec = inspect_model(model, LAYOUT4)
    assert (spec.sliding_window, spec.max_seq_len) == (4096, 4096)
    assert inspect_model(model, LAYOUT4, max_seq_len=100).max_seq_len == 100
    _rejects(model, LAYOUT4, r"sliding window attention \(sliding_window=4096\) with max_seq_len=4097",
             max_seq_len=4097)
    _rejects(make_model("mistral", sliding_window=16), LAYOUT4, r"pass max_seq_len <= 16", max_seq_len=17)
    qwen2 = make_model("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert inspect_model(qwen2, LAYOUT4).max_seq_len == 8
    _rejects(qwen2, LAYOUT4, "sliding window", max_seq_len=9)
    assert inspect_model(make_model("mistral", sliding_window=None), LAYOUT4).max_seq_len is None


def test_moe_and_other_architectures_rejected():
    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      num_experts=4, num_experts_per_tok=2)
    _rejects(transformers.AutoModelForCausalLM.from_config(cfg), LAYOUT4, "mixture-of-experts")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64))
    _rejects(gpt2, LAYOUT4, "model_type 'gpt2'")


def test_every_problem_is_named_at_once():
    model = make_model("llama", attention_bias=True, mlp_bias=True, intermediate_size=130)
    from fusedpar.integrations.hf import UnsupportedModelError, parallelize

    with pytest.raises(UnsupportedModelError) as info:
        parallelize(model, LAYOUT4)
    msg = str(info.value)
    assert "o_proj.bias" in msg and "MLP bias" in msg and "intermediate_size=130" in msg


def test_supported_model_needs_process_group_and_real_weights():
    from fusedpar.integrations.hf import UnsupportedModelError, parallelize

    with pytest.raises(RuntimeError, match="init_process_group"):
        parallelize(make_model("llama"), LAYOUT4)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(make_model("llama").config)
    _rejects(meta, LAYOUT4, "meta-device")
    with pytest.raises(ValueError, match="shift threshold"):
        parallelize(make_model("llama"), LAYOUT4, shift_threshold=-1)
    with pytest.raises(UnsupportedModelError, match="fused kernels need CUDA"):
        parallelize(make_model("llama"), LAYOUT4, fused=True)


def test_cuda_graphs_choice_and_refusals():
    """cuda_graphs: auto = on exactly when the fused path is; True without it is refused, before any
    collective (no process group here); only None / True / False are accepted."""
    from fusedpar.integrations.hf import UnsupportedModelError, parallelize
    from fusedpar.integrations.hf.adapter import graphs_decision

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert graphs_decision(True, cuda, None) and not graphs_decision(False, cpu, None)
    assert graphs_decision(True, cuda, True) and not graphs_decision(True, cuda, False)
    assert not graphs_decision(False, cpu, False)
    with pytest.raises(UnsupportedModelError, match="cuda_graphs=True needs the fused kernels"):
        graphs_decision(False, cpu, True)
    for bad in (1, "yes"):
        with pytest.raises(ValueError, match="cuda_graphs must be None, True or False"):
            graphs_decision(True, cuda, bad)
    with pytest.raises(UnsupportedModelError, match="cuda_graphs=True needs the fused kernels"):
        parallelize(make_model("llama"), LAYOUT4, cuda_graphs=True)  # CPU model: reference path


def test_decode_graph_size():
    """A step replays a decode graph only when every sequence adds one token, at the smallest capture
    size that holds its sequences, within the stack's cap (shift threshold / max_tokens)."""
    from fusedpar.integrations.hf.adapter import decode_graph_size

    from fusedpar.layers import StepBatch

    def decode(n, ctx=5):
        return StepBatch(tuple(range(n)), (1,) * n, (ctx,) * n)

    assert decode_graph_size(decode(1), 64) == 1
    assert decode_graph_size(decode(3), 64) == 4
    assert decode_graph_size(decode(17), 64) == 24
    assert decode_graph_size(decode(64), 64) == 64
    assert decode_graph_size(decode(65), 4096) is None  # beyond the largest capture size
    assert decode_graph_size(decode(3), 3) is None  # size 4 > cap 3: that step would run in base mode
    assert decode_graph_size(decode(3), 4) == 4
    assert decode_graph_size(StepBatch((0, 1), (1, 2), (5, 0)), 64) is None  # a prefill row: eager
    assert decode_graph_size(StepBatch((0,), (7,), (0,)), 64) is None


def test_fused_path_choice():
    """auto: fused only for CUDA bf16/fp16 models with head_dim 2^k >= 16."""
    from fusedpar.integrations.hf import UnsupportedModelError, inspect_model
    from fusedpar.integrations.hf.adapter import fused_decision

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    spec16 = inspect_model(make_model("qwen3", dtype=torch.bfloat16), LAYOUT4)  # head_dim 16
    assert fused_decision(spec16, cuda, None) and not fused_decision(spec16, cpu, None)
    assert not fused_decision(inspect_model(make_model("qwen3"), LAYOUT4), cuda, None)  # fp32: exact path
    assert fused_decision(inspect_model(make_model("qwen3"), LAYOUT4), cuda, True)
    with pytest.raises(UnsupportedModelError, match="head_dim=8"):
        fused_decision(inspect_model(make_model("llama", dtype=torch.bfloat16), LAYOUT4), cuda, True)
    # q/k/v bias and RoPE tables run on the fused path too (the core layer supports them)
    qwen2 = inspect_model(make_model("qwen2", dtype=torch.bfloat16, hidden_size=128), LAYOUT4)
    llama3 = inspect_model(make_model("llama", dtype=torch.bfloat16, hidden_size=128, rope_parameters=LLAMA3_ROPE),
                           LAYOUT4)
    assert qwen2.qkv_bias and llama3.rope_inv_freq is not None
    for spec in (qwen2, llama3):
        assert fused_decision(spec, cuda, None) and fused_decision(spec, cuda, True)
        assert not fused_decision(spec, cpu, None)
