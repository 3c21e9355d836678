"""CUDA-graph decode (fusedpar.layers.graphs): the host-side input staging on CPU, and on GPUs the
captured stack vs the fp64 oracle and vs the eager fused stack, for both FusedComm and the plain
(cuBLAS + NCCL: enable_fused(comm=PlainComm(ctx))) communication."""

from __future__ import annotations

from types import SimpleNamespace

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
    from fusedpar.layers.attention import step_metadata

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
    md = step_metadata(batch, cache, device="cpu")
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


def test_fill_decode_inputs_incremental_rows_match_a_full_fill():
    """Staging buffers refilled step after step with `written` (unchanged table rows skipped) hold what a
    fill of fresh poisoned buffers writes, as sequences gain blocks, leave, join, are freed and their
    ids reused with other blocks, and the batch shrinks to padding and grows back."""
    gen = torch.Generator().manual_seed(3)
    cache, size, max_blocks = _cache(block_size=4, num_blocks=256), 6, 12
    cache.begin_step(StepBatch((SCRATCH_SEQ_ID,), (1,), (0,)))
    scratch_block = cache.block_tables[SCRATCH_SEQ_ID][0]
    host64, host32 = _staging(size, max_blocks)
    written: list = []
    live: dict[int, int] = {}  # seq id -> cached tokens
    for step in range(60):
        if step % 7 == 3 and live:  # a sequence leaves (its id may come back with other blocks)
            sid = sorted(live)[int(torch.randint(len(live), (1,), generator=gen))]
            cache.free(sid)
            del live[sid]
        while len(live) < int(torch.randint(size + 1, (1,), generator=gen)):  # newcomers: a short prefill
            sid = int(torch.randint(8, (1,), generator=gen))
            if sid in live:
                continue
            q = 1 + int(torch.randint(9, (1,), generator=gen))
            cache.begin_step(StepBatch((sid,), (q,), (0,)))
            live[sid] = q
        ids = tuple(sid for sid in sorted(live) if live[sid] < 40)
        batch = StepBatch(ids, (1,) * len(ids), tuple(live[sid] for sid in ids))
        slots = cache.begin_step(batch, device="cpu")
        fill_decode_inputs(batch, slots, cache, size, max_blocks, scratch_block, host64, host32, written)
        ref64, ref32 = _staging(size, max_blocks)
        fill_decode_inputs(batch, slots, cache, size, max_blocks, scratch_block, ref64, ref32)
        assert torch.equal(host64, ref64) and torch.equal(host32, ref32), f"step {step}, batch {batch}"
        for sid in ids:
            live[sid] += 1


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
    from fusedpar.layers.graphs import DecodeGraphs

    stack = SimpleNamespace(fused=None, ctx=SimpleNamespace(device=torch.device("cpu")))
    with pytest.raises(ValueError, match="fused path"):
        DecodeGraphs(stack, _cache(), max_context=64)


def test_prefill_graphs_refuse_sizes_the_attention_cannot_run():
    """A prefill graph of `size` tokens launches the attention with max_seqs + 1 sequences, some empty.
    With size == max_seqs + 1 the attention takes the step for a decode batch (one token per
    sequence) and attends wrongly for every sequence of more than one token; with fewer tokens it
    refuses the launch at capture. The constructor names the constraint before anything is built."""
    from fusedpar.layers.graphs import PrefillGraphs

    stack = SimpleNamespace(fused=None, ctx=SimpleNamespace(device=torch.device("cpu")))
    with pytest.raises(ValueError, match=r"sizes \[9, 10\] .*>= max_seqs \+ 2 = 11 .*max_seqs <= 7"):
        PrefillGraphs(stack, _cache(), max_context=64, sizes=(9, 10, 64), max_seqs=9)
    with pytest.raises(ValueError, match=r"sizes \[2\] .*sizes below 3 tokens cannot be captured"):
        PrefillGraphs(stack, _cache(), max_context=64, sizes=(2, 64), max_seqs=1)
    with pytest.raises(ValueError, match="fused path"):  # 11 passes that check; this CPU stack fails the next
        PrefillGraphs(stack, _cache(), max_context=64, sizes=(11, 64), max_seqs=9)


def _forward_routing_checks(rank, world):
    """World 1, a CPU stack with a stand-in graph set that would serve every step: an invalid mode
    is refused before routing, as on the eager path, and so is a batch using the scratch id."""
    from fusedpar.collectives import ParallelContext
    from fusedpar.layers import ShiftParallelStack, random_decoder_weights
    from fusedpar.layouts import ParallelLayout

    cfg = DecoderConfig(hidden_size=32, num_q_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64)
    stack = ShiftParallelStack.from_full_weights(cfg, ParallelContext(ParallelLayout(world, sp=1, tp=1)),
                                                 [random_decoder_weights(cfg, seed=0)])
    cache = stack.make_cache(block_size=4, num_blocks=16)
    replays = []
    stack.graphs = SimpleNamespace(cache=cache, size_for=lambda batch: 1,
                                   run=lambda x, batch: replays.append(batch) or torch.zeros_like(x))
    cache.begin_step(StepBatch((SCRATCH_SEQ_ID,), (1,), (0,)))  # as capture does
    x = torch.randn(1, 32)
    out = {"graph step": tuple(stack(x, StepBatch((0,), (1,), (0,)), cache).shape)}
    for name, call in {"mode ''": lambda: stack(x, StepBatch((1,), (1,), (0,)), cache, mode=""),
                       "scratch id": lambda: stack(x, StepBatch((SCRATCH_SEQ_ID,), (1,), (1,)), cache)}.items():
        try:
            call()
            out[name] = "ran"
        except ValueError as e:
            out[name] = str(e)
    out["replays"] = len(replays)
    return out


