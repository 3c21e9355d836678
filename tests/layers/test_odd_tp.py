"""kv heads that straddle base-mode TP shards (TP neither a multiple nor a divisor of the kv heads).

6 q / 2 kv heads on SP=2 x TP=3: TP shard 1 holds q heads 2 and 3, which read kv heads 0 and 1,
so its SP blocks carry different kv columns. The plain-PyTorch stack on gloo CPU processes must
match the unsharded fp64 oracle (DenseDecoderStack) in fp32, in base, shift and mixed steps (the
mixed one reads in shift mode the KV cache written in base mode and back).
"""

import pytest

from fusedpar.layers import DecoderConfig
from fusedpar.layouts import ParallelLayout
from fusedpar.testing.dist import run_distributed
from fusedpar.testing.scenarios import Step, run_layer_scenario

REL_TOL = 1e-5

# 7 and 4 prompt tokens: 11 in the step, padded at SP=2 and SP=3.
PREFILL = ((0, 7), (1, 4))
SCENARIOS = {
    "base": [Step(PREFILL, "base"), Step(((0, 1), (1, 1)), "base")],
    "shift": [Step(PREFILL, "shift"), Step(((0, 1), (1, 1)), "shift")],
    "mixed": [Step(PREFILL, "base"), Step(((0, 1), (1, 1)), "shift"), Step(((1, 3), (2, 2)), "base"),
              Step(((0, 1), (2, 1)), "shift")],
}


def _scenarios(rank, world, cfg, sp, tp):
    return {name: run_layer_scenario(rank, world, cfg, sp, tp, steps, num_layers=2, block_size=4).to_dict()
            for name, steps in SCENARIOS.items()}


# (sp, tp, q heads, kv heads, qk_norm, qkv_bias): TP=3 shards over 2 kv heads; TP=2 shards over 3
@pytest.mark.parametrize(("sp", "tp", "h", "hkv", "qk_norm", "qkv_bias"),
                         [(2, 3, 6, 2, False, False), (3, 2, 6, 3, True, True)])
def test_straddling_kv_heads_match_unsharded_reference(sp, tp, h, hkv, qk_norm, qkv_bias):
    assert hkv % tp and tp % hkv  # the shape the old tp rule rejected
    world = sp * tp
    cfg = DecoderConfig(hidden_size=16, num_q_heads=h, num_kv_heads=hkv, head_dim=4, intermediate_size=2 * world,
                        qk_norm=qk_norm, qkv_bias=qkv_bias, rope_theta=500.0)
    placement = ParallelLayout(world, sp=sp, tp=tp).head_placement(h, hkv)
    per_rank = run_distributed(_scenarios, world, cfg, sp, tp)
    for rank, res in enumerate(per_rank):
        for name, steps in SCENARIOS.items():
            r = res[name]
            assert tuple(r["kv_heads"]) == placement.kv_heads(rank, "base") == placement.kv_heads(rank, "shift")
            assert len(r["steps"]) == len(steps)
            for i, (rec, step) in enumerate(zip(r["steps"], steps, strict=True)):
                where = f"rank {rank} scenario {name} step {i} ({rec['mode']}, {rec['tokens']} tokens)"
                assert rec["mode"] == step.mode, where
                assert rec["rel_error"] < REL_TOL, f"{where}: rel error {rec['rel_error']:.3g} >= {REL_TOL}"
                if rec["mode"] == "base":
                    assert rec["padded_tokens"] % sp == 0 and rec["padded_tokens"] - rec["tokens"] < sp
            assert r["cache_rel_error"] < REL_TOL, f"rank {rank} {name}: cache differs from the oracle"
            tokens = sum(q for s in steps for _, q in s.seqs)
            assert sum(r["cache_lengths"].values()) == tokens
            assert r["cache_rows_written"] == 2 * tokens, f"rank {rank} {name}: padding reached the cache"
