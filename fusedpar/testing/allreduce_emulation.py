"""The one-shot all-reduce (fusedpar.kernels.allreduce) on every rank of an EmulatedWorld (CPU, interpreter).

Interpreted programs run one after another, so a rank waiting for a peer would spin forever if
both phases ran in one launch before the peer's copy-in. The driver runs the phases as separate
launches (every rank's copy-in, then every rank's reduce); the flag code still runs, the flags
are simply set when the waits start.
"""

from __future__ import annotations

import torch

from fusedpar.collectives.symmetric import EmulatedWorld
from fusedpar.kernels._host import require_same_on_ranks
from fusedpar.kernels._sync import check_emulated_rank
from fusedpar.kernels.allreduce import (
    OneShotConfig,
    default_config,
    launch_one_shot_all_reduce,
    one_shot_capacity_bytes,
)

__all__ = ["one_shot_all_reduce_emulated"]


def one_shot_all_reduce_emulated(
    world: EmulatedWorld,
    inputs: list[torch.Tensor],
    *,
    outs: list[torch.Tensor] | None = None,
    use_flags: bool = True,
    schedule: str = "phased",
    config: OneShotConfig | None = None,
) -> list[torch.Tensor]:
    """One all-reduce on every rank of an EmulatedWorld (CPU, interpreter); rank r's output at [r].

    schedule "phased": every rank's copy-in, then every rank's reduce (two launches per rank).
    schedule "staggered": copy-in for ranks 0..W-2, the registered op (both phases in ONE launch,
    the GPU path) for rank W-1, then reduce for ranks 0..W-2: a legal interleaving of the real
    protocol that exercises the registered op with live flags.
    Raises RuntimeError if a bounded flag wait timed out (a protocol bug).
    """
    W = world.world_size
    if len(inputs) != W:
        raise ValueError(f"one_shot_all_reduce_emulated: {len(inputs)} inputs for {W} ranks")
    require_same_on_ranks("one_shot_all_reduce_emulated", "inputs", inputs)
    if outs is None:
        # Contiguous, as the launcher requires (empty_like would keep a transposed input's strides).
        outs = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in inputs]
    if schedule not in ("phased", "staggered"):
        raise ValueError(f"one_shot_all_reduce_emulated: unknown schedule {schedule!r}")

    def checked(r: int) -> None:
        check_emulated_rank(world[r], r, "one-shot all-reduce")

    first = range(W) if schedule == "phased" else range(W - 1)
    for r in first:
        launch_one_shot_all_reduce(inputs[r], world[r], outs[r], reduce=False, use_flags=use_flags, config=config)
    if schedule == "staggered":
        t, cfg = world[W - 1], config or default_config()
        torch.ops.fusedpar.one_shot_all_reduce_out(
            inputs[W - 1], t.buffer_ptrs, t.signal_ptrs, t.counters, outs[W - 1], t.rank, t.world_size,
            one_shot_capacity_bytes(t), t.max_blocks, cfg.block, cfg.num_warps, cfg.max_blocks, use_flags,
        )
        checked(W - 1)
    for r in first:
        launch_one_shot_all_reduce(inputs[r], world[r], outs[r], copy_in=False, use_flags=use_flags, config=config)
        checked(r)
    return outs