def test_forward_refuses_a_bad_mode_and_the_scratch_id_before_routing():
    from fusedpar.testing.dist import run_distributed

    (res,) = run_distributed(_forward_routing_checks, 1, timeout=120)
    assert res["graph step"] == (1, 32), res
    assert "mode must be one of" in res["mode ''"], res
    assert "is reserved" in res["scratch id"] and str(SCRATCH_SEQ_ID) in res["scratch id"], res
    assert res["replays"] == 1, res  # only the valid step replayed


# ---- GPU ----------------------------------------------------------------------------------------
REL_TOL = {torch.bfloat16: 3e-2}
MAX_CONTEXT = 128


def _graph_setup(world, cfg, sp, tp, layers, dtype, *, seed, threshold, comm):
    """(device, fp64 oracle, fused stack of `layers` random layers, eager cache, graph cache)."""
    from fusedpar.collectives import ParallelContext
    from fusedpar.layers import DenseDecoderStack, ShiftParallelStack, StepModeRule, random_decoder_weights
    from fusedpar.layers.comm import PlainComm
    from fusedpar.layouts import ParallelLayout

    ctx = ParallelContext(ParallelLayout(world, sp=sp, tp=tp))
    dev = ctx.device
    full = [random_decoder_weights(cfg, seed=seed + i, dtype=torch.float64, device=dev) for i in range(layers)]
    stack = ShiftParallelStack.from_full_weights(cfg, ctx, [{k: v.to(dtype) for k, v in w.items()} for w in full],
                                                 StepModeRule(threshold))
    stack.enable_fused(max_tokens=512, comm=PlainComm(ctx) if comm == "plain" else None)
    caches = [stack.make_cache(block_size=16, num_blocks=128, dtype=dtype) for _ in range(2)]
    return dev, DenseDecoderStack(cfg, full), stack, *caches


def _final_checks(rank, stack, graph_cache, eager_cache, lengths, layers, dtype) -> list[str]:
    """After a graph check: every sequence's k/v in the graph cache equal the eager cache's, and no
    flag wait of the fused kernels timed out."""
    from fusedpar.testing.scenarios import rel_error

    errors = []
    for li in range(layers):
        for sid, n in lengths.items():
            kg, vg = graph_cache.gather(li, sid)
            ke, ve = eager_cache.gather(li, sid)
            if kg.shape[0] != n or rel_error(kg, ke) > REL_TOL[dtype] or rel_error(vg, ve) > REL_TOL[dtype]:
                errors.append(f"cache layer {li} seq {sid}: graph and eager caches differ")
    if stack.fused.spin_timeouts():
        errors.append(f"rank {rank}: a flag wait timed out on {stack.fused.spin_timeouts()}")
    return errors


def _step_vs_eager(stack, oracle, x, batch, cache, eager_cache, graphs, label, errors):
    """One step of `stack` on `cache` (a graph replay where one fits; every graph's output poisoned
    first) against the same stack eager on `eager_cache` and the fp64 oracle: a line into errors
    where either differs; the step's output."""
    from fusedpar.testing.scenarios import rel_error

    dtype = stack.weight_dtype
    for st in graphs._steps.values() if graphs is not None else ():
        st.out.fill_(float("nan"))
    y = stack(x.to(dtype), batch, cache)
    y_eager = stack(x.to(dtype), batch, eager_cache)
    e_oracle, e_eager = rel_error(y, oracle.forward(x, batch)), rel_error(y, y_eager)
    if not (e_oracle < REL_TOL[dtype] and e_eager < REL_TOL[dtype]):
        errors.append(f"{label}: vs oracle {e_oracle:.3g}, vs eager {e_eager:.3g}")
    return y


def _gpu_graph_check(rank, world, cfg, sp, tp, *, comm=None):
    """Prefill 6 sequences (eager, base mode), then decode steps of 1..8 sequences through the
    captured graphs (sizes 1, 4, 8: batches of 3, 5, 6 run padded), crossing cache blocks, and
    one step past max_context (eager). Each step vs the fp64 oracle and vs the same stack run
    eagerly on a second cache. The graphs' static outputs are poisoned before every replay."""
    from fusedpar.testing.scenarios import rel_error

    dtype, layers = torch.bfloat16, 2
    dev, oracle, stack, eager_cache, graph_cache = _graph_setup(world, cfg, sp, tp, layers, dtype, seed=7,
                                                                threshold=64, comm=comm)
    graphs = stack.capture_decode_graphs(graph_cache, max_context=MAX_CONTEXT, sizes=(1, 4, 8))
    gen = torch.Generator().manual_seed(3)
    lengths = {s: n for s, n in zip(range(6), (37, 16, 5, 90, 1, 63), strict=True)}
    errors = []

    def step(batch, label):
        x = torch.randn(batch.num_tokens, cfg.hidden_size, generator=gen, dtype=torch.float64).to(dev)
        return _step_vs_eager(stack, oracle, x, batch, graph_cache, eager_cache, graphs, label, errors)

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
    return errors + _final_checks(rank, stack, graph_cache, eager_cache, lengths, layers, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["decode", "prefill"])
