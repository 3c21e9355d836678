"""Carry out a KV reshard plan (fusedpar.layouts.reshard.kv_plan) on the paged caches of the ranks.

Each rank's paged pool keeps its memory across layouts: the target cache is the same bytes viewed
for the target's local kv heads (PagedKVCache.reinterpret: a rank caching fewer heads per token
gets proportionally more blocks, as Flying Serving scales block capacity with the TP degree; a
new pool only when those bytes hold no block of the target's heads, and a larger one when the
caller asks for more blocks than they hold).

Data path, a fixed number of device ops whatever the layers, sequences and kv heads: the row
indices (row = slot * local_heads + head index of a [layer, rows, head_dim] view of the pool) are
built on the device from the sequences' block tables, one small upload per side, so the host never
touches a token; one row gather per peer (fusedpar.kernels.kv_rows, k and v in one launch) collects
everything a peer gets (every layer, every (sequence, head) piece in plan order) into one contiguous
chunk [2 (k | v), layers, rows, head_dim] of one send buffer, the kept pieces into a last chunk; one
all_to_all_single exchanges the chunks; one row scatter per source writes them into fresh blocks of
the target cache. Every read of the source pool happens before the first write to the target, so the
target may reinterpret the source's memory. Collective over the world (global ranks): every rank
calls it with the same plan; a plan without moves exchanges nothing.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from fusedpar.kernels.kv_rows import move_kv_rows
from fusedpar.layers.kv_cache import PagedKVCache
from fusedpar.layers.policy import StepBatch
from fusedpar.layouts.reshard import KVMove


def _row_index(chunks: list[list[tuple[int, int]]], tables: Mapping[int, torch.Tensor], tokens: Mapping[int, int],
               heads: int, index_of: Mapping[int, int], block_size: int, device: torch.device) -> list[torch.Tensor]:
    """Per chunk of (seq, head) pieces: the rows of a [layer, blocks * block_size * heads, head_dim] pool
    view holding every piece's tokens (row = slot * heads + index_of[head], slot from the sequence's
    block table), pieces in chunk order, tokens in position order. Built on `device` from one upload of
    the block tables and one (table, head, tokens) triple per piece: the host never touches a token."""
    pieces = [p for chunk in chunks for p in chunk]
    sizes = [sum(tokens[seq] for seq, _ in chunk) for chunk in chunks]
    if not pieces:
        return [torch.empty(0, dtype=torch.int64, device=device) for _ in chunks]
    seqs = sorted({seq for seq, _ in pieces})
    slot_of = {seq: i for i, seq in enumerate(seqs)}
    width = max(-(-tokens[seq] // block_size) for seq in seqs)
    table = torch.zeros((len(seqs), width), dtype=torch.int64)
    for seq in seqs:
        t = tables[seq][: -(-tokens[seq] // block_size)]
        table[slot_of[seq], :t.numel()] = t
    meta = torch.tensor([(slot_of[seq], index_of[h], tokens[seq]) for seq, h in pieces], dtype=torch.int64)
    host = torch.cat([table.view(-1), meta.view(-1)])
    dev = host.to(device, non_blocking=True)  # one copy
    table, meta = dev[:table.numel()].view(table.shape), dev[table.numel():].view(-1, 3)
    total = sum(sizes)
    counts = meta[:, 2]
    piece = torch.repeat_interleave(torch.arange(len(pieces), device=device), counts, output_size=total)
    pos = torch.arange(total, device=device) - (torch.cumsum(counts, 0) - counts)[piece]
    slots = table[meta[piece, 0], pos // block_size] * block_size + pos % block_size
    return list((slots * heads + meta[piece, 1]).split(sizes))


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
    # every sequence this rank reads must hold what the migration says
    for seq in sorted({seq for chunk in (*sends, keeps) for seq, _ in chunk}):
        n = sequences[seq][2]
        if cache.seq_len(seq) != n:
            raise RuntimeError(f"rank {rank}: the cache holds {cache.seq_len(seq)} tokens of sequence {seq}, "
                               f"the migration says {n}")
    # the target cache and its blocks (host work only: the pool's memory is untouched so far)
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
    if held and problem is None:
        try:
            target.reserve(StepBatch(tuple(s for s, _ in held), tuple(n for _, n in held), (0,) * len(held)))
        except RuntimeError as exc:  # out of blocks: raised after the exchange, which the peers wait for
            problem = f"rank {rank}: {exc}"

    device = cache.k.device
    tokens = {seq: n for seq, (_, _, n) in sequences.items()}
    send_idx = _row_index([*sends, keeps], {seq: cache.block_table(seq) for chunk in (*sends, keeps)
                                            for seq, _ in chunk}, tokens, h_src, src_index, bs, device)
    recv_n = [sum(sequences[seq][2] for seq, _ in chunk) for chunk in recvs]
    recv_idx = [] if problem else _row_index([*recvs, keeps], {seq: target.block_table(seq) for seq, _ in held},
                                             tokens, h_dst, dst_index, bs, device)
    index = send_idx + recv_idx
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
