"""Tilings of the persistent GEMM: GemmConfig (one launch's compile-time tiling) and pick_config,
the block-size heuristic that matmul's launcher and the fused GEMM + collective ops start from.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from fusedpar.kernels._host import cdiv, next_pow2, require_pow2

SMEM_BYTES = 227 * 1024  # Hopper: dynamic shared memory per CTA


@dataclass(frozen=True)
class GemmConfig:
    """Compile-time tiling of one launch (Triton specialises the kernel on these)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    tma: bool = False  # TMA tile loads (only where tma_compatible holds; else the launcher uses pointers)
    flatten: bool = True  # one fused tile x K loop (see the kernel's FLATTEN)
    block_n2: int = 0  # a second column block per tile: tiles are block_m x (block_n + block_n2)

    def __post_init__(self) -> None:
        # Checked once here rather than per launch: every kernel that takes a GemmConfig needs these,
        # and a bad value otherwise surfaces as a Triton error from inside the kernel (or an empty grid).
        require_pow2("GemmConfig", block_m=self.block_m, block_n=self.block_n, block_k=self.block_k,
                     num_warps=self.num_warps)
        if self.block_n2:
            require_pow2("GemmConfig", block_n2=self.block_n2)
        if self.group_m < 1 or self.num_stages < 1:
            raise ValueError(f"GemmConfig: group_m={self.group_m} and num_stages={self.num_stages} must be >= 1")

    @property
    def tile_n(self) -> int:
        return self.block_n + self.block_n2


def require_one_block(cfg: GemmConfig, op: str) -> None:
    """Raise unless `cfg` tiles with one column block: split tiles (block_n2) are for the plain GEMM
    and qkv_all_to_all; the other fused kernels' epilogues address BLOCK_N-wide tiles."""
    if cfg.block_n2:
        raise ValueError(
            f"{op}: GemmConfig block_n2={cfg.block_n2} (tiles of block_n + block_n2 columns) is supported by "
            f"fusedpar.matmul and qkv_all_to_all only; pass block_n2=0"
        )


