"""torch.library ops of the fused GEMM + all-reduce, with fake impls: torch.compile and CUDA-graph
capture see one opaque node.

`torch.ops.fusedpar.gemm_all_reduce` returns a new [M, N] tensor; `gemm_all_reduce_out` writes a
given one. The peer table travels as its tensors + ints (no registry of workspaces); counters is
declared mutated: it is (the epoch advances), and that keeps the op from being dead-code
eliminated or reordered across another launch on the same table, which would desynchronise the
ranks. `_call_fused` is the router's entry: the op under torch.compile, a direct launch in eager
(the custom-op dispatcher's host cost is a sizeable part of a decode-size call).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedpar.collectives.symmetric import PeerTable
from fusedpar.kernels.fp8 import FP8Operands
from fusedpar.kernels.gemm_all_reduce.launch import _run_plan, check_operands, check_shapes, plan_or_raise
from fusedpar.kernels.gemm_all_reduce.plan import FusedConfig, FusedPlan


def _run_op(x, w, out, buffer_ptrs, signal_ptrs, counters, rank, world_size, buffer_bytes, max_blocks, path,
            partial_fp32, config, use_flags, residual=None, fp8=None) -> None:
    """Body of the registered ops: plan from the op's arguments, then every phase of every chunk."""
    # A light PeerTable stand-in for fused_plan (sizes only).
    table = _Sizes(world_size, buffer_bytes, max_blocks, counters.device)
    pdt = torch.float32 if partial_fp32 else out.dtype
    plan = plan_or_raise(path, x, w, table, pdt, FusedConfig.from_list(list(config)), out.dtype)
    _run_plan(x, w, out, buffer_ptrs, signal_ptrs, counters, rank, world_size, plan, use_flags=use_flags,
              residual=residual, fp8=fp8)


@dataclass(frozen=True)
class _Sizes:
    world_size: int
    buffer_bytes: int
    max_blocks: int
    device: torch.device


@torch.library.custom_op("fusedpar::gemm_all_reduce", mutates_args=("counters",))
def _fused_op(
    x: torch.Tensor,
    w: torch.Tensor,
    buffer_ptrs: torch.Tensor,
    signal_ptrs: torch.Tensor,
    counters: torch.Tensor,
    rank: int,
    world_size: int,
    buffer_bytes: int,
    max_blocks: int,
    path: str,
    partial_fp32: bool,
    config: list[int],
    use_flags: bool,
    residual: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    fp8_tiles: list[int] | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """out = [residual +] sum over ranks of x @ w^T through a fused path; a new contiguous [M, N] tensor
    of x's dtype (e4m3 x and w: of out_dtype, with the scales x_scale, w_scale and fp8_tiles = [w_tile_n,
    w_tile_k, x_group] of FP8Operands)."""
    fp8 = FP8Operands.from_op_args(x_scale, w_scale, fp8_tiles, out_dtype)
    check_operands(x, w, None, counters.device, residual, fp8)
    out = torch.empty((x.shape[0], w.shape[0]), dtype=out_dtype or x.dtype, device=x.device)
    _run_op(x, w, out, buffer_ptrs, signal_ptrs, counters, rank, world_size, buffer_bytes, max_blocks, path,
            partial_fp32, config, use_flags, residual, fp8)
    return out


@_fused_op.register_fake
def _fused_fake(x, w, buffer_ptrs, signal_ptrs, counters, rank, world_size, buffer_bytes, max_blocks, path,
                partial_fp32, config, use_flags, residual=None, x_scale=None, w_scale=None, fp8_tiles=None,
                out_dtype=None):
    check_shapes(x, w)
    return x.new_empty((x.shape[0], w.shape[0]), dtype=out_dtype or x.dtype)


@torch.library.custom_op("fusedpar::gemm_all_reduce_out", mutates_args=("out", "counters"))
def _fused_out_op(
    x: torch.Tensor,
    w: torch.Tensor,
    buffer_ptrs: torch.Tensor,
    signal_ptrs: torch.Tensor,
    counters: torch.Tensor,
    out: torch.Tensor,
    rank: int,
    world_size: int,
    buffer_bytes: int,
    max_blocks: int,
    path: str,
    partial_fp32: bool,
    config: list[int],
    use_flags: bool,
    residual: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    fp8_tiles: list[int] | None = None,
    out_dtype: torch.dtype | None = None,
) -> None:
    """out[:] = [residual +] sum over ranks of x @ w^T through a fused path; out may be any strided
    [M, N] view not sharing memory with x or w, and either residual itself or not overlapping it.
    FP8 arguments: as gemm_all_reduce's op (out_dtype is out's)."""
    fp8 = FP8Operands.from_op_args(x_scale, w_scale, fp8_tiles, out_dtype)
    check_operands(x, w, out, counters.device, residual, fp8)
    _run_op(x, w, out, buffer_ptrs, signal_ptrs, counters, rank, world_size, buffer_bytes, max_blocks, path,
            partial_fp32, config, use_flags, residual, fp8)


@_fused_out_op.register_fake
def _fused_out_fake(x, w, buffer_ptrs, signal_ptrs, counters, out, rank, world_size, buffer_bytes, max_blocks, path,
                    partial_fp32, config, use_flags, residual=None, x_scale=None, w_scale=None, fp8_tiles=None,
                    out_dtype=None):
    check_shapes(x, w)


def _call_fused(x, w, table: PeerTable, out, plan: FusedPlan, use_flags: bool = True,
                residual: torch.Tensor | None = None, fp8: FP8Operands | None = None) -> torch.Tensor:
    """Run a fused plan: through the registered op under torch.compile, else a direct launch (the
    custom-op dispatcher's host cost is a sizeable part of a decode-size call)."""
    out_dtype = x.dtype if fp8 is None else fp8.out_dtype
    if torch.compiler.is_compiling():
        args = (table.buffer_ptrs, table.signal_ptrs, table.counters)
        meta = (table.rank, table.world_size, table.buffer_bytes, table.max_blocks, plan.path,
                plan.partial_dtype == torch.float32 and out_dtype != torch.float32, plan.config.as_list(), use_flags,
                residual, *FP8Operands.op_args(fp8))
        if out is None:
            return torch.ops.fusedpar.gemm_all_reduce(x, w, *args, *meta)
        torch.ops.fusedpar.gemm_all_reduce_out(x, w, *args, out, *meta)
        return out
    if out is None:
        out = torch.empty((x.shape[0], w.shape[0]), dtype=out_dtype, device=x.device)
    _run_plan(x, w, out, table.buffer_ptrs, table.signal_ptrs, table.counters, table.rank, table.world_size, plan,
              use_flags=use_flags, residual=residual, fp8=fp8)
    return out
