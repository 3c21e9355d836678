"""fusedpar.layers.step_times: step-time curves measured through a step function or a stack, in the form
AutoPolicy takes. Structure only (points, warm-up and timed steps, the cache left as found, the same curve
on every rank, values positive): no assert depends on how fast the machine is."""

from __future__ import annotations

import math

import pytest
import torch

from fusedpar.layers import (
    AutoPolicy,
    DecoderConfig,
    PagedKVCache,
    ShiftParallelStack,
    StepBatch,
    StepFacts,
    StepTimeCurve,
    measure_step_times,
    random_decoder_weights,
    stack_step_times,
)
from fusedpar.layers.step_times import step_batches
from fusedpar.layouts import ParallelLayout
from fusedpar.testing.dist import run_distributed

CFG = DecoderConfig(hidden_size=32, num_q_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64)
PREFILL_POINTS, DECODE_POINTS = (1, 6, 16), (1, 2, 5)
LAYOUTS = {"tp": dict(tp=2), "sp": dict(sp=2), "dp": {}}  # ParallelLayout(2, **kw); dp: two replicas


def _cache(blocks: int = 16) -> PagedKVCache:
    return PagedKVCache(num_layers=1, kv_heads=(0,), head_dim=4, block_size=4, num_blocks=blocks,
                        dtype=torch.float32)


def _assert_curve(curve, points):
    assert isinstance(curve, StepTimeCurve) and curve.tokens == tuple(points)
    assert all(math.isfinite(s) and s > 0 for s in curve.seconds), curve


def test_step_batches_split_a_point_over_the_replicas():
    assert step_batches(10, 4) == (None, StepBatch((-1,), (3,), (0,)))  # one sequence of ceil(10 / 4) tokens
    assert step_batches(1, 2) == (None, StepBatch((-1,), (1,), (0,)))
    setup, timed = step_batches(5, 2, decode=True)  # 3 sequences per replica, one cached token each first
    assert setup == StepBatch((-3, -2, -1), (1, 1, 1), (0, 0, 0))
    assert timed == StepBatch((-3, -2, -1), (1, 1, 1), (1, 1, 1))
    with pytest.raises(ValueError, match="replicas must be an int >= 1"):
        step_batches(4, 0)


@pytest.mark.parametrize("decode", [False, True])
def test_measure_runs_a_warm_up_and_iters_steps_per_point_and_frees_its_sequences(decode):
    cache = _cache()
    cache.begin_step(StepBatch((7,), (5,), (0,)))  # a live sequence: kept
    free = cache.free_blocks
    seen = []

    def step(batch):
        seen.append(batch)
        cache.begin_step(batch)  # the step's KV takes blocks, as a real step's does

    points = (1, 3, 8)
    curve = measure_step_times(step, cache, points, replicas=2, decode=decode, iters=2)
    _assert_curve(curve, points)
    want = []
    for n in points:
        setup, timed = step_batches(n, 2, decode)
        want += ([setup, timed] if decode else [timed]) * 3  # one warm-up and 2 timed steps
    assert seen == want
    assert cache.free_blocks == free and set(cache.block_tables) == {7}
    assert curve(1) > 0 and curve(100) > 0  # a StepTimeCurve: AutoPolicy's form


def test_measure_rejects_bad_points_and_taken_sequence_ids():
    cache = _cache()

    def step(batch):
        return None

    for bad in ([], [4, 2], [0, 1], [1.5]):
        with pytest.raises(ValueError, match="curve"):
            measure_step_times(step, cache, bad)
    with pytest.raises(ValueError, match="iters must be an int >= 1"):
        measure_step_times(step, cache, [1], iters=0)
    cache.begin_step(StepBatch((-1,), (1,), (0,)))
    with pytest.raises(ValueError, match=r"sequences \[-1\] are in the cache"):
        measure_step_times(step, cache, [1])


def _stack_curves(rank, world):
    """Prefill and decode curves of a 2-layer stack per layout of 2 ranks (sp: every step in base mode)."""
    from fusedpar.collectives import ParallelContext

    weights = [random_decoder_weights(CFG, seed=i) for i in range(2)]
    out = {}
    for name, kw in LAYOUTS.items():
        ctx = ParallelContext(ParallelLayout(world, **kw))
        stack = ShiftParallelStack.from_full_weights(CFG, ctx, weights)
        cache = stack.make_cache(block_size=4, num_blocks=32)
        mode = "base" if name == "sp" else None
        curves = [stack_step_times(stack, cache, pts, decode=dec, iters=2, mode=mode)
                  for pts, dec in ((PREFILL_POINTS, False), (DECODE_POINTS, True))]
        assert cache.free_blocks == cache.num_blocks and not cache.block_tables
        out[name] = [(c.tokens, c.seconds) for c in curves] + [dict(stack.steps)]
        ctx.close()
    return out


def test_stack_curves_on_two_gloo_ranks_feed_auto_policy():
    per_rank = run_distributed(_stack_curves, 2)
    assert per_rank[0] == per_rank[1]  # the max over ranks: one curve on every rank
    res = per_rank[0]
    steps = 3 * len(PREFILL_POINTS) + 6 * len(DECODE_POINTS)  # per point 3 steps (iters 2 + warm-up), decode: x2
    for name in LAYOUTS:
        (p_tokens, p_secs), (d_tokens, d_secs), ran = res[name]
        _assert_curve(StepTimeCurve(zip(p_tokens, p_secs, strict=True)), PREFILL_POINTS)
        _assert_curve(StepTimeCurve(zip(d_tokens, d_secs, strict=True)), DECODE_POINTS)
        assert sum(ran.values()) == steps and (ran["base"] == steps if name == "sp" else ran["base"] == 0), ran
    lay = {name: ParallelLayout(2, **kw) for name, kw in LAYOUTS.items()}
    policy = AutoPolicy({lay[k]: list(zip(*res[k][0], strict=True)) for k in LAYOUTS}, latency_goal_s=1.0,
                        decode_steps=8, decode_curves={lay[k]: list(zip(*res[k][1], strict=True)) for k in LAYOUTS})
    for f in (StepFacts(1, running=1), StepFacts(16, waiting=2, waiting_prefill_tokens=30), StepFacts(5, running=5)):
        for current in policy.layouts:
            assert policy.decide(f, current) in policy.layouts
            assert all(t > 0 and s >= t for t, s in policy.estimates(f, current).values())
