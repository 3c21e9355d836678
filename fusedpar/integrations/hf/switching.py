"""Switching a parallelized HF model among declared layouts: which weights each rank keeps, the
live switch (model.reshard), and the per-call layout policy.

Weights: per replica size P among the declared layouts, each rank keeps the shard of the layout of
that size with the largest SP (held_layouts_for); every layout of size P is a view of it. o and
down are contiguous column ranges in every layout, so one tensor with the union of a rank's columns
serves every size (share_row_parallel); qkv and gate_up rows are ordered per SP block of each size
and keep one shard per size.

KV: layouts of one replica size cache the same kv heads on the same ranks (nothing moves); across
sizes every cached row moves to the replica that runs it (runtime.row_blocks) along
fusedpar.layouts.kv_plan, carried out by fusedpar.layers.kv_reshard.migrate_kv (on the fused path, CUDA,
through a symmetric staging the runtime keeps: _staging).
"""

from __future__ import annotations

import time

import torch

from fusedpar.collectives import ParallelContext
from fusedpar.collectives.symmetric import SymmetricWorkspace
from fusedpar.layers import ShiftParallelStack
from fusedpar.layers.kv_reshard import migrate_kv, push_staging_bytes
from fusedpar.layouts import ParallelLayout, kv_plan, shard_problems

from .cache import ShiftParallelCache
from .runtime import _Runtime, row_blocks
from .spec import HFModelSpec

_STAGING_BYTES = 512 << 20  # the most a KV migration's staging takes per rank (fused path, CUDA)


def reshard_runtime(rt: _Runtime, layout: ParallelLayout) -> dict:
    """model.reshard(layout) on the model's runtime (see its docstring).

    Every declared layout's context and stack (weights as views) were built by parallelize, so a
    switch selects them: between SP x TP splits of one replica size it is one tiny all-reduce (the
    ranks' agreement on the layout) and no device work; the stacks' decode graphs and the head
    graphs stay (they read the same pool and parameters). Across replica sizes the live KV migrates
    (migrate_kv) into a reinterpreted pool; decode graphs on that memory stay and are rebound
    (DecodeGraphs.rebind) when their layout's view of it returns, those on memory left behind (a grown
    pool) are dropped."""
    t0 = time.perf_counter()
    if not isinstance(layout, ParallelLayout):
        raise ValueError(f"reshard needs a ParallelLayout, got {type(layout).__name__}")
    current = rt.ctx.layout
    if layout.world_size != current.world_size:
        raise ValueError(f"reshard stays within the world of {current.world_size} ranks; {layout!r} has "
                         f"{layout.world_size} ranks")
    if layout not in rt.stacks:  # every declared layout passed these checks at parallelize
        problems = shard_problems(layout, rt.spec.decoder.dims)
        if problems:
            raise ValueError(f"reshard: {layout!r} cannot shard this model: " + "; ".join(problems))
        raise ValueError(f"{layout!r} was not declared: parallelize(..., reshard_layouts=...) names the layouts "
                         f"a model can switch among, here {sorted(map(repr, rt.stacks))}")
    _agree_on_layout(rt, layout)
    ctx, stack = rt.stacks[layout]
    moved = received = 0
    if layout.replica_size != current.replica_size:
        if rt.kv is None:  # a replica that ran no row yet: an empty pool, as every rank takes part
            rt.kv = rt.stack.make_cache(block_size=rt.block_size, num_blocks=16)
        moved, received = _migrate_live_kv(rt, current, layout, ctx, stack)
    elif rt.kv is not None and tuple(stack.layers[0].kv_heads) != tuple(rt.kv.kv_heads):
        raise RuntimeError(f"rank {ctx.global_rank}: {layout!r} caches kv heads {stack.layers[0].kv_heads}, the "
                           f"live cache holds {rt.kv.kv_heads}")
    rt.ctx, rt.stack = ctx, stack
    rt.replayed = None
    return {"weight_bytes_moved": 0, "kv_bytes_moved": moved, "kv_bytes_received": received,
            "seconds": time.perf_counter() - t0, "layout": repr(layout)}


def _agree_on_layout(rt: _Runtime, layout: ParallelLayout) -> None:
    """ValueError on every rank unless all ranks switch to the same declared layout: one all-reduce (max)
    of (i, -i), i = the layout's place among the declared ones (the same order on every rank)."""
    dist = torch.distributed
    if dist.get_world_size() == 1:
        return
    i = list(rt.stacks).index(layout)
    t = torch.tensor([i, -i], dtype=torch.int64, device=rt.ctx.device)  # where the world's backend reduces
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    hi, neg_lo = t.tolist()
    if hi != -neg_lo:
        names = list(map(repr, rt.stacks))
        raise ValueError(f"fusedpar.integrations.hf: reshard: the ranks disagree on the layout (from "
                         f"{names[-neg_lo]} to {names[hi]}), and every rank must switch to the same one")


