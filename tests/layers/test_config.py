"""DecoderConfig's q/k/v bias and RoPE table fields, and rope_cos_sin with a table and scaling."""

import dataclasses

import pytest
import torch

from fusedpar.kernels.reference import rope_cos_sin
from fusedpar.layers import DecoderConfig, DenseDecoderStack, StepBatch, random_decoder_weights, weight_shapes

CFG = DecoderConfig(hidden_size=16, num_q_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=32,
                    rope_theta=500.0)


def test_defaults_are_plain_rope_without_bias():
    assert not CFG.qkv_bias and CFG.rope_inv_freq is None and CFG.rope_attention_scaling == 1.0
    assert CFG.rope_is_default
    assert not {"q_bias", "k_bias", "v_bias"} & set(weight_shapes(CFG))
    shapes = weight_shapes(dataclasses.replace(CFG, qkv_bias=True))
    assert (shapes["q_bias"], shapes["k_bias"], shapes["v_bias"]) == ((32,), (16,), (16,))


def test_rope_table_is_stored_as_a_tuple_and_checked():
    table = torch.tensor([1.0, 0.5, 0.25, 0.125])
    cfg = dataclasses.replace(CFG, rope_inv_freq=table, rope_attention_scaling=1.25)
    assert cfg.rope_inv_freq == (1.0, 0.5, 0.25, 0.125) and not cfg.rope_is_default
    assert hash(cfg) == hash(dataclasses.replace(CFG, rope_inv_freq=[1.0, 0.5, 0.25, 0.125],
                                                 rope_attention_scaling=1.25))
    assert not dataclasses.replace(CFG, rope_attention_scaling=0.5).rope_is_default
    with pytest.raises(ValueError, match="rope_inv_freq has 3 frequencies; head_dim=8 needs head_dim/2"):
        dataclasses.replace(CFG, rope_inv_freq=(1.0, 0.5, 0.25))
    with pytest.raises(ValueError, match="finite"):
        dataclasses.replace(CFG, rope_attention_scaling=float("nan"))


def test_rope_cos_sin_with_a_table_and_scaling():
    pos = torch.tensor([0, 3, 17, 1000])
    theta_table = [500.0 ** (-2 * i / 8) for i in range(4)]
    cos, sin = rope_cos_sin(pos, 8, 500.0, torch.float64)
    cos_t, sin_t = rope_cos_sin(pos, 8, 12345.0, torch.float64, inv_freq=theta_table)  # theta unused
    torch.testing.assert_close(cos_t, cos, rtol=0, atol=1e-12)
    torch.testing.assert_close(sin_t, sin, rtol=0, atol=1e-12)
    table = torch.tensor([0.9, 0.3, 0.02, 0.001], dtype=torch.float64)
    cos_s, sin_s = rope_cos_sin(pos, 8, 500.0, torch.float32, inv_freq=table, scale=0.75)
    ang = pos.double()[:, None] * table[None, :]
    assert cos_s.dtype == torch.float32
    torch.testing.assert_close(cos_s.double(), 0.75 * torch.cat([ang, ang], 1).cos(), rtol=0, atol=1e-7)
    torch.testing.assert_close(sin_s.double(), 0.75 * torch.cat([ang, ang], 1).sin(), rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match="head_dim/2 = 4 entries"):
        rope_cos_sin(pos, 8, 500.0, torch.float32, inv_freq=[1.0, 2.0])


def test_oracle_adds_the_bias_to_q_k_v():
    """Zero biases reproduce the bias-free oracle; a k bias alone changes the output."""
    cfg = dataclasses.replace(CFG, qkv_bias=True)
    w = random_decoder_weights(cfg, seed=2, dtype=torch.float64)
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    batch = StepBatch((0,), (5,), (0,))
    plain = DenseDecoderStack(CFG, [{n: t for n, t in w.items() if not n.endswith("_bias")}]).forward(x, batch)
    zero = {**w, **{n: torch.zeros_like(w[n]) for n in ("q_bias", "k_bias", "v_bias")}}
    torch.testing.assert_close(DenseDecoderStack(cfg, [zero]).forward(x, batch), plain, rtol=0, atol=1e-12)
    k_only = {**zero, "k_bias": w["k_bias"]}
    assert not torch.allclose(DenseDecoderStack(cfg, [k_only]).forward(x, batch), plain)
