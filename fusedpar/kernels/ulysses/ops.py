"""torch.library registrations of the Ulysses launches, for torch.compile, and their fakes.

The peer table travels as its tensors + ints (table_args); tile configs as int lists (gemm_meta,
o_meta). Only tensors the kernel writes through its argument pointer are declared mutated
(counters, out, the scatter staging view): functionalization may run a mutating op on clones and
copy them back, which would overwrite a receive / staging buffer that the peers fill through the
pointer table. Hence fusedpar::qkv_all_to_all returns a copy of the receive buffer (functional
semantics under torch.compile); eager callers get the zero-copy view.

qkv_op / qkv_wait_op / o_proj_op / o_proj_out_op / o_arrival_op call the registered ops from a
PeerTable (the routers under torch.compile, and the emulation's single-launch schedules).
"""

from __future__ import annotations

import torch

from fusedpar.collectives.symmetric import PeerTable
from fusedpar.kernels.fp8 import FP8Operands
from fusedpar.kernels.gemm import GemmConfig
from fusedpar.kernels.ulysses.config import OProjConfig
from fusedpar.kernels.ulysses.launch import (
    launch_all_to_all_o_proj,
    launch_o_arrival,
    launch_qkv_all_to_all,
    launch_qkv_wait,
    qkv_recv_view,
)

_GEMM_META = 9  # the ints of a GemmConfig in an op's schema


def _table_from(buffer, buffer_ptrs, signal_ptrs, counters, rank, world_size, max_blocks) -> PeerTable:
    return PeerTable(rank=rank, world_size=world_size, buffer=buffer, buffer_ptrs=buffer_ptrs,
                     signal_ptrs=signal_ptrs, counters=counters, max_blocks=max_blocks)


def table_args(table: PeerTable) -> tuple:
    """A table as the ops' leading arguments: buffer, buffer_ptrs, signal_ptrs, counters, rank, world, max_blocks."""
    return (table.buffer, table.buffer_ptrs, table.signal_ptrs, table.counters, table.rank, table.world_size,
            table.max_blocks)


def _gemm_cfg(block_m, block_n, block_k, group_m, num_warps, num_stages, tma=0, flatten=1,
              block_n2=0) -> GemmConfig | None:
    if block_m <= 0:
        return None
    return GemmConfig(block_m, block_n, block_k, group_m=group_m, num_warps=num_warps, num_stages=num_stages,
                      tma=bool(tma), flatten=bool(flatten), block_n2=block_n2)


def gemm_meta(cfg: GemmConfig | None) -> list[int]:
    """A GemmConfig as the ints of an op's schema (zeros: None)."""
    if cfg is None:
        return [0] * _GEMM_META
    return [cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m, cfg.num_warps, cfg.num_stages,
            int(cfg.tma), int(cfg.flatten), cfg.block_n2]


def o_meta(cfg: OProjConfig) -> list[int]:
    """An OProjConfig as the ints of an op's schema."""
    return [*gemm_meta(cfg.gemm), cfg.comm_programs, cfg.copy_rows, cfg.copy_cols, cfg.max_bands]


def _o_cfg(meta: list[int]) -> OProjConfig:
    return OProjConfig(_gemm_cfg(*meta[:_GEMM_META]), *meta[_GEMM_META:])


# ================================================================================ qkv_all_to_all