@pytest.mark.parametrize(("h", "hkv", "qk_norm"), [(32, 8, False), (16, 2, True)])
def test_gpu_graphs_match_oracle_and_eager(nccl_world, h, hkv, qk_norm, kind):
    from fusedpar.testing.gpu import all_ranks_ok

    rank, world = nccl_world
    cfg = DecoderConfig(hidden_size=1024, num_q_heads=h, num_kv_heads=hkv, head_dim=128, intermediate_size=2048,
                        qk_norm=qk_norm, rope_theta=1e6)
    check = {"decode": _gpu_graph_check, "prefill": _gpu_prefill_graph_check}[kind]
    errors = []
    for sp, tp in ((world, 1), (1, world)):
        errors += [f"sp={sp} tp={tp}: {e}" for e in check(rank, world, cfg, sp, tp)]
    assert all_ranks_ok(not errors), "\n".join(errors[:8])


@pytest.mark.gpu
def test_gpu_decode_graphs_stock_baseline_and_rope_tables(nccl_world):
    """The plain-TP baseline in a graph (enable_fused(comm=PlainComm(ctx)): cuBLAS + NCCL) and a scaled
    RoPE table (cos/sin computed inside the graph from the static positions)."""
    from fusedpar.testing.gpu import all_ranks_ok

    rank, world = nccl_world
    inv_freq = tuple(1e6 ** (-2 * i / 128) / (1 + i / 16) for i in range(64))
    cfg = DecoderConfig(hidden_size=1024, num_q_heads=16, num_kv_heads=4, head_dim=128, intermediate_size=2048,
                        rope_theta=1e6, rope_inv_freq=inv_freq, rope_attention_scaling=1.1)
    errors = _gpu_graph_check(rank, world, cfg, 1, world, comm="plain")
    errors += _gpu_graph_check(rank, world, cfg, world, 1)
    assert all_ranks_ok(not errors), "\n".join(errors[:8])


@pytest.mark.gpu
def test_gpu_decode_graphs_of_hundreds_of_sequences_match_eager(nccl_world):
    """TP = world, decode graphs of 96 and 256 sequences (a serving engine's resident batches): steps of
    90 and 200 sequences (padded), 256 (exact) and 256 again one token later, each vs the fp64 oracle and
    vs the same stack run eagerly on a second cache, the graphs' outputs poisoned before every replay."""
    from fusedpar.collectives import ParallelContext
    from fusedpar.layers import DenseDecoderStack, ShiftParallelStack, StepModeRule, random_decoder_weights
    from fusedpar.layouts import ParallelLayout
    from fusedpar.testing.gpu import all_ranks_ok

    rank, world = nccl_world
    cfg = DecoderConfig(hidden_size=1024, num_q_heads=16, num_kv_heads=8, head_dim=128, intermediate_size=2048,
                        rope_theta=1e6)
    dtype, layers, n_seqs = torch.bfloat16, 2, 256
    ctx = ParallelContext(ParallelLayout(world, tp=world))
    dev = ctx.device
    full = [random_decoder_weights(cfg, seed=40 + i, dtype=torch.float64, device=dev) for i in range(layers)]
    stack = ShiftParallelStack.from_full_weights(cfg, ctx, [{k: v.to(dtype) for k, v in w.items()} for w in full],
                                                 StepModeRule(64))
    stack.enable_fused(max_tokens=512)
    oracle = DenseDecoderStack(cfg, full)
    eager_cache, graph_cache = (stack.make_cache(block_size=16, num_blocks=2 * n_seqs + 8, dtype=dtype)
                                for _ in range(2))
    gen = torch.Generator().manual_seed(11)
    lengths = {s: 1 + (7 * s) % 19 for s in range(n_seqs)}  # 1..19 tokens: some decodes cross a block
    errors = []

    def step(batch, label, graphs=None):
        x = torch.randn(batch.num_tokens, cfg.hidden_size, generator=gen, dtype=torch.float64).to(dev)
        _step_vs_eager(stack, oracle, x, batch, graph_cache, eager_cache, graphs, label, errors)

    seqs = sorted(lengths)
    for i in range(0, n_seqs, 32):  # prompts, eager, at most 512 tokens a step
        part = seqs[i:i + 32]
        step(StepBatch(tuple(part), tuple(lengths[s] for s in part), (0,) * len(part)), f"prefill {i}")
    graphs = stack.capture_decode_graphs(graph_cache, max_context=64, sizes=(96, 256))
    before = stack.graph_steps
    plan = [seqs[:90], seqs[::-1][:200], seqs, seqs]
    for i, part in enumerate(plan):
        step(StepBatch(tuple(part), (1,) * len(part), tuple(lengths[s] for s in part)), f"decode {i} "
             f"({len(part)} sequences)", graphs)
        for s in part:
            lengths[s] += 1
    if stack.graph_steps - before != len(plan):
        errors.append(f"graph steps {stack.graph_steps - before}, expected {len(plan)}")
    errors += _final_checks(rank, stack, graph_cache, eager_cache, lengths, layers, dtype)
    assert all_ranks_ok(not errors), "\n".join(errors[:8])


