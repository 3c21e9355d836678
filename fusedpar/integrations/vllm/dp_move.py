"""The KV copy of requests moving from a DP rank into the TP/SP class (dp_scheduler.KVMove), run by every worker
before the forward of the step the scheduler moved them at.

A DP block d of rank r is TP blocks [P d, P d + P) of rank r's buffer seen with all kv heads (dp_runner.dp_kv_view):
kv heads [j h, j h + h) of DP block d are TP block P d + j. TP rank j holds kv heads [j h, j h + h) of a TP
block (vLLM's QKVParallelLinear sharding, checked at start-up by layers.py). So a moved request's KV for TP rank
j is head group j of its source DP blocks: the source rank cuts every layer's source blocks into the P head
groups (`head_groups`) and scatters them over the TP group (one collective per move, every layer at once);
each rank writes its group's keys and values of the request's tokens at its destination TP slots through the
attention backend's own KV write (vLLM's CPU backend keeps a block's keys and values apart, [h, 2 bs, hd], not
per token as the DP view does). fusedpar.layers.kv_reshard.migrate_kv moves fusedpar's own PagedKVCache between
layouts; vLLM's per-layer buffers and a one-source move need only this scatter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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


def group_scatter(tp_group) -> Callable[[torch.Tensor, list[torch.Tensor] | None, int], None]:
    """`scatter` for move_kv over vLLM's TP GroupCoordinator (its device group: gloo on CPU), src a rank in the
    group."""
    import torch.distributed as dist

    def scatter(out: torch.Tensor, groups: list[torch.Tensor] | None, src: int) -> None:
        dist.scatter(out, groups, src=tp_group.ranks[src], group=tp_group.device_group)

    return scatter
