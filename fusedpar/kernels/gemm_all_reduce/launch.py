"""Checks and launchers of the fused GEMM + all-reduce kernel (no routing, no op registration).

`launch_chunk` is one launch of the chosen phases over one row chunk; `_run_plan` runs every chunk
of a plan (the GPU path: all phases per launch); `launch_gemm_all_reduce` is the raw launcher as
`table.rank`, with the switches the CPU emulation and the tests need (a subset of the phases,
flags off, a spin limit, a config). Callers normally want gemm_all_reduce().
"""

from __future__ import annotations

import dataclasses

import torch

from fusedpar.collectives.symmetric import PeerTable
from fusedpar.kernels._host import (
    INTERPRETED,
    SUPPORTED_DTYPES,
    cdiv,
    check_out_overlap,
    max_offset,
    overlaps_other_view,
)
from fusedpar.kernels._sync import GPU_SPIN_LIMIT, device_guard, esize, next_pow2, resolve_spin_limit
from fusedpar.kernels.fp8 import NO_FP8_SCALES, FP8Operands, check_fp8_operands
from fusedpar.kernels.gemm_all_reduce.kernels import _gemm_all_reduce_kernel
from fusedpar.kernels.gemm_all_reduce.plan import FusedConfig, FusedPlan, fused_plan, layout


def check_shapes(x: torch.Tensor, w: torch.Tensor) -> None:
    """x [M, K] and w [N, K] (nn.Linear orientation): what the fake impls can check."""
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"gemm_all_reduce: x must be [M, K] and w [N, K], got {tuple(x.shape)}, {tuple(w.shape)}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(
            f"gemm_all_reduce: inner dims differ: x {tuple(x.shape)} is [M, K_local] and w {tuple(w.shape)} is "
            "[N, K_local] (nn.Linear orientation)"
        )


def check_operands(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None, device: torch.device,
                   residual: torch.Tensor | None = None, fp8: FP8Operands | None = None) -> None:
    """The fused paths' operand checks: shapes, one supported dtype, the workspace's device, out and
    residual [M, N] of x's dtype, int32-addressable spans, and out's overlaps (real tensors only).
    fp8: x and w are e4m3 with these scales (check_fp8_operands), out and residual of fp8.out_dtype."""
    check_shapes(x, w)
    if fp8 is not None:
        check_fp8_operands("gemm_all_reduce", x, w, fp8)
    elif x.dtype not in SUPPORTED_DTYPES or w.dtype != x.dtype:
        raise TypeError(
            f"gemm_all_reduce: x and w must share one dtype of {SUPPORTED_DTYPES}, got {x.dtype}, {w.dtype} "
            "(e4m3 operands come with their scales: fp8=FP8Operands)"
        )
    out_dtype = x.dtype if fp8 is None else fp8.out_dtype
    if x.device != device or w.device != device:
        raise ValueError(f"gemm_all_reduce: x ({x.device}) and w ({w.device}) must be on the workspace's {device}")
    if x.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError(
            "gemm_all_reduce on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 before "
            "fusedpar.kernels.gemm_all_reduce is first imported"
        )
    want = (x.shape[0], w.shape[0])
    for name, t in (("out", out), ("residual", residual)):
        if t is not None and (tuple(t.shape) != want or t.dtype != out_dtype or t.device != x.device):
            raise ValueError(
                f"gemm_all_reduce: {name} must be {want} of {out_dtype} on {x.device}, got {tuple(t.shape)} "
                f"{t.dtype} {t.device}"
            )
    for name, t in (("x", x), ("w", w), ("out", out), ("residual", residual)):
        if t is not None and max_offset(t) >= 2**31:
            raise ValueError(f"gemm_all_reduce: {name} spans >= 2**31 elements (int32 offsets); split the call")
    if out is not None and not torch.compiler.is_compiling():  # fakes have no memory; the op body checks again
        _check_out_overlap(x, w, out, residual)


def _check_out_overlap(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None) -> None:
    """out may be residual itself (each element is read by the program that then stores it) but no other
    view of it, and must not share memory with x or w: the fused kernel stores finished tiles of out
    while other programs (and, two-shot, other ranks' pushes) still read the operands."""
    check_out_overlap("gemm_all_reduce", out, x=x, w=w)
    if residual is not None and overlaps_other_view(out, residual):
        raise ValueError("gemm_all_reduce: out overlaps residual without being residual itself; pass "
                         "out=residual (in place) or a separate out")


