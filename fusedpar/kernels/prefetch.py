"""Warm a weight into the GPU's L2 cache ahead of the GEMM that reads it (decode steps).

A decode step is a chain of weight-read-bound GEMMs and latency-bound kernels (attention over a
few sequences, norms, all-reduce waits) during which HBM sits mostly idle. The next GEMM's weight
does not depend on anything computed in the step, so it can be fetched into L2 while a
latency-bound kernel runs; the GEMM then streams it from L2. An H200 has 60 MiB of L2: the
o-projection shard of a TP=4 Llama-3-70B / Qwen3-32B layer (32 / 20 MiB) fits.

l2_prefetch(w) issues Hopper bulk L2 prefetches (`cp.async.bulk.prefetch.L2.global [addr], size`,
sm_90+): a hint with no effect on any value, no completion to wait for, so the kernel only issues
instructions and exits. It takes a 2-D view with contiguous rows (any row stride: the shift
views of row-parallel weights are column slices of the base weight) whose rows and start are
16-byte aligned (the instruction's requirement); anything else is skipped (returns False), as
are CPUs and GPUs before sm_90.

Layers: _l2_prefetch_kernel (@triton.jit) -> l2_prefetch launcher. GPU only (inline PTX): the
CPU interpreter never runs it; tests/kernels/test_prefetch.py checks the planning on CPU and
the launch on a GPU.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fusedpar.kernels._host import cdiv

__all__ = ["PREFETCH_CHUNK_BYTES", "l2_prefetch", "prefetch_plan"]

PREFETCH_CHUNK_BYTES = 4096  # bytes per prefetch instruction (a row is split into chunks of this)
_BLOCK = 128  # instructions per program (one per thread of a 4-warp program)


@triton.jit
def _l2_prefetch_kernel(base, rows, row_bytes, stride_bytes, chunks_per_row, CHUNK: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Program p issues prefetches p * BLOCK .. (p + 1) * BLOCK - 1 of the (row, chunk) list."""
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row = idx // chunks_per_row
    chunk = idx % chunks_per_row
    addr = base + row.to(tl.int64) * stride_bytes + chunk.to(tl.int64) * CHUNK
    size = tl.minimum(row_bytes - chunk.to(tl.int64) * CHUNK, CHUNK).to(tl.int32)
    ok = (row < rows).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $3; mov.u32 $0, 0; }",
        "=r,l,r,r", [addr, ok, size], dtype=tl.int32, is_pure=False, pack=1,
    )


def prefetch_plan(w: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(rows, row bytes, row stride bytes, chunks per row) of the bulk prefetches that cover w, or
    None where the instruction cannot: not 2-D with contiguous rows, or start / row / stride not
    16-byte aligned. Pure host arithmetic (CPU-testable)."""
    if w.dim() != 2 or w.numel() == 0 or (w.stride(1) != 1 and w.shape[1] > 1):
        return None
    elem = w.element_size()
    row_bytes = w.shape[1] * elem
    stride_bytes = w.stride(0) * elem
    if w.data_ptr() % 16 or row_bytes % 16 or stride_bytes % 16:
        return None
    if stride_bytes == row_bytes:  # contiguous block: one long row, fewer (row, chunk) pairs to index
        return 1, row_bytes * w.shape[0], 0, cdiv(row_bytes * w.shape[0], PREFETCH_CHUNK_BYTES)
    return w.shape[0], row_bytes, stride_bytes, cdiv(row_bytes, PREFETCH_CHUNK_BYTES)


@functools.cache
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def l2_prefetch(w: torch.Tensor) -> bool:
    """Ask the GPU to bring every byte of w into L2 (a hint: values are never affected); True if
    the prefetch kernel was launched (on the current stream), False where it does not apply."""
    if not w.is_cuda or not _supported(w.device.index if w.device.index is not None else torch.cuda.current_device()):
        return False
    plan = prefetch_plan(w)
    if plan is None:
        return False
    rows, row_bytes, stride_bytes, chunks = plan
    total = rows * chunks
    with torch.cuda.device(w.device):
        _l2_prefetch_kernel[(cdiv(total, _BLOCK),)](
            w.data_ptr(), rows, row_bytes, stride_bytes, chunks, CHUNK=PREFETCH_CHUNK_BYTES, BLOCK=_BLOCK,
            num_warps=4,
        )
    return True

