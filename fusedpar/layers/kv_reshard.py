"""Carry out a KV reshard plan (fusedpar.layouts.reshard_plan.kv_plan) on the paged caches of the ranks.

Each rank's paged pool keeps its memory across layouts: the target cache is the same bytes viewed
for the target's local kv heads (PagedKVCache.reinterpret: a rank caching fewer heads per token
gets proportionally more blocks, as Flying Serving scales block capacity with the TP degree; a
new pool only when those bytes hold no block of the target's heads, and a larger one when the
caller asks for more blocks than they hold).

Data path: per layer group, one gather, one exchange and one scatter, whatever the peers, sequences
and kv heads. The row indices (row = slot * local_heads + head index of a [layer, rows, head_dim]
view of the pool) are built on the device (fusedpar.kernels.kv_rows.paged_rows) from the sequences'
block tables and one line per (sequence, head) piece, uploaded in one pinned copy per side, so the
host never touches a token. The layers are moved in groups (about _GROUP_BYTES of the plan's KV per
rank each, at most _MAX_GROUPS, the first and the last half the size of the others, whose gather and
scatter nothing hides; the same groups on every rank). Each group has one row-major buffer [rows,
group layers, 2 (k | v), 1, head_dim], so that each peer's rows are one contiguous split:

    [ sent (peers in group order, pieces in plan order) | kept | received (sources in group order) ]

one row gather (fusedpar.kernels.kv_rows, k and v in one launch) fills sent and kept, one
asynchronous all_to_all_single fills received, and one row scatter writes kept and received into
fresh blocks of the target cache once the exchange is done. The device starts before the host has
planned the target: the send side's rows, then the first two groups' gathers and exchanges, are
issued first; the target cache, its blocks and its rows are set up while they run. Group g's
scatter is issued after group g + 1's gather, so that group g + 1's exchange runs beside it. A layer
of the source pool is read before the first write to that layer of the target, so the target may
reinterpret the source's memory (reinterpret keeps every layer in its own bytes). Collective over
the world (global ranks): every rank calls it with the same plan; a plan without moves exchanges
nothing.

Through a staging (a SymmetricWorkspace the caller builds once, peer-addressable over NVLink) the rows take
one pass instead of three: per layer group, one push (fusedpar.kernels.kv_rows.push_kv_rows) stores every
row this rank sends straight from its pool into its receiver's staging (senders in group order, pieces in
plan order: the offsets follow from the plan, the same on every rank) and the kept rows into a local buffer;
a device barrier; two scatters into the target's blocks. The row moves and an all-to-all share the HBM: run
side by side, each slows the other about as much as it hides, so the push's single pass is what shortens the
migration. _PUSH_GROUPS groups when the staging holds the busiest receiver's KV, each in its own region of
it (one: at two GPUs the host issues more groups slower than the device runs them; perf/bench_reshard.py,
perf/results/reshard.json); where it is short, as few groups as fit half of it each, the halves alternating.
Several groups: the pushes and barriers go on a high-priority stream, every push into a fresh region before
the host plans the target, and group g's scatters run on the caller's stream beside the later pushes; a push
into a region a group used before waits until every rank has scattered that group (its stream waits for this
rank's scatter, then a barrier). A barrier before the first push keeps an earlier migration's scatters safe.
Every barrier has the world's timeout: a peer that never arrives ends the process with a CUDA error instead
of a hang.
"""

from __future__ import annotations

import contextlib
from array import array
from collections.abc import Mapping
from itertools import accumulate, pairwise

import torch
import torch.distributed as dist

from fusedpar.collectives.symmetric import SymmetricWorkspace
from fusedpar.kernels.kv_rows import move_kv_rows, paged_rows, push_kv_rows
from fusedpar.layers.kv_cache import PagedKVCache, upload
from fusedpar.layers.step_plan import StepBatch
from fusedpar.layouts.reshard_plan import KVMove

# KV bytes (of the whole plan, per rank on average) per layer group of a migration, and the most groups
_GROUP_BYTES = 32 << 20
_MAX_GROUPS = 4
# layer groups of a migration through a staging at least (more where the staging is short)
_PUSH_GROUPS = 1