def check_reshard_layouts(layout: ParallelLayout, reshard_layouts) -> tuple[ParallelLayout, ...]:
    """The declared layouts as a tuple; ValueError naming every one that cannot join `layout` (not a
    layout, or another world size). Whether the model fits each one is inspect_model's check."""
    try:
        declared = tuple(reshard_layouts)
    except TypeError:
        raise ValueError(f"reshard_layouts must be an iterable of ParallelLayout, got {reshard_layouts!r}") from None
    problems = []
    for lay in declared:
        if not isinstance(lay, ParallelLayout):
            problems.append(f"{lay!r} is not a ParallelLayout")
        elif lay.world_size != layout.world_size:
            problems.append(f"{lay!r} has {lay.world_size} ranks, the model's layout {layout.world_size}")
    if problems:
        raise ValueError("reshard_layouts: " + "; ".join(problems))
    return tuple(dict.fromkeys(declared))


def held_layouts_for(layouts) -> dict[int, ParallelLayout]:
    """Replica size P -> the layout whose weights each rank keeps for the declared layouts of that size:
    the one with the largest SP. Its base shard holds the rows of every SP x TP split of P on the same
    rank, each one contiguous range (fusedpar.layouts.view_range), so all of them are views. Layouts of
    different replica sizes order the fused qkv and gate_up rows differently (per SP block of their
    own chunks), so each replica size keeps its own shards; a pure DP layout (P = 1) keeps the full
    weights."""
    held: dict[int, ParallelLayout] = {}
    for lay in layouts:
        P = lay.replica_size
        if P not in held or lay.sp > held[P].sp:
            held[P] = lay
    return held


def share_row_parallel(per: dict, held_layouts: dict, union: dict, spec: HFModelSpec, rank: int, full: dict) -> None:
    """One copy of o and down for every replica size: their shards are contiguous column ranges of the
    global weight in every layout, so each is a view of one tensor holding the union of this rank's
    columns (fusedpar.layouts.holdings); the replicated norms are shared too. qkv and gate_up keep one
    shard per replica size (their rows are ordered per SP block, differently for each size)."""
    from fusedpar.layers.weights import build_shard
    from fusedpar.layouts import WeightShard, view_range

    dims = spec.decoder.dims
    first = next(iter(per.values()))
    for name in ("o", "down"):
        segments = union[name]
        shared = build_shard(full, WeightShard(name, "in", segments, (0, 0)))
        for P, w in per.items():
            shard = held_layouts[P].weight_shards(dims).shard(rank, name)
            span = view_range(segments, shard.base)
            if span is None:
                continue  # not one range of the union: this size keeps its own copy
            w.base[name] = shared.narrow(1, span[0], span[1] - span[0])
            lo, hi = shard.shift
            w.shift[name] = w.base[name].narrow(1, lo, hi - lo)
    for w in per.values():
        w.replicated = first.replicated


def step_facts(state: ShiftParallelCache, new_columns: int, attention_mask):
    """The StepFacts (fusedpar.layers.layout_policy) of a forward call on `state`: scheduled_tokens =
    its real new tokens; running = rows holding cached tokens; waiting = rows without, that this call
    starts, with waiting_prefill_tokens their real new tokens; no host KV tier (capacity 0); no
    priorities. None when the call has no real new token. Computed from the call's inputs alone, so
    every rank gets the same facts."""
    from fusedpar.layers.layout_policy import StepFacts

    past = state.width
    if attention_mask is None:
        new = [new_columns] * len(state.seq_ids)
    else:
        new = attention_mask[:, past:past + new_columns].to("cpu").long().sum(1).tolist()
    if not sum(new):
        return None
    waiting = [q for q, c in zip(new, state.cached, strict=True) if not c and q]
    return StepFacts(scheduled_tokens=sum(new), running=sum(1 for c in state.cached if c), waiting=len(waiting),
                     waiting_prefill_tokens=sum(waiting))


def follow_policy(model, rt: _Runtime, state: ShiftParallelCache, new_columns: int, attention_mask) -> None:
    """Ask parallelize's policy for this call's layout (policy.decide(facts, current)) and switch to it
    (model.reshard, collective) when it differs; every rank asks with the same facts."""
    facts = step_facts(state, new_columns, attention_mask)
    if facts is None:
        return
    current = rt.ctx.layout
    chosen = rt.policy.decide(facts, current)
    if chosen != current:
        rt.reshards.append(model.reshard(chosen))


