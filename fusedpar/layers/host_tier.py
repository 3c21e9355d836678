"""Host KV tier: swapped-out sequences' KV in host memory, in an order that no layout depends on.

Tiered KV buffering (Seesaw) for layouts that change: a sequence swapped out under layout A and
swapped in under layout B arrives on B's ranks exactly as a prefill in B would have cached it, so
the re-sharding of its KV happens on the way through the host.

Storage, per rank: one preallocated pool [num_blocks, layers, 2 (k | v), block_size, head_dim] in
the caches' dtype, pinned when the caches live on CUDA (plain memory on CPU), with its own block
allocator (lowest free ids first). One pool block holds block_size consecutive tokens of ONE kv head
of one sequence, for every layer, k and v. Kv head h of an n-token sequence takes
nb = ceil(n / block_size) blocks; its token t is row t % block_size of its block t // block_size;
rows past n in its last block are zero. Per sequence the order is therefore
[kv head, token block, layer, k | v, token in block, head_dim]: no rank, TP shard or SP split
appears in it, and the host copy is the same whichever layout wrote it.

Ownership: each kv head of a swapped-out sequence is kept once on the node, by its writer: the
rank of the sequence's replica that caches it, or, where several do (kv-head replication,
P = sp * tp > h_kv), holders[seq % len(holders)] of them in rank order, so replicated heads spread
over the ranks' pools. Host memory is thus ONE copy of the KV over all ranks of the node,
    2 * layers * h_kv * nb * block_size * head_dim * itemsize bytes per sequence,
split over the ranks by the heads they write; nothing is duplicated. The price: swap_in under a
layout that puts a head on another rank fetches it from its writer, point to point over the
process group (gloo with CPU tensors, NCCL through the writer's device on GPU).

Directory: every rank keeps the same directory, seq -> (tokens, writer of each kv head). It is
computed, never exchanged: swap_out, swap_in and drop are called by every rank of the world with the
same arguments (ranks outside a sequence's replica only update their directory). So every rank
knows every rank's pool use, and a host capacity error is raised on every rank alike, before
anything changes. swap_in is collective (its transfers, and an agreement on the target caches'
room); swap_out and drop exchange nothing.

Streams (CUDA): swap_out gathers the sequence's blocks from the paged cache into a device staging
tensor on the current stream (later writes into the freed blocks are ordered after the gather),
frees the blocks, and copies the staging tensor into the pinned pool on the tier's side stream.
swap_in runs on the side stream after all work issued before it on the current stream: host ->
device copies, the transfers, the writes into fresh blocks of the target cache; its agreement (one
all-reduce of a flag, world > 1) also runs there, so the host waits for the tier's earlier copies
but never for the compute stream (small index tensors travel through pinned memory: no copy from
pageable memory makes the host wait for a stream). Both return a SwapHandle: wait() makes the
current stream wait for the copies (call it before a step reads a swapped-in sequence),
synchronize() blocks the host until they finished, ready() polls. All the tier's copies run on its
one side stream, so a pool block freed by swap_in and handed to a later swap_out is written only
after it was read; host reads of the pool (read) wait for every pending copy. On CPU everything
runs synchronously and the handles are done on return.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fusedpar.kernels.kv_rows import move_kv_rows
from fusedpar.layers.kv_cache import PagedKVCache, upload
from fusedpar.layers.step_plan import StepBatch
from fusedpar.layouts import ParallelLayout, StepMode


class SwapHandle:
    """The copies of one swap_out / swap_in: done on return on CPU, a CUDA event on GPU."""

    def __init__(self, event: torch.cuda.Event | None = None, device: torch.device | None = None):
        self._event, self._device = event, device

    def ready(self) -> bool:
        """True once every copy of the swap has finished (never blocks)."""
        return self._event is None or self._event.query()

    def wait(self) -> None:
        """Make the current stream wait for the swap's copies (host does not block)."""
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)

    def synchronize(self) -> None:
        """Block the host until the swap's copies finished."""
        if self._event is not None:
            self._event.synchronize()