# Every launch asks for its tiling: cached, since running the heuristic per call costs tens of us of host
# time, as much as the launch itself; arguments are ints, dtypes and bools.
@functools.lru_cache(maxsize=4096)
def pick_config(
    m: int,
    n: int,
    k: int,
    *,
    dtype: torch.dtype,
    out_dtype: torch.dtype | None = None,
    num_sms: int,
    interpret: bool,
    tma: bool = False,
) -> GemmConfig:
    """Block sizes for C[m, n] = A[m, k] @ W[n, k]^T (A, W of `dtype`; C of `out_dtype`).

    Interpreter: 32x32x32 tiles, GROUP_M=2, so CPU tests are quick yet still see several tiles,
    ragged edges and more than one swizzle group per program.

    GPU (tuned on H200 over the Llama-3-70B and Qwen3-32B TP=4 shapes with perf/tools/tune_gemm.py; the
    chosen tilings' times: perf/bench_gemm.py, perf/results/gemm.json). A config
    needs num_stages * (BLOCK_M + BLOCK_N) * BLOCK_K * 2 + BLOCK_M * BLOCK_N * 2 bytes of the 227 KiB
    of shared memory per CTA.
      - m <= 64 (decode): weight-read bound, so the grid must cover the SMs: BLOCK_M = next power
        of two >= m (min 16); BLOCK_N the widest of 128/64/32 that still gives >= 0.6 x #SMs
        column tiles; BLOCK_K 256 (m <= 16, BLOCK_N <= 64) or 128; 4 warps; as many stages (<= 5)
        as fit.
      - otherwise by wave quantisation of 128x256 tiles (the fastest tile when it fills the
        machine): 128x256x64 (8 warps, 3 stages) when those tiles fill their waves >= 84% or form
        one wave of >= 60% of the SMs; else 128x128x64 (4 warps, 5 stages) when that gives >= 0.6 x
        #SMs tiles; else 64x128x128 (4 warps, 4 stages). fp32 output never takes 128x256 (its
        epilogue tile alone is 128 KiB).
      - tma=True (16-bit operands that `tma_compatible` accepts), m > 64: TMA loads and the best
        score of four tiles, score = wave fill (tiles / (waves * #SMs)) x the tile's own efficiency:
        128x256x64 (8 warps, 4 stages) 1.0, 128x128x64 (4 warps, 5 stages) 0.97, 64x128x128 (4
        warps, 4 stages) 0.82, and the split tile 64 x (256 + 64) (BLOCK_N2; 4 warps, 4 stages,
        nested loop) 0.91: where both fill their waves (N = 5120 x 2048 rows) 128x128 is
        faster. With N and K both >= 4096 the split tile takes GROUP_M = 16 (all 16 tile rows of
        1024 rows in one swizzle group); narrower or shallower shapes keep 8.
    fp32 inputs halve BLOCK_K so the operand buffers keep the same byte size.
    Not offered, slower on these shapes: cutting K so narrow-N GEMMs fill every SM,
    stream-K (every SM starts at its own K offset, so shared operands no longer meet in L2), and
    a lockstep split-K of the last partial wave (its fp32 partial round trip costs more than the
    fuller wave gains).
    """
    if interpret:
        return GemmConfig(32, 32, 32, group_m=2, num_warps=4, num_stages=1, tma=tma)
    in_bytes = dtype.itemsize
    out_bytes = (out_dtype or dtype).itemsize

    def tiles(block_m: int, block_n: int) -> int:
        return cdiv(m, block_m) * cdiv(n, block_n)

    def wave_fill(t: int) -> float:
        return t / (cdiv(t, num_sms) * num_sms)

    if tma and m > 64 and in_bytes == 2:
        choices = [(0.97, GemmConfig(128, 128, 64, group_m=8, num_warps=4, num_stages=5, tma=True)),
                   (0.82, GemmConfig(64, 128, 128, group_m=8, num_warps=4, num_stages=4, tma=True))]
        if out_bytes <= 2:  # fp32 out: the 128x256 epilogue tile alone is 128 KiB
            choices.insert(0, (1.0, GemmConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=4, tma=True)))
            choices.append((0.91, GemmConfig(64, 256, 64, group_m=8, num_warps=4, num_stages=4, tma=True,
                                             flatten=False, block_n2=64)))
        best = max(choices, key=lambda c: c[0] * wave_fill(tiles(c[1].block_m, c[1].tile_n)))[1]
        if best.block_n2 and n >= 4096 and k >= 4096:
            best = dataclasses.replace(best, group_m=16)  # see the docstring: wide, deep split-tile GEMMs
        return best

    def max_stages(bm: int, bn: int, bk: int, cap: int = 5) -> int:
        per_stage = (bm + bn) * bk * max(2, in_bytes)
        return max(2, min(cap, (SMEM_BYTES - bm * bn * out_bytes) // per_stage))

    if m <= 64:
        block_m = max(16, next_pow2(m))
        block_n = next((bn for bn in (128, 64) if cdiv(n, bn) >= 0.6 * num_sms), 32)
        block_k = 256 if (m <= 16 and block_n <= 64) else 128
        cfg = GemmConfig(block_m, block_n, block_k, group_m=8, num_warps=4,
                         num_stages=max_stages(block_m, block_n, block_k))
    else:
        t256 = tiles(128, 256)
        if out_bytes <= 2 and (wave_fill(t256) >= 0.84 or 0.6 * num_sms <= t256 <= num_sms):
            cfg = GemmConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=3)
        elif tiles(128, 128) >= 0.6 * num_sms:
            cfg = GemmConfig(128, 128, 64, group_m=8, num_warps=4, num_stages=max_stages(128, 128, 64))
        else:
            cfg = GemmConfig(64, 128, 128, group_m=8, num_warps=4, num_stages=max_stages(64, 128, 128, cap=4))
    if in_bytes == 4:
        cfg = dataclasses.replace(cfg, block_k=cfg.block_k // 2)
    return cfg
