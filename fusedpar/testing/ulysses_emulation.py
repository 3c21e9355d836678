"""The Ulysses ops (fusedpar.kernels.ulysses) on every rank of an EmulatedWorld, in one process.

The interpreter runs a launch's programs one after another, so a launch that waits for a peer's
later phase would spin forever. The drivers therefore run the launchers phase by phase: every
rank's READY launch, then every rank's producing launch (qkv produce / o push), then every rank's
consuming launch (qkv wait / o GEMM). The flag code still runs and the bounded spins prove each
wait is real. The "staggered" schedule runs the last rank through the registered op instead (all
phases in one launch with live flags, the GPU code path). Each driver raises RuntimeError if a
bounded flag wait timed out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusedpar.collectives.symmetric import EmulatedWorld
from fusedpar.kernels._host import require_same_on_ranks
from fusedpar.kernels._sync import check_emulated_rank
from fusedpar.kernels.fp8 import FP8Operands
from fusedpar.kernels.gemm import GemmConfig
from fusedpar.kernels.ulysses.config import OProjConfig, default_o_config
from fusedpar.kernels.ulysses.launch import (
    launch_all_to_all_o_proj,
    launch_o_arrival,
    launch_qkv_all_to_all,
    qkv_recv_view,
    zeroed_padding,
)
from fusedpar.kernels.ulysses.ops import o_proj_out_op, qkv_op, qkv_wait_op

__all__ = ["all_to_all_o_proj_emulated", "emulated_check", "qkv_all_to_all_emulated", "scattered_o_proj_emulated"]


def emulated_check(world: EmulatedWorld, what: str) -> None:
    """Raise RuntimeError if a bounded flag wait of any rank of `world` timed out."""
    for r in range(world.world_size):
        check_emulated_rank(world[r], r, what)


def qkv_all_to_all_emulated(
    world: EmulatedWorld,
    xs: list[torch.Tensor],
    ws: list[torch.Tensor],
    *,
    schedule: str = "phased",
    use_flags: bool = True,
    config: GemmConfig | None = None,
    rotate: bool | None = None,
    fp8: list[FP8Operands] | None = None,
) -> list[torch.Tensor]:
    """One qkv_all_to_all on every rank of an EmulatedWorld; returns every rank's receive-buffer view.
    fp8: e4m3 xs and ws with these scales, one per rank (receive buffers of each one's out_dtype).

    "phased": every rank's READY launch, then every rank's produce launch, then every rank's wait
    launch. "staggered": READY for all ranks, produce for ranks 0..W-2, then rank W-1 runs the
    registered op (all phases in ONE launch; its READY is re-sent, harmlessly, with the same
    epoch), then ranks 0..W-2 wait through the registered wait op (the wait-only launch of
    qkv_all_to_all(wait=False) + qkv_all_to_all_wait).
    """
    W = world.world_size
    if len(xs) != W or len(ws) != W:
        raise ValueError(f"qkv_all_to_all_emulated: {len(xs)} inputs / {len(ws)} weights for {W} ranks")
    if schedule not in ("phased", "staggered"):
        raise ValueError(f"qkv_all_to_all_emulated: unknown schedule {schedule!r}")
    require_same_on_ranks("qkv_all_to_all_emulated", "x", xs)
    require_same_on_ranks("qkv_all_to_all_emulated", "w", ws)
    first = range(W) if schedule == "phased" else range(W - 1)
    f8 = fp8 if fp8 is not None else [None] * W
    dtypes = [x.dtype if f is None else f.out_dtype for x, f in zip(xs, f8, strict=True)]
    kw = {"use_flags": use_flags, "config": config, "rotate": rotate}
    for r in range(W):
        launch_qkv_all_to_all(xs[r], ws[r], world[r], produce=False, wait=False, fp8=f8[r], **kw)
    for r in first:
        launch_qkv_all_to_all(xs[r], ws[r], world[r], send_ready=False, wait=False, fp8=f8[r], **kw)
    if schedule == "staggered":
        R = W - 1
        got = qkv_op(xs[R], ws[R], world[R], use_flags=use_flags, config=config, fp8=f8[R])
        if not torch.equal(got, qkv_recv_view(world[R], xs[R].shape[0], ws[R].shape[0] // W, dtypes[R])):
            raise AssertionError("the registered op's copy differs from its receive buffer")
    for r in first:
        if schedule == "staggered" and use_flags:
            qkv_wait_op(world[r])
        else:
            launch_qkv_all_to_all(xs[r], ws[r], world[r], send_ready=False, produce=False, fp8=f8[r], **kw)
    emulated_check(world, "qkv_all_to_all")
    return [qkv_recv_view(world[r], xs[r].shape[0], ws[r].shape[0] // W, dtypes[r]) for r in range(W)]


def all_to_all_o_proj_emulated(
    world: EmulatedWorld,
    attns: list[torch.Tensor],
    ws: list[torch.Tensor],
    *,
    outs: list[torch.Tensor] | None = None,
    schedule: str = "phased",
    use_flags: bool = True,
    config: OProjConfig | None = None,
    fp8: list[FP8Operands] | None = None,
) -> list[torch.Tensor]:
    """One all_to_all_o_proj on every rank of an EmulatedWorld; rank r's output at [r].
    fp8: e4m3 attns and ws with these scales, one per rank (outputs of each one's out_dtype).

    "phased": READY launches, then push launches, then GEMM launches, each over all ranks.
    "staggered": READY for all, push for ranks 0..W-2, the registered op (one launch, all phases)
    for rank W-1, then GEMM for ranks 0..W-2.
    """
    W = world.world_size
    if len(attns) != W or len(ws) != W:
        raise ValueError(f"all_to_all_o_proj_emulated: {len(attns)} inputs / {len(ws)} weights for {W} ranks")
    if schedule not in ("phased", "staggered"):
        raise ValueError(f"all_to_all_o_proj_emulated: unknown schedule {schedule!r}")
    require_same_on_ranks("all_to_all_o_proj_emulated", "attn", attns)
    require_same_on_ranks("all_to_all_o_proj_emulated", "w", ws)
    f8 = fp8 if fp8 is not None else [None] * W
    if outs is None:
        outs = [torch.empty((a.shape[0] // W, w.shape[0]), dtype=a.dtype if f is None else f.out_dtype)
                for a, w, f in zip(attns, ws, f8, strict=True)]
    first = range(W) if schedule == "phased" else range(W - 1)
    kw = {"use_flags": use_flags, "config": config}
    for r in range(W):
        launch_all_to_all_o_proj(attns[r], ws[r], world[r], outs[r], push=False, gemm=False, fp8=f8[r], **kw)
    for r in first:
        launch_all_to_all_o_proj(attns[r], ws[r], world[r], outs[r], send_ready=False, gemm=False, fp8=f8[r], **kw)
    if schedule == "staggered":
        R = W - 1
        o_proj_out_op(attns[R], ws[R], outs[R], world[R], config or default_o_config(), use_flags=use_flags,
                      fp8=f8[R])
    for r in first:
        launch_all_to_all_o_proj(attns[r], ws[r], world[r], outs[r], send_ready=False, push=False, fp8=f8[r], **kw)
    emulated_check(world, "all_to_all_o_proj")
    return outs


def scattered_o_proj_emulated(world: EmulatedWorld, ws: list[torch.Tensor], *, tokens: int, num_tokens: int,
                              c: int) -> list[torch.Tensor]:
    """scattered_o_proj on every rank of an EmulatedWorld, after every rank's scattering attention:
    every rank's arrival publish, then every rank's wait + GEMM."""
    W = world.world_size
    if len(ws) != W:
        raise ValueError(f"scattered_o_proj_emulated: {len(ws)} weights for {W} ranks")
    for r in range(W):
        launch_o_arrival(world[r], wait=False)
    outs = []
    for r in range(W):
        local = zeroed_padding(world[r], tokens, num_tokens, c, ws[r].dtype)
        launch_o_arrival(world[r], publish=False)
        outs.append(F.linear(local, ws[r]))
    emulated_check(world, "scattered_o_proj")
    return outs
