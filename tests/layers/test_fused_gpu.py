"""The decoder layer on the fused kernels (qkv_all_to_all, Triton attention, all_to_all_o_proj,
gemm_all_reduce) vs the fp64 oracle and vs the reference path, on NCCL GPUs under torchrun."""

import pytest
import torch

from fusedpar.kernels.fp8 import FP8Scheme
from fusedpar.layers import DecoderConfig
from fusedpar.testing.scenarios import Step, run_layer_scenario

pytestmark = pytest.mark.gpu

REL_TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3}

# Odd token counts (padding in base mode), decode in shift, a second prefill on the same cache,
# and a decode batch big enough for the one-shot / two-shot reduce paths to differ.
STEPS = [
    Step(((0, 333), (1, 70), (2, 1)), "base"),
    Step(((0, 1), (1, 1), (2, 1)), "shift"),
    Step(((3, 1029),), "base"),
    Step(tuple((s, 1) for s in range(4)), "shift"),
    Step(((0, 5), (1, 3), (2, 64), (3, 2)), "base"),
    Step(((0, 2049),), "shift"),
]


def _layouts(world):
    out = [(world, 1), (1, world)]
    if world >= 4:
        out.append((2, world // 2))
    return out


def _check_fused_against_oracle_and_plain(rank, world, cfg, dtype):
    for sp, tp in _layouts(world):
        fused = run_layer_scenario(rank, world, cfg, sp, tp, STEPS, dtype=dtype, block_size=16, fused=True)
        plain = run_layer_scenario(rank, world, cfg, sp, tp, STEPS, dtype=dtype, block_size=16)
        for i, (f, p) in enumerate(zip(fused.steps, plain.steps, strict=True)):
            where = f"sp={sp} tp={tp} step {i} ({f.mode}, {f.tokens} tokens)"
            assert f.mode == p.mode
            assert f.rel_error < REL_TOL[dtype], f"{where}: fused rel error {f.rel_error:.3g}"
            # the fused path must be about as accurate as the plain bf16 path, not just within tolerance
            assert f.rel_error < 2 * p.rel_error + 4e-3, f"{where}: fused {f.rel_error:.3g} vs plain {p.rel_error:.3g}"
        assert fused.cache_rel_error < REL_TOL[dtype]
        assert fused.cache_lengths == plain.cache_lengths


@pytest.mark.parametrize("dtype", [torch.bfloat16])
@pytest.mark.parametrize(("h", "hkv", "qk_norm"), [(32, 8, False), (16, 2, True)])
def test_fused_decoder_matches_oracle_and_reference(nccl_world, dtype, h, hkv, qk_norm):
    rank, world = nccl_world
    cfg = DecoderConfig(hidden_size=1024, num_q_heads=h, num_kv_heads=hkv, head_dim=128,
                        intermediate_size=2048, qk_norm=qk_norm, rope_theta=1e6)
    _check_fused_against_oracle_and_plain(rank, world, cfg, dtype)


def _llama3_style_table(head_dim: int, theta: float = 5e5, factor: float = 8.0) -> tuple[float, ...]:
    """A scaled RoPE table no rope_theta gives: low frequencies divided by `factor`, a smooth ramp between."""
    out = []
    for i in range(head_dim // 2):
        f = theta ** (-2 * i / head_dim)
        ramp = min(max((2 * i / head_dim - 0.25) / 0.5, 0.0), 1.0)  # 0 for high, 1 for low frequencies
        out.append(f / (1 + (factor - 1) * ramp))
    return tuple(out)


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_fused_decoder_with_qkv_bias_and_rope_tables(nccl_world, dtype):
    """Qwen2-style q/k/v bias (added after qkv_all_to_all, in the GEMM in shift mode) and a scaled
    RoPE table with attention scaling (cos/sin tables into the Triton attention), with GQA, Qwen3
    q/k norm and, at 4+ ranks, replicated kv heads (duplicated bias entries)."""
    rank, world = nccl_world
    cfg = DecoderConfig(hidden_size=1024, num_q_heads=16, num_kv_heads=2, head_dim=128, intermediate_size=2048,
                        qk_norm=True, rope_theta=5e5, qkv_bias=True, rope_inv_freq=_llama3_style_table(128),
                        rope_attention_scaling=1.1)
    assert not cfg.rope_is_default
    _check_fused_against_oracle_and_plain(rank, world, cfg, dtype)


# an activation quantised from bf16 hidden states instead of the oracle's float64 ones may land on the other
# e4m3 neighbour: within 2^-4 of it, twice (as tests/layers/test_fp8_decoder.py's FP8_ROUNDING)
FP8_ROUNDING = 2 * 2.0**-4


@pytest.mark.parametrize("scheme", [FP8Scheme("channel"), FP8Scheme("block"), FP8Scheme("tensor")],
                         ids=["channel", "block128", "tensor"])
def test_fp8_weights_run_the_plain_path_on_cuda_and_the_fused_path_refuses_them(nccl_world, scheme):
    """FP8 (e4m3) projection weights: the plain path (FP8 reference math) against the unsharded FP8 oracle;
    the fused path refuses them on CUDA by name (its e4m3 variants are not enabled there)."""
    rank, world = nccl_world
    cfg = DecoderConfig(hidden_size=1024, num_q_heads=16, num_kv_heads=2, head_dim=128, intermediate_size=2048,
                        qk_norm=True, rope_theta=1e6)
    for sp, tp in _layouts(world):
        plain = run_layer_scenario(rank, world, cfg, sp, tp, STEPS, dtype=torch.bfloat16, block_size=16, fp8=scheme)
        for i, p in enumerate(plain.steps):
            assert p.rel_error < FP8_ROUNDING, f"sp={sp} tp={tp} step {i} ({p.mode}): rel error {p.rel_error:.3g}"
        assert plain.cache_rel_error < FP8_ROUNDING
        with pytest.raises(ValueError, match=r"FP8 weights \(down, gate_up, o, qkv\) run on the plain GEMMs on CUDA"):
            run_layer_scenario(rank, world, cfg, sp, tp, STEPS, dtype=torch.bfloat16, block_size=16, fused=True,
                               fp8=scheme)