def launch_chunk(x, w, out, buffer_ptrs, signal_ptrs, counters, rank, world, plan: FusedPlan, *,
                  gemm: bool, reduce: bool, copy: bool, use_flags: bool, spin_limit: int | None,
                  residual: torch.Tensor | None = None, fp8: FP8Operands | None = None):
    """One launch of the chosen phases over x [rows, K] -> out [rows, N] (+ residual): a chunk of
    `plan`, as rank `rank` of `world` (fp8: e4m3 x and w with these scales, x_scale's rows those of
    the chunk). Returns Triton's compiled handle (GPU)."""
    two_shot = plan.path == "two_shot"
    cfg, g = plan.config, plan.config.gemm
    m, k = x.shape
    n = w.shape[0]
    res = residual if residual is not None else out
    tiles, own_cap, result_off, _, _ = layout(plan.path, m, n, world, cfg, esize(plan.partial_dtype),
                                               esize(out.dtype))
    scale_args = NO_FP8_SCALES if fp8 is None else fp8.kernel_args()
    if fp8 is not None and fp8.block_k(k, g.block_k) != g.block_k:
        g = dataclasses.replace(g, block_k=fp8.block_k(k, g.block_k))
    last = copy if two_shot else reduce
    split = 1 if two_shot else cfg.split_k
    if INTERPRETED and split > 1 and gemm and reduce:
        # The interpreter runs a launch's programs one after another, so a reducer would wait for
        # a unit of a program that has not run yet (on GPUs every program is resident).
        raise ValueError("gemm_all_reduce: split_k > 1 under the interpreter needs the GEMM and reduce phases in "
                         "separate launches (fusedpar.testing.gemm_all_reduce_emulation, schedule='phased')")
    with device_guard(x.device):
        return _gemm_all_reduce_kernel[(min(cfg.num_sms, tiles * split),)](
            x,
            w,
            out,
            m,
            n,
            k,
            x.stride(0),
            x.stride(1),
            w.stride(0),
            w.stride(1),
            out.stride(0),
            out.stride(1),
            res,
            res.stride(0),
            res.stride(1),
            buffer_ptrs,
            signal_ptrs,
            counters,
            rank,
            plan.slot_bytes,
            result_off,
            own_cap,
            scale_args,
            WORLD=world,
            WORLD_P2=next_pow2(world),
            BLOCK_M=g.block_m,
            BLOCK_N=g.block_n,
            BLOCK_K=g.block_k,
            GROUP_M=g.group_m,
            NUM_SMS=cfg.num_sms,
            EVEN_K=k % g.block_k == 0 and cdiv(k, g.block_k) % split == 0,  # every range's steps full
            INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            PARTIAL_FP32=plan.partial_dtype == torch.float32 and out.dtype != torch.float32,
            COMM_ROWS=cfg.comm_rows,
            SPLIT_K=split,
            SPLIT_WORLD_P2=next_pow2(split * world),
            TWO_SHOT=two_shot,
            DO_GEMM=gemm,
            DO_REDUCE=reduce,
            DO_COPY=copy and two_shot,
            RETIRE=last,
            USE_FLAGS=use_flags,
            HAS_RESIDUAL=residual is not None,
            SPIN_LIMIT=resolve_spin_limit(spin_limit, INTERPRETED, GPU_SPIN_LIMIT),
            FP8=fp8 is not None,
            SCALE_IN_LOOP=fp8 is not None and fp8.scale_in_loop(k),
            num_warps=g.num_warps,
            num_stages=g.num_stages,
        )


def chunk_fp8(fp8: FP8Operands | None, m0: int, rows: int) -> FP8Operands | None:
    """The scales of rows [m0, m0 + rows) of the activations (the weight's are whole)."""
    return None if fp8 is None else dataclasses.replace(fp8, x_scale=fp8.x_scale.narrow(0, m0, rows))


