"""CUDA-graph decode (fusedpar.layers.graphs): the host-side input staging on CPU, and on GPUs the
captured stack vs the fp64 oracle and vs the eager fused stack, for both the fused and the stock
(cuBLAS + torch symm_mem one-shot) communication."""

from __future__ import annotations

import pytest
import torch

from fusedpar.layers import DecoderConfig, PagedKVCache, StepBatch
from fusedpar.layers.graphs import SCRATCH_SEQ_ID, fill_decode_inputs


def _cache(block_size=4, num_blocks=64):
    return PagedKVCache(num_layers=1, kv_heads=(0,), head_dim=16, block_size=block_size, num_blocks=num_blocks,
                        dtype=torch.float32)


def _staging(size, max_blocks):
    return torch.full((2, size), -7, dtype=torch.int64), torch.full((2 * size + 1 + size * max_blocks,), -7,
                                                                     dtype=torch.int32)


@pytest.mark.parametrize(("lengths", "size"), [((5, 1, 12, 7), 4), ((3, 8, 4), 8), ((15,), 1), ((2, 9, 4), 6)])
def test_fill_decode_inputs_matches_eager_metadata(lengths, size):
    from fusedpar.kernels.attention import AttentionMetadata

    cache, max_blocks = _cache(), 6
    scratch = cache.begin_step(StepBatch((SCRATCH_SEQ_ID,), (1,), (0,)))
    scratch_block = cache.block_tables[SCRATCH_SEQ_ID][0]
    assert int(scratch) == scratch_block * cache.block_size
    ids = tuple(range(10, 10 + len(lengths)))
    cache.begin_step(StepBatch(ids, lengths, (0,) * len(lengths)))  # prefill: scattered blocks
    cache.begin_step(StepBatch((99,), (9,), (0,)))  # another sequence in between
    batch = StepBatch(ids, (1,) * len(ids), lengths)
    slots = cache.begin_step(batch, device="cpu")
    host64, host32 = _staging(size, max_blocks)  # poisoned: every element must be written
    fill_decode_inputs(batch, slots, cache, size, max_blocks, scratch_block, host64, host32)
    md = AttentionMetadata.from_step(batch, cache, device="cpu")
    n = len(ids)
    assert host64[0, :n].tolist() == batch.positions().tolist()
    assert host64[1, :n].tolist() == slots.tolist()
    assert host32[: size + 1].tolist() == list(range(size + 1))
    assert host32[size + 1 : size + 1 + n].tolist() == md.context_lens.tolist()
    tables = host32[2 * size + 1 :].view(size, max_blocks)
    w = md.block_tables.shape[1]
    assert torch.equal(tables[:n, :w], md.block_tables)
    assert (tables[:n, w:] == 0).all()
    # padding rows: position 0, the scratch slot, context 0, the scratch block
    assert (host64[0, n:] == 0).all() and (host64[1, n:] == scratch_block * cache.block_size).all()
    assert (host32[size + 1 + n : 2 * size + 1] == 0).all()
    assert (tables[n:, 0] == scratch_block).all() and (tables[n:, 1:] == 0).all()
    assert (host64 != -7).all() and (host32 != -7).all()


def test_fill_decode_inputs_all_padding_and_errors():
    cache = _cache()
    host64, host32 = _staging(3, 2)
    fill_decode_inputs(None, None, cache, 3, 2, 5, host64, host32)
    assert host64[1].tolist() == [20, 20, 20] and host64[0].tolist() == [0, 0, 0]
    assert host32.view(-1)[7:].view(3, 2)[:, 0].tolist() == [5, 5, 5]
    cache.begin_step(StepBatch((1, 2), (9, 3), (0, 0)))
    batch = StepBatch((1, 2), (1, 1), (9, 3))
    slots = cache.begin_step(batch, device="cpu")
    with pytest.raises(ValueError, match=r"needs 3 cache blocks.*at most 2"):
        fill_decode_inputs(batch, slots, cache, 3, 2, 5, *_staging(3, 2))
    with pytest.raises(ValueError, match="cannot take 2 sequences"):
        fill_decode_inputs(batch, slots, cache, 1, 4, 5, *_staging(1, 4))
    with pytest.raises(ValueError, match="one token per sequence"):
        fill_decode_inputs(StepBatch((1,), (2,), (10,)), slots[:1], cache, 2, 4, 5, *_staging(2, 4))


