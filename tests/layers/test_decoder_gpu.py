"""The reference shift-parallel decoder on NCCL in bf16 vs the fp64 oracle, and the fused path's shift-mode
decode GEMMs on the weight-streaming kernel against the reference path (run under torchrun)."""

import pytest
import torch

from fusedpar.layers import DecoderConfig
from fusedpar.testing.scenarios import Step, run_layer_scenario

pytestmark = pytest.mark.gpu

REL_TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-5}

MIXED = [
    Step(((0, 333), (1, 70), (2, 1)), "base"),  # 404 tokens: not a multiple of 8 SP ranks
    Step(((0, 1), (1, 1), (2, 1)), "shift"),
    Step(((0, 1), (1, 1), (2, 1)), "shift"),
    Step(((3, 129), (0, 1)), "base"),
    Step(((0, 1), (1, 1), (2, 1), (3, 1))),  # policy (threshold 16): shift
    Step(((1, 40),)),  # policy: base
]


def _layouts(world):
    out = [(world, 1), (1, world)]
    if world >= 4:
        out.append((2, world // 2))
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("h", "hkv", "qk_norm"), [(32, 8, False), (16, 2, True)])
def test_decoder_on_nccl_matches_oracle(nccl_world, dtype, h, hkv, qk_norm):
    rank, world = nccl_world
    cfg = DecoderConfig(hidden_size=1024, num_q_heads=h, num_kv_heads=hkv, head_dim=64,
                        intermediate_size=2048, qk_norm=qk_norm, rope_theta=1e6)
    for sp, tp in _layouts(world):
        res = run_layer_scenario(rank, world, cfg, sp, tp, MIXED, threshold=16, dtype=dtype, block_size=16)
        for i, rec in enumerate(res.steps):
            assert rec.rel_error < REL_TOL[dtype], f"sp={sp} tp={tp} step {i} {rec}"
        assert res.cache_rel_error < REL_TOL[dtype]
        assert [r.mode for r in res.steps][4:] == (["shift", "base"] if sp > 1 else ["shift", "shift"])


# Shift-mode steps of at most gemv.MAX_M rows (a prefill and decode steps) and one larger step.
DECODE_STEPS = [
    Step(((0, 20), (1, 9), (2, 1)), "shift"),
    Step(((0, 1), (1, 1), (2, 1)), "shift"),
    Step(tuple((s, 1) for s in range(4)), "shift"),
    Step(((4, 70),), "shift"),
]


def test_fused_shift_decode_runs_the_decode_gemm_and_matches_the_plain_path(nccl_world, monkeypatch):
    """The fused layer path in shift mode (one GPU under a one-process torchrun; TP = world otherwise): the qkv
    and gate_up GEMMs of steps of at most MAX_M rows, and the o and down GEMMs where the shift group has one
    rank, run on gemv.skinny_matmul with the routing table routing every size it takes there; the 70-row step does
    not. bf16 results as accurate as the plain path's."""
    from fusedpar.kernels import gemv
    from tests.conftest import decode_gemm_rows

    rank, world = nccl_world
    calls, real = [], gemv.skinny_matmul

    def counted(a, w, out=None, *, swiglu_block=0):
        calls.append(a.shape[0])
        return real(a, w, out, swiglu_block=swiglu_block)

    monkeypatch.setattr(gemv, "skinny_matmul", counted)
    cfg = DecoderConfig(hidden_size=1024, num_q_heads=16, num_kv_heads=8, head_dim=128, intermediate_size=2048,
                        qkv_bias=True, rope_theta=1e6)
    with decode_gemm_rows(gemv.MAX_M):  # the routed path, whatever this GPU's routing entry says
        fused = run_layer_scenario(rank, world, cfg, 1, world, DECODE_STEPS, dtype=torch.bfloat16, block_size=16,
                                   fused=True)
    routed = calls[:]
    plain = run_layer_scenario(rank, world, cfg, 1, world, DECODE_STEPS, dtype=torch.bfloat16, block_size=16)
    assert calls == routed  # the reference path never routes
    per_layer_step = 4 if world == 1 else 2  # qkv, gate_up (+ o, down over a group of one)
    small = [s for s in DECODE_STEPS if sum(q for _, q in s.seqs) <= gemv.MAX_M]
    assert routed == [r for s in small for r in [sum(q for _, q in s.seqs)] * (2 * per_layer_step)]  # two layers
    for i, (f, p) in enumerate(zip(fused.steps, plain.steps, strict=True)):
        assert f.mode == p.mode == "shift"
        assert f.rel_error < REL_TOL[torch.bfloat16], f"step {i}: fused rel error {f.rel_error:.3g}"
        assert f.rel_error < 2 * p.rel_error + 4e-3, f"step {i}: fused {f.rel_error:.3g} vs plain {p.rel_error:.3g}"
    assert fused.cache_rel_error < REL_TOL[torch.bfloat16]