def _gpu_rebind_check(rank, world, cfg, sp, tp):
    """Decode graphs captured on one cache replay on another cache object over the same memory, seen
    the same way (the pool reinterpreted to other heads and back, as a layout switch and its return
    leave it), after rebind(): the sequences' KV moved into it, steps vs the oracle and the eager
    stack, every step a replay. Other memory refuses to rebind."""

    dtype, layers = torch.bfloat16, 2
    dev, oracle, stack, eager_cache, graph_cache = _graph_setup(world, cfg, sp, tp, layers, dtype, seed=11,
                                                                threshold=64, comm=None)
    graphs = stack.capture_decode_graphs(graph_cache, max_context=MAX_CONTEXT, sizes=(1, 4))
    gen = torch.Generator().manual_seed(5)
    lengths = {0: 21, 1: 40, 2: 3}
    errors = []

    def step(cache, batch, label):
        x = torch.randn(batch.num_tokens, cfg.hidden_size, generator=gen, dtype=torch.float64).to(dev)
        _step_vs_eager(stack, oracle, x, batch, cache, eager_cache, graphs, label, errors)

    def decode(cache, seqs, label):
        step(cache, StepBatch(seqs, (1,) * len(seqs), tuple(lengths[s] for s in seqs)), label)
        for s in seqs:
            lengths[s] += 1

    step(graph_cache, StepBatch(tuple(lengths), tuple(lengths.values()), (0,) * 3), "prefill")
    decode(graph_cache, (0, 1, 2), "decode before the switch")
    held = {s: [graph_cache.gather(li, s) for li in range(layers)] for s in lengths}  # copies, before reuse
    other = tuple(range(100, 100 + 2 * len(graph_cache.kv_heads)))
    moved = graph_cache.reinterpret(other).reinterpret(graph_cache.kv_heads)
    for s, kv in held.items():
        moved.fill(s, torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv]))
    if graphs.rebind(stack.make_cache(block_size=16, num_blocks=128, dtype=dtype)):
        errors.append("rebind took a cache on other memory")
    if not graphs.rebind(moved) or graphs.cache is not moved or graphs.stale_reason() is not None:
        errors.append(f"rebind refused the same view of the pool ({graphs.stale_reason()})")
    before = stack.graph_steps
    for i, seqs in enumerate([(1,), (2, 0), (0, 1, 2), (2,)]):
        decode(moved, seqs, f"decode {i} after rebind")
    if stack.graph_steps - before != 4:
        errors.append(f"{stack.graph_steps - before} of 4 decode steps after rebind replayed a graph")
    return errors + _final_checks(rank, stack, moved, eager_cache, lengths, layers, dtype)


@pytest.mark.gpu
def test_gpu_decode_graphs_rebind_to_the_same_view_of_the_pool(nccl_world):
    from fusedpar.testing.gpu import all_ranks_ok

    rank, world = nccl_world
    cfg = DecoderConfig(hidden_size=1024, num_q_heads=16, num_kv_heads=4, head_dim=128, intermediate_size=2048,
                        rope_theta=1e6)
    errors = []
    for sp, tp in ((world, 1), (1, world)):
        errors += [f"sp={sp} tp={tp}: {e}" for e in _gpu_rebind_check(rank, world, cfg, sp, tp)]
    assert all_ranks_ok(not errors), "\n".join(errors[:8])