def test_capture_needs_the_fused_cuda_path():
    from types import SimpleNamespace

    from fusedpar.layers.graphs import DecodeGraphs

    stack = SimpleNamespace(fused=None, ctx=SimpleNamespace(device=torch.device("cpu")))
    with pytest.raises(ValueError, match="fused path"):
        DecodeGraphs(stack, _cache(), max_context=64)


# ---- GPU ----------------------------------------------------------------------------------------
REL_TOL = {torch.bfloat16: 3e-2}
MAX_CONTEXT = 128


def _gpu_graph_check(rank, world, cfg, sp, tp, *, fuse_comm, plain_all_reduce="nccl"):
    """Prefill 6 sequences (eager, base mode), then decode steps of 1..8 sequences through the
    captured graphs (sizes 1, 4, 8: batches of 3, 5, 6 run padded), crossing cache blocks, and
    one step past max_context (eager). Each step vs the fp64 oracle and vs the same stack run
    eagerly on a second cache. The graphs' static outputs are poisoned before every replay."""
    from fusedpar.collectives import ParallelContext
    from fusedpar.layers import DenseDecoderStack, ShiftParallelStack, ShiftPolicy, random_decoder_weights
    from fusedpar.layouts import ParallelLayout
    from fusedpar.testing.scenarios import rel_error

    dtype, layers = torch.bfloat16, 2
    ctx = ParallelContext(ParallelLayout(world, sp=sp, tp=tp))
    dev = ctx.device
    full = [random_decoder_weights(cfg, seed=7 + i, dtype=torch.float64, device=dev) for i in range(layers)]
    oracle = DenseDecoderStack(cfg, full)
    stack = ShiftParallelStack.from_full_weights(cfg, ctx, [{k: v.to(dtype) for k, v in w.items()} for w in full],
                                                 ShiftPolicy(64))
    stack.enable_fused(max_tokens=512, fuse_comm=fuse_comm, plain_all_reduce=plain_all_reduce)
    eager_cache = stack.make_cache(block_size=16, num_blocks=128, dtype=dtype)
    graph_cache = stack.make_cache(block_size=16, num_blocks=128, dtype=dtype)
    graphs = stack.capture_decode_graphs(graph_cache, max_context=MAX_CONTEXT, sizes=(1, 4, 8))
    gen = torch.Generator().manual_seed(3)
    lengths = {s: n for s, n in zip(range(6), (37, 16, 5, 90, 1, 63), strict=True)}
    errors = []

    def step(batch, label):
        x = torch.randn(batch.num_tokens, cfg.hidden_size, generator=gen, dtype=torch.float64).to(dev)
        for st in graphs._steps.values():
            st.out.fill_(float("nan"))
        y_graph = stack(x.to(dtype), batch, graph_cache)
        y_eager = stack(x.to(dtype), batch, eager_cache)
        want = oracle.forward(x, batch)
        e_oracle, e_eager = rel_error(y_graph, want), rel_error(y_graph, y_eager)
        if not (e_oracle < REL_TOL[dtype] and e_eager < REL_TOL[dtype]):
            errors.append(f"{label}: vs oracle {e_oracle:.3g}, vs eager {e_eager:.3g}")
        return y_graph

    step(StepBatch(tuple(lengths), tuple(lengths.values()), (0,) * 6), "prefill")
    before = stack.graph_steps
    plan = [(0, 1, 2), (3,), (0, 1, 2, 3, 4, 5), (5, 1, 4, 2, 0), tuple(range(6))] * 3 + [(3, 4)]
    for i, seqs in enumerate(plan):
        step(StepBatch(seqs, (1,) * len(seqs), tuple(lengths[s] for s in seqs)), f"decode {i} {seqs}")
        for s in seqs:
            lengths[s] += 1
    expect_graph = len(plan)  # every decode step so far fits a graph (contexts < max_context)
    while lengths[3] + 1 <= MAX_CONTEXT:
        last_graph_y = step(StepBatch((3,), (1,), (lengths[3],)), "decode 3 up to the graph limit")
        lengths[3] += 1
        expect_graph += 1
    step(StepBatch((3,), (1,), (lengths[3],)), "decode past max_context (eager)")
    lengths[3] += 1
    # replay_last (model_bench's graph-only timing): the size-1 graph re-runs its last staged step
    # (seq 3's last graph step; the eager step after it wrote a later position, which it never reads)
    graphs._steps[1].out.fill_(float("nan"))
    graphs.replay_last(1)
    e_replay = rel_error(graphs._steps[1].out[:1], last_graph_y)
    if not e_replay < REL_TOL[dtype]:
        errors.append(f"replay_last(1) vs the step it repeats: {e_replay:.3g}")
    try:
        graphs.replay_last(3)
        errors.append("replay_last(3) ran although no graph of size 3 was captured")
    except ValueError:
        pass
    if stack.graph_steps - before != expect_graph:
        errors.append(f"graph steps {stack.graph_steps - before}, expected {expect_graph}")
    for li in range(layers):
        for sid, n in lengths.items():
            kg, vg = graph_cache.gather(li, sid)
            ke, ve = eager_cache.gather(li, sid)
            if kg.shape[0] != n or rel_error(kg, ke) > REL_TOL[dtype] or rel_error(vg, ve) > REL_TOL[dtype]:
                errors.append(f"cache layer {li} seq {sid}: graph and eager caches differ")
    if stack.fused.spin_timeouts():
        errors.append(f"rank {rank}: a flag wait timed out on {stack.fused.spin_timeouts()}")
    return errors


