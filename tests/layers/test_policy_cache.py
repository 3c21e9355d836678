"""StepModeRule, StepBatch and PagedKVCache bookkeeping (single process)."""

import pytest
import torch

from fusedpar.layers import PagedKVCache, StepBatch, StepModeRule, padded_token_count


def test_policy_threshold_is_inclusive_for_shift():
    p = StepModeRule(threshold=64)
    assert [p.mode(n, 4) for n in (1, 64, 65, 4096)] == ["shift", "shift", "base", "base"]
    assert StepModeRule.always("base").mode(1, 2) == "base"
    assert StepModeRule.always("shift").mode(10**6, 2) == "shift"
    assert StepModeRule(0).mode(10**6, 1) == "shift"  # SP=1: the two modes are one computation


@pytest.mark.parametrize("bad", [-1, 1.5, "8"])
def test_policy_rejects_bad_threshold(bad):
    with pytest.raises(ValueError, match="threshold"):
        StepModeRule(bad)


def test_padding_and_positions():
    assert [padded_token_count(n, 4) for n in (1, 4, 13, 16)] == [4, 4, 16, 16]
    b = StepBatch((5, 9), (3, 1), (0, 7))
    assert b.num_tokens == 4
    assert b.positions().tolist() == [0, 1, 2, 7]
    assert b.after().context_lens == (3, 8)


@pytest.mark.parametrize(("args", "match"), [
    (((), (), ()), "non-empty"),
    (((1, 1), (2, 2), (0, 0)), "unique"),
    (((1,), (0,), (0,)), "query_lens >= 1"),
    (((1,), (1, 2), (0,)), "equal"),
])
def test_step_batch_validation(args, match):
    with pytest.raises(ValueError, match=match):
        StepBatch(*args)


def _cache(num_blocks=8):
    return PagedKVCache(num_layers=2, kv_heads=(3, 4), head_dim=2, block_size=4, num_blocks=num_blocks,
                        dtype=torch.float32)


def test_cache_roundtrip_over_scattered_blocks():
    cache = _cache()
    g = torch.Generator().manual_seed(0)
    # interleave two sequences and free one so the third gets non-contiguous blocks
    written = {}
    for batch in (StepBatch((0, 1), (5, 3), (0, 0)), StepBatch((0, 1), (1, 2), (5, 3))):
        slots = cache.begin_step(batch)
        k = torch.randn(batch.num_tokens, 2, 2, generator=g)
        cache.write(1, slots, k, -k)
        start = 0
        for sid, q in zip(batch.seq_ids, batch.query_lens, strict=True):
            written.setdefault(sid, []).append(k[start:start + q])
            start += q
    cache.free(0)
    slots = cache.begin_step(StepBatch((2,), (9,), (0,)))
    k2 = torch.randn(9, 2, 2, generator=g)
    cache.write(1, slots, k2, -k2)
    assert len(set(cache.block_tables[2])) == 3
    table = cache.block_tables[2]
    assert table != list(range(table[0], table[0] + 3)), f"blocks {table} are contiguous: test proves nothing"
    k1, v1 = cache.gather(1, 1)
    assert torch.equal(k1, torch.cat(written[1])) and torch.equal(v1, -k1)
    assert torch.equal(cache.gather(1, 2)[0], k2)
    assert cache.k[0].abs().sum() == 0  # layer 0 never written


def test_cache_rejects_wrong_context_and_overflow():
    cache = _cache(num_blocks=2)
    cache.begin_step(StepBatch((0,), (3,), (0,)))
    with pytest.raises(ValueError, match="cache holds 3 tokens, step says context 2"):
        cache.begin_step(StepBatch((0,), (1,), (2,)))
    with pytest.raises(RuntimeError, match="out of blocks"):
        cache.begin_step(StepBatch((1,), (9,), (0,)))
    with pytest.raises(ValueError, match="does not match"):
        cache.write(0, torch.tensor([0]), torch.zeros(1, 3, 2), torch.zeros(1, 3, 2))


