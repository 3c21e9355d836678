"""FP8 weights through the shift-parallel decoder on gloo CPU processes (the plain GEMMs) against the unsharded
oracle with the same FP8 weights (fusedpar.layers.reference, the FP8 reference math), both in float64.

Block scales whose activation groups every shard cuts at the same columns as the unsharded layer give the
same numbers in every layout and mode. Per-channel and per-tensor activations are scaled per token over
the columns a rank holds, as vLLM's row-parallel FP8 layers do: exact wherever no layer splits its input
columns (base mode at SP = P), within FP8 rounding where one does (shift mode at TP > 1)."""

import pytest
import torch

from fusedpar.kernels.fp8 import FP8Scheme
from fusedpar.layers import DecoderConfig
from fusedpar.testing.dist import run_distributed
from fusedpar.testing.scenarios import run_layer_scenario
from tests.layers.test_decoder_dist import SCENARIOS

EXACT = 1e-10  # float64 everywhere: only the summation order differs
# an activation scaled over a rank's columns instead of its whole row: the two e4m3 roundings of each value
# are each within 2^-4 of it
FP8_ROUNDING = 2 * 2.0**-4


def _scenarios(rank, world, cfg, sp, tp, scheme, names):
    out = {}
    for name in names:
        threshold = 4 if name == "policy" else None
        out[name] = run_layer_scenario(rank, world, cfg, sp, tp, SCENARIOS[name], threshold=threshold,
                                       dtype=torch.float64, fp8=scheme).to_dict()
    return out


def _cfg(sp: int, tp: int, qk_norm: bool = False) -> DecoderConfig:
    return DecoderConfig(hidden_size=48, num_q_heads=8, num_kv_heads=2, head_dim=8, intermediate_size=8 * sp * tp,
                         qk_norm=qk_norm, rope_theta=500.0)


def _errors(per_rank) -> dict[tuple[str, str], float]:
    """Worst relative error per (scenario, mode) over ranks and steps, and of the cached k/v."""
    worst: dict[tuple[str, str], float] = {}
    for res in per_rank:
        for name, r in res.items():
            for rec in r["steps"]:
                key = (name, rec["mode"])
                worst[key] = max(worst.get(key, 0.0), rec["rel_error"])
            worst[(name, "cache")] = max(worst.get((name, "cache"), 0.0), r["cache_rel_error"])
    return worst


@pytest.mark.parametrize(("sp", "tp", "qk_norm"), [(2, 1, False), (1, 2, True), (2, 2, False), (4, 1, True)])
def test_block_scaled_weights_match_the_unsharded_fp8_model_in_every_mode(sp, tp, qk_norm):
    per_rank = run_distributed(_scenarios, sp * tp, _cfg(sp, tp, qk_norm), sp, tp, FP8Scheme("block", (8, 8)),
                               ("mixed", "policy"))
    worst = _errors(per_rank)
    assert {m for _, m in worst} >= ({"shift", "cache"} if sp == 1 else {"base", "shift", "cache"})
    assert max(worst.values()) < EXACT, worst


@pytest.mark.parametrize("weight", ["channel", "tensor"])
def test_per_token_activation_scales_are_exact_without_split_columns_and_close_with_them(weight):
    per_rank = run_distributed(_scenarios, 2, _cfg(2, 1), 2, 1, FP8Scheme(weight), ("base", "shift"))
    worst = _errors(per_rank)
    assert worst[("base", "base")] < EXACT and worst[("base", "cache")] < EXACT, worst
    # shift mode is TP = 2: o and down split their input columns, and so do their activation scales
    assert EXACT < worst[("shift", "shift")] < FP8_ROUNDING, worst
    assert worst[("shift", "cache")] < FP8_ROUNDING, worst


def test_the_fused_kernels_refuse_fp8_weights_by_name():
    per_rank = run_distributed(_fused_refusal, 2)
    assert all("FP8 weights (down, gate_up, o, qkv) run on the plain GEMMs" in msg for msg in per_rank), per_rank


def _fused_refusal(rank, world):
    from fusedpar import ParallelLayout
    from fusedpar.collectives import ParallelContext
    from fusedpar.layers import ShiftParallelStack, random_decoder_weights
    from fusedpar.layers.comm import PlainComm
    from fusedpar.layers.fp8_weights import FP8Weight
    from fusedpar.testing.scenarios import FP8_SOURCES

    cfg = _cfg(2, 1)
    ctx = ParallelContext(ParallelLayout(world, sp=2))
    w = random_decoder_weights(cfg, seed=0, dtype=torch.float32)
    w = {k: FP8Weight.quantize(v, FP8Scheme("block", (8, 8))) if k in FP8_SOURCES else v for k, v in w.items()}
    stack = ShiftParallelStack.from_full_weights(cfg, ctx, [w])
    stack.enable_fused(max_tokens=16, comm=PlainComm(ctx))  # the plain GEMMs take them
    try:
        stack.enable_fused(max_tokens=16)
    except ValueError as e:
        return str(e)
    return "no error"