@dataclass(frozen=True)
class _Entry:
    tokens: int
    writers: dict[int, int]  # kv head -> the rank keeping it


def _token_rows(table: torch.Tensor, block_size: int, tokens: torch.Tensor) -> torch.Tensor:
    """The paged-cache slots of `tokens` of a sequence with block table `table` (int64, host)."""
    return table.long()[tokens // block_size] * block_size + tokens % block_size


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(position in ids, first id, count) of each run of consecutive ids."""
    out: list[tuple[int, int, int]] = []
    for i, b in enumerate(ids):
        if out and out[-1][1] + out[-1][2] == b:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((i, b, 1))
    return out


class HostKVTier:
    """One rank's part of the node's host KV tier (see the module docstring for layout and contract).

    rank, world_size: this rank in the world the layouts cover (global numbering, as `pg` has it).
    num_q_heads, num_kv_heads: the model's, to place heads per layout (ParallelLayout.head_placement).
    num_blocks, block_size: this rank's pool; every rank of the world must pass the same values.
    device: where the paged caches live (the pool is pinned host memory if it is CUDA).
    pg: the world's process group for swap_in (None: the default group).
    """

    def __init__(self, *, rank: int, world_size: int, num_layers: int, num_q_heads: int, num_kv_heads: int,
                 head_dim: int, block_size: int, num_blocks: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", pg: dist.ProcessGroup | None = None):
        for name, v in (("world_size", world_size), ("num_layers", num_layers), ("num_q_heads", num_q_heads),
                        ("num_kv_heads", num_kv_heads), ("head_dim", head_dim), ("block_size", block_size),
                        ("num_blocks", num_blocks)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"HostKVTier {name} must be an int >= 1, got {v!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"HostKVTier rank must be an int in [0, {world_size}), got {rank!r}")
        self.rank, self.world_size = rank, world_size
        self.num_layers, self.head_dim, self.block_size, self.num_blocks = num_layers, head_dim, block_size, num_blocks
        self.num_q_heads, self.num_kv_heads = num_q_heads, num_kv_heads
        device = torch.device(device)
        cuda = device.type == "cuda"
        if cuda and device.index is None:  # the caches' tensors name their index: compare like with like
            device = torch.device("cuda", torch.cuda.current_device())
        self.dtype, self.device, self.pg = dtype, device, pg
        self.pool = torch.zeros((num_blocks, num_layers, 2, block_size, head_dim), dtype=dtype, pin_memory=cuda)
        self._free = list(range(num_blocks))  # a heap: the lowest free ids first
        self._kept: dict[tuple[int, int], list[int]] = {}  # (seq, kv head) -> pool blocks, heads this rank writes
        self._dir: dict[int, _Entry] = {}
        self._used = [0] * world_size  # pool blocks in use per rank, from the directory
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self._last: torch.cuda.Event | None = None  # the latest side-stream work on the pool

    # ---- sizes and queries ------------------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        return self.num_layers * 2 * self.block_size * self.head_dim * self.pool.element_size()

    def blocks_for(self, tokens: int) -> int:
        """Pool blocks one kv head of a `tokens`-token sequence takes."""
        return -(-tokens // self.block_size)

    def free_blocks(self, rank: int | None = None) -> int:
        """Free pool blocks of `rank` (default: this rank), from the shared directory."""
        return self.num_blocks - self._used[self.rank if rank is None else rank]

    def holds(self, seq: int) -> bool:
        return seq in self._dir

    @property
    def sequences(self) -> dict[int, int]:
        """seq -> tokens of every sequence in the tier."""
        return {s: e.tokens for s, e in sorted(self._dir.items())}

    def writers(self, seq: int) -> dict[int, int]:
        """kv head -> the rank keeping it, of a sequence in the tier."""
        return dict(self._entry(seq).writers)

    def read(self, seq: int, head: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [layers, tokens, head_dim] (host copies) of kv head `head` of `seq`, which this rank keeps.
        Waits for the tier's pending copies first."""
        e = self._entry(seq)
        if (seq, head) not in self._kept:
            raise KeyError(f"rank {self.rank} does not keep kv head {head} of sequence {seq} (its writer: rank "
                           f"{e.writers.get(head)})")
        if self._last is not None:
            self._last.synchronize()
        blocks = self.pool[torch.tensor(self._kept[(seq, head)])]  # [nb, L, 2, bs, hd]
        kv = blocks.permute(2, 1, 0, 3, 4).reshape(2, self.num_layers, -1, self.head_dim)[:, :, :e.tokens]
        return kv[0].clone(), kv[1].clone()

    def writer_map(self, layout: ParallelLayout, replica: int, seq: int) -> dict[int, int]:
        """kv head -> the rank that writes it when `seq` is swapped out of `replica` of `layout`."""
        return {h: rs[seq % len(rs)] for h, rs in self._holders(layout, replica).items()}

    # ---- swap out ---------------------------------------------------------------------------------
    def swap_out(self, sequences: Mapping[int, tuple[int, int]], cache: PagedKVCache | None,
                 layout: ParallelLayout) -> SwapHandle:
        """Copy `sequences` (seq -> (its replica in `layout`, tokens)) into the tier and free their device
        blocks. Every rank of the world calls it with the same arguments; cache: this rank's cache in
        `layout` (None where it caches none of them). Checks everything before changing anything."""
        seqs = sorted(sequences)
        need = [0] * self.world_size
        plans = []
        for seq in seqs:
            replica, tokens = sequences[seq]
            if seq in self._dir:
                raise ValueError(f"swap_out: sequence {seq} is already in the host tier ({self._dir[seq].tokens} "
                                 "tokens); swap it in or drop it first")
            if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
                raise ValueError(f"swap_out: sequence {seq} must have an int >= 1 of tokens, got {tokens!r}")
            writers = self.writer_map(layout, replica, seq)
            for w in writers.values():
                need[w] += self.blocks_for(tokens)
            here = layout.coords(self.rank).dp == replica
            if here:
                self._check_cache(cache, layout, "swap_out")
                if cache.seq_len(seq) != tokens:
                    raise ValueError(f"swap_out: rank {self.rank} caches {cache.seq_len(seq)} tokens of sequence "
                                     f"{seq}, the call says {tokens}")
            plans.append((seq, tokens, writers, here))
        for r in range(self.world_size):
            if self._used[r] + need[r] > self.num_blocks:
                raise RuntimeError(
                    f"host KV tier out of blocks: rank {r} needs {need[r]} more for sequences {seqs}, "
                    f"{self.num_blocks - self._used[r]} free of {self.num_blocks} (block_size {self.block_size}, "
                    f"{self.bytes_per_block} bytes per block); drop or swap in sequences, or make the pool larger")
        pool_blocks: list[int] = []  # the pool blocks written, in staging order
        pieces: list[tuple[list[int], int, int]] = []  # (cache blocks, local head index, tokens) in that order
        for seq, tokens, writers, here in plans:
            if here:
                idx = [i for i, h in enumerate(cache.kv_heads) if writers[h] == self.rank]
                if idx:
                    nb = self.blocks_for(tokens)
                    blocks = self._alloc(len(idx) * nb)
                    for j, i in enumerate(idx):
                        self._kept[(seq, cache.kv_heads[i])] = blocks[j * nb:(j + 1) * nb]
                        pieces.append((list(cache.block_tables[seq]), i, tokens))
                    pool_blocks += blocks
                cache.free(seq)  # bookkeeping only: the gather below is issued before any later write
            self._dir[seq] = _Entry(tokens, writers)
            for r in set(writers.values()):
                self._used[r] += self.blocks_for(tokens) * sum(1 for w in writers.values() if w == r)
        if not pieces:
            return SwapHandle() if self._stream is None else self._handle()
        st = self._gather(cache, pieces)
        if self._stream is None:
            self._to_pool(st, pool_blocks)
            return SwapHandle()
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            st.record_stream(self._stream)
            self._to_pool(st, pool_blocks)
        return self._handle()

    # ---- swap in ----------------------------------------------------------------------------------
    def swap_in(self, sequences: Mapping[int, int], cache: PagedKVCache | None, layout: ParallelLayout, *,
                keep: bool = False) -> SwapHandle:
        """Write `sequences` (seq -> its replica in `layout`) into fresh blocks of the caches of that
        replica's ranks, each rank the kv heads `layout` places on it (fetching heads it does not keep
        from their writers), then release their host copies (keep=True: leave them in the tier).
        Collective over the world: every rank calls it with the same arguments; cache: this rank's
        cache in `layout` (None where it serves none of them). All ranks refuse together (ValueError /
        RuntimeError) before any transfer when a sequence is not in the tier or a target cache lacks room."""
        seqs = sorted(sequences)
        problem: Exception | None = None
        try:
            mine = self._check_swap_in(sequences, cache, layout)
        except (ValueError, KeyError, RuntimeError) as exc:
            problem, mine = exc, []
        if self.world_size > 1 and dist.is_initialized():  # refuse together: no rank waits in a transfer
            flag = torch.tensor([0 if problem else 1], dtype=torch.int32)
            if self._stream is None:
                dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.pg)
            else:  # on the side stream: the host waits for the tier's earlier copies, not for the compute stream
                with torch.cuda.stream(self._stream):
                    flag = upload(flag, self.device)
                    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.pg)
            if problem is None and not int(flag.item()):
                problem = RuntimeError(f"swap_in of sequences {seqs}: refused on another rank (see its error)")
        if problem is not None:
            raise problem
        if self._stream is None:
            self._swap_in(seqs, sequences, mine, cache, layout)
        else:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                self._swap_in(seqs, sequences, mine, cache, layout)
        if not keep:
            self._release(seqs)
        return SwapHandle() if self._stream is None else self._handle()

    def drop(self, seqs) -> None:
        """Forget sequences' host copies (every rank, same ids; unknown ids: nothing to do)."""
        self._release([s for s in seqs if s in self._dir])

    # ---- internals --------------------------------------------------------------------------------
    def _entry(self, seq: int) -> _Entry:
        if seq not in self._dir:
            raise KeyError(f"sequence {seq} is not in the host KV tier (holding {sorted(self._dir)})")
        return self._dir[seq]

    def _holders(self, layout: ParallelLayout, replica: int) -> dict[int, list[int]]:
        """kv head -> the ranks of `replica` that cache it in `layout`, in rank order."""
        if layout.world_size != self.world_size:
            raise ValueError(f"host tier: {layout!r} covers {layout.world_size} ranks, the tier's world has "
                             f"{self.world_size}")
        if not isinstance(replica, int) or not 0 <= replica < layout.dp:
            raise ValueError(f"host tier: replica {replica!r} outside dp={layout.dp} of {layout!r}")
        placement = layout.head_placement(self.num_q_heads, self.num_kv_heads)
        P = layout.replica_size
        holders: dict[int, list[int]] = {}
        for r in range(replica * P, (replica + 1) * P):
            for h in placement.kv_heads(r, StepMode.BASE):
                holders.setdefault(h, []).append(r)
        return dict(sorted(holders.items()))

    def _check_cache(self, cache: PagedKVCache | None, layout: ParallelLayout, what: str) -> None:
        want = layout.head_placement(self.num_q_heads, self.num_kv_heads).kv_heads(self.rank, StepMode.BASE)
        if cache is None:
            raise ValueError(f"{what}: rank {self.rank} serves a sequence of {layout!r} but got no cache")
        if tuple(cache.kv_heads) != tuple(want):
            raise ValueError(f"{what}: rank {self.rank}'s cache holds kv heads {tuple(cache.kv_heads)}, {layout!r} "
                             f"places {tuple(want)} on it")
        shape = (self.num_layers, len(want), self.head_dim)
        got = (cache.k.shape[0], cache.k.shape[3], cache.k.shape[4])
        if got != shape or cache.k.dtype != self.dtype or cache.k.device != self.device:
            raise ValueError(f"{what}: cache (layers, kv heads, head_dim) {got} {cache.k.dtype} on {cache.k.device}, "
                             f"the tier has {shape} {self.dtype} on {self.device}")

    def _check_swap_in(self, sequences: Mapping[int, int], cache: PagedKVCache | None,
                       layout: ParallelLayout) -> list[int]:
        """The sequences this rank will cache; raises on anything that would stop the swap."""
        mine = []
        for seq in sorted(sequences):
            self._entry(seq)
            self._holders(layout, sequences[seq])  # checks world and replica
            if layout.coords(self.rank).dp == sequences[seq]:
                mine.append(seq)
        if mine:
            self._check_cache(cache, layout, "swap_in")
            held = [s for s in mine if s in cache.block_tables]
            if held:
                raise ValueError(f"swap_in: rank {self.rank}'s cache already holds sequences {held}")
            need = sum(-(-self._dir[s].tokens // cache.block_size) for s in mine)
            if need > cache.free_blocks:
                raise RuntimeError(f"swap_in: rank {self.rank}'s KV cache needs {need} blocks for sequences {mine}, "
                                   f"{cache.free_blocks} free of {cache.num_blocks} (block_size {cache.block_size})")
        return mine

    def _alloc(self, n: int) -> list[int]:
        return sorted(heapq.heappop(self._free) for _ in range(n))

    def _release(self, seqs) -> None:
        for seq in seqs:
            e = self._dir.pop(seq)
            for h, w in e.writers.items():
                self._used[w] -= self.blocks_for(e.tokens)
                for b in self._kept.pop((seq, h), []):
                    heapq.heappush(self._free, b)

    def _handle(self) -> SwapHandle:
        ev = torch.cuda.Event()
        ev.record(self._stream)
        self._last = ev
        return SwapHandle(ev, self.device)

    def _gather(self, cache: PagedKVCache, pieces: list[tuple[list[int], int, int]]) -> torch.Tensor:
        """Every piece (its cache block table, local head index, tokens) in pool order, one after the
        other: [sum of pool blocks, L, 2, bs, hd], rows past a piece's tokens zero. One row gather for
        k and v over all pieces (fusedpar.kernels.kv_rows, block order; rows past the tokens: idx -1)."""
        bs, h = self.block_size, len(cache.kv_heads)
        rows = []
        for table, i, tokens in pieces:
            tok = torch.arange(self.blocks_for(tokens) * bs)
            r = _token_rows(torch.tensor(table), cache.block_size, tok.clamp(max=tokens - 1)) * h + i
            rows.append(r.masked_fill_(tok >= tokens, -1))
        idx = upload(torch.cat(rows), self.device)  # one small copy
        st = torch.empty((idx.numel() // bs, self.num_layers, 2, bs, self.head_dim), dtype=self.dtype,
                         device=cache.k.device)
        move_kv_rows(*self._rows_view(cache), idx, st, scatter=False)
        return st

    def _rows_view(self, cache: PagedKVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """cache.k, cache.v as [L, cache rows, hd] (row = slot * local heads + head index)."""
        return cache.k.view(self.num_layers, -1, self.head_dim), cache.v.view(self.num_layers, -1, self.head_dim)

    def _to_pool(self, st: torch.Tensor, blocks: list[int]) -> None:
        for pos, first, count in _runs(blocks):
            self.pool[first:first + count].copy_(st[pos:pos + count], non_blocking=True)

    def _swap_in(self, seqs: list[int], sequences: Mapping[int, int], mine: list[int], cache: PagedKVCache | None,
                 layout: ParallelLayout) -> None:
        """Assemble this rank's sequences in one device buffer [blocks, L, 2, bs, hd] (sequence, local head,
        token block order): its kept heads by few host -> device copies (runs of consecutive pool blocks
        into consecutive rows), the others received from their writers; then one row scatter for k and v
        (fusedpar.kernels.kv_rows, block order) of every sequence's tokens into fresh blocks of the cache
        (rows past its end skipped)."""
        L, bs, hd, rank = self.num_layers, self.block_size, self.head_dim, self.rank
        offset: dict[tuple[int, int], int] = {}  # (seq, kv head) -> its first row in `assembled`
        rows = 0
        for seq in mine:
            nb = self.blocks_for(self._dir[seq].tokens)
            for h in cache.kv_heads:
                offset[(seq, h)], rows = rows, rows + nb
        assembled = torch.empty((rows, L, 2, bs, hd), dtype=self.dtype, device=self.device)
        spare: list[tuple[int, int, int]] = []  # (seq, head, nb) kept here, sent only
        for seq in seqs:
            e = self._dir[seq]
            for h, dests in self._holders(layout, sequences[seq]).items():
                if e.writers[h] == rank and rank not in dests:
                    spare.append((seq, h, self.blocks_for(e.tokens)))
        sent = torch.empty((sum(nb for _, _, nb in spare), L, 2, bs, hd), dtype=self.dtype, device=self.device)
        at, pos = {}, 0
        for seq, h, nb in spare:
            at[(seq, h)], pos = pos, pos + nb
        into: dict[str, list[tuple[int, int]]] = {"assembled": [], "sent": []}  # (row, pool block)
        ops = []
        for seq in seqs:
            e = self._dir[seq]
            nb = self.blocks_for(e.tokens)
            for h, dests in self._holders(layout, sequences[seq]).items():
                w = e.writers[h]
                if w == rank:
                    buf, row = (assembled, offset[(seq, h)]) if rank in dests else (sent, at[(seq, h)])
                    into["assembled" if buf is assembled else "sent"] += [
                        (row + b, blk) for b, blk in enumerate(self._kept[(seq, h)])]
                    ops += [dist.P2POp(dist.isend, buf[row:row + nb], d, group=self.pg) for d in dests if d != rank]
                elif rank in dests:
                    row = offset[(seq, h)]
                    ops.append(dist.P2POp(dist.irecv, assembled[row:row + nb], w, group=self.pg))
        for name, buf in (("assembled", assembled), ("sent", sent)):
            self._from_pool_rows(into[name], buf)
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        if not mine:
            return
        ns = [self._dir[s].tokens for s in mine]
        cache.begin_step(StepBatch(tuple(mine), tuple(ns), (0,) * len(mine)), device="cpu")
        h = len(cache.kv_heads)
        idx = torch.full((rows * bs,), -1, dtype=torch.int64)  # per row of `assembled`: its cache row
        for seq, n in zip(mine, ns, strict=True):
            slots = _token_rows(torch.tensor(cache.block_tables[seq]), cache.block_size, torch.arange(n))
            for j, head in enumerate(cache.kv_heads):
                start = offset[(seq, head)] * bs
                idx[start:start + n] = slots * h + j
        move_kv_rows(*self._rows_view(cache), upload(idx, self.device), assembled, scatter=True)  # one small copy

    def _from_pool_rows(self, pairs: list[tuple[int, int]], out: torch.Tensor) -> None:
        """out[row] = pool[block] for every (row, block): one copy per run consecutive on both sides."""
        run = None  # (first row, first block, count)
        for row, blk in sorted(pairs):
            if run is not None and row == run[0] + run[2] and blk == run[1] + run[2]:
                run = (run[0], run[1], run[2] + 1)
                continue
            if run is not None:
                out[run[0]:run[0] + run[2]].copy_(self.pool[run[1]:run[1] + run[2]], non_blocking=True)
            run = (row, blk, 1)
        if run is not None:
            out[run[0]:run[0] + run[2]].copy_(self.pool[run[1]:run[1] + run[2]], non_blocking=True)