@pytest.mark.gpu
@pytest.mark.parametrize(("h", "hkv", "qk_norm"), [(32, 8, False), (16, 2, True)])
def test_gpu_decode_graphs_match_oracle_and_eager(nccl_world, h, hkv, qk_norm):
    from fusedpar.testing.gpu import all_ranks_ok

    rank, world = nccl_world
    cfg = DecoderConfig(hidden_size=1024, num_q_heads=h, num_kv_heads=hkv, head_dim=128, intermediate_size=2048,
                        qk_norm=qk_norm, rope_theta=1e6)
    errors = []
    for sp, tp in ((world, 1), (1, world)):
        errors += [f"sp={sp} tp={tp}: {e}" for e in _gpu_graph_check(rank, world, cfg, sp, tp, fuse_comm=True)]
    assert all_ranks_ok(not errors), "\n".join(errors[:8])


@pytest.mark.gpu
def test_gpu_decode_graphs_stock_baseline_and_rope_tables(nccl_world):
    """The plain-TP baseline in a graph (cuBLAS + torch symm_mem one-shot) and a scaled RoPE table
    (cos/sin computed inside the graph from the static positions)."""
    from fusedpar.testing.gpu import all_ranks_ok

    rank, world = nccl_world
    inv_freq = tuple(1e6 ** (-2 * i / 128) / (1 + i / 16) for i in range(64))
    cfg = DecoderConfig(hidden_size=1024, num_q_heads=16, num_kv_heads=4, head_dim=128, intermediate_size=2048,
                        rope_theta=1e6, rope_inv_freq=inv_freq, rope_attention_scaling=1.1)
    errors = _gpu_graph_check(rank, world, cfg, 1, world, fuse_comm=False, plain_all_reduce="symm_mem")
    errors += _gpu_graph_check(rank, world, cfg, world, 1, fuse_comm=True)
    assert all_ranks_ok(not errors), "\n".join(errors[:8])
