"""Carry out a KV reshard plan (fusedpar.layouts.reshard.kv_plan) on the paged caches of the ranks.

Each rank's paged pool keeps its memory across layouts: the target cache is the same bytes viewed
for the target's local kv heads (PagedKVCache.reinterpret: a rank caching fewer heads per token
gets proportionally more blocks, as Flying Serving scales block capacity with the TP degree; a
new pool only when those bytes hold no block of the target's heads, and a larger one when the
caller asks for more blocks than they hold).

Data path, a fixed number of device ops whatever the layers, sequences and kv heads: every index
is built on the host first (token rows of the pool: row = slot * local_heads + head index, per
layer) and copied to the device once; one row gather per peer (fusedpar.kernels.kv_rows, k and v in
one launch) collects everything a peer gets (every layer, every (sequence, head) piece in plan
order) into one contiguous chunk [2 (k | v), layers, rows, head_dim] of one send buffer, the kept
pieces into a last chunk; one all_to_all_single exchanges the chunks; one row scatter per source
writes them into fresh blocks of the target cache. Every read of the source pool happens before the first write to
the target, so the target may reinterpret the source's memory. Collective over the world (global
ranks): every rank calls it with the same plan; a plan without moves exchanges nothing.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from fusedpar.kernels.kv_rows import move_kv_rows
from fusedpar.layers.kv_cache import PagedKVCache
from fusedpar.layers.policy import StepBatch
from fusedpar.layouts.reshard import KVMove


def _token_rows(slots: torch.Tensor, heads: int, index: int) -> torch.Tensor:
    """Rows of a [layer, blocks * block_size * heads, head_dim] view holding head `index` at `slots`."""
    return slots * heads + index


def migrate_kv(cache: PagedKVCache, rank: int, plan: list[KVMove], target_heads: tuple[int, ...],
               sequences: Mapping[int, tuple[bool, bool, int]], pg: dist.ProcessGroup | None = None,
               min_blocks: int = 0) -> tuple[PagedKVCache, int]:
    """(this rank's cache for the target layout, KV bytes it received from peers).

    cache: this rank's cache in the source layout (its kv_heads: the source placement's); its
        contents are consumed (the target may reuse its memory).
    target_heads: this rank's kv heads in the target layout.
    sequences: seq -> (cached here in the source layout, cached here in the target layout, tokens):
        every live sequence of the world, the same on every rank (the plan's sequences). The target
        holds exactly the sequences cached here in the target layout, filled in increasing id order
        (identical block tables on ranks with identical pools).
    min_blocks: the target pool is grown to at least this many blocks (PagedKVCache.grow) before the
        sequences are written: a rank caching more heads per token than before (or more sequences)
        may need more than the reinterpreted memory holds; callers that want identical pools on
        every rank pass one agreed value.
    """
    target_heads = tuple(target_heads)
    layers, _, bs, h_src, hd = cache.k.shape
    h_dst = len(target_heads)
    src_index = {h: i for i, h in enumerate(cache.kv_heads)}
    dst_index = {h: j for j, h in enumerate(target_heads)}
    if not dist.is_initialized():
        group_ranks = [rank]
    else:
        group_ranks = list(range(dist.get_world_size())) if pg is None else dist.get_process_group_ranks(pg)
    place = {r: i for i, r in enumerate(group_ranks)}
    # (seq, head) pieces in plan order: per peer what this rank sends, per peer what it receives
    sends: list[list[tuple[int, int]]] = [[] for _ in group_ranks]
    recvs: list[list[tuple[int, int]]] = [[] for _ in group_ranks]
    for m in plan:
        if m.src == m.dst or not sequences[m.seq][2]:
            continue
        if m.src == rank:
            sends[place[m.dst]].append((m.seq, m.head))
        elif m.dst == rank:
            recvs[place[m.src]].append((m.seq, m.head))
    keeps = [(seq, h) for seq, (here, there, n) in sorted(sequences.items()) if here and there and n
             for h in target_heads if h in src_index]
    # source slots of every sequence this rank reads
    src_slots: dict[int, torch.Tensor] = {}
    for seq, _ in [p for chunk in sends for p in chunk] + keeps:
        if seq not in src_slots:
            n = sequences[seq][2]
            if cache.seq_len(seq) != n:
                raise RuntimeError(f"rank {rank}: the cache holds {cache.seq_len(seq)} tokens of sequence {seq}, "
                                   f"the migration says {n}")
            table = cache.block_table(seq).long()
            src_slots[seq] = (table.view(-1, 1) * bs + torch.arange(bs)).view(-1)[:n]
    # the target cache and its slots (host work only: the pool's memory is untouched so far)
    if cache.k.shape[1] * h_src < h_dst:  # the pool's memory holds no block of the target's heads
        target = PagedKVCache(num_layers=layers, kv_heads=target_heads, head_dim=hd, block_size=bs,
                              num_blocks=max(1, min_blocks), dtype=cache.k.dtype, device=cache.k.device)
    else:
        target = cache.reinterpret(target_heads)
    if min_blocks > target.num_blocks:
        target.grow(min_blocks)
    held = sorted((seq, n) for seq, (_, there, n) in sequences.items() if there and n > 0)
    problem = None
    have = {(seq, h) for seq, h in keeps} | {p for chunk in recvs for p in chunk}
    missing = [(seq, [h for h in target_heads if (seq, h) not in have]) for seq, _ in held]
    missing = [(seq, hs) for seq, hs in missing if hs]
    if missing:
        seq, hs = missing[0]
        problem = f"rank {rank}: the plan brings no KV of sequence {seq}, kv heads {hs}"
    dst_slots: dict[int, torch.Tensor] = {}
    if held and problem is None:
        try:
            slots = target.begin_step(StepBatch(tuple(s for s, _ in held), tuple(n for _, n in held),
                                                (0,) * len(held)), device="cpu")
        except RuntimeError as exc:  # out of blocks: raised after the exchange, which the peers wait for
            problem = f"rank {rank}: {exc}"
        else:
            dst_slots = dict(zip((s for s, _ in held), slots.split([n for _, n in held]), strict=True))

    def rows(pieces, slots, index, heads):
        parts = [_token_rows(slots[seq], heads, index[h]) for seq, h in pieces]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    send_idx = [rows(chunk, src_slots, src_index, h_src) for chunk in (*sends, keeps)]
    recv_n = [sum(sequences[seq][2] for seq, _ in chunk) for chunk in recvs]
    recv_idx = [] if problem else [rows(chunk, dst_slots, dst_index, h_dst) for chunk in (*recvs, keeps)]
    device = cache.k.device
    host = send_idx + recv_idx
    index = list(torch.cat(host).to(device, non_blocking=True).split([t.numel() for t in host]))  # one copy
    send_rows = [t.numel() for t in send_idx]
    # gather: chunk p = [2, layers, rows_p, hd], peers in group order, then the kept pieces
    flat = [t.view(layers, -1, hd) for t in (cache.k, cache.v)]
    send = torch.empty((2 * layers * sum(send_rows), hd), dtype=cache.k.dtype, device=device)
    chunks, pos = [], 0
    for idx, n in zip(index[:len(send_idx)], send_rows, strict=True):
        chunk = send[pos:pos + 2 * layers * n].view(2, layers, n, hd)
        move_kv_rows(*flat, idx, chunk, scatter=False)
        chunks.append(chunk)
        pos += 2 * layers * n
    out_split = [2 * layers * n for n in send_rows[:-1]]
    in_split = [2 * layers * n for n in recv_n]
    recv = torch.empty((sum(in_split), hd), dtype=cache.k.dtype, device=device)
    if plan:  # the same plan on every rank: all of them take part, or none
        dist.all_to_all_single(recv, send[:sum(out_split)], in_split, out_split, group=pg)
    if problem is not None:
        raise RuntimeError(problem)
    # scatter: every received chunk, then the kept one, into the target's fresh blocks
    pieces, pos = [], 0
    for n in recv_n:
        pieces.append(recv[pos:pos + 2 * layers * n].view(2, layers, n, hd))
        pos += 2 * layers * n
    pieces.append(chunks[-1])
    tflat = [t.view(layers, -1, hd) for t in (target.k, target.v)]
    for idx, chunk in zip(index[len(send_idx):], pieces, strict=True):
        move_kv_rows(*tflat, idx, chunk, scatter=True)
    return target, recv.numel() * recv.element_size()