def _row_index(sides: list[tuple[list[list[tuple[int, int]]], Mapping[int, list[int]], int, Mapping[int, int]]],
               tokens: Mapping[int, int], block_size: int, device: torch.device,
               extra: list[int] | None = None) -> list[torch.Tensor]:
    """Per side (chunks of (seq, head) pieces, the sequences' block tables, local kv heads, head -> local
    index): one tensor of the rows of a [layer, blocks * block_size * heads, head_dim] pool view holding
    every piece's tokens (row = slot * heads + index_of[head], slot from the block table), chunks
    in order, pieces in chunk order, tokens in position order, on `device`. One pinned upload of the
    block tables and one line per piece for all sides, then one fusedpar.kernels.kv_rows.paged_rows
    launch per side: the host never touches a token. extra: more int64 values for the device, uploaded
    in the same copy and returned after the sides' tensors."""
    host: list[int] = list(extra or ())
    launches = []
    total = 0
    for chunks, tables, heads, index_of in sides:
        pieces = [p for chunk in chunks for p in chunk]
        seqs = sorted({seq for seq, _ in pieces})
        nb = {seq: -(-tokens[seq] // block_size) for seq in seqs}
        width = max(nb.values(), default=1)
        t_off = len(host)
        for seq in seqs:
            host += [*tables[seq][:nb[seq]], *([0] * (width - nb[seq]))]
        p_off, slot_of, first = len(host), {seq: i for i, seq in enumerate(seqs)}, total
        for seq, h in pieces:
            host += [slot_of[seq], index_of[h], tokens[seq], total]
            total += tokens[seq]
        launches.append((t_off, len(seqs), width, p_off, len(pieces), heads, first, total,
                         max((tokens[seq] for seq in seqs), default=0)))
    # array -> tensor: a C loop over the ints (torch.tensor(list) inspects each one, which is slower)
    flat = upload(torch.frombuffer(array("q", host), dtype=torch.int64) if host else torch.empty(0, dtype=torch.int64),
                  device)
    rows = torch.empty(total, dtype=torch.int64, device=device)
    out = []
    for t_off, n_seqs, width, p_off, n_pieces, heads, first, end, longest in launches:
        paged_rows(flat[t_off:t_off + n_seqs * width].view(n_seqs, width), flat[p_off:p_off + 4 * n_pieces].view(-1, 4),
                   rows, block_size=block_size, heads=heads, max_tokens=longest)
        out.append(rows[first:end])
    return out if extra is None else [*out, flat[:len(extra)]]


def migrate_kv(cache: PagedKVCache, rank: int, plan: list[KVMove], target_heads: tuple[int, ...],
               sequences: Mapping[int, tuple[bool, bool, int]], pg: dist.ProcessGroup | None = None,
               min_blocks: int = 0, staging: SymmetricWorkspace | None = None) -> tuple[PagedKVCache, int]:
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
    staging: peer-addressable memory over the same ranks (fusedpar.collectives.SymmetricWorkspace, built
        once by the caller): the rows go straight from each sender's pool into their receiver's staging
        (push_kv_rows, NVLink stores) instead of through an all-to-all, in as few layer groups as it
        holds. None, or a staging whose half holds no layer of the busiest receiver's KV: the
        all-to-all.
    """
    target_heads = tuple(target_heads)
    layers, _, bs, h_src, hd = cache.k.shape
    h_dst = len(target_heads)
    src_index = {h: i for i, h in enumerate(cache.kv_heads)}
    dst_index = {h: j for j, h in enumerate(target_heads)}
    if staging is not None:  # its ranks: no lookup on the way to the first push
        group_ranks = list(staging.ranks)
        if pg is not None and dist.get_process_group_ranks(pg) != group_ranks:
            raise ValueError(f"migrate_kv: the staging spans ranks {group_ranks}, the process group "
                             f"{dist.get_process_group_ranks(pg)}")
    elif not dist.is_initialized():
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
    tokens = {seq: n for seq, (_, _, n) in sequences.items()}
    if staging is not None and plan:
        done = _migrate_by_push(cache, rank, plan, target_heads, sequences, min_blocks, staging, group_ranks,
                                (sends, recvs, keeps), tokens)
        if done is not None:
            return done
    device = cache.k.device
    n_sent = [sum(tokens[seq] for seq, _ in chunk) for chunk in sends]
    n_recv = [sum(tokens[seq] for seq, _ in chunk) for chunk in recvs]
    n_keep = sum(tokens[seq] for seq, _ in keeps)
    sent, rows = sum(n_sent), sum(n_sent) + n_keep + sum(n_recv)
    per_token = 2 * layers * hd * cache.k.element_size()  # one (sequence, kv head) token, every layer
    moved = sum(tokens[m.seq] for m in plan if m.src != m.dst) * per_token // len(group_ranks)
    groups = _layer_groups(layers, moved)
    flat = [t.view(layers, -1, hd) for t in (cache.k, cache.v)]
    # device work first: the send side's rows, then the first groups' gathers and exchanges
    gather_idx = _row_index([([*sends, keeps], {seq: cache.block_tables[seq] for chunk in (*sends, keeps)
                                                for seq, _ in chunk}, h_src, src_index)], tokens, bs, device)[0]
    received, issued = 0, []

    def issue(l0: int, l1: int) -> None:
        nonlocal received
        buf = torch.empty((rows, l1 - l0, 2, 1, hd), dtype=cache.k.dtype, device=device)
        move_kv_rows(flat[0][l0:l1], flat[1][l0:l1], gather_idx, buf[:sent + n_keep], scatter=False)
        work = None
        if plan:  # the same plan on every rank: all of them take part, or none
            per_row = 2 * (l1 - l0)
            work = dist.all_to_all_single(buf[sent + n_keep:].view(-1, hd), buf[:sent].view(-1, hd),
                                          [per_row * n for n in n_recv], [per_row * n for n in n_sent],
                                          group=pg, async_op=True)
            received += sum(n_recv) * per_row * hd * buf.element_size()
        issued.append((work, buf, l0, l1))

    for l0, l1 in groups[:2]:
        issue(l0, l1)
    # the target (host work, while the first exchanges run; its memory is written only by the scatters)
    target, held, problem = _target(cache, rank, target_heads, sequences, min_blocks, keeps, recvs)
    scatter_idx = None
    if problem is None:  # the target's rows of the buffers' tail: kept pieces, then received ones
        scatter_idx = _row_index([([keeps, *recvs], {seq: target.block_tables[seq] for seq, _ in held}, h_dst,
                                   dst_index)], tokens, bs, device)[0]
    tflat = [t.view(layers, -1, hd) for t in (target.k, target.v)]
    for l0, l1 in groups[2:]:
        issue(l0, l1)  # group g's gather and exchange, then group g - 2's scatter
        _scatter(issued.pop(0), tflat, scatter_idx, sent)
    while issued:
        _scatter(issued.pop(0), tflat, scatter_idx, sent)
    if problem is not None:
        raise RuntimeError(problem)
    return target, received


def _target(cache: PagedKVCache, rank: int, target_heads: tuple[int, ...],
            sequences: Mapping[int, tuple[bool, bool, int]], min_blocks: int, keeps: list[tuple[int, int]],
            recvs: list[list[tuple[int, int]]]) -> tuple[PagedKVCache, list[tuple[int, int]], str | None]:
    """(the target cache with the held sequences' blocks reserved, (seq, tokens) it holds, the problem
    that makes it unusable or None). Host work only: the pool's memory is untouched."""
    layers, _, bs, h_src, hd = cache.k.shape
    if cache.k.shape[1] * h_src < len(target_heads):  # the pool's memory holds no block of the target's heads
        target = PagedKVCache(num_layers=layers, kv_heads=target_heads, head_dim=hd, block_size=bs,
                              num_blocks=max(1, min_blocks), dtype=cache.k.dtype, device=cache.k.device)
    else:
        target = cache.reinterpret(target_heads)
    if min_blocks > target.num_blocks:
        target.grow(min_blocks)
    held = sorted((seq, n) for seq, (_, there, n) in sequences.items() if there and n > 0)
    have = {(seq, h) for seq, h in keeps} | {p for chunk in recvs for p in chunk}
    missing = [(seq, [h for h in target_heads if (seq, h) not in have]) for seq, _ in held]
    missing = [(seq, hs) for seq, hs in missing if hs]
    if missing:
        seq, hs = missing[0]
        return target, held, f"rank {rank}: the plan brings no KV of sequence {seq}, kv heads {hs}"
    if held:
        try:
            target.reserve(StepBatch(tuple(s for s, _ in held), tuple(n for _, n in held), (0,) * len(held)))
        except RuntimeError as exc:  # out of blocks: raised after the exchange, which the peers wait for
            return target, held, f"rank {rank}: {exc}"
    return target, held, None


def push_staging_bytes(plan: list[KVMove], tokens: Mapping[int, int], world: int, per_token: int) -> int:
    """Bytes a staging needs per rank for migrate_kv to push `plan` in one group: the busiest receiver's
    rows (ranks 0 .. world - 1) at per_token bytes each (2 * layers * head_dim * element size)."""
    return per_token * max(sum(tokens[m.seq] for m in plan if m.dst == r and m.src != r) for r in range(world))


def _migrate_by_push(cache: PagedKVCache, rank: int, plan: list[KVMove], target_heads: tuple[int, ...],
                     sequences: Mapping[int, tuple[bool, bool, int]], min_blocks: int, staging: SymmetricWorkspace,
                     group_ranks: list[int], pieces: tuple,
                     tokens: Mapping[int, int]) -> tuple[PagedKVCache, int] | None:
    """migrate_kv through `staging` (module docstring): per layer group one push, one device barrier and
    two scatters. None, before any device work, when half the staging holds no layer of the busiest
    receiver's KV (the same answer on every rank: the plan is)."""
    sends, recvs, keeps = pieces
    layers, _, bs, h_src, hd = cache.k.shape
    world, me = len(group_ranks), group_ranks.index(rank)
    place = {r: i for i, r in enumerate(group_ranks)}
    counts = [[0] * world for _ in range(world)]  # counts[q][p]: rows q sends p, the same on every rank
    for m in plan:
        if m.src != m.dst:
            counts[place[m.src]][place[m.dst]] += tokens[m.seq]
    elt = cache.k.element_size()
    per_layer = max(sum(c[p] for c in counts) for p in range(world)) * 2 * hd * elt  # the busiest receiver
    split = _push_groups(layers, per_layer, staging.buffer_bytes)
    if split is None:  # half the staging holds no layer of the busiest receiver's KV: the all-to-all
        return None
    groups, regions, reuse = split
    # the peers are done with the staging (an earlier migration's scatters); issued first, so that the
    # device waits for the slowest peer while this host builds the push
    staging.barrier()
    n_keep = sum(tokens[seq] for seq, _ in keeps)
    keep_buf = torch.empty(n_keep * layers * 2 * hd, dtype=cache.k.dtype, device=cache.k.device)
    # push order: destination after destination, this rank's own slot holding the kept pieces
    chunks = [keeps if p == me else sends[p] for p in range(world)]
    bounds = list(accumulate((sum(tokens[seq] for seq, _ in c) for c in chunks), initial=0))
    offs = [0 if p == me else sum(counts[q][p] for q in range(me)) for p in range(world)]
    addrs = staging.peer_addresses()
    meta = []
    for g, (l0, _) in enumerate(groups):
        ptrs = [keep_buf.data_ptr() + n_keep * l0 * 2 * hd * elt if p == me else addrs[p] + regions[g]
                for p in range(world)]
        meta += [*ptrs, *bounds, *offs]
    m = 3 * world + 1  # meta values per group
    if any(x % 16 for g in range(len(groups)) for x in meta[g * m:g * m + world]):  # 16-byte stores
        raise RuntimeError(f"migrate_kv: a staging or keep buffer address is not 16-byte aligned: {meta}")
    tables = {seq: cache.block_tables[seq] for chunk in chunks for seq, _ in chunk}
    push_idx, meta_dev = _row_index([(chunks, tables, h_src, {h: i for i, h in enumerate(cache.kv_heads)})],
                                    tokens, bs, cache.k.device, extra=meta)
    flat = [t.view(layers, -1, hd) for t in (cache.k, cache.v)]
    n_recv = sum(counts[q][me] for q in range(world))
    staged = staging.view(cache.k.dtype)
    # several groups (CUDA): the pushes and barriers on a high-priority stream, the scatters on the caller's, so
    # that group g's scatter runs beside the later pushes and never holds up a barrier the peers wait on
    main = torch.cuda.current_stream(cache.k.device) if cache.k.is_cuda and len(groups) > 1 else None
    hi = torch.cuda.Stream(cache.k.device, priority=-1) if main is not None else None
    on_hi = torch.cuda.stream(hi) if hi is not None else contextlib.nullcontext()
    landed: list = []  # per group: its rows are in their receivers' stagings
    scattered: list = []  # per group: its received rows are scattered (its staging region is free again)
    if hi is not None:
        hi.wait_stream(main)  # the caller's work on the pool, the push's index

    def push(g: int) -> None:
        l0, l1 = groups[g]
        with on_hi:
            if reuse[g] is not None:  # a region reused: every rank has scattered what it held
                if hi is not None:
                    hi.wait_event(scattered[reuse[g]])
                staging.barrier()
            push_kv_rows(flat[0][l0:l1], flat[1][l0:l1], push_idx, meta_dev[g * m:(g + 1) * m], world=world)
            staging.barrier()  # every push of group g has landed in its receiver's staging
            landed.append(hi.record_event() if hi is not None else None)

    # every push into a fresh region goes out before the host plans the target
    pushed = 0
    while pushed < len(groups) and reuse[pushed] is None:
        push(pushed)
        pushed += 1
    # the target (host work, while the pushes run; its memory is written only by the scatters)
    target, held, problem = _target(cache, rank, target_heads, sequences, min_blocks, keeps, recvs)
    recv_idx = keep_idx = None
    if problem is None:
        idx = _row_index([([*recvs, keeps], {seq: target.block_tables[seq] for seq, _ in held}, len(target_heads),
                           {h: j for j, h in enumerate(target_heads)})], tokens, bs, cache.k.device)[0]
        recv_idx, keep_idx = idx.split([n_recv, n_keep])
    tflat = [t.view(layers, -1, hd) for t in (target.k, target.v)]
    for g, (l0, l1) in enumerate(groups):
        if main is not None:
            main.wait_event(landed[g])
        if problem is None:
            lg, at = l1 - l0, regions[g] // elt
            recv = staged[at:at + n_recv * lg * 2 * hd].view(n_recv, lg, 2, 1, hd)
            keep = keep_buf[n_keep * l0 * 2 * hd:n_keep * l1 * 2 * hd].view(n_keep, lg, 2, 1, hd)
            move_kv_rows(tflat[0][l0:l1], tflat[1][l0:l1], recv_idx, recv, scatter=True)
            move_kv_rows(tflat[0][l0:l1], tflat[1][l0:l1], keep_idx, keep, scatter=True)
        scattered.append(main.record_event() if main is not None else None)
        while pushed < len(groups) and reuse[pushed] <= g:  # their regions' readers are done here
            push(pushed)
            pushed += 1
    if problem is not None:
        raise RuntimeError(problem)
    return target, n_recv * layers * 2 * hd * elt


def _push_groups(layers: int, per_layer: int,
                 capacity: int) -> tuple[list[tuple[int, int]], list[int], list[int | None]] | None:
    """([l0, l1) layer ranges, their byte offsets in the staging, the earlier group whose region each one
    reuses or None) for received rows of per_layer bytes per layer; None when half the staging holds no
    layer. _PUSH_GROUPS groups (at most one per layer) each in its own region when all of them fit the
    staging; else as few groups as fit half of it each, alternating between its halves, so that one
    group's push runs while the other half's rows are still being read."""
    g = min(layers, max(1, _PUSH_GROUPS))
    if per_layer * layers <= capacity:
        groups = list(pairwise(layers * i // g for i in range(g + 1)))
        regions = [0]  # each group's rows after the last one's, 256-byte aligned
        for l0, l1 in groups[:-1]:
            regions.append(-(-(regions[-1] + (l1 - l0) * per_layer) // 256) * 256)
        if regions[-1] + (groups[-1][1] - groups[-1][0]) * per_layer <= capacity:
            return groups, regions, [None] * g
    half = capacity // 2 // 256 * 256
    most = half // max(per_layer, 1)
    if most < 1:
        return None
    g = max(g, -(-layers // most), 2)
    groups = list(pairwise(layers * i // g for i in range(g + 1)))
    return groups, [half * (i % 2) for i in range(g)], [i - 2 if i > 1 else None for i in range(g)]


def _layer_groups(layers: int, nbytes: int) -> list[tuple[int, int]]:
    """[l0, l1) ranges of consecutive layers, about _GROUP_BYTES of nbytes each (at most _MAX_GROUPS, at
    least one layer), the first and the last of three or more groups half the size of the others: the
    migration pipelines its gathers, exchanges and scatters over them, and only the first gather and
    the last scatter run beside no exchange."""
    g = max(1, min(layers, _MAX_GROUPS, nbytes // _GROUP_BYTES))
    weights = [1] + [2] * (g - 2) + [1] if g > 2 else [1] * g
    bounds = [0]
    for i, upto in enumerate(accumulate(weights), 1):  # at least one layer per group, the rest after it
        bounds.append(max(bounds[-1] + 1, min(layers - (g - i), round(layers * upto / sum(weights)))))
    return list(pairwise(bounds))


def _scatter(group: tuple, tflat: list[torch.Tensor], idx: torch.Tensor | None, sent: int) -> None:
    """Wait for one layer group's exchange, then write the buffer's kept and received rows into layers
    [l0, l1) of the target's fresh blocks (idx None: only wait)."""
    work, buf, l0, l1 = group
    if work is not None:
        work.wait()
    if idx is not None:
        move_kv_rows(tflat[0][l0:l1], tflat[1][l0:l1], idx, buf[sent:], scatter=True)