def _run_plan(x, w, out, buffer_ptrs, signal_ptrs, counters, rank, world, plan: FusedPlan, *, gemm: bool = True,
              reduce: bool = True, copy: bool = True, use_flags: bool = True, spin_limit: int | None = None,
              residual: torch.Tensor | None = None, fp8: FP8Operands | None = None):
    """The chosen phases (default all: the GPU path) of every chunk, one launch per chunk. Returns the last handle."""
    if len(plan.chunks) == 1 and plan.chunks[0] == (0, x.shape[0]):  # the decode case: no row views to build
        return launch_chunk(x, w, out, buffer_ptrs, signal_ptrs, counters, rank, world, plan, gemm=gemm,
                             reduce=reduce, copy=copy, use_flags=use_flags, spin_limit=spin_limit, residual=residual,
                             fp8=fp8)
    handle = None
    for m0, rows in plan.chunks:
        handle = launch_chunk(x.narrow(0, m0, rows), w, out.narrow(0, m0, rows), buffer_ptrs, signal_ptrs,
                               counters, rank, world, plan, gemm=gemm, reduce=reduce, copy=copy,
                               use_flags=use_flags, spin_limit=spin_limit,
                               residual=None if residual is None else residual.narrow(0, m0, rows),
                               fp8=chunk_fp8(fp8, m0, rows))
    return handle


def plan_or_raise(path, x, w, table, partial_dtype, config, out_dtype: torch.dtype | None = None) -> FusedPlan:
    """fused_plan for x [M, K], w [N, K] on `table` (partials and output in out_dtype, default x's dtype),
    or ValueError saying why the path cannot run."""
    plan, why = fused_plan(path, x.shape[0], w.shape[0], x.shape[1], out_dtype or x.dtype, table,
                           partial_dtype=partial_dtype, config=config)
    if plan is None:
        raise ValueError(f"gemm_all_reduce: the fused {path} path cannot run this call: {why}")
    return plan


def launch_gemm_all_reduce(
    x: torch.Tensor,
    w: torch.Tensor,
    table: PeerTable,
    out: torch.Tensor,
    *,
    path: str = "two_shot",
    gemm: bool = True,
    reduce: bool = True,
    copy: bool = True,
    partial_dtype: torch.dtype | None = None,
    use_flags: bool = True,
    spin_limit: int | None = None,
    config: FusedConfig | None = None,
    residual: torch.Tensor | None = None,
    fp8: FP8Operands | None = None,
):
    """Raw launcher as `table.rank` (fp8: e4m3 x and w with these scales): the chosen phases (all: the GPU
    path; one: a step of the CPU emulation), one launch per row chunk. No routing, no op registration:
    callers normally want gemm_all_reduce().

    A subset of the phases needs a one-chunk plan: the epoch only advances in the last phase, so
    the next chunk's phases must wait for it (fusedpar.testing.gemm_all_reduce_emulation
    interleaves chunks and phases properly). use_flags=False skips the flag protocol: correct only
    when something else orders the ranks (the phased emulation); a data race on GPUs. Returns the
    last launch's compiled handle (GPU; PTX/TTGIR inspection).
    """
    if path not in ("one_shot", "two_shot"):
        raise ValueError(f"launch_gemm_all_reduce: path must be 'one_shot' or 'two_shot', got {path!r}")
    if not (gemm or reduce or (copy and path == "two_shot")):
        raise ValueError("launch_gemm_all_reduce: nothing to do (no phase selected)")
    check_operands(x, w, out, table.device, residual, fp8)
    plan = plan_or_raise(path, x, w, table, partial_dtype, config, out.dtype)
    if len(plan.chunks) > 1 and not (gemm and reduce and (copy or path == "one_shot")):
        raise ValueError(
            f"launch_gemm_all_reduce: a subset of the phases needs a one-chunk plan, this call runs "
            f"{len(plan.chunks)} chunks (use fusedpar.testing.gemm_all_reduce_emulation, or a bigger workspace)"
        )
    return _run_plan(x, w, out, table.buffer_ptrs, table.signal_ptrs, table.counters, table.rank, table.world_size,
                     plan, gemm=gemm, reduce=reduce, copy=copy, use_flags=use_flags, spin_limit=spin_limit,
                     residual=residual, fp8=fp8)