def test_rebind_takes_the_same_view_only():
    """rebind (CPU part: no capture): a cache object over the captured memory seen the same way takes the
    graphs over (scratch reserved there, staged table rows forgotten); other memory, other heads or
    another view of the same memory do not; shares_memory tells the pool's views apart from other memory."""
    from fusedpar.layers.graphs import DecodeGraphs, _view_of

    pool = PagedKVCache(num_layers=2, kv_heads=(0,), head_dim=8, block_size=4, num_blocks=48, dtype=torch.float32)
    tp = pool.reinterpret((0, 1))
    g = object.__new__(DecodeGraphs)  # the state _setup leaves, without a capture
    tp.begin_step(StepBatch((SCRATCH_SEQ_ID,), (1,), (0,)))
    g.cache, g.scratch_block, g._cache_view = tp, tp.block_tables[SCRATCH_SEQ_ID][0], _view_of(tp)
    g._cache_ptr, g._cache_generation = tp.k.data_ptr(), tp.generation
    g._steps = {1: SimpleNamespace(written=[("row", 1)])}
    back = tp.reinterpret((0, 1, 2, 3)).reinterpret((0, 1))  # a switch to 4 heads per rank and back
    back.begin_step(StepBatch((7,), (9,), (0,)))  # a migrated sequence takes blocks 0-2 first
    assert g.shares_memory(back) and g.rebind(back) and g.cache is back
    assert g.scratch_block == back.block_tables[SCRATCH_SEQ_ID][0] == 3
    assert g._steps[1].written == [] and g._cache_generation == back.generation
    assert g.rebind(back)  # already bound
    assert not g.rebind(pool.reinterpret((0, 1, 2, 3)))  # the same memory, another view
    assert not g.rebind(pool.reinterpret((4, 5)))  # other heads
    other = PagedKVCache(num_layers=2, kv_heads=(0, 1), head_dim=8, block_size=4, num_blocks=24, dtype=torch.float32)
    assert not g.shares_memory(other) and not g.rebind(other) and g.cache is back
    odd = PagedKVCache(num_layers=2, kv_heads=(0,), head_dim=8, block_size=4, num_blocks=50, dtype=torch.float32)
    g2 = object.__new__(DecodeGraphs)
    g2.cache = odd.reinterpret((0, 1))  # 25 blocks; via 4 heads and back: 24
    g2._cache_view, g2._steps = _view_of(g2.cache), {}
    assert not g2.rebind(odd.reinterpret((0, 1, 2, 3)).reinterpret((0, 1)))


# ---- prefill graphs: staging (CPU) ----------------------------------------------------------------
def _prefill_staging(size, max_seqs, max_blocks):
    return (torch.full((2, size), -7, dtype=torch.int64),
            torch.full(((max_seqs + 2) + (max_seqs + 1) + (max_seqs + 1) * max_blocks,), -7, dtype=torch.int32))


def _split_prefill_staging(host32, max_seqs, max_blocks):
    s = max_seqs
    return host32[: s + 2], host32[s + 2 : 2 * s + 3], host32[2 * s + 3 :].view(s + 1, max_blocks)


@pytest.mark.parametrize(("query_lens", "contexts", "size", "max_seqs"),
                         [((7, 1, 4), (0, 5, 9), 24, 4), ((5, 3), (2, 0), 8, 2), ((13,), (0,), 13, 3)])
def test_fill_prefill_inputs_matches_eager_metadata(query_lens, contexts, size, max_seqs):
    from fusedpar.layers.attention import step_metadata
    from fusedpar.layers.graphs import fill_prefill_inputs

    cache, max_blocks = _cache(), 7
    cache.begin_step(StepBatch((SCRATCH_SEQ_ID,), (1,), (0,)))
    scratch_block = cache.block_tables[SCRATCH_SEQ_ID][0]
    ids = tuple(range(20, 20 + len(query_lens)))
    if any(contexts):
        with_ctx = [(i, c) for i, c in zip(ids, contexts, strict=True) if c]
        cache.begin_step(StepBatch(tuple(i for i, _ in with_ctx), tuple(c for _, c in with_ctx), (0,) * len(with_ctx)))
    cache.begin_step(StepBatch((99,), (6,), (0,)))  # another sequence in between: scattered blocks
    batch = StepBatch(ids, query_lens, contexts)
    slots = cache.begin_step(batch, device="cpu")
    host64, host32 = _prefill_staging(size, max_seqs, max_blocks)  # poisoned: every element must be written
    fill_prefill_inputs(batch, slots, cache, size, max_seqs, max_blocks, scratch_block, host64, host32)
    md = step_metadata(batch, cache, device="cpu")
    n, m = batch.num_tokens, len(ids)
    cu, ctx, tables = _split_prefill_staging(host32, max_seqs, max_blocks)
    assert host64[0, :n].tolist() == batch.positions().tolist() and host64[1, :n].tolist() == slots.tolist()
    assert cu[: m + 1].tolist() == md.cu_seqlens_q.tolist()
    assert cu[m + 1 : max_seqs + 1].tolist() == [n] * (max_seqs - m)  # empty sequence slots
    assert int(cu[max_seqs + 1]) == size  # the padding sequence takes the rest
    assert ctx[:m].tolist() == md.context_lens.tolist() and (ctx[m:] == 0).all()
    w = md.block_tables.shape[1]
    assert torch.equal(tables[:m, :w], md.block_tables) and (tables[:m, w:] == 0).all()
    assert (tables[m:max_seqs] == 0).all() and (tables[max_seqs] == scratch_block).all()
    # padding rows: position 0 and slot -1 (no cache write)
    assert (host64[0, n:] == 0).all() and (host64[1, n:] == -1).all()
    assert (host64 != -7).all() and (host32 != -7).all()


