"""Options, launch shapes and workspace sizes of the Ulysses ops.

UlyssesOptions: the tuning options of the public routers (path, spin limit, tile configs, routing
overrides); the defaults route by size (fusedpar.kernels.routing) and tile by heuristic.
pick_qkv_config: the qkv GEMM's tiling (N tiles never straddle a rank's column block).
OProjConfig: all_to_all_o_proj's launch shape (GEMM tiling, push programs, copy tile, bands).
Workspace sizes: the qkv receive buffer is [W*m, blk] and the o staging buffer [W, m, C] (or,
for the scattering attention, [m, W*C]: the same bytes), both of the activation dtype, at the
start of the op's own symmetric data buffer.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from fusedpar.kernels._host import INTERPRETED, cdiv, require_pow2
from fusedpar.kernels._sync import align_up, esize
from fusedpar.kernels.fp8 import pick_fp8_config
from fusedpar.kernels.gemm import GemmConfig, pick_config, require_one_block
from fusedpar.kernels.routing import RowRanges

PATHS = ("auto", "fused", "plain")


@dataclass(frozen=True)
class OProjConfig:
    """Launch shape of all_to_all_o_proj.

    gemm: GEMM tiling (None: fusedpar.kernels.gemm.pick_config for [m, N] x K = W*C; one column
        block only, split tiles are refused).
    comm_programs: programs that push first (then join the GEMM). Each keeps 32 KiB of posted
        stores in flight, so a handful saturates NVLink while the other programs start the GEMM.
    copy_rows x copy_cols: elements one program moves per copy step (powers of two; 32 x 512 is 8
        per thread for 8 warps: 16-byte vector loads and stores).
    max_bands: most push bands (each band = ceil(m / bands) rows rounded up to BLOCK_M, one flag
        row each; capped by the table's max_blocks - 1).
    """

    gemm: GemmConfig | None = None
    comm_programs: int = 8
    copy_rows: int = 32
    copy_cols: int = 512
    max_bands: int = 64

    def __post_init__(self) -> None:
        # comm_programs and max_bands are clamped to >= 1 by the launcher, gemm checks itself.
        require_pow2("OProjConfig", copy_rows=self.copy_rows, copy_cols=self.copy_cols)


INTERPRETER_O_CONFIG = OProjConfig(comm_programs=2, copy_rows=8, copy_cols=16, max_bands=64)
GPU_O_CONFIG = OProjConfig()


def default_o_config() -> OProjConfig:
    """The OProjConfig a launch takes when none is given (small copy tiles under the interpreter)."""
    return INTERPRETER_O_CONFIG if INTERPRETED else GPU_O_CONFIG


@dataclass(frozen=True)
class UlyssesOptions:
    """Tuning options of qkv_all_to_all, all_to_all_o_proj, qkv_all_to_all_wait and scattered_o_proj.

    path: "auto" (by size and workspace room, the same choice on every rank), "fused" (the
        symmetric-memory kernels; errors if they cannot run) or "plain" (F.linear + the NCCL
        all-to-all of fusedpar.collectives.comm; needs the group).
    spin_limit: polls before a flag wait gives up (None: fusedpar.kernels._sync's default).
    qkv_config: the qkv GEMM tiling (None: pick_qkv_config).
    o_config: all_to_all_o_proj's launch shape (None: default_o_config()).
    qkv_fused_rows / o_proj_fused_rows: rows per rank where "auto" takes the fused kernel (None:
        fusedpar.kernels.routing.thresholds of the device and group size).
    """

    path: str = "auto"
    spin_limit: int | None = None
    qkv_config: GemmConfig | None = None
    o_config: OProjConfig | None = None
    qkv_fused_rows: RowRanges | None = None
    o_proj_fused_rows: RowRanges | None = None

    def __post_init__(self) -> None:
        if self.path not in PATHS:
            raise ValueError(f"UlyssesOptions: path must be one of {PATHS}, got {self.path!r}")


DEFAULT_OPTIONS = UlyssesOptions()


def qkv_workspace_bytes(tokens: int, blk: int, sp: int, dtype: torch.dtype) -> int:
    """Data bytes per rank the qkv receive buffer needs: [sp * tokens, blk] of dtype."""
    return sp * tokens * blk * esize(dtype)


def o_proj_workspace_bytes(tokens: int, c: int, sp: int, dtype: torch.dtype) -> int:
    """Data bytes per rank the o_proj staging buffer needs: [sp, tokens, c] of dtype (c = q * hd)."""
    return sp * tokens * c * esize(dtype)


def o_proj_fp8_layout(tokens: int, c: int, sp: int, group: int) -> tuple[int, int]:
    """(byte offset of the staged activation scales, data bytes per rank) of all_to_all_o_proj on e4m3 rows:
    [sp, tokens, c] e4m3, then (ALIGN_BYTES-aligned) [sp, tokens, c // group] fp32 scales."""
    scale_off = align_up(sp * tokens * c)
    return scale_off, scale_off + sp * tokens * (c // group) * 4


# Row ranges tuned on 4x H200; the resulting kernel's times: perf/bench_qkv_all_to_all.py,
# perf/results/qkv_all_to_all.json.
# Rows per rank (inclusive) where 16-bit TMA-able qkv GEMMs take split 64 x (256 + 64) tiles, when
# 320 columns tile a block exactly (blk 2560: Llama-3-70B and Qwen3-32B at SP=4). Tuned with
# perf/bench_qkv_all_to_all.py --sweep-configs (run_gpu.sh qkv_sweep; printed, not recorded).
QKV_SPLIT_TILE_ROWS = (512, 1024)
# Rows per rank (inclusive) where the qkv kernel rotates its tile order (the kernel's ROTATE), so that the
# ranks' peer stores go to different owners at any moment; outside this range the rotation did not pay.
# Tuned with perf/bench_qkv_all_to_all.py --sweep-configs (run_gpu.sh qkv_sweep: the plain and the rotated
# tile order; printed, not recorded).
QKV_ROTATE_ROWS = (1024, 2048)


@functools.lru_cache(maxsize=1024)  # per launch; a cached tiling costs no host time
def pick_qkv_config(m: int, n_total: int, k: int, blk: int, dtype: torch.dtype, num_sms: int,
                    tma_ok: bool = False) -> GemmConfig:
    """The qkv GEMM's tiling for x [m, k] @ w [n_total = W*blk, k]^T.

    Split tiles at QKV_SPLIT_TILE_ROWS (above). TMA-fed 128 x 128 x 64 tiles with nested tile / K
    loops at 3-6 waves of 128 x 128 tiles. Elsewhere fusedpar.kernels.gemm.pick_config. Then
    BLOCK_N is halved while it does not divide blk (and half of it does), so that no tile wastes
    its MMA on two blocks.
    """
    split_n = 320
    tiles = cdiv(m, 128) * cdiv(n_total, 128)
    if (tma_ok and not INTERPRETED and dtype.itemsize == 2 and blk % split_n == 0
            and QKV_SPLIT_TILE_ROWS[0] <= m <= QKV_SPLIT_TILE_ROWS[1]):
        cfg = GemmConfig(64, 256, 64, group_m=8, num_warps=4, num_stages=4, tma=True, flatten=False, block_n2=64)
    elif tma_ok and not INTERPRETED and dtype.itemsize == 2 and 3 * num_sms < tiles <= 6 * num_sms:
        cfg = GemmConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=4, tma=True, flatten=False)
    else:
        cfg = pick_config(m, n_total, k, dtype=dtype, num_sms=num_sms, interpret=INTERPRETED)
    while not cfg.block_n2 and cfg.block_n > 32 and blk % cfg.block_n and blk % (cfg.block_n // 2) == 0:
        cfg = dataclasses.replace(cfg, block_n=cfg.block_n // 2)
    return cfg


@functools.lru_cache(maxsize=1024)
def pick_qkv_fp8_config(m: int, n_total: int, k: int, blk: int, out_dtype: torch.dtype, num_sms: int,
                        tma_ok: bool = False) -> GemmConfig:
    """The qkv GEMM's tiling on e4m3 operands: the FP8 GEMM's (fusedpar.kernels.fp8.pick_fp8_config), with
    BLOCK_N halved while it does not divide blk (and half of it does), as pick_qkv_config."""
    cfg = pick_fp8_config(m, n_total, k, out_dtype=out_dtype, num_sms=num_sms, interpret=INTERPRETED,
                          tma=tma_ok and m > 64)
    while cfg.block_n > 32 and blk % cfg.block_n and blk % (cfg.block_n // 2) == 0:
        cfg = dataclasses.replace(cfg, block_n=cfg.block_n // 2)
    return cfg


@dataclass(frozen=True)
class OLaunchShape:
    """What all_to_all_o_proj's launcher derives from an OProjConfig for one call."""

    gemm: GemmConfig
    band_rows: int  # rows per push band (a multiple of gemm.block_m)
    num_bands: int
    comm_programs: int


def o_launch_shape(m: int, n: int, C: int, W: int, dtype, out_dtype, max_blocks: int, cfg: OProjConfig,
                   num_sms: int) -> OLaunchShape:
    gemm = cfg.gemm or pick_config(m, n, W * C, dtype=dtype, out_dtype=out_dtype, num_sms=num_sms,
                                   interpret=INTERPRETED)
    require_one_block(gemm, "all_to_all_o_proj")
    m_tiles = cdiv(m, gemm.block_m)
    bands_cap = max(1, min(cfg.max_bands, max_blocks - 1))
    band_rows = gemm.block_m * cdiv(m_tiles, bands_cap)
    comm = max(1, min(cfg.comm_programs, num_sms - 1)) if W > 1 else 0
    return OLaunchShape(gemm, band_rows, cdiv(m, band_rows), comm)
