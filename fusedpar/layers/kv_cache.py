"""Paged KV cache owned once per rank and used unchanged by both modes.

KV-cache invariance means a rank caches the same kv heads in base and shift mode
(HeadPlacement proves it), so the cache stores only `kv_heads` and never learns the mode.
Layout per layer: k, v [num_blocks, block_size, num_local_kv_heads, head_dim]; each sequence
owns a block table. Blocks are handed out in a deterministic order, so ranks that see the same
steps hold identical block tables without talking to each other. `grow` enlarges the pool in
place (callers that cannot plan the cache size, e.g. the HF adapter, grow it before a step that
does not fit); it keeps that determinism.
"""

from __future__ import annotations

import torch

from fusedpar.layers.step_plan import StepBatch


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor (block tables, row indices) on `device` without making the host wait: on
    CUDA through a fresh pinned buffer (a copy from pageable memory waits for the stream's earlier
    work)."""
    if device.type != "cuda":
        return t.to(device)
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t).to(device, non_blocking=True)


class PagedKVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        kv_heads: tuple[int, ...],
        head_dim: int,
        block_size: int,
        num_blocks: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        for name, v in (("num_layers", num_layers), ("head_dim", head_dim), ("block_size", block_size),
                        ("num_blocks", num_blocks)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"PagedKVCache {name} must be an int, got {v!r}")
        if min(num_layers, len(kv_heads), head_dim, block_size, num_blocks) < 1:
            raise ValueError(
                f"PagedKVCache sizes must be >= 1: layers={num_layers}, kv_heads={len(kv_heads)}, "
                f"head_dim={head_dim}, block_size={block_size}, blocks={num_blocks}"
            )
        self.kv_heads = tuple(kv_heads)
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_layers, num_blocks, block_size, len(kv_heads), head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        self._table_tensors: dict[int, torch.Tensor] = {}  # block_table() cache, rebuilt on growth
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self.generation = 0  # bumped by every grow(): holders of k/v views (CUDA graphs) compare it

    def reinterpret(self, kv_heads: tuple[int, ...]) -> PagedKVCache:
        """A cache for other local kv heads on this cache's memory (no allocation): each layer's bytes
        viewed as blocks of [block_size, len(kv_heads), head_dim], as many as fit. It starts empty;
        this cache's contents are overwritten by its use (copy what must survive first)."""
        layers, _, bs, h_old, hd = self.k.shape
        h = len(kv_heads)
        if h < 1:
            raise ValueError("PagedKVCache.reinterpret: kv_heads must not be empty")
        per_layer = self.num_blocks * bs * h_old * hd
        blocks = per_layer // (bs * h * hd)
        if blocks < 1:
            raise ValueError(f"PagedKVCache.reinterpret: {per_layer} values per layer hold no block of "
                             f"{bs} x {h} x {hd}")
        new = object.__new__(PagedKVCache)
        new.kv_heads, new.block_size, new.num_blocks = tuple(kv_heads), bs, blocks
        shape = (layers, blocks, bs, h, hd)
        new.k = self.k.reshape(layers, per_layer)[:, : blocks * bs * h * hd].view(shape)
        new.v = self.v.reshape(layers, per_layer)[:, : blocks * bs * h * hd].view(shape)
        new.block_tables, new.lengths, new._table_tensors = {}, {}, {}
        new._free = list(range(blocks - 1, -1, -1))
        new.generation = self.generation + 1
        return new

    def fill(self, seq_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a whole sequence: k, v [layers, n, local kv heads, head_dim] into fresh blocks."""
        layers, n = k.shape[:2]
        if k.shape != v.shape or layers != self.k.shape[0] or tuple(k.shape[2:]) != tuple(self.k.shape[3:]):
            raise ValueError(f"cache fill: k {tuple(k.shape)} / v {tuple(v.shape)} do not match layers x n x "
                             f"{tuple(self.k.shape[3:])}")
        if seq_id in self.block_tables:
            raise ValueError(f"cache fill: sequence {seq_id} already holds blocks")
        slots = self.begin_step(StepBatch((seq_id,), (n,), (0,)))
        for layer in range(layers):
            self.write(layer, slots, k[layer], v[layer])

    @property
    def free_blocks(self) -> int:
        """Blocks not held by any sequence."""
        return len(self._free)

    def blocks_needed(self, batch: StepBatch) -> int:
        """Blocks begin_step(batch) would take from the pool (0 when every sequence has room)."""
        bs = self.block_size
        return sum(max(0, -(-(c + q) // bs) - len(self.block_tables.get(sid, ())))
                   for sid, q, c in zip(batch.seq_ids, batch.query_lens, batch.context_lens, strict=True))

    def grow(self, num_blocks: int) -> None:
        """Enlarge the pool to `num_blocks` blocks in total, keeping every block, table and value.

        self.k / self.v are replaced by larger tensors (views of the old ones taken before the
        call, e.g. captured in a CUDA graph, no longer see the cache; block ids, tables and
        lengths stay valid). The free blocks the pool had are handed out first, in their order,
        then the new ones in increasing order: ranks that grow at the same points keep identical
        tables. num_blocks equal to the current size is a no-op; smaller raises ValueError.
        """
        old = self.num_blocks
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool):
            raise ValueError(f"PagedKVCache.grow: num_blocks must be an int, got {num_blocks!r}")
        if num_blocks < old:
            raise ValueError(f"PagedKVCache.grow: cannot shrink {old} blocks to {num_blocks}")
        if num_blocks == old:
            return
        for name in ("k", "v"):
            t = getattr(self, name)
            new = torch.zeros((t.shape[0], num_blocks, *t.shape[2:]), dtype=t.dtype, device=t.device)
            new[:, :old] = t
            setattr(self, name, new)
        # _free is popped from its end: the new blocks go in front of the old free ones
        self._free = list(range(num_blocks - 1, old - 1, -1)) + self._free
        self.num_blocks = num_blocks
        self.generation += 1

    def seq_len(self, seq_id: int) -> int:
        return self.lengths.get(seq_id, 0)

    def begin_step(self, batch: StepBatch, device: torch.device | str | None = None) -> torch.Tensor:
        """Reserve room for the step's new tokens; return the cache slot of each packed token
        (int64, on the cache's device unless `device` says otherwise: a CUDA-graph step stages
        the slots on the host with the rest of its inputs).

        Checks that each sequence's cached length is the batch's context length: a mismatch
        means the caller lost track of a sequence, which would otherwise corrupt attention.
        All checks run before anything changes: a step that raises (mismatch, out of blocks)
        leaves the cache as it was, so the caller can grow the pool or fix the batch and retry.
        """
        bs = self.block_size
        self._check_room(batch)
        if all(q == 1 for q in batch.query_lens):  # a decode step: one slot per sequence, no tensor work
            slots = []
            for sid, c in zip(batch.seq_ids, batch.context_lens, strict=True):
                table = self._extend_table(sid, c + 1)
                slots.append(table[c // bs] * bs + c % bs)
                self.lengths[sid] = c + 1
            return torch.tensor(slots, dtype=torch.int64, device=self.k.device if device is None else device)
        touched: list[int] = []  # the blocks the new tokens land in, sequence after sequence
        offset: list[int] = []  # per sequence: index into `touched` of its block 0 (may be negative)
        for sid, q, c in zip(batch.seq_ids, batch.query_lens, batch.context_lens, strict=True):
            table = self._extend_table(sid, c + q)
            offset.append(len(touched) - c // bs)
            touched.extend(table[c // bs:(c + q - 1) // bs + 1])
            self.lengths[sid] = c + q
        # One gather for all tokens: Python touches each sequence once, never each token (a decode
        # step of 64 sequences or a 16K-token prefill both cost a handful of tensor ops).
        pos = batch.positions()
        seq_of = torch.repeat_interleave(torch.arange(len(offset)), torch.tensor(batch.query_lens))
        block = torch.tensor(touched)[torch.tensor(offset)[seq_of] + pos // bs]
        return (block * bs + pos % bs).to(self.k.device if device is None else device)

    def reserve(self, batch: StepBatch) -> None:
        """begin_step without the slots: the step's blocks and lengths, for a caller that addresses the
        new tokens through the block tables itself (a KV migration builds its row indices on the device).
        The same checks, run before anything changes."""
        self._check_room(batch)
        for sid, q, c in zip(batch.seq_ids, batch.query_lens, batch.context_lens, strict=True):
            self._extend_table(sid, c + q)
            self.lengths[sid] = c + q

    def _extend_table(self, sid: int, tokens: int) -> list[int]:
        """Sequence sid's block table, grown from the free list (its end first) to hold `tokens` tokens."""
        table = self.block_tables.setdefault(sid, [])
        need = -(-tokens // self.block_size) - len(table)
        if need > 0:
            table.extend(reversed(self._free[-need:]))
            del self._free[-need:]
        return table

    def _check_room(self, batch: StepBatch) -> None:
        for sid, c in zip(batch.seq_ids, batch.context_lens, strict=True):
            if self.seq_len(sid) != c:
                raise ValueError(f"sequence {sid}: cache holds {self.seq_len(sid)} tokens, step says context {c}")
        need_total = self.blocks_needed(batch)
        if need_total > len(self._free):
            raise RuntimeError(
                f"KV cache out of blocks: the step needs {need_total} more, {len(self._free)} free of "
                f"{self.num_blocks} (block_size {self.block_size}); grow() the cache or split the step"
            )

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [n, local kv heads, head_dim] of n real tokens at their slots."""
        if k.shape[0] != slots.shape[0] or k.shape[1:] != self.k.shape[3:]:
            raise ValueError(
                f"cache write: k {tuple(k.shape)} does not match {slots.shape[0]} slots x {tuple(self.k.shape[3:])}"
            )
        self.k[layer].view(-1, *self.k.shape[3:])[slots] = k.to(self.k.dtype)
        self.v[layer].view(-1, *self.v.shape[3:])[slots] = v.to(self.v.dtype)

    def gather(self, layer: int, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [seq_len, local kv heads, head_dim] of one sequence, in position order."""
        n = self.seq_len(seq_id)
        blocks = torch.tensor(self._table(seq_id), device=self.k.device)
        k = self.k[layer][blocks].reshape(-1, *self.k.shape[3:])[:n]
        v = self.v[layer][blocks].reshape(-1, *self.v.shape[3:])[:n]
        return k, v

    def block_table(self, seq_id: int) -> torch.Tensor:
        """The sequence's block ids as a CPU int32 tensor (cached; rebuilt only when it gains a block,
        so building per-step attention metadata costs no per-block Python work)."""
        table = self._table(seq_id)
        t = self._table_tensors.get(seq_id)
        if t is None or t.numel() != len(table):
            t = self._table_tensors[seq_id] = torch.tensor(table, dtype=torch.int32)
        return t

    def _table(self, seq_id: int) -> list[int]:
        if seq_id not in self.block_tables:
            raise KeyError(f"sequence {seq_id} holds no cache blocks (never stepped, or freed)")
        return self.block_tables[seq_id]

    def free(self, seq_id: int) -> None:
        """Return the sequence's blocks to the pool (an unknown or already freed id: nothing to do)."""
        self._table_tensors.pop(seq_id, None)
        self._free.extend(reversed(self.block_tables.pop(seq_id, [])))
        self.lengths.pop(seq_id, None)