@torch.library.custom_op("fusedpar::qkv_all_to_all", mutates_args=("counters",))
def _qkv_op(
    x: torch.Tensor,
    w: torch.Tensor,
    buffer: torch.Tensor,
    buffer_ptrs: torch.Tensor,
    signal_ptrs: torch.Tensor,
    counters: torch.Tensor,
    rank: int,
    world_size: int,
    max_blocks: int,
    use_flags: bool,
    gemm_meta: list[int],
    x_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    fp8_tiles: list[int] | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """All phases in one launch, then a copy of the receive buffer [W*m, blk] (e4m3 x and w: of out_dtype,
    with the scales of FP8Operands.op_args)."""
    table = _table_from(buffer, buffer_ptrs, signal_ptrs, counters, rank, world_size, max_blocks)
    fp8 = FP8Operands.from_op_args(x_scale, w_scale, fp8_tiles, out_dtype)
    launch_qkv_all_to_all(x, w, table, use_flags=use_flags, config=_gemm_cfg(*gemm_meta), fp8=fp8)
    blk = w.shape[0] // world_size
    return qkv_recv_view(table, x.shape[0], blk, out_dtype or x.dtype).clone()


@_qkv_op.register_fake
def _qkv_fake(x, w, buffer, buffer_ptrs, signal_ptrs, counters, rank, world_size, max_blocks, use_flags, gemm_meta,
              x_scale=None, w_scale=None, fp8_tiles=None, out_dtype=None):
    if w.dim() != 2 or x.dim() != 2 or w.shape[0] % world_size or x.shape[1] != w.shape[1]:
        raise ValueError("qkv_all_to_all: x must be [m, d] and w [W*blk, d]")
    return x.new_empty((world_size * x.shape[0], w.shape[0] // world_size), dtype=out_dtype or x.dtype)


@torch.library.custom_op("fusedpar::qkv_all_to_all_wait", mutates_args=("counters",))
def _qkv_wait_op(signal_ptrs: torch.Tensor, counters: torch.Tensor, rank: int, world_size: int) -> None:
    launch_qkv_wait(signal_ptrs, counters, rank, world_size)


@_qkv_wait_op.register_fake
def _qkv_wait_fake(signal_ptrs, counters, rank, world_size):
    return None


def qkv_op(x: torch.Tensor, w: torch.Tensor, table: PeerTable, *, use_flags: bool = True,
           config: GemmConfig | None = None, fp8: FP8Operands | None = None) -> torch.Tensor:
    """torch.ops.fusedpar.qkv_all_to_all on `table`: all phases, a copy of the receive buffer."""
    return torch.ops.fusedpar.qkv_all_to_all(x, w, *table_args(table), use_flags, gemm_meta(config),
                                             *FP8Operands.op_args(fp8))


def qkv_wait_op(table: PeerTable) -> None:
    """torch.ops.fusedpar.qkv_all_to_all_wait on `table`."""
    torch.ops.fusedpar.qkv_all_to_all_wait(table.signal_ptrs, table.counters, table.rank, table.world_size)


# ================================================================================ all_to_all_o_proj


@torch.library.custom_op("fusedpar::all_to_all_o_proj", mutates_args=("counters",))
def _o_op(
    attn: torch.Tensor,
    w: torch.Tensor,
    buffer: torch.Tensor,
    buffer_ptrs: torch.Tensor,
    signal_ptrs: torch.Tensor,
    counters: torch.Tensor,
    rank: int,
    world_size: int,
    max_blocks: int,
    use_flags: bool,
    meta: list[int],
    x_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    fp8_tiles: list[int] | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """A new [m, N] output (e4m3 attn and w_o: of out_dtype, with the scales of FP8Operands.op_args)."""
    table = _table_from(buffer, buffer_ptrs, signal_ptrs, counters, rank, world_size, max_blocks)
    out = torch.empty((attn.shape[0] // world_size, w.shape[0]), dtype=out_dtype or attn.dtype, device=attn.device)
    launch_all_to_all_o_proj(attn, w, table, out, use_flags=use_flags, config=_o_cfg(meta),
                             fp8=FP8Operands.from_op_args(x_scale, w_scale, fp8_tiles, out_dtype))
    return out


@_o_op.register_fake
def _o_fake(attn, w, buffer, buffer_ptrs, signal_ptrs, counters, rank, world_size, max_blocks, use_flags, meta,
            x_scale=None, w_scale=None, fp8_tiles=None, out_dtype=None):
    if attn.dim() != 2 or w.dim() != 2 or attn.shape[0] % world_size or w.shape[1] != world_size * attn.shape[1]:
        raise ValueError("all_to_all_o_proj: attn must be [W*m, C] and w_o [N, W*C]")
    return attn.new_empty((attn.shape[0] // world_size, w.shape[0]), dtype=out_dtype or attn.dtype)


@torch.library.custom_op("fusedpar::all_to_all_o_proj_out", mutates_args=("out", "counters"))
def _o_out_op(
    attn: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    buffer: torch.Tensor,
    buffer_ptrs: torch.Tensor,
    signal_ptrs: torch.Tensor,
    counters: torch.Tensor,
    rank: int,
    world_size: int,
    max_blocks: int,
    use_flags: bool,
    meta: list[int],
    x_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    fp8_tiles: list[int] | None = None,
    out_dtype: torch.dtype | None = None,
) -> None:
    """Into `out` (FP8 arguments: as all_to_all_o_proj's op)."""
    table = _table_from(buffer, buffer_ptrs, signal_ptrs, counters, rank, world_size, max_blocks)
    launch_all_to_all_o_proj(attn, w, table, out, use_flags=use_flags, config=_o_cfg(meta),
                             fp8=FP8Operands.from_op_args(x_scale, w_scale, fp8_tiles, out_dtype))


@_o_out_op.register_fake
def _o_out_fake(
    attn, w, out, buffer, buffer_ptrs, signal_ptrs, counters, rank, world_size, max_blocks, use_flags, meta,
    x_scale=None, w_scale=None, fp8_tiles=None, out_dtype=None
):
    return None


def o_proj_op(attn: torch.Tensor, w: torch.Tensor, table: PeerTable, config: OProjConfig, *,
              use_flags: bool = True, fp8: FP8Operands | None = None) -> torch.Tensor:
    """torch.ops.fusedpar.all_to_all_o_proj on `table`: a new [m, N] output."""
    return torch.ops.fusedpar.all_to_all_o_proj(attn, w, *table_args(table), use_flags, o_meta(config),
                                                *FP8Operands.op_args(fp8))


def o_proj_out_op(attn: torch.Tensor, w: torch.Tensor, out: torch.Tensor, table: PeerTable, config: OProjConfig, *,
                  use_flags: bool = True, fp8: FP8Operands | None = None) -> None:
    """torch.ops.fusedpar.all_to_all_o_proj_out on `table`: into `out`."""
    torch.ops.fusedpar.all_to_all_o_proj_out(attn, w, out, *table_args(table), use_flags, o_meta(config),
                                             *FP8Operands.op_args(fp8))


# ================================================================================ scattered_o_proj


@torch.library.custom_op("fusedpar::o_scatter_arrival", mutates_args=("local", "counters"))
def _o_arrival_op(local: torch.Tensor, buffer: torch.Tensor, buffer_ptrs: torch.Tensor, signal_ptrs: torch.Tensor,
                  counters: torch.Tensor, rank: int, world_size: int, max_blocks: int) -> None:
    """The arrival barrier; `local` (the staging view) is what the peers' stores filled."""
    launch_o_arrival(_table_from(buffer, buffer_ptrs, signal_ptrs, counters, rank, world_size, max_blocks))


@_o_arrival_op.register_fake
def _o_arrival_fake(local, buffer, buffer_ptrs, signal_ptrs, counters, rank, world_size, max_blocks) -> None:
    return None


def o_arrival_op(local: torch.Tensor, table: PeerTable) -> None:
    """torch.ops.fusedpar.o_scatter_arrival on `table` (local: its staging view)."""
    torch.ops.fusedpar.o_scatter_arrival(local, *table_args(table))
