"""The reference shift-parallel decoder on NCCL in bf16 vs the fp64 oracle (run under torchrun)."""

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
