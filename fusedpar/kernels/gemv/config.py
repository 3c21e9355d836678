"""Tilings of the decode GEMM: SkinnyConfig (one launch's tiling and K split), the bare table of
GPU tilings per M bucket, and pick_config, which reads the table and sizes the K split so the
programs fill the SMs (perf/tools/bench_gemv.py --sweep times every table row per shape).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from fusedpar.kernels._host import cdiv, next_pow2, require_pow2

SMEM_BYTES = 227 * 1024  # Hopper: dynamic shared memory per CTA
MAX_M = 64  # the decode GEMM's row limit: beyond it the persistent GEMM (fusedpar.kernels.gemm) is the one to use
MAX_SPLIT_K = 64  # bounds the fp32 workspace (split_k x M x N) and the reduce pass


@dataclass(frozen=True)
class SkinnyConfig:
    """Compile-time tiling of one launch plus its K split.

    block_n x block_k: the W tile of one K step (block_k along W's contiguous dim). split_k: the K
    range is cut into this many programs per N tile (1 = no workspace, no reduce pass).
    dot: tensor cores (tl.dot, rows of A padded to 16) or CUDA-core products (tl.sum).
    """

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    dot: bool = True

    def __post_init__(self) -> None:
        require_pow2("SkinnyConfig", block_n=self.block_n, block_k=self.block_k, num_warps=self.num_warps)
        if not 1 <= self.split_k <= MAX_SPLIT_K or self.num_stages < 1:
            raise ValueError(f"SkinnyConfig: split_k={self.split_k} must be in [1, {MAX_SPLIT_K}] and "
                             f"num_stages={self.num_stages} >= 1")

    def block_m(self, m: int) -> int:
        """Rows of A per program: every row (m <= MAX_M), padded to a power of two (>= 16 for tl.dot)."""
        return max(16 if self.dot else 1, next_pow2(m))


# The GPU tilings, one row per M bucket (first row whose largest M >= m):
#   (largest M, BLOCK_N, BLOCK_K, num_warps, num_stages, programs per SM, least K steps per split)
# Shared memory per program: num_stages * (BLOCK_N + BLOCK_M) * BLOCK_K * 2 bytes (<= 227 KiB); one
# program per SM at these sizes, each keeping num_stages - 1 W tiles in flight.
GPU_TABLE: tuple[tuple[int, int, int, int, int, int, int], ...] = (
    (16, 64, 256, 4, 4, 1, 2),
    (32, 64, 256, 4, 3, 1, 2),
    (64, 64, 128, 4, 4, 1, 4),
)

# Interpreter: small tiles so CPU tests see several N tiles, K splits and ragged edges.
INTERPRETER_ROW = (MAX_M, 16, 32, 4, 1, 1, 1)


def choose_split(n: int, k: int, block_n: int, block_k: int, *, slots: int, min_steps: int) -> int:
    """K splits per N tile: the split count s (each split >= min_steps K steps, s <= MAX_SPLIT_K) that
    minimises waves(s) x steps per split, i.e. the K steps of the busiest SM; ties go to fewer
    splits (less workspace traffic). slots = programs the GPU runs at once (#SMs x programs per SM).
    Splits are even: s is reduced to cdiv(k_steps, cdiv(k_steps, s)) so no split is empty."""
    k_steps = max(1, cdiv(k, block_k))
    n_tiles = cdiv(n, block_n)
    best, best_cost = 1, None
    for s in range(1, min(MAX_SPLIT_K, max(1, k_steps // max(1, min_steps))) + 1):
        per = cdiv(k_steps, s)
        s_eff = cdiv(k_steps, per)
        cost = cdiv(n_tiles * s_eff, slots) * per
        if best_cost is None or cost < best_cost:
            best, best_cost = s_eff, cost
    return best


def table_row(m: int, *, interpret: bool) -> tuple[int, int, int, int, int, int, int]:
    """The table row for m rows (INTERPRETER_ROW under the interpreter)."""
    if interpret:
        return INTERPRETER_ROW
    return next(row for row in GPU_TABLE if m <= row[0])


# Every launch asks for its tiling: cached (arguments are ints, a dtype and bools).
@functools.lru_cache(maxsize=4096)
def pick_config(m: int, n: int, k: int, *, dtype: torch.dtype, num_sms: int, interpret: bool) -> SkinnyConfig:
    """The tiling of C[m, n] = A[m, k] @ W[n, k]^T (m <= MAX_M) from the table row of m, with the K split
    chosen by choose_split for the device's num_sms. fp32 inputs halve BLOCK_K (same bytes per tile).
    The interpreter runs tl.dot for fp16 / fp32 and tl.sum products for bf16 (its tl.dot cannot bf16)."""
    _, block_n, block_k, warps, stages, per_sm, min_steps = table_row(m, interpret=interpret)
    if dtype == torch.float32:
        block_k //= 2
    split = choose_split(n, k, block_n, block_k, slots=num_sms * per_sm, min_steps=min_steps)
    dot = not (interpret and dtype == torch.bfloat16)
    return SkinnyConfig(block_n, block_k, split_k=split, num_warps=warps, num_stages=stages, dot=dot)


def shared_memory_bytes(cfg: SkinnyConfig, m: int, in_bytes: int) -> int:
    """Operand ring of one program: num_stages x (BLOCK_N + BLOCK_M) x BLOCK_K elements."""
    return cfg.num_stages * (cfg.block_n + cfg.block_m(m)) * cfg.block_k * in_bytes