def test_cache_grow_keeps_blocks_tables_and_values():
    cache = _cache(num_blocks=3)  # block_size 4
    g = torch.Generator().manual_seed(1)
    first = StepBatch((7, 8), (5, 2), (0, 0))  # 7 takes blocks 0, 1; 8 takes block 2
    assert cache.blocks_needed(first) == 3 and cache.free_blocks == 3
    slots = cache.begin_step(first)
    k = torch.randn(7, 2, 2, generator=g)
    cache.write(0, slots, k, 2 * k)
    cache.free(8)  # block 2 back in the pool
    assert cache.free_blocks == 1 and cache.block_tables == {7: [0, 1]}
    second = StepBatch((7, 9), (4, 6), (5, 0))  # 7 needs 1 more block (9 tokens), 9 needs 2
    assert cache.blocks_needed(second) == 3
    old_k = cache.k
    cache.grow(6)
    assert (cache.num_blocks, cache.free_blocks) == (6, 4) and cache.k.shape[1] == cache.v.shape[1] == 6
    assert cache.k is not old_k and torch.equal(cache.k[:, :3], old_k)
    assert cache.block_tables == {7: [0, 1]} and cache.lengths == {7: 5}
    got_k, got_v = cache.gather(0, 7)
    assert torch.equal(got_k, k[:5]) and torch.equal(got_v, 2 * k[:5])
    # the old free block is handed out first, then the new ones in order (deterministic on every rank)
    slots = cache.begin_step(second)
    assert cache.block_tables == {7: [0, 1, 2], 9: [3, 4]} and cache.free_blocks == 1
    k2 = torch.randn(10, 2, 2, generator=g)
    cache.write(0, slots, k2, 2 * k2)
    assert torch.equal(cache.gather(0, 7)[0], torch.cat([k[:5], k2[:4]]))
    assert torch.equal(cache.gather(0, 9)[1], 2 * k2[4:])
    assert cache.k[1].abs().sum() == 0  # layer 1 never written, before or after the grow
    cache.grow(6)  # same size: nothing changes
    assert cache.num_blocks == 6 and cache.free_blocks == 1
    with pytest.raises(ValueError, match="cannot shrink"):
        cache.grow(5)
    cache.begin_step(StepBatch((10,), (4,), (0,)))
    assert cache.block_tables[10] == [5] and cache.free_blocks == 0


def _snapshot(cache):
    return ({k: list(v) for k, v in cache.block_tables.items()}, dict(cache.lengths), cache.free_blocks)


def test_rejected_step_leaves_the_cache_unchanged_and_can_be_retried():
    cache = _cache(num_blocks=3)  # block_size 4
    cache.begin_step(StepBatch((5,), (3,), (0,)))
    before = _snapshot(cache)
    # sequence 1 would fit, sequence 2 is out of blocks: nothing may be reserved for 1 either
    too_big = StepBatch((1, 2), (4, 9), (0, 0))
    with pytest.raises(RuntimeError, match=r"out of blocks: the step needs 4 more, 2 free of 3"):
        cache.begin_step(too_big)
    assert _snapshot(cache) == before
    # a context mismatch late in the batch: the sequences before it are untouched too
    with pytest.raises(ValueError, match="sequence 5: cache holds 3 tokens, step says context 2"):
        cache.begin_step(StepBatch((1, 5), (4, 1), (0, 2)))
    assert _snapshot(cache) == before
    cache.grow(5)
    slots = cache.begin_step(too_big)  # the same step, retried after growing the pool
    assert slots.numel() == 13 and cache.lengths == {5: 3, 1: 4, 2: 9}


def test_cache_generation_counts_growth():
    cache = _cache(num_blocks=2)
    assert cache.generation == 0
    cache.grow(2)  # no-op
    assert cache.generation == 0
    cache.grow(4)
    assert cache.generation == 1


def test_decode_graphs_refuse_replay_after_growth_or_new_fused_kernels():
    """DecodeGraphs._check_live (the graph replay itself needs CUDA: a stand-in graph counts replays):
    a grown cache, other fused kernels, or a freed scratch sequence (padding rows read - decode
    padding also writes - its block, which a freed scratch hands to the next real sequence)."""
    from types import SimpleNamespace

    from fusedpar.layers.graphs import SCRATCH_SEQ_ID, DecodeGraphs

    cache = _cache(num_blocks=2)
    cache.begin_step(StepBatch((SCRATCH_SEQ_ID,), (1,), (0,)))  # as capture does
    kernels = object()
    replays = []
    graphs = DecodeGraphs.__new__(DecodeGraphs)  # the state a capture leaves, without capturing
    graphs.cache, graphs.sizes, graphs.stack = cache, (1,), SimpleNamespace(fused=kernels)
    graphs._cache_ptr, graphs._cache_generation, graphs._fused = cache.k.data_ptr(), cache.generation, kernels
    graphs.scratch_block = cache.block_tables[SCRATCH_SEQ_ID][0]
    graphs._steps = {1: SimpleNamespace(graph=SimpleNamespace(replay=lambda: replays.append(1)))}
    graphs.replay_last(1)
    assert replays == [1]
    with pytest.raises(ValueError, match="no decode graph of size 2"):
        graphs.replay_last(2)
    graphs.stack.fused = object()  # enable_fused again: other workspaces
    with pytest.raises(RuntimeError, match="fused kernels changed"):
        graphs.replay_last(1)
    graphs.stack.fused = kernels
    for sid in list(cache.block_tables):  # a "reset" that frees every sequence, the scratch too
        cache.free(sid)
    cache.begin_step(StepBatch((7,), (3,), (0,)))
    assert cache.block_tables[7][0] == graphs.scratch_block  # the block went to a real sequence
    with pytest.raises(RuntimeError, match=r"scratch sequence .* was freed"):
        graphs.replay_last(1)
    cache.grow(3)
    with pytest.raises(RuntimeError, match="KV cache was grown"):
        graphs.replay_last(1)
    assert replays == [1]


