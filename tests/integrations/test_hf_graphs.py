"""fusedpar.integrations.hf decode graphs on CPU: the choices, and what can be checked without capturing.

In-process: when decode steps replay CUDA graphs (cuda_graphs; auto = on the fused path) and at
which size (decode_graph_size). Across ranks (gloo): a paged-cache grow makes the graphs stale and
their recapture is collective, so every rank of a replica must grow at the same step. A fork (a
deep-copied past_key_values) can be garbage-collected on one rank steps before another; were its
blocks freed at once, the ranks' free counts, and so their grow decisions, would part. Collected
forks are therefore freed only at a step that would otherwise grow (and only those every rank has
collected), or when a call starts new sequences: the pools stay identical on every rank, with no
per-step collective. Also: a 0-row call, and the final norm + lm_head graph refused while hooks
observe those modules. The captures themselves need CUDA (tests/integrations/hf_gpu_check.py).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch

from fusedpar.layouts import ParallelLayout
from fusedpar.testing.dist import run_distributed
from tests.integrations.hf_models import make_model


def _tiny_parallel_llama(world: int):
    """A tiny random Llama parallelized over `world` ranks (TP), on 4-token cache blocks."""
    import torch

    from fusedpar.integrations.hf import parallelize
    from fusedpar.layouts import ParallelLayout
    from tests.integrations.hf_models import make_model

    torch.manual_seed(0)
    return parallelize(make_model("llama"), ParallelLayout(world, sp=1, tp=world), block_size=4)


def _same_on_both_ranks(res: list) -> dict:
    r0, r1 = res[0], res[1]
    for key in r0:
        assert r0[key] == r1[key], f"{key}: rank 0 {r0[key]} != rank 1 {r1[key]}"
    return r0


def _pool(rt) -> tuple:
    kv = rt.kv
    return kv.num_blocks, kv.free_blocks, kv.generation, sorted(kv.block_tables.items()), list(kv._free)


def _fork_worker(rank: int, world: int) -> dict:
    import copy
    import gc

    import torch

    from fusedpar.layers import StepBatch

    pm = _tiny_parallel_llama(world)
    rt = pm._fusedpar
    ids = torch.randint(1, 100, (1, 30))
    past = pm(ids, use_cache=True).past_key_values  # creates the cache: 18 blocks, 8 held
    fork = copy.deepcopy(past)  # 8 more
    fork_ids = list(fork.seq_ids)
    out = {"start": _pool(rt)}
    if rank == 0:  # rank 0 collects the fork now, rank 1 only later
        del fork
        gc.collect()
    out["collected on rank 0"] = _pool(rt)
    # a step that does not fit: rank 1 still holds the fork, so nothing is freed and both grow
    rt._reserve(StepBatch((10_000,), (12,), (0,)))
    out["grown"] = _pool(rt)
    if rank == 1:
        del fork
        gc.collect()
    # a step that needs more than the free blocks: now every rank has collected the fork, whose
    # blocks return to the pool there instead of a grow
    need = rt.kv.free_blocks + 4
    rt._reserve(StepBatch((10_001,), (4 * need,), (0,)))
    out["freed"] = _pool(rt)
    out["fork ids held"] = [sid for sid in fork_ids if sid in rt.kv.block_tables]
    # a call that starts new sequences frees the live cache and every fork, collected or not, in one order
    fork2 = copy.deepcopy(past)
    if rank == 1:
        del fork2
        gc.collect()
    pm(ids[:, :9], use_cache=True)
    out["new sequences"] = _pool(rt)
    return out


def test_forks_collected_at_different_steps_keep_the_pools_identical():
    res = run_distributed(_fork_worker, 2)
    r0 = _same_on_both_ranks(res)
    num, free, gen = r0["start"][:3]
    assert num == 18 and free == num - 16  # created for 2 x (8 blocks + 1); the prompt and the fork hold 8 each
    assert r0["collected on rank 0"][:3] == (num, free, gen), "a collected fork was freed at once"
    assert r0["grown"][0] == 2 * num and r0["grown"][2] == gen + 1
    assert r0["freed"][0] == 2 * num and r0["freed"][2] == gen + 1, "the fork's blocks should have avoided a grow"
    assert r0["fork ids held"] == []
    # after the new call only its 9 tokens (3 blocks) are held
    assert r0["new sequences"][1] == r0["new sequences"][0] - 3


def _cycle_worker(rank: int, world: int) -> dict:
    """A fork in a reference cycle (freed by the cyclic GC only) that rank 0 collects in the middle of
    new_state (right after the collected ids are drained) and rank 1 not at all: both pools must still
    free it at that call. And forks released before they are collected leave nothing behind."""
    import copy
    import gc

    import torch

    from fusedpar.layers import StepBatch

    pm = _tiny_parallel_llama(world)
    rt = pm._fusedpar
    ids = torch.randint(1, 100, (1, 30))
    past = pm(ids, use_cache=True).past_key_values
    holder = {"fork": copy.deepcopy(past)}
    holder["self"] = holder
    del holder
    if rank == 0:
        drain = rt._drain_collected

        def drain_then_collect():
            out = drain()
            gc.collect()  # what a GC triggered by any allocation there would do
            return out

        rt._drain_collected = drain_then_collect
    gc.disable()
    try:
        past = pm(ids[:, :9], use_cache=True).past_key_values  # new sequences: frees the live cache and every fork
    finally:
        gc.enable()
    rt.__dict__.pop("_drain_collected", None)
    out = {"after new sequences": _pool(rt)}
    rt._reserve(StepBatch((10_000,), (40,), (0,)))  # a grow on both ranks or on neither
    out["after a step"] = _pool(rt)
    for _ in range(50):  # forks released (e.g. Cache.reset) before they are collected
        fork = copy.deepcopy(past)
        fork.release()
        del fork
    gc.collect()
    out["collected ids kept"] = len(rt._drain_collected())
    return out


def test_fork_collected_inside_new_state_is_freed_on_every_rank():
    res = run_distributed(_cycle_worker, 2)
    r0 = _same_on_both_ranks(res)
    num, free = r0["after new sequences"][:2]
    assert free == num - 3, "only the new 9-token sequence (3 blocks) should hold blocks"
    assert r0["collected ids kept"] == 0, "released forks' ids should not pile up"


def _edges_worker(rank: int, world: int) -> dict:
    import torch

    pm = _tiny_parallel_llama(world)
    rt = pm._fusedpar
    out = {"empty batch": tuple(pm(torch.empty((0, 3), dtype=torch.long)).logits.shape)}
    # the norm + lm_head graph is skipped whenever hooks would observe those modules (a replay would
    # not call them); checked before anything is captured, so this runs on CPU
    hidden = torch.randn(1, 1, pm.config.hidden_size)
    seen = []
    rt.replayed = 1
    for module in (pm.lm_head, pm.model.norm):
        for register in (module.register_forward_hook, module.register_forward_pre_hook):
            handle = register(lambda *a: seen.append(1))
            seen.append(rt.head_logits(pm, hidden) is None)
            handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    seen.append(rt.head_logits(pm, hidden) is None)
    handle.remove()
    rt.replayed = None
    out["skipped under hooks"] = seen
    out["vocab"] = pm.config.vocab_size
    return out


def test_empty_batch_and_head_graph_refused_under_hooks():
    for res in run_distributed(_edges_worker, 2):
        assert res["empty batch"] == (0, 3, res["vocab"])
        assert res["skipped under hooks"] == [True] * 5


def test_cuda_graphs_choice_and_refusals():
    """cuda_graphs: auto = on exactly when the fused path is; True without it is refused, before any
    collective (no process group here); only None / True / False are accepted."""
    from fusedpar.integrations.hf import UnsupportedModelError, parallelize
    from fusedpar.integrations.hf.model import graphs_decision

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert graphs_decision(True, cuda, None) and not graphs_decision(False, cpu, None)
    assert graphs_decision(True, cuda, True) and not graphs_decision(True, cuda, False)
    assert not graphs_decision(False, cpu, False)
    with pytest.raises(UnsupportedModelError, match="cuda_graphs=True needs the fused kernels"):
        graphs_decision(False, cpu, True)
    for bad in (1, "yes"):
        with pytest.raises(ValueError, match="cuda_graphs must be None, True or False"):
            graphs_decision(True, cuda, bad)
    with pytest.raises(UnsupportedModelError, match="cuda_graphs=True needs the fused kernels"):
        parallelize(make_model("llama"), ParallelLayout(4, sp=2, tp=2), cuda_graphs=True)  # CPU model: reference path


def test_decode_graph_size():
    """A step replays a decode graph only when every sequence adds one token, at the smallest capture
    size that holds its sequences, within the stack's cap (shift threshold / max_tokens)."""
    from fusedpar.integrations.hf.runtime import decode_graph_size
    from fusedpar.layers import StepBatch

    def decode(n, ctx=5):
        return StepBatch(tuple(range(n)), (1,) * n, (ctx,) * n)

    assert decode_graph_size(decode(1), 64) == 1
    assert decode_graph_size(decode(3), 64) == 4
    assert decode_graph_size(decode(17), 64) == 24
    assert decode_graph_size(decode(64), 64) == 64
    assert decode_graph_size(decode(65), 4096) is None  # beyond the largest capture size
    assert decode_graph_size(decode(3), 3) is None  # size 4 > cap 3: that step would run in base mode
    assert decode_graph_size(decode(3), 4) == 4
    assert decode_graph_size(StepBatch((0, 1), (1, 2), (5, 0)), 64) is None  # a prefill row: eager
    assert decode_graph_size(StepBatch((0,), (7,), (0,)), 64) is None
