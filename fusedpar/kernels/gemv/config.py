"""Tilings of the decode GEMM: SkinnyConfig (one launch's tiling and program count), the bare table
of GPU tilings per M bucket, and pick_config, which reads the table and chooses how many programs
share the K steps (perf/tools/bench_gemv.py --sweep times candidate tilings per shape).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from fusedpar.kernels._host import cdiv, next_pow2, require_pow2

SMEM_BYTES = 227 * 1024  # Hopper: dynamic shared memory per CTA
MAX_M = 64  # the decode GEMM's row limit: beyond it the persistent GEMM (fusedpar.kernels.gemm) is the one to use
# choose_programs' cost model, in K steps of one program: starting a wave of programs or a new N tile
# inside one (the pipeline's prologue, the first loads' full memory latency, the epilogue's stores), and
# the reduce pass that split tiles need (a second launch reading the fp32 partials).
SEGMENT_OVERHEAD_STEPS = 2
REDUCE_STEPS = 2


@dataclass(frozen=True)
class SkinnyConfig:
    """Compile-time tiling of one launch plus its program count.

    block_n x block_k: the W tile of one K step (block_k along W's contiguous dim). programs: how many
    programs share the cdiv(N, block_n) x cdiv(K, block_k) K steps, in equal runs (kernels.py): the N
    tile count means no tile is split; a multiple of it is split-K; anything else stream-K. Capped at
    the number of K steps by the launcher.
    dot: tensor cores (tl.dot, rows of A padded to 16) or CUDA-core products (tl.sum).
    """

    block_n: int
    block_k: int
    programs: int
    num_warps: int = 4
    num_stages: int = 3
    dot: bool = True

    def __post_init__(self) -> None:
        require_pow2("SkinnyConfig", block_n=self.block_n, block_k=self.block_k, num_warps=self.num_warps)
        if self.programs < 1 or self.num_stages < 1:
            raise ValueError(f"SkinnyConfig: programs={self.programs} and num_stages={self.num_stages} must be >= 1")

    def block_m(self, m: int) -> int:
        """Rows of A per program: every row (m <= MAX_M), padded to a power of two (>= 16 for tl.dot)."""
        return max(16 if self.dot else 1, next_pow2(m))


# The GPU tilings, one row per M bucket (first row whose largest M >= m):
#   (largest M, BLOCK_N, BLOCK_K, num_warps, num_stages, programs per SM, least K steps per program)
# Shared memory per program: num_stages * (BLOCK_N + BLOCK_M) * BLOCK_K * 2 bytes (<= 227 KiB); one
# program per SM at these sizes, each keeping num_stages - 1 W tiles in flight. Every N tile re-reads
# A's BLOCK_M x BLOCK_K tile (from L2) beside its BLOCK_N x BLOCK_K W tile, so at 64 rows BLOCK_N is
# 128 to keep that traffic at half of W's.
GPU_TABLE: tuple[tuple[int, int, int, int, int, int, int], ...] = (
    (16, 64, 256, 4, 4, 1, 2),
    (32, 64, 256, 4, 3, 1, 2),
    (64, 128, 128, 4, 3, 1, 4),
)

# Interpreter: small tiles so CPU tests see several N tiles, split tiles and ragged edges.
INTERPRETER_ROW = (MAX_M, 16, 32, 4, 1, 1, 1)


def schedule(n: int, k: int, block_n: int, block_k: int, programs: int) -> tuple[int, int, int, int, int]:
    """(programs, K steps per tile, total units, most segments of one program, most slots of one tile) of
    a launch: programs capped at the unit count; a segment is one program's run of units in one N tile, a
    tile's slots the programs that share it (kernels.py)."""
    k_steps = max(1, cdiv(k, block_k))
    units = cdiv(n, block_n) * k_steps
    programs = max(1, min(programs, units))
    longest, shortest = cdiv(units, programs), units // programs
    max_segments = cdiv(longest - 1, k_steps) + 1
    max_slots = cdiv(k_steps - 1, shortest) + 1
    return programs, k_steps, units, max_segments, max_slots


def tiles_are_whole(units: int, k_steps: int, programs: int) -> bool:
    """Whether every program owns whole N tiles (no tile split, no workspace or reduce pass)."""
    return units % programs == 0 and (units // programs) % k_steps == 0


def choose_programs(n: int, k: int, block_n: int, block_k: int, *, slots: int, min_steps: int) -> int:
    """How many programs share the K steps: of split-K counts (N tiles x s, each program >= min_steps
    K steps) and stream-K (one program per slot), the one of least estimated time:
    waves x (K steps per program + SEGMENT_OVERHEAD_STEPS x segments) + REDUCE_STEPS if a tile is split.
    Ties go to fewer programs. slots = programs the GPU runs at once (#SMs x programs per SM)."""
    k_steps = max(1, cdiv(k, block_k))
    n_tiles = cdiv(n, block_n)
    units = n_tiles * k_steps
    candidates = {n_tiles * cdiv(k_steps, cdiv(k_steps, s)) for s in range(1, max(1, k_steps // min_steps) + 1)}
    candidates.add(max(1, min(slots, units // min_steps)))
    best, best_cost = n_tiles, None
    for p in sorted(candidates):
        p, k_steps, units, max_segments, _ = schedule(n, k, block_n, block_k, p)
        cost = cdiv(p, slots) * (cdiv(units, p) + SEGMENT_OVERHEAD_STEPS * max_segments)
        cost += 0 if tiles_are_whole(units, k_steps, p) else REDUCE_STEPS
        if best_cost is None or cost < best_cost:
            best, best_cost = p, cost
    return best


def table_row(m: int, *, interpret: bool) -> tuple[int, int, int, int, int, int, int]:
    """The table row for m rows (INTERPRETER_ROW under the interpreter)."""
    if interpret:
        return INTERPRETER_ROW
    return next(row for row in GPU_TABLE if m <= row[0])


# Every launch asks for its tiling: cached (arguments are ints, a dtype and bools).
@functools.lru_cache(maxsize=4096)
def pick_config(m: int, n: int, k: int, *, dtype: torch.dtype, num_sms: int, interpret: bool,
                swiglu: bool = False) -> SkinnyConfig:
    """The tiling of C[m, n] = A[m, k] @ W[n, k]^T (m <= MAX_M; n the output columns) from the table row
    of m, with the program count of choose_programs for the device's num_sms. fp32 inputs and the SwiGLU
    epilogue (two W tiles per K step: gate and up) halve BLOCK_K, so a K step reads the same bytes and
    the operand ring still fits. The interpreter runs tl.dot for fp16 / fp32 and tl.sum products for
    bf16 (its tl.dot cannot bf16)."""
    _, block_n, block_k, warps, stages, per_sm, min_steps = table_row(m, interpret=interpret)
    if dtype == torch.float32 and not interpret:
        block_k //= 2
    if swiglu and not interpret:
        block_k //= 2
    programs = choose_programs(n, k, block_n, block_k, slots=num_sms * per_sm, min_steps=min_steps)
    dot = not (interpret and dtype == torch.bfloat16)
    return SkinnyConfig(block_n, block_k, programs, num_warps=warps, num_stages=stages, dot=dot)


def shared_memory_bytes(cfg: SkinnyConfig, m: int, in_bytes: int, swiglu: bool = False) -> int:
    """Operand ring of one program: num_stages x (BLOCK_N (x 2 with SwiGLU) + BLOCK_M) x BLOCK_K elements."""
    return cfg.num_stages * (cfg.block_n * (2 if swiglu else 1) + cfg.block_m(m)) * cfg.block_k * in_bytes
