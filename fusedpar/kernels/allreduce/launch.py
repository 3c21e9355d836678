"""Checks and raw launchers of the one-shot all-reduce kernel (kernels.py); no routing, no op registration.

`_launch` is one launch of the chosen phases; `_launch_both` runs both phases in one launch (the GPU
path of the registered ops and of eager calls); `launch_one_shot_all_reduce` is the raw launcher as
`table.rank`, with the switches the CPU emulation and the tests need (one phase, flags off, a spin
limit, a config). Callers normally want one_shot_all_reduce().
"""

from __future__ import annotations

import torch

from fusedpar.collectives.symmetric import PeerTable
from fusedpar.kernels._host import INTERPRETED, SUPPORTED_DTYPES, cdiv
from fusedpar.kernels._sync import next_pow2, resolve_spin_limit
from fusedpar.kernels.allreduce.config import OneShotConfig, default_config, one_shot_capacity_bytes
from fusedpar.kernels.allreduce.kernels import _one_shot_all_reduce_kernel


def _check(x: torch.Tensor, device: torch.device, slot_bytes: int, out: torch.Tensor | None) -> None:
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"one-shot all-reduce supports {SUPPORTED_DTYPES}, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"one-shot all-reduce: x is on {x.device} but the peer table is on {device}")
    if x.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError(
            "one-shot all-reduce on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 "
            "before fusedpar.kernels.allreduce is first imported"
        )
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"one-shot all-reduce supports CUDA (and CPU under TRITON_INTERPRET=1), got {x.device}")
    if x.numel() * x.element_size() > slot_bytes:
        raise ValueError(
            f"one-shot all-reduce: {x.numel() * x.element_size()} bytes exceed the workspace slot of "
            f"{slot_bytes} bytes (buffer_bytes / 2); use a bigger workspace or all_reduce(), which falls "
            "back to NCCL"
        )
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or out.device != x.device):
        raise ValueError(
            f"one-shot all-reduce: out must match x ({tuple(x.shape)}, {x.dtype}, {x.device}), "
            f"got ({tuple(out.shape)}, {out.dtype}, {out.device})"
        )
    if out is not None and not out.is_contiguous():
        raise ValueError("one-shot all-reduce: out must be contiguous")


def _launch(
    x: torch.Tensor,
    out: torch.Tensor,
    buffer_ptrs: torch.Tensor,
    signal_ptrs: torch.Tensor,
    counters: torch.Tensor,
    rank: int,
    world_size: int,
    slot_bytes: int,
    max_blocks: int,
    *,
    copy_in: bool,
    reduce: bool,
    use_flags: bool,
    spin_limit: int | None,
    config: OneShotConfig | None,
):
    """Launch; returns Triton's compiled-kernel handle (None when nothing ran or interpreting)."""
    n = x.numel()
    if n == 0:
        return None
    cfg = config or default_config()
    grid = min(cdiv(n, cfg.block), cfg.max_blocks, max_blocks)
    return _one_shot_all_reduce_kernel[(grid,)](
        x.contiguous(),
        out,
        n,
        buffer_ptrs,
        signal_ptrs,
        counters,
        rank,
        slot_bytes,
        WORLD=world_size,
        WORLD_P2=next_pow2(world_size),
        BLOCK=cfg.block,
        COPY_IN=copy_in,
        REDUCE=reduce,
        USE_FLAGS=use_flags,
        SPIN_LIMIT=resolve_spin_limit(spin_limit, INTERPRETED, 0),
        num_warps=cfg.num_warps,
    )


def _launch_both(x, out, buffer_ptrs, signal_ptrs, counters, rank, world_size, slot_bytes, max_blocks,
                 cfg: OneShotConfig | None, *, use_flags: bool = True):
    """Both phases in one launch, default spin limit: the path of the registered ops and of eager calls.
    use_flags=False (the registered ops' argument, for the emulation) skips the flag protocol."""
    return _launch(x, out, buffer_ptrs, signal_ptrs, counters, rank, world_size, slot_bytes, max_blocks,
                   copy_in=True, reduce=True, use_flags=use_flags, spin_limit=None, config=cfg)

def launch_one_shot_all_reduce(
    x: torch.Tensor,
    table: PeerTable,
    out: torch.Tensor,
    *,
    copy_in: bool = True,
    reduce: bool = True,
    use_flags: bool = True,
    spin_limit: int | None = None,
    config: OneShotConfig | None = None,
):
    """Launch the kernel as `table.rank` (both phases, or one of them for the CPU emulation).

    Raw launcher, no op registration: callers normally want one_shot_all_reduce(). copy_in only:
    publishes x (out untouched); reduce only: waits, sums into out, advances the epoch.
    use_flags=False skips the flag protocol: correct only when something else orders the ranks
    (the phased emulation), a data race on GPUs. spin_limit None: unbounded on GPU, bounded
    under the interpreter. Returns Triton's compiled-kernel handle on GPUs (PTX inspection).
    """
    if out is None:
        raise ValueError("launch_one_shot_all_reduce: out is required (one_shot_all_reduce allocates it)")
    slot_bytes = one_shot_capacity_bytes(table)
    _check(x, table.device, slot_bytes, out)
    if not (copy_in or reduce):
        raise ValueError("launch_one_shot_all_reduce: nothing to do (copy_in=False and reduce=False)")
    return _launch(
        x,
        out,
        table.buffer_ptrs,
        table.signal_ptrs,
        table.counters,
        table.rank,
        table.world_size,
        slot_bytes,
        table.max_blocks,
        copy_in=copy_in,
        reduce=reduce,
        use_flags=use_flags,
        spin_limit=spin_limit,
        config=config,
    )
