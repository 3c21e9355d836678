"""Launch shapes and plans of the fused GEMM + all-reduce: configs, tiling heuristics, workspace sizes.

A plan is a pure function of shapes, dtypes and the workspace's sizes, so every rank of a group
makes the same one. One-shot runs in one launch; two-shot splits M into balanced row chunks (one
launch each) that fit a double-buffer slot and the flag words, each with >= W tiles (every rank
must own a tile of every launch: the double-buffering argument of kernels.py).

Workspace of one launch (one slot; the workspace holds two):
    one_shot: W x split_k x tiles partial blocks of BLOCK_M x BLOCK_N (partial dtype); flag rows =
        the grid (min(num_sms, units)).
    two_shot: W x cdiv(tiles, W) partial blocks, then (ALIGN_BYTES-aligned) a result region of
        `tiles` blocks in x's dtype; flag rows = num_sms + cdiv(tiles, W).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from fusedpar.collectives.symmetric import PeerTable
from fusedpar.kernels._host import INTERPRETED, cdiv, require_pow2
from fusedpar.kernels._sync import align_up, esize, slot_size, sm_count
from fusedpar.kernels.gemm import SMEM_BYTES, GemmConfig, pick_config, require_one_block

PATHS = ("auto", "local", "one_shot", "two_shot", "unfused")


@dataclass(frozen=True)
class FusedConfig:
    """Launch shape of one fused path.

    gemm: tiling of the GEMM phase (fusedpar.kernels.gemm.GemmConfig).
    num_sms: persistent stride and upper bound of the grid (the device's SM count: every program
        must be co-resident with the ones it waits for).
    comm_rows: tile rows per step of the reduce / copy loops (comm_rows x block_n elements).
    split_k: one_shot only: K ranges per output tile, each a separate work unit with its own
        partial (1 = none). Decode GEMMs read the weight once and are bound by how many SMs
        stream it: split-K puts more SMs on an output too narrow to fill the GPU with tiles.
    """

    gemm: GemmConfig
    num_sms: int
    comm_rows: int
    split_k: int = 1

    def __post_init__(self) -> None:
        # The kernel does not survive bad values: num_sms=0 launches an empty grid (out never written),
        # and comm_rows must tile block_m exactly (a larger step reads and stores other tiles' rows).
        if self.num_sms < 1:
            raise ValueError(f"FusedConfig: num_sms={self.num_sms} must be >= 1 (the persistent grid size)")
        require_pow2("FusedConfig", comm_rows=self.comm_rows)
        if self.comm_rows > self.gemm.block_m:
            raise ValueError(f"FusedConfig: comm_rows={self.comm_rows} must divide block_m={self.gemm.block_m} "
                             "(a power of two <= block_m)")

    def as_list(self) -> list[int]:
        g = self.gemm
        return [g.block_m, g.block_n, g.block_k, g.group_m, g.num_warps, g.num_stages, self.num_sms, self.comm_rows,
                self.split_k]

    @staticmethod
    def from_list(v: list[int]) -> FusedConfig:
        return FusedConfig(GemmConfig(*v[:6]), num_sms=v[6], comm_rows=v[7], split_k=v[8] if len(v) > 8 else 1)


@dataclass(frozen=True)
class FusedPlan:
    """How one fused call runs: path, config, partial dtype and the row chunks (one launch each)."""

    path: str  # "one_shot" or "two_shot"
    config: FusedConfig
    partial_dtype: torch.dtype
    chunks: tuple[tuple[int, int], ...]  # (first row, rows)
    slot_bytes: int


@dataclass(frozen=True)
class GemmAllReduceOptions:
    """Tuning options of gemm_all_reduce (the defaults: route by size, tile by heuristic).

    path: "auto" (choose_path), or force "one_shot" / "two_shot" (ValueError if the workspace
        cannot hold it), "unfused" (cuBLAS + all_reduce) or "local" (no communication).
    partial_dtype: None (x's dtype, what the plain path's all-reduce sends) or torch.float32 (more
        accurate, twice the NVLink bytes).
    config: the fused paths' launch shape (None: default_config).
    one_shot_max_rows / two_shot_min_rows: None takes fusedpar.kernels.routing.thresholds.
    """

    path: str = "auto"
    partial_dtype: torch.dtype | None = None
    config: FusedConfig | None = None
    one_shot_max_rows: int | None = None
    two_shot_min_rows: int | None = None

    def __post_init__(self) -> None:
        if self.path not in PATHS:
            raise ValueError(f"gemm_all_reduce: path must be one of {PATHS}, got {self.path!r}")


_COMM_ELEMS_PER_WARP = 512  # elements per reduce/copy step and warp: 16 per thread (two 16-byte bf16 vectors)
_COMM_ELEMS_INTERPRETER = 256  # several steps per 32 x 32 tile


def default_config(path: str, m: int, n: int, k: int, dtype: torch.dtype, partial_dtype: torch.dtype,
                   num_sms: int, *, interpret: bool | None = None) -> FusedConfig:
    """Tiling of a fused path.

    Interpreter: 32x32x32 tiles (as fusedpar.kernels.gemm), 256-element comm steps; it never splits
    K (its one-launch emulation of a rank runs programs one after another, and a split tile's
    reducer waits for other programs).
    GPU: fusedpar.kernels.gemm.pick_config (the fused GEMM loop is the plain kernel's) with the
    partial dtype as the epilogue dtype; comm steps move 16 elements per thread (two 16-byte
    vectors of bf16 per rank). One-shot decode adjusts it:
      - m <= SPLIT_K_MAX_ROWS: where the output has too few BLOCK_N-wide tiles to give most SMs a
        share of the weight (N 5120: 80 tiles of 64 columns on 132 SMs), 128-column tiles split in
        K so that more SMs stream the weight, e.g. 40 x 3 = 120 units (_decode_split).
      - DEEP_K_ROWS (17-32 rows, 16-bit inputs, BLOCK_N <= 64): 256-deep K steps, as pick_config
        gives <= 16 rows: more weight bytes in flight per SM.
    """
    interpreted = INTERPRETED if interpret is None else interpret
    if interpreted:
        gcfg = pick_config(m, n, k, dtype=dtype, out_dtype=partial_dtype, num_sms=num_sms, interpret=True)
        comm = _COMM_ELEMS_INTERPRETER
    else:
        gcfg = pick_config(m, n, k, dtype=dtype, out_dtype=partial_dtype, num_sms=num_sms, interpret=False)
        comm = _COMM_ELEMS_PER_WARP * gcfg.num_warps
    split = 1
    if path == "one_shot" and not interpreted and m <= SPLIT_K_MAX_ROWS:
        gcfg, split = _decode_split(n, k, esize(dtype), gcfg, num_sms)
    elif (path == "one_shot" and not interpreted and DEEP_K_ROWS[0] <= m <= DEEP_K_ROWS[1]
          and gcfg.block_n <= 64 and gcfg.block_k == 128 and esize(dtype) == 2):
        stages = _stages_that_fit(gcfg.block_m, gcfg.block_n, 256, 2, esize(partial_dtype), cap=5)
        if stages >= 2:
            gcfg = dataclasses.replace(gcfg, block_k=256, num_stages=stages)
    return FusedConfig(gcfg, num_sms=num_sms, comm_rows=max(1, min(gcfg.block_m, comm // gcfg.block_n)),
                       split_k=split)


# One-shot split-K pays at 1-2 rows only (from 4 rows every unit's push of its partial rows to every
# rank and the W x split sums cost more than the extra SMs gain) and only with >= _SPLIT_MIN_K of K per
# range; 8192-wide outputs (128 tiles) never gain. Split tile: 128 columns, 128-deep K steps, 4 warps,
# 4 stages (fp32 inputs get fewer stages). Tuned on 4x H200: perf/bench_gemm_all_reduce.py --split-sweep,
# perf/results/gemm_all_reduce.json ("graph split-sweep" records).
SPLIT_K_MAX_ROWS = 2
# One-shot decode of 17-32 rows takes 256-deep K steps (see default_config); at 64 rows they lost
# (same benchmark and record).
DEEP_K_ROWS = (17, 32)
_SPLIT_MIN_K = 1024
_SPLIT_TILE = (128, 128, 4, 4)  # block_n, block_k, warps, stages


def _stages_that_fit(bm: int, bn: int, bk: int, in_bytes: int, out_bytes: int, *, cap: int) -> int:
    """Most pipeline stages (<= cap) of bm x bk and bn x bk operand tiles that fit shared memory
    beside a bm x bn epilogue tile (may be < 2: the tiling does not fit)."""
    return min(cap, (SMEM_BYTES - bm * bn * out_bytes) // ((bm + bn) * bk * in_bytes))


def _decode_split(n: int, k: int, elem: int, gcfg: GemmConfig, num_sms: int) -> tuple[GemmConfig, int]:
    """(tiling, split_k) that gives the most SMs a share of the weight: the unsplit tiling's
    cdiv(n, block_n) units, or 128-column tiles x s K ranges (units <= num_sms, >= _SPLIT_MIN_K of K
    per range); ties keep no split."""
    best = (cdiv(n, gcfg.block_n), gcfg, 1)
    bn, bk, warps, stages = _SPLIT_TILE
    bm = gcfg.block_m
    stages = _stages_that_fit(bm, bn, bk, elem, elem, cap=stages)
    if stages < 2:
        return gcfg, 1
    wide = GemmConfig(bm, bn, bk, gcfg.group_m, warps, stages)
    for split in range(2, 17):
        units = cdiv(n, bn) * split
        if units > num_sms or cdiv(k, split) < _SPLIT_MIN_K:
            break
        if units > best[0]:
            best = (units, wide, split)
    return best[1], best[2]


def layout(path: str, rows: int, n: int, world: int, cfg: FusedConfig, psize: int, osize: int):
    """(tiles, own_cap, result_off, slot bytes needed, flag rows needed) of one launch over `rows` rows."""
    g = cfg.gemm
    require_one_block(g, "gemm_all_reduce")
    tiles = cdiv(rows, g.block_m) * cdiv(n, g.block_n)
    tile = g.block_m * g.block_n
    if path == "one_shot":
        units = tiles * cfg.split_k
        return tiles, 0, 0, world * units * tile * psize, min(cfg.num_sms, units)
    own_cap = cdiv(tiles, world)
    result_off = align_up(world * own_cap * tile * psize)
    return tiles, own_cap, result_off, result_off + tiles * tile * osize, cfg.num_sms + own_cap


def required_workspace(
    path: str,
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    world_size: int,
    *,
    num_sms: int,
    partial_dtype: torch.dtype | None = None,
    config: FusedConfig | None = None,
) -> tuple[int, int]:
    """(nbytes, max_blocks) of a SymmetricWorkspace that runs `path` over m rows in ONE launch.

    nbytes covers both double-buffer slots. Smaller workspaces still run two_shot, in row chunks.
    """
    pdt = partial_dtype or dtype
    cfg = config or default_config(path, m, n, k, dtype, pdt, num_sms)
    _, _, _, need, flag_rows = layout(path, m, n, world_size, cfg, esize(pdt), esize(dtype))
    return 2 * align_up(need), flag_rows


def slot_bytes_of(table: PeerTable) -> int:
    """Bytes of one double-buffer slot of `table` (half the data buffer, ALIGN_BYTES-aligned)."""
    return slot_size(table)


def fused_plan(
    path: str,
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    table: PeerTable,
    *,
    partial_dtype: torch.dtype | None = None,
    config: FusedConfig | None = None,
) -> tuple[FusedPlan | None, str]:
    """(plan, "") if the fused `path` can run this call on `table`, else (None, why not).

    Pure function of shapes, dtypes and the table's sizes, so every rank makes the same choice.
    two_shot splits M into balanced chunks of whole tile rows, each fitting one slot and the flag
    words and holding >= world_size tiles; one_shot must fit in one launch.
    """
    if path not in ("one_shot", "two_shot"):
        raise ValueError(f"fused_plan: unknown path {path!r}")
    sms = config.num_sms if config is not None else sm_count(table.device, INTERPRETED)
    args = (path, m, n, k, dtype, table.world_size, slot_bytes_of(table), table.max_blocks, sms, partial_dtype, config)
    # Cached in eager mode, where the router plans on every call and a decode step's host time
    # matters; dynamo traces the plain function instead (it would bypass the cache anyway).
    return _plan_cached.__wrapped__(*args) if torch.compiler.is_compiling() else _plan_cached(*args)


@functools.lru_cache(maxsize=4096)
def _plan_cached(path, m, n, k, dtype, world, slot, max_blocks, num_sms, partial_dtype, config):
    pdt = partial_dtype or dtype
    if pdt not in (dtype, torch.float32):
        return None, f"partial dtype must be {dtype} or torch.float32, got {pdt}"
    cfg = config or default_config(path, m, n, k, dtype, pdt, num_sms)
    psize, osize = esize(pdt), esize(dtype)
    bm = cfg.gemm.block_m

    def size_problem(rows: int) -> str:
        """Why one launch over `rows` rows does not fit the workspace ("" if it does); monotone in rows."""
        tiles, own_cap, _, need, flag_rows = layout(path, rows, n, world, cfg, psize, osize)
        if need > slot:
            return f"needs a {need}-byte slot, the workspace has {slot}"
        if flag_rows > max_blocks:
            return f"needs {flag_rows} flag rows, the workspace has max_blocks={max_blocks}"
        tile = cfg.gemm.block_m * cfg.gemm.block_n
        region = world * (tiles * cfg.split_k if path == "one_shot" else own_cap) * tile
        if max(region, tiles * tile) >= 2**31:
            return "workspace regions of >= 2**31 elements (int32 offsets)"
        return ""

    if cfg.split_k < 1 or (cfg.split_k > 1 and path != "one_shot"):
        return None, f"split_k={cfg.split_k}: must be >= 1, and > 1 only on the one_shot path"
    if m == 0 or n == 0:
        return FusedPlan(path, cfg, pdt, (), slot), ""
    if path == "one_shot":
        why = size_problem(m)
        return (None, f"one_shot: {why}") if why else (FusedPlan(path, cfg, pdt, ((0, m),), slot), "")
    # two_shot: the largest chunk (in tile rows) that fits, by bisection; then balanced chunks so
    # the last one is not a sliver.
    tile_rows = cdiv(m, bm)
    lo, hi = 0, tile_rows
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if size_problem(min(m, mid * bm)):
            hi = mid - 1
        else:
            lo = mid
    if lo == 0:
        return None, f"two_shot: {size_problem(min(m, bm))}"
    n_chunks = cdiv(tile_rows, lo)
    per = cdiv(tile_rows, n_chunks) * bm
    chunks = tuple((m0, min(per, m - m0)) for m0 in range(0, m, per))
    # Every rank must own a tile of every launch (the double-buffering argument).
    smallest = min(rows for _, rows in chunks)
    tiles = cdiv(smallest, bm) * cdiv(n, cfg.gemm.block_n)
    if tiles < world:
        return None, f"two_shot: a chunk of {smallest} rows has {tiles} tiles < world size {world}"
    return FusedPlan(path, cfg, pdt, chunks, slot), ""