@pytest.mark.parametrize(("field", "values"), [
    ("query_lens", (1.5,)), ("query_lens", (True,)), ("context_lens", (0.5,)), ("context_lens", (None,)),
    ("seq_ids", ("a",)),
])
def test_step_batch_takes_ints_only(field, values):
    kw = dict(seq_ids=(0,), query_lens=(2,), context_lens=(0,))
    kw[field] = values
    with pytest.raises(ValueError, match=f"StepBatch {field} must be ints"):
        StepBatch(**kw)


def test_step_batch_normalises_sequences_and_numpy_ints():
    import numpy as np

    b = StepBatch([np.int64(3), 4], [np.int32(2), 1], [0, np.int64(5)])
    assert b.seq_ids == (3, 4) and b.query_lens == (2, 1) and b.context_lens == (0, 5)
    assert all(type(v) is int for v in (*b.seq_ids, *b.query_lens, *b.context_lens))
    assert hash(b) == hash(StepBatch((3, 4), (2, 1), (0, 5)))
    assert b.positions().tolist() == [0, 1, 5]


def test_policy_rejects_bool_threshold_and_bad_sp():
    with pytest.raises(ValueError, match="shift threshold must be an int"):
        StepModeRule(True)
    with pytest.raises(ValueError, match="sp must be >= 1, got 0"):
        StepModeRule(4).mode(5, 0)


@pytest.mark.parametrize(("override", "match"), [
    (dict(hidden_size=0), "hidden_size must be >= 1"), (dict(num_q_heads=-4), "num_q_heads must be >= 1"),
    (dict(hidden_size=32.5), "hidden_size must be an int"), (dict(intermediate_size=0), "intermediate_size"),
    (dict(head_dim=7), "head_dim=7 must be even"), (dict(rope_theta=0.0), "rope_theta must be a finite number > 0"),
    (dict(rope_theta=-1e4), "rope_theta"), (dict(rms_norm_eps=-1.0), "rms_norm_eps must be a finite number > 0"),
    (dict(rms_norm_eps=float("nan")), "rms_norm_eps"),
])
def test_decoder_config_rejects_impossible_sizes(override, match):
    from fusedpar.layers import DecoderConfig

    kw = dict(hidden_size=32, num_q_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64)
    with pytest.raises(ValueError, match=match):
        DecoderConfig(**{**kw, **override})


def test_needs_rope_tables_past_the_kernels_angle_range():
    """Plain RoPE uses the kernel's own fp32 angles up to ROPE_THETA_MAX_KV_LEN, cos/sin tables past it
    (the stack and the graphs ask this); scaled RoPE always uses tables."""
    from fusedpar.kernels.attention import ROPE_THETA_MAX_KV_LEN
    from fusedpar.layers import DecoderConfig
    from fusedpar.layers.decoder import needs_rope_tables

    kw = dict(hidden_size=32, num_q_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64)
    plain, scaled = DecoderConfig(**kw), DecoderConfig(**kw, rope_attention_scaling=0.5)
    assert plain.rope_is_default and not scaled.rope_is_default
    assert [needs_rope_tables(plain, n) for n in (1, ROPE_THETA_MAX_KV_LEN, ROPE_THETA_MAX_KV_LEN + 1)] == [
        False, False, True]
    assert needs_rope_tables(scaled, 1) and needs_rope_tables(scaled, ROPE_THETA_MAX_KV_LEN + 1)


