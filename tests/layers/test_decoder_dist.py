"""Shift-parallel decoder on gloo CPU processes vs the single-process unsharded oracle (fp32 vs fp64).

Also Qwen2-style q/k/v bias and a scaled RoPE table (DecoderConfig.qkv_bias, rope_inv_freq,
rope_attention_scaling), in base, shift and mixed steps.
"""

import pytest
import torch

from fusedpar.layers import DecoderConfig
from fusedpar.testing.dist import run_distributed
from fusedpar.testing.scenarios import Step, run_layer_scenario

REL_TOL = {torch.float32: 1e-5}

# 13 and 6 prompt tokens: 19 in the step, odd at SP=2 and SP=4 (padding exercised).
PREFILL = Step(((0, 13), (1, 6)))
SCENARIOS = {
    "base": [Step(PREFILL.seqs, "base"), Step(((0, 1), (1, 1)), "base"), Step(((1, 3),), "base")],
    "shift": [Step(PREFILL.seqs, "shift"), Step(((0, 1), (1, 1)), "shift"), Step(((0, 3),), "shift")],
    # prefill in base, decode in shift, another prefill (new sequence + a continued chunk) in
    # base, then a decode step: one cache throughout.
    "mixed": [
        Step(PREFILL.seqs, "base"),
        Step(((0, 1), (1, 1)), "shift"),
        Step(((0, 1), (1, 1)), "shift"),
        Step(((1, 1),), "shift"),
        Step(((2, 7), (0, 5)), "base"),
        Step(((0, 1), (1, 1), (2, 1)), "shift"),
    ],
    # policy-driven with threshold 4: 19 and 12 tokens -> base, 1-3 tokens -> shift
    "policy": [PREFILL, Step(((0, 1), (1, 1))), Step(((2, 12),)), Step(((0, 1), (2, 1), (1, 1)))],
}

# (sp, tp, q heads, kv heads, qk_norm): the four (SP, TP) shapes with GQA, kv
# replication (P > kv heads), MQA, TP > kv heads, and Qwen3's q/k norm.
CONFIGS = [
    (2, 1, 8, 4, False),
    (1, 2, 8, 2, True),
    (2, 2, 8, 2, True),
    (2, 2, 16, 8, False),
    (2, 2, 8, 1, False),
    (4, 1, 8, 2, False),
    (4, 1, 4, 1, True),
]


def _all_scenarios(rank, world, cfg, sp, tp):
    out = {}
    for name, steps in SCENARIOS.items():
        threshold = 4 if name == "policy" else None
        out[name] = run_layer_scenario(rank, world, cfg, sp, tp, steps, threshold=threshold).to_dict()
    return out


@pytest.mark.parametrize(("sp", "tp", "h", "hkv", "qk_norm"), CONFIGS)
def test_decoder_matches_unsharded_reference(sp, tp, h, hkv, qk_norm):
    cfg = DecoderConfig(hidden_size=48, num_q_heads=h, num_kv_heads=hkv, head_dim=8,
                        intermediate_size=8 * sp * tp, qk_norm=qk_norm, rope_theta=500.0)
    per_rank = run_distributed(_all_scenarios, sp * tp, cfg, sp, tp)
    tol = REL_TOL[torch.float32]
    for rank, res in enumerate(per_rank):
        for name, r in res.items():
            steps = SCENARIOS[name]
            assert len(r["steps"]) == len(steps)
            for i, (rec, step) in enumerate(zip(r["steps"], steps, strict=True)):
                where = f"rank {rank} scenario {name} step {i} ({rec['mode']}, {rec['tokens']} tokens)"
                assert rec["rel_error"] < tol, f"{where}: rel error {rec['rel_error']:.3g} >= {tol}"
                # the policy answers "shift" at <= 4 tokens, and always when SP=1 (same computation)
                expected_mode = step.mode or ("shift" if rec["tokens"] <= 4 or sp == 1 else "base")
                assert rec["mode"] == expected_mode, where
                if rec["mode"] == "base":
                    assert rec["padded_tokens"] % sp == 0 and rec["padded_tokens"] - rec["tokens"] < sp
            assert r["cache_rel_error"] < tol, f"rank {rank} {name}: cache differs from oracle"
            # Only real tokens reach the cache: one written row per layer per cached token.
            tokens = sum(q for s in steps for _, q in s.seqs)
            assert sum(r["cache_lengths"].values()) == tokens
            assert r["cache_rows_written"] == 2 * tokens, f"rank {rank} {name}: padding reached the cache"


