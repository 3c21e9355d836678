"""Ranks that call parallelize with different settings or different weights get one named error
each, before any collective that could hang or mix their results."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from fusedpar.testing.dist import run_distributed

CASES = {
    "same": ({}, {}),
    "threshold": ({"shift_threshold": 16}, {"shift_threshold": 64}),
    "block_size": ({"block_size": 16}, {"block_size": 8}),
    "weights": ({"seed": 0}, {"seed": 1}),
}


def _parallelize_worker(rank, world):
    from fusedpar import ParallelLayout
    from fusedpar.integrations.hf import parallelize
    from tests.integrations.hf_models import make_model

    out = {}
    for name, per_rank in CASES.items():
        kw = dict(per_rank[rank])
        model = make_model("llama", seed=kw.pop("seed", 0))
        try:
            parallelize(model, ParallelLayout(world, sp=2), **kw)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


def test_ranks_that_disagree_are_named_on_every_rank():
    res = run_distributed(_parallelize_worker, 2, timeout=300)
    for rank, out in enumerate(res):
        assert out["same"] is None, f"rank {rank}: agreeing ranks were refused: {out['same']}"
        assert out["threshold"] and "shift_threshold: rank 0: 16; rank 1: 64" in out["threshold"], out["threshold"]
        assert out["block_size"] and "block_size: rank 0: 16; rank 1: 8" in out["block_size"], out["block_size"]
        assert out["weights"] and "embedding checksum" in out["weights"], out["weights"]
        for name in ("threshold", "block_size"):
            assert "embedding checksum" not in out[name], f"rank {rank}, {name}: names a setting that agrees"
