"""torch.library ops of the one-shot all-reduce, with fake impls: torch.compile and CUDA-graph
capture see one opaque node.

`torch.ops.fusedpar.one_shot_all_reduce` returns a new tensor; `one_shot_all_reduce_out` writes a
given one. The peer table travels as its tensors + ints (no registry of workspaces: no module
globals). counters is declared mutated: it is (the epoch advances), and it keeps the op from being
dead-code eliminated or reordered across another launch on the same table, which would
desynchronise the ranks. The ops' use_flags argument is for the CPU emulation
(fusedpar.testing.allreduce_emulation); `_call_op`, the public function's path under
torch.compile, always passes True.
"""

from __future__ import annotations

import torch

from fusedpar.collectives.symmetric import PeerTable
from fusedpar.kernels.allreduce.config import OneShotConfig, one_shot_capacity_bytes
from fusedpar.kernels.allreduce.launch import _check, _launch_both


@torch.library.custom_op("fusedpar::one_shot_all_reduce", mutates_args=("counters",))
def _one_shot_op(
    x: torch.Tensor,
    buffer_ptrs: torch.Tensor,
    signal_ptrs: torch.Tensor,
    counters: torch.Tensor,
    rank: int,
    world_size: int,
    slot_bytes: int,
    max_blocks: int,
    block: int,
    num_warps: int,
    grid_cap: int,
    use_flags: bool,
) -> torch.Tensor:
    _check(x, counters.device, slot_bytes, None)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_both(x, out, buffer_ptrs, signal_ptrs, counters, rank, world_size, slot_bytes, max_blocks,
                 OneShotConfig(block, num_warps, grid_cap), use_flags=use_flags)
    return out


@_one_shot_op.register_fake
def _one_shot_fake(
    x,
    buffer_ptrs,
    signal_ptrs,
    counters,
    rank,
    world_size,
    slot_bytes,
    max_blocks,
    block,
    num_warps,
    grid_cap,
    use_flags,
):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("fusedpar::one_shot_all_reduce_out", mutates_args=("out", "counters"))
def _one_shot_out_op(
    x: torch.Tensor,
    buffer_ptrs: torch.Tensor,
    signal_ptrs: torch.Tensor,
    counters: torch.Tensor,
    out: torch.Tensor,
    rank: int,
    world_size: int,
    slot_bytes: int,
    max_blocks: int,
    block: int,
    num_warps: int,
    grid_cap: int,
    use_flags: bool,
) -> None:
    _check(x, counters.device, slot_bytes, out)
    _launch_both(x, out, buffer_ptrs, signal_ptrs, counters, rank, world_size, slot_bytes, max_blocks,
                 OneShotConfig(block, num_warps, grid_cap), use_flags=use_flags)


@_one_shot_out_op.register_fake
def _one_shot_out_fake(
    x,
    buffer_ptrs,
    signal_ptrs,
    counters,
    out,
    rank,
    world_size,
    slot_bytes,
    max_blocks,
    block,
    num_warps,
    grid_cap,
    use_flags,
):
    return None


def _call_op(x: torch.Tensor, table: PeerTable, out: torch.Tensor | None, cfg: OneShotConfig) -> torch.Tensor:
    """Run through the registered op (what torch.compile traces): both phases, one launch, with flags."""
    args = (table.buffer_ptrs, table.signal_ptrs, table.counters)
    meta = (
        table.rank,
        table.world_size,
        one_shot_capacity_bytes(table),
        table.max_blocks,
        cfg.block,
        cfg.num_warps,
        cfg.max_blocks,
        True,  # use_flags
    )
    if out is None:
        return torch.ops.fusedpar.one_shot_all_reduce(x, *args, *meta)
    torch.ops.fusedpar.one_shot_all_reduce_out(x, *args, out, *meta)
    return out
