"""The KV copy of requests moving between a DP rank and the TP/SP class (dp_scheduler.KVMove), run by every worker
before the forward of the step the scheduler moved them at: a TP step's moves go from DP ranks into the TP/SP class
(`move_kv`), a DP step's from the TP/SP class to DP ranks (`move_kv_to_dp`).

A DP block d of rank r is TP blocks [P d, P d + P) of rank r's buffer seen with all kv heads (dp_runner.dp_kv_view):
kv heads [j h, j h + h) of DP block d are TP block P d + j. TP rank j holds kv heads [j h, j h + h) of a TP
block (vLLM's QKVParallelLinear sharding, checked at start-up by layers.py). So a moved request's KV for TP rank
j is head group j of its source DP blocks: the source rank cuts every layer's source blocks into the P head
groups (`head_groups`) and scatters them over the TP group (one collective per move, every layer at once);
each rank writes its group's keys and values of the request's tokens at its destination TP slots through the
attention backend's own KV write (vLLM's CPU backend keeps a block's keys and values apart, [h, 2 bs, hd], not
per token as the DP view does). fusedpar.layers.kv_reshard.migrate_kv moves fusedpar's own PagedKVCache between
layouts; vLLM's per-layer buffers and a one-source move need only this scatter.

The way back is the reverse: every rank reads its kv-head group of the request's tokens from its TP blocks, in the
backend's block layout, and gathers it on the destination rank, which joins the P groups (rank j's are kv heads
[j h, j h + h)) and writes all kv heads of each token into its DP blocks through the DP view. The backend's layout
of a block is read back by probing its own write once (`block_layout`): it places every element of a token's key
and value somewhere in the block, and where is all a read needs.

A peer that dies or stalls during a move: every collective of a move waits at most `move_timeout` (vLLM's
distributed_timeout_seconds where set, else MOVE_TIMEOUT_S), and a move ends with a bounded barrier of the TP group
(`group_settle`), so a rank whose part of a move already left (a scatter's source writes into its sockets and
returns) still learns that a peer never finished it. `guarded` turns any failure of the move on this rank into
KVMoveError naming the move, this rank and the peers it waited on.
"""

from __future__ import annotations

import datetime
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .dp_runner import dp_kv_view


def head_groups(caches: Sequence[torch.Tensor], P: int, dp_blocks: Sequence[int], dp_offset: int) -> list[torch.Tensor]:
    """The P head groups of DP blocks `dp_blocks` (pool-local ids; the pool starts at DP block dp_offset of the
    buffer) of every layer's TP KV cache in `caches` ([N, h, bs, 2 hd] each): group j is [layers, blocks, h, bs,
    2 hd], the kv heads TP rank j holds."""
    idx = torch.tensor([dp_offset + b for b in dp_blocks], dtype=torch.long, device=caches[0].device)
    stacked = torch.stack([dp_kv_view(kv, P).index_select(0, idx) for kv in caches])  # [L, n, P h, bs, 2hd]
    h = caches[0].shape[1]
    return [g.contiguous() for g in stacked.split(h, dim=2)]


