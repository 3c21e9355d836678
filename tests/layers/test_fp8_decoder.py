"""FP8 weights through the shift-parallel decoder on gloo CPU processes (the plain GEMMs) against the unsharded
oracle with the same FP8 weights (fusedpar.layers.reference, the FP8 reference math), both in float64.

Block scales whose activation groups every shard cuts at the same columns as the unsharded layer give the
same numbers in every layout and mode. Per-channel and per-tensor activations are scaled per token over
the columns a rank holds, as vLLM's row-parallel FP8 layers do: exact wherever no layer splits its input
columns (base mode at SP = P), within FP8 rounding where one does (shift mode at TP > 1)."""

import os

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


def test_the_fused_path_takes_fp8_weights_and_refuses_what_its_kernels_cannot_by_name():
    taken, refused, cuda = run_distributed(_fused_acceptance, 2)[0]
    assert taken == "taken", taken
    assert cuda.startswith("FP8 weights (down, gate_up, o, qkv) run on the plain GEMMs on CUDA"), cuda
    # block (8, 8): one scale per 8 input columns, under the kernels' smallest K step (16 on the interpreter)
    for name, k in (("qkv", 48), ("o", 64), ("down", 32), ("gate_up", 48)):
        assert f"base {name}: one scale per 8 of its {k} input columns: the kernels take scales spanning K or a " \
               "multiple of 16 columns" in refused, refused
    assert "shift down: one scale per 8 of its 16 input columns" in refused, refused


def _fused_acceptance(rank, world):
    from fusedpar import ParallelLayout
    from fusedpar.collectives import ParallelContext
    from fusedpar.layers import ShiftParallelStack, random_decoder_weights
    from fusedpar.layers.fp8_weights import FP8Weight
    from fusedpar.testing.scenarios import FP8_SOURCES, FallbackFusedComm

    cfg = DecoderConfig(hidden_size=48, num_q_heads=8, num_kv_heads=2, head_dim=8, intermediate_size=32,
                        rope_theta=500.0)
    ctx = ParallelContext(ParallelLayout(world, sp=2))
    out = []
    for block in ((16, 16), (8, 8)):
        w = random_decoder_weights(cfg, seed=0, dtype=torch.float32)
        w = {k: FP8Weight.quantize(v, FP8Scheme("block", block)) if k in FP8_SOURCES else v for k, v in w.items()}
        stack = ShiftParallelStack.from_full_weights(cfg, ctx, [w])
        try:
            stack.enable_fused(max_tokens=16, comm=FallbackFusedComm(ctx, cfg, max_tokens=16, dtype=torch.float32))
            out.append("taken")
        except ValueError as e:
            out.append(str(e))
    stack.ctx.device = torch.device("cuda")  # only read by the check: the e4m3 variants are not enabled on CUDA
    try:
        stack.enable_fused(max_tokens=16, comm=FallbackFusedComm(ctx, cfg, max_tokens=16, dtype=torch.float32))
        out.append("taken on CUDA")
    except ValueError as e:
        out.append(str(e))
    finally:
        stack.ctx.device = torch.device("cpu")
    return out


class KernelEntriesComm:
    """The fused stages' FP8 kernel entries without workspaces (gloo processes share no memory): qkv and the
    base o-projection through fusedpar.kernels.ulysses' qkv_all_to_all and all_to_all_o_proj, the
    row-parallel GEMMs through fusedpar.kernels.gemm_all_reduce, each quantising its activations once and
    running the e4m3 GEMM on the interpreter, with the plain collectives; attention in the fused layer path."""

    def __init__(self, ctx, cfg):
        from fusedpar.layers.comm import PlainComm

        self.ctx, self.plain = ctx, PlainComm(ctx)

    def should_use(self, x):
        return True

    def qkv(self, h, w, mode, bias=None):
        from fusedpar.kernels.ulysses import UlyssesOptions, qkv_all_to_all

        if mode != "base":
            return self.plain.qkv(h, w, mode, bias)
        return qkv_all_to_all(h, w.q, None, self.ctx.sp, options=UlyssesOptions(path="plain"), w_scale=w.scale,
                              w_tile=w.tile)

    def column_parallel(self, x, w, *, swiglu_block=0):
        return self.plain.column_parallel(x, w, swiglu_block=swiglu_block)

    def o_target(self, mode, rows):
        return None

    def o_proj(self, attn, w, mode, *, residual=None):
        from fusedpar.collectives import all_reduce_sum
        from fusedpar.kernels.ulysses import UlyssesOptions, all_to_all_o_proj

        if mode != "base":
            return self.row_parallel(attn, w, mode, residual=residual)
        y = all_to_all_o_proj(attn, w.q, None, self.ctx.sp, options=UlyssesOptions(path="plain"), w_scale=w.scale,
                              w_tile=w.tile)
        y = all_reduce_sum(y, self.ctx.tp)
        return y if residual is None else residual + y

    def row_parallel(self, x, w, mode, *, residual=None, swiglu_block=0):
        from fusedpar.kernels.gemm_all_reduce import gemm_all_reduce

        act = self.plain.swiglu(x, swiglu_block) if swiglu_block else x
        y = gemm_all_reduce(act, w.q, self.ctx.attention_group(mode), None, w_scale=w.scale, w_tile=w.tile)
        return y if residual is None else residual + y

    def fuses_residual(self, rows, w, mode):
        return False


def _fused_fp8_scenario(rank, world, scheme):
    from tests.conftest import _fix_interpreter_for_numpy_2_4

    _fix_interpreter_for_numpy_2_4()  # spawned ranks do not run conftest
    cfg = DecoderConfig(hidden_size=32, num_q_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=64,
                        rope_theta=500.0)
    return {name: run_layer_scenario(rank, world, cfg, 2, 1, SCENARIOS[name], fp8=scheme,
                                     fused_ops=KernelEntriesComm).to_dict() for name in ("mixed",)}


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the fused layer path on CPU needs the Triton interpreter (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("scheme", [FP8Scheme("block", (16, 16)), FP8Scheme("channel")], ids=["block16", "channel"])
def test_fused_layer_path_on_the_fp8_kernels_matches_the_unsharded_fp8_model(scheme):
    """fp32 hidden states on the FP8 kernels against the float64 FP8 oracle: an activation whose fp32 value
    rounds to another e4m3 neighbour than its float64 value is the only difference, within FP8 rounding."""
    worst = _errors(run_distributed(_fused_fp8_scenario, 2, scheme))
    assert {m for _, m in worst} == {"base", "shift", "cache"}, worst
    assert max(worst.values()) < FP8_ROUNDING, worst
