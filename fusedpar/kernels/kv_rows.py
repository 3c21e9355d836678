"""Gather and scatter of token rows of a paged KV pool, k and v in one Triton launch.

A KV migration (fusedpar.layers.reshard.migrate_kv) reads the pieces it sends out of the paged
pool and writes what it receives into fresh blocks. Seen as [layers, rows, head_dim] (row = cache
slot * local kv heads + head index), both are row moves with one row index shared by every layer:

    gather:  chunk[0, l, i] = k_pool[l, idx[i]]    chunk[1, l, i] = v_pool[l, idx[i]]
    scatter: k_pool[l, idx[i]] = chunk[0, l, i]    v_pool[l, idx[i]] = chunk[1, l, i]

chunk [2, layers, n, head_dim] contiguous (k then v: what the exchange sends), idx int64 [n] (no
repeats for a scatter). One program per (BLOCK_R rows, layer, k | v) loads its row indices once and
copies head_dim-wide rows. torch's index_select / index_copy_ along dim 1 do the same at about half
the bandwidth (their index kernels address element by element): perf/tools/probe_kv_gather.py.

_move_rows_kernel (@triton.jit) -> move_kv_rows (checks, grid; the torch ops where Triton cannot run:
CPU tensors without TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedpar.kernels._host import INTERPRETED, cdiv, next_pow2

BLOCK_R = 32  # rows per program: 32 x 128 bf16 = 8 KiB moved per program


@triton.jit(do_not_specialize=["n"])
def _move_rows_kernel(k_pool_ptr, v_pool_ptr, idx_ptr, chunk_ptr, n, stride_pool_layer, layers, HD: tl.constexpr,
                      HD_P2: tl.constexpr, SCATTER: tl.constexpr, BLOCK_R: tl.constexpr):
    """Program (row block, layer, kv): the rows idx[rb * BLOCK_R ...] of one layer of k (kv 0) or v."""
    rb = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    kv = tl.program_id(2)
    rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, HD_P2)
    mask = (rows < n)[:, None] & (cols < HD)[None, :]
    idx = tl.load(idx_ptr + rows, mask=rows < n, other=0).to(tl.int64)
    pool_off = layer * stride_pool_layer + idx[:, None] * HD + cols[None, :]
    chunk = chunk_ptr + ((kv * layers + layer) * n + rows[:, None].to(tl.int64)) * HD + cols[None, :]
    if kv == 0:  # noqa: SIM108 (a runtime scalar: Triton takes an if, not a ternary)
        pool = k_pool_ptr + pool_off
    else:
        pool = v_pool_ptr + pool_off
    if SCATTER:
        tl.store(pool, tl.load(chunk, mask=mask), mask=mask)
    else:
        tl.store(chunk, tl.load(pool, mask=mask), mask=mask)


def _check(k_pool: torch.Tensor, v_pool: torch.Tensor, idx: torch.Tensor, chunk: torch.Tensor) -> None:
    problems = []
    if k_pool.dim() != 3 or v_pool.shape != k_pool.shape or k_pool.stride() != v_pool.stride():
        problems.append(f"k_pool / v_pool must be one [layers, rows, head_dim] shape and strides, got "
                        f"{tuple(k_pool.shape)} {k_pool.stride()} / {tuple(v_pool.shape)} {v_pool.stride()}")
    elif k_pool.stride(2) != 1 or k_pool.stride(1) != k_pool.shape[2]:
        problems.append(f"pool rows must be contiguous (strides (., {k_pool.shape[2]}, 1)), got {k_pool.stride()}")
    if idx.dim() != 1 or idx.dtype != torch.int64:
        problems.append(f"idx must be int64 [n], got {idx.dtype} {tuple(idx.shape)}")
    if k_pool.dim() == 3 and idx.dim() == 1:
        want = (2, k_pool.shape[0], idx.numel(), k_pool.shape[2])
        if tuple(chunk.shape) != want or not chunk.is_contiguous():
            problems.append(f"chunk must be contiguous {want} (k | v, layers, n, head_dim), got "
                            f"{tuple(chunk.shape)}{'' if chunk.is_contiguous() else ' non-contiguous'}")
    if not (k_pool.dtype == v_pool.dtype == chunk.dtype):
        problems.append(f"dtypes differ: k_pool {k_pool.dtype}, v_pool {v_pool.dtype}, chunk {chunk.dtype}")
    if len({t.device for t in (k_pool, v_pool, idx, chunk)}) != 1:
        problems.append(f"tensors on several devices: {[str(t.device) for t in (k_pool, v_pool, idx, chunk)]}")
    if problems:
        raise ValueError("fusedpar.move_kv_rows: " + "; ".join(problems))


def move_kv_rows(k_pool: torch.Tensor, v_pool: torch.Tensor, idx: torch.Tensor, chunk: torch.Tensor, *,
                 scatter: bool) -> None:
    """Gather (scatter=False) rows idx of k_pool / v_pool [layers, rows, head_dim] into chunk
    [2, layers, n, head_dim], or scatter chunk into those rows (idx without repeats). In place."""
    _check(k_pool, v_pool, idx, chunk)
    n = idx.numel()
    if n == 0:
        return
    if k_pool.device.type == "cpu" and not INTERPRETED:  # Triton compiled for a GPU: the torch ops
        for pool, part in ((k_pool, chunk[0]), (v_pool, chunk[1])):
            if scatter:
                pool.index_copy_(1, idx, part)
            else:
                torch.index_select(pool, 1, idx, out=part)
        return
    layers, _, hd = k_pool.shape
    grid = (cdiv(n, BLOCK_R), layers, 2)
    guard = torch.cuda.device(k_pool.device) if k_pool.device.type == "cuda" else None
    args = (k_pool, v_pool, idx, chunk, n, k_pool.stride(0), layers)
    kw = {"HD": hd, "HD_P2": next_pow2(hd), "SCATTER": scatter, "BLOCK_R": BLOCK_R}
    if guard is None:
        _move_rows_kernel[grid](*args, **kw)
    else:
        with guard:
            _move_rows_kernel[grid](*args, **kw)


def move_kv_rows_reference(k_pool: torch.Tensor, v_pool: torch.Tensor, idx: torch.Tensor, chunk: torch.Tensor, *,
                           scatter: bool) -> None:
    """The plain-torch meaning of move_kv_rows (tests)."""
    for pool, part in ((k_pool, chunk[0]), (v_pool, chunk[1])):
        if scatter:
            pool[:, idx] = part
        else:
            part.copy_(pool[:, idx])


__all__ = ["BLOCK_R", "move_kv_rows", "move_kv_rows_reference"]
