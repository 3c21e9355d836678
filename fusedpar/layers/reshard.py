"""Carry out a KV reshard plan (fusedpar.layouts.reshard.kv_plan) on the paged caches of the ranks.

Each rank's paged pool keeps its memory across layouts: the target cache is the same bytes viewed
for the target's local kv heads (PagedKVCache.reinterpret: a rank caching fewer heads per token
gets proportionally more blocks, as Flying Serving scales block capacity with the TP degree; a
new pool only when those bytes hold no block of the target's heads, and a larger one when the
caller asks for more blocks than they hold). The live sequences' KV is staged first (each rank's
own heads, and the heads it sends), exchanged in one point-to-point message per pair of ranks
(its pieces in plan order on both sides), then written into fresh blocks of the target cache.
Collective over the world (global ranks): every rank calls it with the same plan.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from fusedpar.layers.kv_cache import PagedKVCache
from fusedpar.layouts.reshard import KVMove


def migrate_kv(cache: PagedKVCache, rank: int, plan: list[KVMove], target_heads: tuple[int, ...],
               sequences: Mapping[int, tuple[bool, bool, int]], pg: dist.ProcessGroup | None = None,
               min_blocks: int = 0) -> tuple[PagedKVCache, int]:
    """(this rank's cache for the target layout, KV bytes it received).

    cache: this rank's cache in the source layout (its kv_heads: the source placement's).
    target_heads: this rank's kv heads in the target layout.
    sequences: seq -> (cached here in the source layout, cached here in the target layout, tokens):
        every live sequence of the world, the same on every rank (the plan's sequences).
    min_blocks: the target pool is grown to at least this many blocks (PagedKVCache.grow) before the
        sequences are written: a rank caching more heads per token than before (or more sequences)
        may need more than the reinterpreted memory holds; callers that want identical pools on
        every rank pass one agreed value.
    """
    layers, hd = cache.k.shape[0], cache.k.shape[-1]
    src_index = {h: i for i, h in enumerate(cache.kv_heads)}
    staged: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (seq, head) -> k, v [L, n, hd]
    needed = {(m.seq, m.head) for m in plan if m.src == rank}
    for seq, (here, there, _) in sequences.items():
        if not here:
            continue
        ks, vs = zip(*(cache.gather(layer, seq) for layer in range(layers)), strict=True)
        k, v = torch.stack(ks), torch.stack(vs)  # [L, n, h_src, hd]
        for h, i in src_index.items():
            if (there and h in target_heads) or (seq, h) in needed:
                staged[(seq, h)] = (k[:, :, i].clone(), v[:, :, i].clone())
    # one message per peer and direction: every (seq, head) k | v the plan sends from this rank to a
    # peer, flattened in plan order; the receiver cuts its buffer in the same order
    outgoing: dict[int, list[torch.Tensor]] = {}
    incoming: dict[int, list[tuple[int, int, int]]] = {}  # src -> (seq, head, tokens) in plan order
    for m in plan:
        if m.src == rank:
            k, v = staged[(m.seq, m.head)]
            outgoing.setdefault(m.dst, []).extend((k.reshape(-1), v.reshape(-1)))
        elif m.dst == rank:
            incoming.setdefault(m.src, []).append((m.seq, m.head, sequences[m.seq][2]))
    ops, buffers, received = [], {}, 0
    for dst, parts in sorted(outgoing.items()):
        ops.append(dist.P2POp(dist.isend, torch.cat(parts), dst, group=pg))
    for src, items in sorted(incoming.items()):
        buf = torch.empty(sum(2 * layers * n * hd for _, _, n in items), dtype=cache.k.dtype, device=cache.k.device)
        buffers[src] = buf
        ops.append(dist.P2POp(dist.irecv, buf, src, group=pg))
        received += buf.numel() * buf.element_size()
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for src, items in incoming.items():
        pos, buf = 0, buffers[src]
        for seq, head, n in items:
            size = layers * n * hd
            k = buf[pos:pos + size].view(layers, n, hd)
            v = buf[pos + size:pos + 2 * size].view(layers, n, hd)
            staged[(seq, head)] = (k, v)
            pos += 2 * size
    _, blocks, bs, h_old, _ = cache.k.shape
    if blocks * h_old < len(target_heads):  # the pool's memory holds no block of the target's heads
        target = PagedKVCache(num_layers=layers, kv_heads=tuple(target_heads), head_dim=hd, block_size=bs,
                              num_blocks=max(1, min_blocks), dtype=cache.k.dtype, device=cache.k.device)
    else:
        target = cache.reinterpret(tuple(target_heads))
    if min_blocks > target.num_blocks:
        target.grow(min_blocks)
    for seq, (_, there, _) in sorted(sequences.items()):
        if not there:
            continue
        missing = [h for h in target_heads if (seq, h) not in staged]
        if missing:
            raise RuntimeError(f"rank {rank}: the plan brings no KV of sequence {seq}, kv heads {missing}")
        k = torch.stack([staged[(seq, h)][0] for h in target_heads], dim=2)  # [L, n, h_dst, hd]
        v = torch.stack([staged[(seq, h)][1] for h in target_heads], dim=2)
        target.fill(seq, k, v)
    return target, received
