"""The HF adapter's decode-graph runtime on CPU (gloo): what can be checked without capturing.

With decode graphs, a paged-cache grow makes the graphs stale and their recapture is collective, so
every rank of a replica must grow at the same step even when their free blocks differ (a fork freed
on one rank only, as when one rank drops its last reference to a deep-copied past_key_values
earlier). The graph runtime agrees on the smallest free count over the replica; the eager runtime
keeps deciding locally. The capture itself needs CUDA (tests/integrations/hf_gpu_check.py).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from fusedpar.testing.dist import run_distributed


def _growth_worker(rank: int, world: int) -> dict:
    from fusedpar.integrations.hf import parallelize

    from fusedpar.layers import StepBatch
    from fusedpar.layouts import ParallelLayout
    from tests.integrations.hf_models import make_model

    out = {}
    for graphs in (True, False):
        pm = parallelize(make_model("llama"), ParallelLayout(world, sp=1, tp=world), block_size=4)
        rt = pm._fusedpar
        rt.cuda_graphs = graphs  # the graph runtime's growth rule (nothing is captured on CPU)
        rt._reserve(StepBatch((0,), (8,), (0,)))  # creates the cache: 16 blocks
        rt.kv.begin_step(StepBatch((0,), (8,), (0,)))  # 2 blocks
        rt.kv.begin_step(StepBatch((1,), (40,), (0,)))  # 10 blocks: 4 free
        if rank == 0:
            rt.kv.free(1)  # freed on rank 0 only: 14 free there
        before = (rt.kv.num_blocks, rt.kv.free_blocks, rt.kv.generation)
        rt._reserve(StepBatch((2,), (24,), (0,)))  # 6 blocks: rank 1 must grow
        out[graphs] = {"before": before, "after": (rt.kv.num_blocks, rt.kv.generation)}
    return out


def test_graph_runtime_grows_the_cache_on_every_rank_together():
    res = run_distributed(_growth_worker, 2)
    r0, r1 = res[0], res[1]
    assert r0[True]["before"][:2] == (16, 14) and r1[True]["before"][:2] == (16, 4)
    # graphs: both grow at this step, to the same size (16 - 4 + 6 < 2 * 16)
    assert r0[True]["after"][0] == r1[True]["after"][0] == 32
    for r in (r0, r1):
        assert r[True]["after"][1] == r[True]["before"][2] + 1, "no grow happened on this rank"
    # eager: each rank decides from its own free blocks (rank 0 had room)
    assert r0[False]["after"][0] == 16 and r1[False]["after"][0] == 32
