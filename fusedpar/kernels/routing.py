"""Where each fused op takes over from the plain path (cuBLAS GEMMs + NCCL collectives).

One table, keyed by (GPU name, world size of the op's group). Each entry names the benchmark
and results file its numbers come from; `thresholds(device, world)` returns the entry measured
for that GPU and world, else the one for that GPU and the nearest measured world, else DEFAULT.
The decision is made from shapes and this table alone, so every rank of a group routes alike.

Rows are rows of the op's input per rank (m); ranges are inclusive (lo, hi), hi None = unbounded.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

RowRanges = tuple[tuple[int, int | None], ...]


@dataclass(frozen=True)
class Thresholds:
    """Routing thresholds of one (GPU, world size).

    qkv_fused_rows: rows per SP rank where qkv_all_to_all runs its fused GEMM + all-to-all kernel.
    o_proj_fused_rows: rows per SP rank where all_to_all_o_proj runs its fused kernel.
    one_shot_max_rows: gemm_all_reduce takes the one-shot kernel up to this many rows (CUDA graphs
        only: eager, the Triton launch's host cost loses to cuBLAS + NCCL at decode sizes).
    two_shot_min_rows: gemm_all_reduce takes the two-shot kernel from this many rows.
    all_reduce_one_shot_max_bytes: all_reduce takes the one-shot kernel up to this size (graphs).
    measured: the benchmarks and results files behind the numbers.
    decode_gemm_max_rows: the GEMMs with nothing to exchange (fusedpar.layers.comm: column_parallel, qkv
        without the all-to-all, row_parallel over a group of one) run on the weight-streaming decode GEMM
        (fusedpar.kernels.gemv) up to this many rows, where perf/tools/bench_gemv.py showed it ahead of
        cuBLAS on that GPU; 0 (an entry without that measurement): cuBLAS at every size.
    """

    qkv_fused_rows: RowRanges
    o_proj_fused_rows: RowRanges
    one_shot_max_rows: int
    two_shot_min_rows: int
    all_reduce_one_shot_max_bytes: int
    measured: str
    decode_gemm_max_rows: int = 0


def in_ranges(rows: int, ranges: RowRanges) -> bool:
    """Whether `rows` lies in one of the inclusive (lo, hi) ranges (hi None = unbounded)."""
    return any(lo <= rows and (hi is None or rows <= hi) for lo, hi in ranges)


TABLE: dict[tuple[str, int], Thresholds] = {
    # SP=4 / TP=4, Llama-3-70B and Qwen3-32B shapes; each field is where the fused path beat the plain one:
    #   qkv_fused_rows                 perf/bench_qkv_all_to_all.py       perf/results/qkv_all_to_all.json
    #   o_proj_fused_rows              perf/bench_all_to_all_o_proj.py    perf/results/all_to_all_o_proj.json
    #   one_shot_max_rows (graphs),
    #   two_shot_min_rows              perf/bench_gemm_all_reduce.py      perf/results/gemm_all_reduce.json
    #   all_reduce_one_shot_max_bytes  perf/bench_one_shot_all_reduce.py  perf/results/one_shot_all_reduce.json
    ("H200", 4): Thresholds(
        qkv_fused_rows=((1, None),),
        o_proj_fused_rows=((1, 128),),
        one_shot_max_rows=64,
        two_shot_min_rows=8192,
        all_reduce_one_shot_max_bytes=256 * 1024,
        measured="perf/bench_qkv_all_to_all.py, bench_all_to_all_o_proj.py, bench_gemm_all_reduce.py, "
        "bench_one_shot_all_reduce.py on 4x H200 (perf/results/*.json)",
    ),
}

DEFAULT = TABLE[("H200", 4)]


@functools.cache
def _gpu_name(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    name = torch.cuda.get_device_name(device)
    for known in sorted({gpu for gpu, _ in TABLE}, key=len, reverse=True):
        if known in name:
            return known
    return name


@functools.cache
def _lookup(gpu: str, world: int) -> Thresholds:
    if (gpu, world) in TABLE:
        return TABLE[(gpu, world)]
    same_gpu = [w for g, w in TABLE if g == gpu]
    if same_gpu:
        return TABLE[(gpu, min(same_gpu, key=lambda w: (abs(w - world), w)))]
    return DEFAULT


def thresholds(device: torch.device, world: int) -> Thresholds:
    """The routing thresholds for an op on `device` whose group has `world` ranks."""
    return _lookup(_gpu_name(device), int(world))