def _refused_steps_leave_the_cache(rank, world):
    """World 1: steps refused for the input's dtype or a cache of another shape raise ValueError
    before reserving anything; the same step then runs."""
    from fusedpar.collectives import ParallelContext
    from fusedpar.layers import DecoderConfig, ShiftParallelStack, random_decoder_weights
    from fusedpar.layouts import ParallelLayout

    cfg = DecoderConfig(hidden_size=32, num_q_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64)
    ctx = ParallelContext(ParallelLayout(world, sp=1, tp=1))
    stack = ShiftParallelStack.from_full_weights(cfg, ctx, [random_decoder_weights(cfg, seed=i) for i in range(2)])
    cache = stack.make_cache(block_size=4, num_blocks=16)
    batch = StepBatch((0,), (5,), (0,))
    x = torch.randn(5, 32)
    out = {}
    for name, call in {
        "float64 hidden": lambda: stack(x.double(), batch, cache),
        "one-layer cache": lambda: stack(x, batch, PagedKVCache(num_layers=1, kv_heads=cache.kv_heads, head_dim=8,
                                                               block_size=4, num_blocks=16, dtype=torch.float32)),
        "head_dim 4 cache": lambda: stack(x, batch, PagedKVCache(num_layers=2, kv_heads=cache.kv_heads, head_dim=4,
                                                                block_size=4, num_blocks=16, dtype=torch.float32)),
        "float16 cache": lambda: stack(x, batch, stack.make_cache(block_size=4, num_blocks=16, dtype=torch.float16)),
    }.items():
        try:
            call()
            out[name] = "ran"
        except ValueError as e:
            out[name] = str(e)
    out["lengths after refusals"] = dict(cache.lengths)
    out["then runs"] = tuple(stack(x, batch, cache).shape)
    return out


def test_refused_forward_leaves_the_cache_unchanged():
    from fusedpar.testing.dist import run_distributed

    (res,) = run_distributed(_refused_steps_leave_the_cache, 1, timeout=120)
    assert "hidden is torch.float64, the stack's weights are torch.float32" in res["float64 hidden"], res
    assert "cache holds 1 layers of head_dim 8" in res["one-layer cache"], res
    assert "cache holds 2 layers of head_dim 4" in res["head_dim 4 cache"], res
    assert "in torch.float16; this stack needs 2 layers of head_dim 8 in torch.float32" in res["float16 cache"], res
    assert res["lengths after refusals"] == {} and res["then runs"] == (5, 32), res


def test_cache_argument_types_and_unknown_sequences():
    with pytest.raises(ValueError, match="num_blocks must be an int, got True"):
        PagedKVCache(num_layers=1, kv_heads=(0,), head_dim=4, block_size=2, num_blocks=True, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"block_size must be an int, got 2\.5"):
        PagedKVCache(num_layers=1, kv_heads=(0,), head_dim=4, block_size=2.5, num_blocks=4, dtype=torch.float32)
    cache = _cache()
    with pytest.raises(ValueError, match="grow: num_blocks must be an int"):
        cache.grow(16.5)
    for call in (lambda: cache.gather(0, 99), lambda: cache.block_table(99)):
        with pytest.raises(KeyError, match="sequence 99 holds no cache blocks"):
            call()
    cache.free(99)  # unknown id: nothing to free, no error


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_decode_step_slots_match_the_general_path(block_size):
    """begin_step's decode shortcut (every query length 1) hands out the blocks and slots the general
    path does: the same steps with one extra 2-token sequence last (which forces the general path and
    takes its blocks after the others') give the same tables and slots for the decode sequences."""
    gen = torch.Generator().manual_seed(block_size)

    def cache():
        return PagedKVCache(num_layers=1, kv_heads=(0,), head_dim=2, block_size=block_size, num_blocks=512,
                            dtype=torch.float32)

    fast, general = cache(), cache()
    lens = {sid: int(torch.randint(1, 3 * block_size + 2, (1,), generator=gen)) for sid in range(5)}
    for c in (fast, general):
        c.begin_step(StepBatch(tuple(lens), tuple(lens.values()), (0,) * len(lens)))
    extra = 1000
    for step in range(3 * block_size + 3):
        ids = tuple(sid for sid in lens if (sid + step) % 3)  # a changing subset of the sequences
        batch = StepBatch(ids, (1,) * len(ids), tuple(lens[s] for s in ids))
        got = fast.begin_step(batch)
        mixed = StepBatch((*ids, extra + step), (*(1,) * len(ids), 2), (*batch.context_lens, 0))
        want = general.begin_step(mixed)
        assert got.dtype == torch.int64 and got.tolist() == want[: len(ids)].tolist(), f"step {step}"
        for sid in ids:
            assert fast.block_tables[sid] == general.block_tables[sid]
            assert fast.seq_len(sid) == general.seq_len(sid) == lens[sid] + 1
            lens[sid] += 1
        general.free(extra + step)  # its blocks go back: both pools hand out the same blocks next