def _live_states(rt: _Runtime) -> list[ShiftParallelCache]:
    """The live caches (the active one and its unreleased copies) that every rank holds, in one order.

    A copy garbage-collected on some ranks only (each collects on its own schedule) is released on
    all: the program dropped it everywhere. One all_gather_object over the world."""
    mine = {tuple(st.seq_ids): st for st in (rt.active, *rt.forks) if st is not None and not st.released}
    world = torch.distributed.get_world_size()
    seen: list = [None] * world
    torch.distributed.all_gather_object(seen, sorted(mine))
    common = set.intersection(*(set(x) for x in seen))
    for ids, st in mine.items():
        if ids not in common:
            st.released = True
            if rt.active is st:
                rt.active = None
    return [mine[ids] for ids in sorted(common)]


def _staging(rt: _Runtime, stack: ShiftParallelStack, plan: list, tokens: dict[int, int]) -> SymmetricWorkspace | None:
    """The migration's staging on the fused path (CUDA): the busiest receiver's KV rounded up to a power
    of two, at most _STAGING_BYTES (a larger migration pushes in layer groups), made or enlarged
    collectively when a plan needs more than the one held (every rank computes the same size from the
    plan); None elsewhere."""
    kv = rt.kv
    if not plan or stack.fused is None or kv is None or kv.k.device.type != "cuda":
        return None
    per_token = 2 * kv.k.shape[0] * kv.k.shape[-1] * kv.k.element_size()  # one kv head, every layer
    need = push_staging_bytes(plan, tokens, torch.distributed.get_world_size(), per_token)
    if rt.staging is None or rt.staging.buffer_bytes < min(need, _STAGING_BYTES):
        # a power of two from 1 MiB: a growing batch re-allocates (a collective rendezvous) a few times, not
        # at every switch
        size = min(_STAGING_BYTES, max(1 << 20, 1 << (need - 1).bit_length()))
        rt.staging = None  # the old one's memory back before the larger one is allocated
        rt.staging = SymmetricWorkspace(torch.distributed.group.WORLD, size)
    return rt.staging


def _migrate_live_kv(rt: _Runtime, src: ParallelLayout, dst: ParallelLayout, ctx: ParallelContext,
                     stack: ShiftParallelStack) -> tuple[int, int]:
    """Move the KV of every live sequence from `src`'s placement to `dst`'s (collective over the world):
    (bytes sent over the world, bytes this rank received). rt.kv becomes the target pool, reinterpreted
    from the same memory and grown to the same block count on every rank."""
    dims = rt.spec.decoder.dims
    replicas: dict[int, tuple[int, int]] = {}
    tokens: dict[int, int] = {}
    for st in _live_states(rt):
        rows = len(st.seq_ids)
        before = {i: d for d, block in enumerate(row_blocks(rows, src.dp)) for i in block}
        after = {i: d for d, block in enumerate(row_blocks(rows, dst.dp)) for i in block}
        for i, (seq, n) in enumerate(zip(st.seq_ids, st.cached, strict=True)):
            if n:
                replicas[seq], tokens[seq] = (before[i], after[i]), n
    rank = ctx.global_rank
    here, there = src.coords(rank).dp, dst.coords(rank).dp
    sequences = {seq: (d_src == here, d_dst == there, tokens[seq]) for seq, (d_src, d_dst) in replicas.items()}
    plan = kv_plan(src, dst, dims, replicas)
    kv, heads = rt.kv, tuple(stack.layers[0].kv_heads)
    # one block count for every rank: the largest of what the memory holds for the target heads and what the
    # target's sequences need
    bs = kv.block_size
    need = sum(-(-n // bs) for seq, (_, mine, n) in sequences.items() if mine)
    blocks = torch.tensor([max(kv.num_blocks * len(kv.kv_heads) // len(heads), need, 1)], dtype=torch.int64,
                          device=kv.k.device)  # where the world's backend reduces (NCCL: the GPU)
    torch.distributed.all_reduce(blocks, op=torch.distributed.ReduceOp.MAX)
    target, received = migrate_kv(kv, rank, plan, heads, sequences, min_blocks=int(blocks),
                                  staging=_staging(rt, stack, plan, tokens))
    element = kv.k.element_size()
    moved = sum(2 * kv.k.shape[0] * tokens[m.seq] * kv.k.shape[-1] * element for m in plan)
    rt.kv = target
    rt._gone.clear()
    for _, other in rt.stacks.values():
        if other.graphs is not None and not other.graphs.shares_memory(target):
            other.graphs = None  # captured on memory the target pool left (it grew): capture again
    return moved, received
