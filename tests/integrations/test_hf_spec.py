"""fusedpar.integrations.hf.inspect_model: which models run, how, and what is refused (spec.py).

In-process (no process group: every check runs before any collective): the RoPE table handed to
the core is the HF rotary module's own; unsupported configs, families and layouts fail at
parallelize time naming every problem at once; sliding windows set the per-sequence limit; the
fused path is chosen for CUDA bf16/fp16 models the fused kernels compute.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fusedpar.layouts import ParallelLayout  # noqa: E402
from tests.integrations.hf_models import LLAMA3_ROPE, make_model  # noqa: E402

LAYOUT2 = ParallelLayout(2, sp=2)
LAYOUT4 = ParallelLayout(4, sp=2, tp=2)


def _rejects(model, layout, match, **kw):
    from fusedpar.integrations.hf import UnsupportedModelError, parallelize

    with pytest.raises(UnsupportedModelError, match=match):
        parallelize(model, layout, **kw)


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
    per-sequence limit; Mistral's window still limits."""
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


SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64)


@pytest.mark.parametrize(("model_type", "named"), [
    ("olmo", "model_type 'olmo'"),          # LayerNorm without weights: no rms_norm_eps
    ("cohere", "model_type 'cohere'"),      # LayerNorm, parallel attention + MLP
    ("starcoder2", "model_type 'starcoder2'"),
    ("qwen3_next", "model_type 'qwen3_next'"),  # linear-attention layers have no self_attn
])
def test_other_families_fail_naming_the_model_type(model_type, named):
    from fusedpar.integrations.hf import UnsupportedModelError, parallelize

    try:
        config = transformers.AutoConfig.for_model(model_type, **SMALL)
    except ValueError:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(UnsupportedModelError, match=named):
        parallelize(model, LAYOUT2)


def test_layout_must_be_a_parallel_layout():
    from fusedpar.integrations.hf import parallelize

    with pytest.raises(TypeError, match=r"ParallelLayout.*int"):
        parallelize(make_model("llama"), 2)


def test_fused_path_choice():
    """auto: fused only for CUDA bf16/fp16 models with head_dim 2^k >= 16."""
    from fusedpar.integrations.hf import UnsupportedModelError, inspect_model
    from fusedpar.integrations.hf.model import fused_decision

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