def token_kv(group: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ([layers, tokens, h, hd] each) of the first `tokens` tokens of one head group of DP blocks
    ([layers, blocks, h, bs, 2 hd]: the DP view's layout, each token's key then its value)."""
    L, n, h, bs, c = group.shape
    rows = group.permute(0, 1, 3, 2, 4).reshape(L, n * bs, h, c)[:, :tokens]
    return rows[..., : c // 2], rows[..., c // 2:]


def tp_slots(tp_blocks: Sequence[int], block_size: int, tokens: int, device=None) -> torch.Tensor:
    """The slots (block id x block_size + offset) of the first `tokens` tokens of TP blocks `tp_blocks`."""
    blocks = torch.tensor(list(tp_blocks), dtype=torch.long, device=device)
    slots = (blocks[:, None] * block_size + torch.arange(block_size, device=device)[None, :]).reshape(-1)
    return slots[:tokens]


def move_kv(moves, caches: Sequence[torch.Tensor], P: int, dp_offset: int, rank: int,
            scatter: Callable[[torch.Tensor, list[torch.Tensor] | None, int], None],
            write: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]) -> int:
    """Copy the KV of every move (dp_scheduler.KVMove) into this rank's TP blocks; collective over the TP group:
    every rank calls it with the same moves in the same order. caches: every layer's KV buffer of this rank
    ([N, h, bs, 2 hd], read through the DP view on the source rank); scatter(out, groups, src): out receives
    groups[j] on rank j from rank src (groups None on the other ranks); write(layer, key, value, slots): the
    attention backend's own KV write of [tokens, h, hd] keys and values at TP slots (the TP path's layout of a
    block is the backend's, not the DP view's). Returns the bytes of KV written into this rank's TP blocks."""
    moved = 0
    for move in moves:
        n = -(-move.tokens // caches[0].shape[2])
        if len(move.dp_blocks) != n or len(move.tp_blocks) != n:
            raise RuntimeError(f"fusedpar DP: move of {move.request_id} ({move.tokens} tokens) pairs "
                               f"{len(move.dp_blocks)} DP blocks with {len(move.tp_blocks)} TP blocks")
        if not n:
            continue
        ref = caches[0]
        out = torch.empty((len(caches), n, *ref.shape[1:]), dtype=ref.dtype, device=ref.device)
        groups = head_groups(caches, P, move.dp_blocks, dp_offset) if rank == move.rank else None
        scatter(out, groups, move.rank)
        key, value = token_kv(out, move.tokens)
        slots = tp_slots(move.tp_blocks, ref.shape[2], move.tokens, ref.device)
        for layer in range(len(caches)):
            write(layer, key[layer].contiguous(), value[layer].contiguous(), slots)
        moved += 2 * key.numel() * key.element_size()
    return moved


@dataclass(frozen=True)
class MoveCost:
    """What a step's KV moves cost in seconds: `latency` per moved request (its collective) and `per_byte` per byte
    of KV it moves (every rank's part together), fitted to timed moves of scratch KV (time_moves)."""

    latency: float
    per_byte: float

    def seconds(self, requests: int, nbytes: int) -> float:
        return requests * self.latency + nbytes * self.per_byte

    @classmethod
    def fit(cls, sizes: Sequence[int], seconds: Sequence[float]) -> MoveCost:
        """The line through the (bytes, seconds) of the smallest and the largest timed move, never below 0."""
        (s0, t0), (s1, t1) = min(zip(sizes, seconds, strict=True)), max(zip(sizes, seconds, strict=True))
        per_byte = max(0.0, (t1 - t0) / (s1 - s0)) if s1 > s0 else 0.0
        return cls(max(0.0, t0 - per_byte * s0), per_byte)


MOVE_PROBE_BYTES = (1 << 16, 1 << 23)  # the scratch moves time_moves times at engine start-up


def time_moves(scatter: Callable[[torch.Tensor, list[torch.Tensor] | None, int], None],
               gather: Callable[[torch.Tensor, list[torch.Tensor] | None, int], None], P: int, rank: int,
               sizes: Sequence[int], device=None, iters: int = 3) -> list[float]:
    """Seconds of one move of scratch KV of each size in `sizes` (bytes of every rank's part together): the mean of a
    move into the TP/SP class (move_kv's scatter from rank 0) and one to a DP rank (move_kv_to_dp's gather to rank 0)
    of float32 parts of size / P bytes each, the median of `iters` after one untimed; this rank's times (the caller
    takes the slowest rank's). Collective over the group of scatter and gather: every rank calls it alike."""
    out = []
    for size in sizes:
        part = torch.zeros(max(1, size // (4 * P)), dtype=torch.float32, device=device)
        parts = [torch.empty_like(part) for _ in range(P)] if rank == 0 else None
        times = []
        for i in range(iters + 1):
            t0 = time.perf_counter()
            scatter(part, parts, 0)
            gather(part, parts, 0)
            if i:
                times.append((time.perf_counter() - t0) / 2)
        out.append(statistics.median(times))
    return out


MOVE_TIMEOUT_S = 60.0  # a move's bound on a missing peer where vLLM's distributed_timeout_seconds is not set


def move_timeout(distributed_timeout_seconds: float | None) -> datetime.timedelta:
    """How long each collective of a KV move waits for a peer: vLLM's distributed_timeout_seconds (its
    ParallelConfig's bound on the device groups' collectives, which the moves run on) where set, else
    MOVE_TIMEOUT_S."""
    seconds = MOVE_TIMEOUT_S if distributed_timeout_seconds is None else float(distributed_timeout_seconds)
    return datetime.timedelta(seconds=seconds)


class KVMoveError(RuntimeError):
    """A KV move between the classes that did not complete on this rank: a peer died or stalled during it. The
    message starts with PREFIX and names the move, this rank and the peers it waited on."""

    PREFIX = "fusedpar DP: KV move"


def move_failure(moves, into_tp: bool, rank: int, P: int, seconds: float, timeout: datetime.timedelta,
                 error: BaseException) -> KVMoveError:
    """The error of a step's KV moves (dp_scheduler.KVMove: into the TP/SP class when into_tp, else to DP ranks)
    that failed on TP rank `rank` of P after `seconds`: the peers it waited on are the group's other ranks."""
    peers = [r for r in range(P) if r != rank]
    who = f"rank {peers[0]}" if len(peers) == 1 else f"one of ranks {peers}"
    what = ", ".join(f"{m.request_id} ({'from DP rank' if into_tp else 'to DP rank'} {m.rank})" for m in moves)
    where = "into the TP/SP class" if into_tp else "from the TP/SP class to DP ranks"
    return KVMoveError(f"{KVMoveError.PREFIX} {where} failed on rank {rank} after {seconds:.1f} s (bound "
                       f"{timeout.total_seconds():.0f} s per collective): {who} died or stalled during it; moving "
                       f"{what} ({type(error).__name__}: {error})")


def guarded(run: Callable[[], int], settle: Callable[[], None], moves, into_tp: bool, rank: int, P: int,
            timeout: datetime.timedelta) -> int:
    """run() (a step's moves: move_kv or move_kv_to_dp), then settle() (group_settle: every rank finished its part),
    returning run()'s bytes; any failure of either is raised as KVMoveError (move_failure)."""
    start = time.monotonic()
    try:
        moved = run()
        settle()
    except Exception as e:
        raise move_failure(moves, into_tp, rank, P, time.monotonic() - start, timeout, e) from e
    return moved


def _wait(work, timeout: datetime.timedelta | None) -> None:
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout)


def group_settle(tp_group, timeout: datetime.timedelta | None = None) -> Callable[[], None]:
    """A barrier of vLLM's TP GroupCoordinator (its device group, where the moves ran) whose wait is bounded by
    `timeout` (RuntimeError past it): every rank reached it, so every rank's part of the moves before it is done."""
    import torch.distributed as dist

    def settle() -> None:
        flag = torch.zeros(1)
        _wait(dist.all_reduce(flag, group=tp_group.device_group, async_op=True), timeout)

    return settle


def group_scatter(tp_group, timeout: datetime.timedelta | None = None) -> Callable[[torch.Tensor, list[torch.Tensor]
                                                                                   | None, int], None]:
    """`scatter` for move_kv over vLLM's TP GroupCoordinator (its device group: gloo on CPU), src a rank in the
    group; its wait is bounded by `timeout` (RuntimeError past it; None: the group's own)."""
    import torch.distributed as dist

    def scatter(out: torch.Tensor, groups: list[torch.Tensor] | None, src: int) -> None:
        _wait(dist.scatter(out, groups, src=tp_group.ranks[src], group=tp_group.device_group, async_op=True),
              timeout)

    return scatter


def block_layout(write_into: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None],
                 block_shape: Sequence[int], dtype: torch.dtype, device=None, base: int = 64) -> tuple[torch.Tensor,
                                                                                                      torch.Tensor]:
    """Where the attention backend's KV write puts the keys and values of one TP block's tokens: (key_index,
    value_index), each [bs, h, hd] of positions in the block's flat elements. write_into(cache, key, value, slots)
    is the backend's write of [tokens, h, hd] keys and values at `slots` of `cache` ([blocks, *block_shape]);
    block_shape: [h, bs, 2 hd]. The write is probed on a scratch block with codes of the elements, base-`base`
    digits at a time (exact in 16-bit floats too); RuntimeError unless it places every key and value element
    exactly once (a write that scales or packs its values cannot be read back this way)."""
    h, bs, c = block_shape
    hd, n = c // 2, bs * h * (c // 2)
    codes = torch.arange(n, device=device).reshape(bs, h, hd)
    slots = torch.arange(bs, device=device)
    acc = torch.zeros(h * bs * c, dtype=torch.long, device=device)
    kind = None
    scale = 1
    while True:
        digit = (codes // scale) % base
        block = torch.full((1, h, bs, c), -1.0, dtype=dtype, device=device)
        write_into(block, digit.to(dtype), (digit + base).to(dtype), slots)
        flat = block.reshape(-1).to(torch.long)
        written = torch.where(flat < 0, 0, torch.where(flat < base, 1, 2))  # 0: untouched, 1: key, 2: value
        if kind is None:
            kind = written
        elif not torch.equal(kind, written):
            kind = None
            break
        acc += (flat.clamp(min=0) % base) * scale
        scale *= base
        if scale >= n:
            break
    out = []
    for k in (1, 2):
        pos = (kind == k).nonzero().reshape(-1) if kind is not None else torch.empty(0, dtype=torch.long)
        code = acc[pos]
        if pos.numel() != n or not torch.equal(code.sort().values, torch.arange(n, device=device)):
            raise RuntimeError(f"fusedpar DP: the attention backend's KV write does not place each of the {n} "
                               f"{'key' if k == 1 else 'value'} elements of a [{h}, {bs}, {c}] block exactly once "
                               f"({pos.numel()} places found): its TP blocks cannot be read back for a move to a DP "
                               "rank")
        index = torch.empty(n, dtype=torch.long, device=device)
        index[code] = pos
        out.append(index.reshape(bs, h, hd))
    return out[0], out[1]


def tp_token_kv(cache: torch.Tensor, tp_blocks: Sequence[int], tokens: int,
                layout: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The keys and values ([tokens, h, 2 hd]: each token's key, then its value) of the first `tokens` tokens of TP
    blocks `tp_blocks` of one layer's cache ([N, h, bs, 2 hd], written by the backend: `layout` is its
    block_layout)."""
    key_index, value_index = layout
    h, hd = key_index.shape[1:]
    idx = torch.tensor(list(tp_blocks), dtype=torch.long, device=cache.device)
    flat = cache.index_select(0, idx).reshape(len(tp_blocks), -1)
    key = flat[:, key_index.reshape(-1)].reshape(-1, h, hd)[:tokens]
    value = flat[:, value_index.reshape(-1)].reshape(-1, h, hd)[:tokens]
    return torch.cat([key, value], dim=-1)


def move_kv_to_dp(moves, caches: Sequence[torch.Tensor], P: int, dp_offset: int, rank: int,
                  gather: Callable[[torch.Tensor, list[torch.Tensor] | None, int], None],
                  layout: tuple[torch.Tensor, torch.Tensor]) -> int:
    """Copy the KV of every move (dp_scheduler.KVMove of a DP step: from the TP/SP class to DP rank move.rank) into
    the DP blocks of its destination rank; collective over the TP group: every rank calls it with the same moves in
    the same order. caches: every layer's KV buffer of this rank ([N, h, bs, 2 hd]); gather(part, parts, dst):
    parts (a list of P tensors on rank dst, None elsewhere) receives every rank's `part`; layout: the backend's
    block layout (block_layout). Returns the bytes of KV written into this rank's DP blocks."""
    moved = 0
    for move in moves:
        bs = caches[0].shape[2]
        n = -(-move.tokens // bs)
        if len(move.dp_blocks) != n or len(move.tp_blocks) != n:
            raise RuntimeError(f"fusedpar DP: move of {move.request_id} ({move.tokens} tokens) pairs "
                               f"{len(move.tp_blocks)} TP blocks with {len(move.dp_blocks)} DP blocks")
        if not n:
            continue
        part = torch.stack([tp_token_kv(kv, move.tp_blocks, move.tokens, layout) for kv in caches])
        parts = [torch.empty_like(part) for _ in range(P)] if rank == move.rank else None
        gather(part.contiguous(), parts, move.rank)
        if parts is None:
            continue
        rows = torch.cat(parts, dim=2)  # [layers, tokens, P h, 2 hd]: kv heads in rank order
        t = torch.arange(move.tokens, device=rows.device)
        blocks = torch.tensor([dp_offset + b for b in move.dp_blocks], dtype=torch.long, device=rows.device)
        blk, off = blocks[t // bs], t % bs
        for layer, kv in enumerate(caches):
            dp_kv_view(kv, P)[blk, :, off, :] = rows[layer].to(kv.dtype)
        moved += rows.numel() * rows.element_size()
    return moved


def group_gather(tp_group, timeout: datetime.timedelta | None = None) -> Callable[[torch.Tensor, list[torch.Tensor]
                                                                                 | None, int], None]:
    """`gather` for move_kv_to_dp over vLLM's TP GroupCoordinator (its device group: gloo on CPU), dst a rank in
    the group; its wait is bounded by `timeout` (RuntimeError past it; None: the group's own)."""
    import torch.distributed as dist

    def gather(part: torch.Tensor, parts: list[torch.Tensor] | None, dst: int) -> None:
        _wait(dist.gather(part, parts, dst=tp_group.ranks[dst], group=tp_group.device_group, async_op=True),
              timeout)

    return gather