def test_fill_prefill_inputs_capture_input_and_errors():
    from fusedpar.layers.graphs import fill_prefill_inputs

    cache = _cache()
    host64, host32 = _prefill_staging(6, 2, 3)
    fill_prefill_inputs(None, None, cache, 6, 2, 3, 5, host64, host32)
    cu, ctx, tables = _split_prefill_staging(host32, 2, 3)
    assert cu.tolist() == [0, 0, 0, 6] and (ctx == 0).all()
    assert tables[2].tolist() == [5, 5, 5] and (tables[:2] == 0).all()
    assert host64[1].tolist() == [-1] * 6 and (host64[0] == 0).all()
    cache.begin_step(StepBatch((1, 2), (9, 3), (0, 0)))
    batch = StepBatch((1, 2), (4, 2), (9, 3))
    slots = cache.begin_step(batch, device="cpu")
    with pytest.raises(ValueError, match=r"needs 4 cache blocks.*at most 3"):
        fill_prefill_inputs(batch, slots, cache, 6, 2, 3, 5, *_prefill_staging(6, 2, 3))
    with pytest.raises(ValueError, match="cannot take 6 tokens of 2 sequences"):
        fill_prefill_inputs(batch, slots, cache, 6, 1, 4, 5, *_prefill_staging(6, 1, 4))
    with pytest.raises(ValueError, match="cannot take 6 tokens"):
        fill_prefill_inputs(batch, slots, cache, 5, 2, 4, 5, *_prefill_staging(5, 2, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("query_lens", "contexts", "size", "max_seqs"),
                         [((7, 1, 4), (0, 5, 9), 24, 4), ((6, 6), (3, 0), 12, 2)])
def test_prefill_staging_attends_like_the_eager_step(dtype, query_lens, contexts, size, max_seqs):
    """The Triton attention (interpreter) on the padded graph inputs - empty sequence slots, a padding
    sequence over the scratch block, slot -1 - gives the real rows the eager step's outputs and
    writes the cache exactly where the eager step does (nothing else changes: padding writes none)."""
    from fusedpar.kernels._host import INTERPRETED
    from fusedpar.kernels.attention import paged_attention
    from fusedpar.layers.attention import step_metadata
    from fusedpar.layers.graphs import fill_prefill_inputs
    from fusedpar.testing.numerics import assert_close, poison_

    if not INTERPRETED:
        pytest.skip("needs the Triton interpreter (TRITON_INTERPRET=1 before fusedpar.kernels.attention loads)")
    nq, nkv, hd = 4, 2, 16
    cache = PagedKVCache(num_layers=1, kv_heads=(0, 1), head_dim=hd, block_size=4, num_blocks=40, dtype=dtype)
    cache.begin_step(StepBatch((SCRATCH_SEQ_ID,), (1,), (0,)))
    scratch_block = cache.block_tables[SCRATCH_SEQ_ID][0]
    ids = tuple(range(30, 30 + len(query_lens)))
    with_ctx = [(i, c) for i, c in zip(ids, contexts, strict=True) if c]
    cache.begin_step(StepBatch(tuple(i for i, _ in with_ctx), tuple(c for _, c in with_ctx), (0,) * len(with_ctx)))
    batch = StepBatch(ids, query_lens, contexts)
    slots = cache.begin_step(batch, device="cpu")
    gen = torch.Generator().manual_seed(5)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen).to(dtype))  # cached context and stale slots alike
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen).to(dtype))
    n, width = batch.num_tokens, (nq + 2 * nkv) * hd
    qkv = torch.randn((size, width), generator=gen).to(dtype)  # rows n.. are the padding sequence's tokens
    common = dict(num_q_heads=nq, rope_theta=1e4, q_norm=(1 + 0.2 * torch.randn(hd, generator=gen)).to(dtype),
                  k_norm=(1 + 0.2 * torch.randn(hd, generator=gen)).to(dtype))

    k_eager, v_eager = cache.k[0].clone(), cache.v[0].clone()
    md = step_metadata(batch, cache, device="cpu")
    out_eager = poison_(torch.empty((n, nq * hd), dtype=dtype))
    paged_attention(qkv[:n], num_tokens=n, cu_seqlens_q=md.cu_seqlens_q, context_lens=md.context_lens,
                    block_tables=md.block_tables, k_cache=k_eager, v_cache=v_eager, slots=slots,
                    positions=batch.positions(), max_query_len=md.max_query_len, max_kv_len=md.max_kv_len,
                    out=out_eager, **common)

    max_blocks = -(-max(max(c + q for c, q in zip(contexts, query_lens, strict=True)), size) // 4)
    host64, host32 = _prefill_staging(size, max_seqs, max_blocks)
    fill_prefill_inputs(batch, slots, cache, size, max_seqs, max_blocks, scratch_block, host64, host32)
    cu, ctx, tables = _split_prefill_staging(host32, max_seqs, max_blocks)
    k_graph, v_graph = cache.k[0].clone(), cache.v[0].clone()
    out_graph = poison_(torch.empty((size, nq * hd), dtype=dtype))
    paged_attention(qkv, num_tokens=size, cu_seqlens_q=cu, context_lens=ctx, block_tables=tables,
                    k_cache=k_graph, v_cache=v_graph, slots=host64[1], positions=host64[0], max_query_len=size,
                    max_kv_len=max_blocks * 4, out=out_graph, **common)
    assert_close(out_graph[:n], out_eager, dtype=dtype, name="graph-staged attention vs eager")
    assert torch.equal(k_graph, k_eager) and torch.equal(v_graph, v_eager), "cache writes differ from the eager step"
    assert not torch.equal(k_eager, cache.k[0]), "the eager step wrote nothing: the comparison proves nothing"


# ---- prefill graphs: GPU ----------------------------------------------------------------------------
def _gpu_prefill_graph_check(rank, world, cfg, sp, tp, *, comm=None):
    """Varlen shift-mode steps through PrefillGraphs (sizes 32 / 96 / 256, at most 4 sequences) next
    to decode graphs (sizes 1 / 4): fresh prompts, a chunked-prefill continuation, mixed prefill +
    decode, a step of exactly a captured size, and the steps that must run eagerly (base mode above
    the threshold, too many sequences, a context past max_context). Each step vs the fp64 oracle and
    vs the same stack run eagerly on a second cache; the graphs' outputs are poisoned before every
    replay, and the two caches must agree at the end."""
    from fusedpar.testing.scenarios import rel_error

    dtype, layers, max_context = torch.bfloat16, 2, 160
    dev, oracle, stack, eager_cache, graph_cache = _graph_setup(world, cfg, sp, tp, layers, dtype, seed=11,
                                                                threshold=256, comm=comm)
    decode = stack.capture_decode_graphs(graph_cache, max_context=max_context, sizes=(1, 4))
    prefill = stack.capture_prefill_graphs(graph_cache, max_context=max_context, sizes=(32, 96, 256), max_seqs=4)
    gen = torch.Generator().manual_seed(4)
    lengths: dict[int, int] = {}
    errors = []

    def step(seqs, query_lens, label, expect):
        batch = StepBatch(tuple(seqs), tuple(query_lens), tuple(lengths.get(s, 0) for s in seqs))
        x = torch.randn(batch.num_tokens, cfg.hidden_size, generator=gen, dtype=torch.float64).to(dev)
        for g in (decode, prefill):
            for st in g._steps.values():
                st.out.fill_(float("nan"))
        counts = (decode.replays, prefill.replays)
        y_graph = stack(x.to(dtype), batch, graph_cache)
        ran = "decode" if decode.replays > counts[0] else "prefill" if prefill.replays > counts[1] else "eager"
        y_eager = stack(x.to(dtype), batch, eager_cache)
        want = oracle.forward(x, batch)
        e_oracle, e_eager = rel_error(y_graph, want), rel_error(y_graph, y_eager)
        if not (e_oracle < REL_TOL[dtype] and e_eager < REL_TOL[dtype]):
            errors.append(f"{label}: vs oracle {e_oracle:.3g}, vs eager {e_eager:.3g}")
        if ran != expect:
            errors.append(f"{label}: ran {ran}, expected {expect}")
        for s, q in zip(seqs, query_lens, strict=True):
            lengths[s] = lengths.get(s, 0) + q

    step((0, 1, 2), (37, 16, 5), "three fresh prompts (58 tokens, graph 96)", "prefill")
    step((3,), (300,), "a base-mode prompt above the threshold", "eager")
    step((0, 4), (1, 20), "mixed decode + new prompt (21 tokens, graph 32)", "prefill")
    step((1,), (40,), "chunked-prefill continuation (graph 96)", "prefill")
    step((0, 1, 2, 4), (8, 8, 8, 8), "exactly 32 tokens (no padding rows)", "prefill")
    step((0, 1, 2, 4), (1, 1, 1, 1), "decode of 4 (decode graph)", "decode")
    step((5, 6, 7, 8, 9), (3, 2, 4, 1, 5), "5 sequences > max_seqs 4", "eager")
    step((2,), (150,), "a context past max_context", "eager")
    step((0, 1, 4), (60, 30, 20), "110 tokens (graph 256)", "prefill")
    return errors + _final_checks(rank, stack, graph_cache, eager_cache, lengths, layers, dtype)


@pytest.mark.gpu
def test_gpu_prefill_graphs_stock_baseline_and_rope_tables(nccl_world):
    """Plain TP (cuBLAS + NCCL inside the graph) and a scaled RoPE table computed inside the graph."""
    from fusedpar.testing.gpu import all_ranks_ok

    rank, world = nccl_world
    inv_freq = tuple(1e6 ** (-2 * i / 128) / (1 + i / 16) for i in range(64))
    cfg = DecoderConfig(hidden_size=1024, num_q_heads=16, num_kv_heads=4, head_dim=128, intermediate_size=2048,
                        rope_theta=1e6, rope_inv_freq=inv_freq, rope_attention_scaling=1.1)
    errors = _gpu_prefill_graph_check(rank, world, cfg, 1, world, comm="plain")
    errors += _gpu_prefill_graph_check(rank, world, cfg, world, 1)
    assert all_ranks_ok(not errors), "\n".join(errors[:8])


# ---- base-mode graphs: GPU --------------------------------------------------------------------------
def _gpu_base_graph_check(rank, world, cfg, *, comm=None):
    """SP = world: base-mode varlen steps (above the threshold, 64) through BaseGraphs (sizes 128 / 256,
    at most 4 sequences) next to shift-mode PrefillGraphs (32 / 64): fresh prompts, a mixed decode +
    prompt step, a step of exactly a captured size, chunked-prefill continuations, and the steps that
    must run eagerly (too many sequences, more tokens than the largest graph, a context past
    max_context). Each step vs the fp64 oracle and vs the same stack run eagerly on a second cache; the
    graphs' outputs are poisoned before every replay, and the two caches must agree at the end."""
    from fusedpar.testing.scenarios import rel_error

    dtype, layers, max_context = torch.bfloat16, 2, 300
    dev, oracle, stack, eager_cache, graph_cache = _graph_setup(world, cfg, world, 1, layers, dtype, seed=13,
                                                                threshold=64, comm=comm)
    shift = stack.capture_prefill_graphs(graph_cache, max_context=max_context, sizes=(32, 64), max_seqs=4)
    base = stack.capture_base_graphs(graph_cache, max_context=max_context, sizes=(128, 256), max_seqs=4)
    gen = torch.Generator().manual_seed(6)
    lengths: dict[int, int] = {}
    errors = []

    def step(seqs, query_lens, label, expect):
        batch = StepBatch(tuple(seqs), tuple(query_lens), tuple(lengths.get(s, 0) for s in seqs))
        x = torch.randn(batch.num_tokens, cfg.hidden_size, generator=gen, dtype=torch.float64).to(dev)
        for g in (shift, base):
            for st in g._steps.values():
                st.out.fill_(float("nan"))
        counts = (shift.replays, base.replays, stack.steps["base"])
        y_graph = stack(x.to(dtype), batch, graph_cache)
        ran = ("shift graph" if shift.replays > counts[0] else "base graph" if base.replays > counts[1]
               else "eager base" if stack.steps["base"] > counts[2] else "eager shift")
        y_eager = stack(x.to(dtype), batch, eager_cache, use_graphs=False)
        want = oracle.forward(x, batch)
        e_oracle, e_eager = rel_error(y_graph, want), rel_error(y_graph, y_eager)
        if not (e_oracle < REL_TOL[dtype] and e_eager < REL_TOL[dtype]):
            errors.append(f"{label}: vs oracle {e_oracle:.3g}, vs eager {e_eager:.3g}")
        if ran != expect:
            errors.append(f"{label}: ran {ran}, expected {expect}")
        for s, q in zip(seqs, query_lens, strict=True):
            lengths[s] = lengths.get(s, 0) + q

    step((0, 1, 2), (37, 16, 50), "three fresh prompts (103 tokens, graph 128)", "base graph")
    step((0, 1, 2), (1, 1, 1), "decode of 3 (shift graph 32)", "shift graph")
    step((0, 3), (1, 100), "mixed decode + new prompt (101 tokens, graph 128)", "base graph")
    step((1, 2, 3, 4), (32, 32, 32, 32), "exactly 128 tokens (no padding rows)", "base graph")
    step((3, 4), (99, 101), "chunked-prefill continuations (200 tokens, graph 256)", "base graph")
    step((5, 6, 7, 8, 9), (30, 20, 20, 10, 10), "5 sequences > max_seqs 4", "eager base")
    step((0, 5), (150, 150), "300 tokens > the largest graph", "eager base")
    step((3,), (120,), "a context past max_context (351 > 300)", "eager base")
    step((0, 1, 2, 4), (70, 1, 1, 1), "73 tokens (graph 128, one prompt and three decodes)", "base graph")
    return errors + _final_checks(rank, stack, graph_cache, eager_cache, lengths, layers, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize(("h", "hkv", "qk_norm"), [(32, 8, False), (16, 2, True)])
def test_gpu_base_graphs_match_oracle_and_eager(nccl_world, h, hkv, qk_norm):
    """(16, 2) at 4 GPUs: SP above the kv heads (each kv head on two ranks)."""
    from fusedpar.testing.gpu import all_ranks_ok

    rank, world = nccl_world
    if world < 2:
        pytest.skip("base-mode graphs need SP >= 2: one GPU has no base mode")
    cfg = DecoderConfig(hidden_size=1024, num_q_heads=h, num_kv_heads=hkv, head_dim=128, intermediate_size=2048,
                        qk_norm=qk_norm, rope_theta=1e6)
    errors = _gpu_base_graph_check(rank, world, cfg)
    assert all_ranks_ok(not errors), "\n".join(errors[:8])


@pytest.mark.parametrize(("sp", "threshold", "sizes", "match"), [
    (2, 64, (64, 128), r"sizes \[64\] <= shift threshold 64"),
    (4, 16, (66, 128), r"sizes \[66\] are not multiples of SP = 4"),
    (1, 0, (128,), r"SP = 1: base mode is shift mode"),
])
def test_base_graphs_refuse_sizes_base_mode_never_runs(sp, threshold, sizes, match):
    """The size checks run before any capture (no GPU needed to reach them)."""
    from types import SimpleNamespace

    from fusedpar.layers.graphs import BaseGraphs

    stack = SimpleNamespace(fused=object(), fused_max_tokens=4096, ctx=SimpleNamespace(
        sp=SimpleNamespace(size=sp), device=torch.device("cuda")), policy=SimpleNamespace(threshold=threshold))
    with pytest.raises(ValueError, match=match):
        BaseGraphs(stack, _cache(), max_context=256, sizes=sizes, max_seqs=4)