def _check_scenarios(per_rank, names):
    tol = REL_TOL[torch.float32]
    for rank, res in enumerate(per_rank):
        for name in names:
            r, steps = res[name], SCENARIOS[name]
            for i, (rec, step) in enumerate(zip(r["steps"], steps, strict=True)):
                where = f"rank {rank} scenario {name} step {i} ({rec['mode']}, {rec['tokens']} tokens)"
                assert rec["rel_error"] < tol, f"{where}: rel error {rec['rel_error']:.3g} >= {tol}"
                assert rec["mode"] == step.mode, where
            assert r["cache_rel_error"] < tol, f"rank {rank} {name}: cache differs from oracle"
            tokens = sum(q for s in steps for _, q in s.seqs)
            assert r["cache_rows_written"] == 2 * tokens, f"rank {rank} {name}: padding reached the cache"


def _bias_rope_scenarios(rank, world, cfg, sp, tp):
    return {name: run_layer_scenario(rank, world, cfg, sp, tp, SCENARIOS[name]).to_dict()
            for name in ("base", "shift", "mixed")}


def scaled_rope_table(head_dim: int) -> tuple[float, ...]:
    """A RoPE frequency table no rope_theta gives (low frequencies stretched, llama3-style)."""
    return tuple(500.0 ** (-2 * i / head_dim) / (1 + i) for i in range(head_dim // 2))


# (sp, tp, q heads, kv heads, qk_norm): 2x2 replicates the 2 kv heads (and their bias entries)
# over 4 ranks; SP=2 pads 19 tokens to 20 (the bias must not leak through padding rows).
@pytest.mark.parametrize(("sp", "tp", "h", "hkv", "qk_norm"), [(2, 2, 8, 2, True), (2, 1, 8, 4, False)])
def test_qkv_bias_and_scaled_rope_match_unsharded_reference(sp, tp, h, hkv, qk_norm):
    cfg = DecoderConfig(hidden_size=48, num_q_heads=h, num_kv_heads=hkv, head_dim=8, intermediate_size=8 * sp * tp,
                        qk_norm=qk_norm, rope_theta=500.0, qkv_bias=True, rope_inv_freq=scaled_rope_table(8),
                        rope_attention_scaling=0.8)
    per_rank = run_distributed(_bias_rope_scenarios, sp * tp, cfg, sp, tp)
    _check_scenarios(per_rank, ("base", "shift", "mixed"))


def test_base_mode_pads_and_strips_13_tokens_at_sp4():
    cfg = DecoderConfig(hidden_size=32, num_q_heads=8, num_kv_heads=4, head_dim=8, intermediate_size=32)
    steps = [Step(((0, 13),), "base"), Step(((0, 1),), "base")]
    per_rank = run_distributed(run_layer_scenario, 4, cfg, 4, 1, steps)
    for r in per_rank:
        first, decode = r.steps
        assert (first.tokens, first.padded_tokens) == (13, 16)
        assert (decode.tokens, decode.padded_tokens) == (1, 4)  # 3 of 4 SP ranks hold only padding
        assert first.rel_error < REL_TOL[torch.float32] and decode.rel_error < REL_TOL[torch.float32]
        assert r.cache_lengths == {0: 14}


def _row_parallel_half(rank, world, dtype, naive=False):
    from fusedpar.collectives import ParallelContext
    from fusedpar.collectives.comm import all_reduce_sum
    from fusedpar.layers.comm import PlainComm
    from fusedpar.layouts import ParallelLayout

    gen = torch.Generator().manual_seed(5)
    m, k, n = 37, 96 * world, 53  # odd rows / columns
    a = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    cols = slice(rank * k // world, (rank + 1) * k // world)
    ctx = ParallelContext(ParallelLayout(world, sp=1, tp=world))
    a_s, w_s = a[:, cols].contiguous(), w[:, cols].contiguous()
    if naive:  # each rank's partial rounded to half, summed in half
        y = all_reduce_sum(torch.nn.functional.linear(a_s, w_s), ctx.attention_group("shift"))
        assert torch.equal(y, PlainComm(ctx).row_parallel(a_s, w_s, "shift"))  # the stock path
    else:
        y = PlainComm(ctx, reference=True).row_parallel(a_s, w_s, "shift")
    return y, (a.float() @ w.float().T).to(dtype), a.float().abs() @ w.float().abs().T, k


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_row_parallel_rounds_once_like_the_unsharded_gemm(dtype):
    """Half-precision row-parallel partials are summed in fp32 and rounded once: the result is the
    unsharded GEMM's rounding, up to one unit in the last place plus fp32 summation-order noise
    (~sqrt(K) fp32 epsilons of sum |a_i w_i|: it matters only for results near zero), the same on
    every rank - not P + 1 roundings that flip near-tied greedy tokens."""
    per_rank = run_distributed(_row_parallel_half, 4, dtype)
    y0, want, abs_sum, k = per_rank[0]
    for y, *_ in per_rank[1:]:
        assert torch.equal(y, y0)
    fi = torch.finfo(dtype)  # spacing of half values near `want` (subnormals: the fixed smallest step)
    ulp = fi.eps * want.float().abs().clamp_min(fi.smallest_normal)
    tol = ulp + 4 * k ** 0.5 * torch.finfo(torch.float32).eps * abs_sum
    off = (y0.float() - want.float()).abs() / tol
    assert y0.dtype == dtype and off.max() <= 1.0, f"{off.max():.2f} x the tolerance off the unsharded rounding"
    # the naive sum of half partials is measurably worse (the check above can fail)
    naive = run_distributed(_row_parallel_half, 4, dtype, naive=True)[0][0]
    assert ((naive.float() - want.float()).abs() / tol).max() > 1.0


def _rejected_steps(rank, world):
    from fusedpar.collectives import ParallelContext
    from fusedpar.layers import PagedKVCache, ShiftParallelStack, StepBatch, random_decoder_weights
    from fusedpar.layouts import ParallelLayout

    cfg = DecoderConfig(hidden_size=32, num_q_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=32)
    ctx = ParallelContext(ParallelLayout(world, sp=2, tp=1))
    stack = ShiftParallelStack.from_full_weights(cfg, ctx, [random_decoder_weights(cfg, seed=0)])
    cache = stack.make_cache(block_size=4, num_blocks=8)
    batch, x = StepBatch((7,), (5,), (0,)), torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
    errors = []
    try:
        stack(x, batch, cache, mode="Base")
        errors.append("mode 'Base' was accepted")
    except ValueError as e:
        if "mode must be one of" not in str(e):
            errors.append(f"mode 'Base': {e}")
    other = PagedKVCache(num_layers=1, kv_heads=(99,), head_dim=8, block_size=4, num_blocks=8, dtype=torch.float32)
    try:
        stack(x, batch, other)
        errors.append("a cache of other kv heads was accepted")
    except ValueError as e:
        if "cache holds kv heads (99,)" not in str(e):
            errors.append(f"wrong cache: {e}")
    if cache.lengths or cache.block_tables or other.lengths or other.block_tables:
        errors.append(f"a rejected step reserved cache room: {cache.lengths} {other.lengths}")
    y = stack(x, batch, cache)  # the same step, retried with valid arguments, runs
    if y.shape != (5, 32) or cache.lengths != {7: 5}:
        errors.append(f"retry: output {tuple(y.shape)}, lengths {cache.lengths}")
    return errors


def test_rejected_step_reserves_nothing_in_the_cache():
    """A bad mode or a cache of other kv heads raises before the cache reserves any room, so the
    caller can retry the step (advancing the cache and then raising would lose the reserved room)."""
    for rank_errors in run_distributed(_rejected_steps, 2):
        assert not rank_errors, rank_errors
