"""Benchmark: fused row-parallel GEMM + all-reduce (fusedpar gemm_all_reduce) vs cuBLAS + all-reduce.

Per-rank shapes of one TP=4 layer's row-parallel GEMMs (x [tokens, K_local] @ w[N, K_local]^T,
then the sum over the ranks), w being the shift-mode column view (block 1 of a 4-block base):
    llama70b.o     N 8192, K 8192/4  = 2048        qwen32b.o     N 5120, K 2048
    llama70b.down  N 8192, K 28672/4 = 7168        qwen32b.down  N 5120, K 25600/4 = 6400
tokens = rows per rank, 8 .. 16384 (powers of two). world = every GPU of the job (torchrun).

Paths timed in the same run, same shapes, same inputs:
    cublas+nccl          F.linear + dist.all_reduce (eager): the plain path, every size
    fused                gemm_all_reduce forced onto its fused path: one_shot for tokens <= 64,
                         two_shot above (eager)
    routed               gemm_all_reduce(path="auto"): what the library really does (eager)
  and for tokens <= 64 (decode), each as a CUDA graph of CALLS calls:
    cublas+symm_mem graph  torch.matmul into a symmetric buffer + torch.ops.symm_mem.one_shot_all_reduce
    cublas+nccl graph      F.linear + dist.all_reduce
    fused graph            our one_shot

Protocol: warm-up (Triton compilation, NCCL/graph setup) first; every sample
is a stream-ordered device barrier across the ranks, a CUDA event, the calls (CALLS for decode
sizes, 1 above, rotating over operand sets whose weights together exceed the L2 cache), a CUDA
event; per-call time = sample / calls; median of --iters (>= 20) samples per rank; the reported
figure is the MAX over ranks (a collective is as slow as its slowest rank). The eager paths'
samples interleave in a seeded random order, each right after an untimed run of its own path
(_bench.BarrierTimer.eager_interleaved: an NCCL sample timed right after a Triton one ran slower).

Records (rank 0 writes --out, a JSON list), bench "gemm_all_reduce": per case and token count one
"eager" record (baseline cublas+nccl eager vs fused eager) and, for tokens <= 64, one "graph"
record (baseline: the faster stock graph path vs fused graph; the decode target is >= 1.1x vs
cuBLAS + torch one-shot). Keys: bench, case, tokens, world, gpu, baseline, baseline_ms, fused_ms,
speedup, roofline_pct, torch, triton, date, command, plus path, routed_path, routed_ms,
routed_speedup (the "never below 0.97x of the plain path" check: the router falls back), n, k,
floor_ms, gemm_floor_ms, comm_floor_ms, paths_ms, max_rel_err_vs_baseline, config, chunks.

Roofline: floor = max(GEMM floor, all-reduce floor), i.e. a PERFECT overlap of the two, not their
sum, with every constant measured in this run:
    GEMM floor       max(2 tokens N K / peak, (weight + x + out bytes) / HBM bandwidth); peak: a
                     cuBLAS bf16 8192^3 GEMM; HBM: a 1 GiB device copy (read + write bytes);
    all-reduce floor 2 (W-1)/W * out bytes / B_bus, B_bus the NCCL all-reduce bus bandwidth at
                     256 MiB (NVLink as the stock stack reaches it; NVLS/multicast off).
roofline_pct = floor / fused time * 100. For decode the floor ignores latency (launch + one
cross-GPU hop: perf/results/one_shot_all_reduce.json), so decode percentages are low
by construction.

Usage (GPU machine, repo root):
    torchrun --nproc-per-node 4 perf/bench_gemm_all_reduce.py [--shapes llama70b,qwen32b]
        [--gemms o,down] [--tokens 8,64,2048] [--iters 20] [--no-mlp-tail] [--out perf/results/gemm_all_reduce.json]
--mlp-tail (default on) adds, for the down shapes at decode sizes, records "<shape>.down mlp-tail
graph": the layer's SwiGLU -> down -> all-reduce -> + residual in a CUDA graph, stock (silu_mul +
cuBLAS + torch one-shot + torch add) vs fused (silu_mul + our one-shot adding the residual in its
reduce epilogue).
--split-sweep (off by default) also times, for decode sizes <= 64 rows, the one-shot in a CUDA graph
with explicit tilings and split-K factors (SPLIT_SWEEP; records "<shape> graph split-sweep", "sweep":
true, speedup vs the same point's stock graph baseline): the data behind
gemm_all_reduce.SPLIT_K_MAX_ROWS, the split tile and the decode BLOCK_K. They carry roofline_pct and
floor_ms like the others; the stored ones (runs of 2026-11-21 and -22), written before the sweep
recorded them, had them recomputed from their own n, k, tokens, world, peak_tflops, hbm_gbps,
nccl_bus_gbps and fused_ms with the same formula ("roofline_recomputed": true).
Without CUDA or outside torchrun it prints a message and exits 0.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench  # setup, timing and records shared by the benchmarks
import shapes
from _bench import BarrierTimer, max_over_ranks

_bench.add_repo_to_path()  # run as a script from anywhere

TP = 4  # the layer's shapes are per rank of a TP=4 split, whatever the world size
SHIFT_BLOCK = 1
MODELS = ("llama70b", "qwen32b")  # keys of shapes.SHAPES
DEFAULT_TOKENS = [2**i for i in range(3, 15)]  # 8 .. 16384
DECODE_MAX = 64  # tokens <= this: one_shot forced path and the graph comparison
CALLS_DECODE = 10  # calls per sample / per captured graph at decode sizes
WORKSPACE_BYTES = 512 << 20  # two 256 MiB slots: up to 8192 x 8192 bf16 two-shot in one launch
WORKSPACE_FLAG_ROWS = 2048


def layer_cases(models: list[str], gemms: set[str]) -> list[tuple[str, int, int]]:
    """(name, N, K_local) of the row-parallel GEMMs of one TP=4 layer."""
    out = []
    for model in models:
        m = shapes.shape(model)
        if "o" in gemms:
            out.append((f"{model}.o", m.hidden, m.q_size // TP))
        if "down" in gemms:
            out.append((f"{model}.down", m.hidden, m.intermediate // TP))
    return out


def measure_ceilings(timer: BarrierTimer, group, world: int) -> tuple[float, float, float]:
    """(peak FLOP/s of a cuBLAS bf16 8192^3 GEMM, HBM bytes/s of a 1 GiB copy, NCCL bus bytes/s at 256 MiB).

    Times are max over ranks, like every other figure of this script.
    """

    def gemm_ms() -> float:
        a = torch.randn((8192, 8192), device="cuda", dtype=torch.bfloat16)
        return timer.eager([lambda: torch.matmul(a, a)] * 3)

    def copy_ms() -> float:
        n = (1 << 30) // 4
        src, dst = torch.rand(n, device="cuda"), torch.empty(n, device="cuda")
        return timer.eager([lambda: dst.copy_(src)] * 3)

    def all_reduce_ms() -> float:
        big = torch.randn((256 << 20) // 2, device="cuda", dtype=torch.bfloat16)
        return timer.eager([lambda: dist.all_reduce(big, group=group)] * 2)

    peak = 2 * 8192**3 / (max_over_ranks(gemm_ms()) * 1e-3)
    hbm = 2 * (1 << 30) / (max_over_ranks(copy_ms()) * 1e-3)
    bus = 2 * (world - 1) / world * (256 << 20) / (max_over_ranks(all_reduce_ms()) * 1e-3)
    torch.cuda.empty_cache()
    return peak, hbm, bus


def make_weight(n: int, k: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """w [n, k] ~ N(0, 1/k): block SHIFT_BLOCK of a [n, TP k] base, the shift-mode column view."""
    base = torch.randn((n, TP * k), generator=gen, device="cuda").div_(math.sqrt(k)).to(dtype)
    return base.narrow(1, SHIFT_BLOCK * k, k)


@dataclass
class Context:
    group: object
    ws: object
    timer: BarrierTimer
    rank: int
    world: int
    symm_buf: torch.Tensor | None
    peak: float
    hbm: float
    bus: float
    common: dict
    gar: object


def floors_ms(ctx: Context, tokens: int, n: int, k: int) -> tuple[float, float, float]:
    """(floor, GEMM floor, all-reduce floor) in ms of one [tokens, k] x [k, n] GEMM + all-reduce (module doc)."""
    gemm_floor = max(2 * tokens * n * k / ctx.peak, (n * k + tokens * k + tokens * n) * 2 / ctx.hbm) * 1e3
    comm_floor = 2 * (ctx.world - 1) / ctx.world * tokens * n * 2 / ctx.bus * 1e3
    return max(gemm_floor, comm_floor), gemm_floor, comm_floor


def bench_point(ctx: Context, name: str, n: int, k: int, tokens: int, ops: list[tuple[torch.Tensor, torch.Tensor]]):
    """Time every path for one (case, tokens); returns its records (max over ranks everywhere)."""
    gar, group, ws, timer = ctx.gar, ctx.group, ctx.ws, ctx.timer
    one_shot = gar.GemmAllReduceOptions(path="one_shot")
    dtype = ops[0][0].dtype
    n_sets = len(ops)
    decode = tokens <= DECODE_MAX
    fused_path = "one_shot" if decode else "two_shot"
    # What path="auto" takes in an eager call (no capture): decode sizes stay off the one-shot there.
    routed_path = gar.auto_path(tokens, n, k, dtype, ctx.world, ws.table, ops[0][0].device)
    plan, why = gar.fused_plan(fused_path, tokens, n, k, dtype, ws.table)
    # Decode: CALLS calls per sample over rotating operand sets. Above: one call per sample, the
    # operand set rotating from sample to sample.
    rotating = [ops[i % n_sets] for i in range(CALLS_DECODE)] if decode else None
    state = {"i": 0}

    def plain(x, w):
        y = torch.nn.functional.linear(x, w)
        dist.all_reduce(y, group=group)
        return y

    def fused(x, w):
        return gar.gemm_all_reduce(x, w, group, ws, options=gar.GemmAllReduceOptions(path=fused_path))

    def routed(x, w):
        return gar.gemm_all_reduce(x, w, group, ws)

    def calls_of(fn) -> list[Callable[[], object]]:
        if rotating is not None:
            return [lambda x=x, w=w: fn(x, w) for x, w in rotating]

        def call():
            x, w = ops[state["i"] % n_sets]
            state["i"] += 1
            return fn(x, w)

        return [call]

    paths_ms: dict[str, float | None] = {}

    def timed(key: str, fns: list[Callable[[], object]], mode: str) -> None:
        try:
            ms = timer.graph(fns) if mode == "graph" else timer.eager(fns)
        except Exception as exc:
            # Report and keep the other paths (a stock op this build lacks, a Triton compile or
            # shared-memory error): every rank compiles the same kernels, so all ranks fail alike
            # and still meet in the max_over_ranks collective below.
            print(f"rank {ctx.rank}: {name} {tokens} {key} failed: {exc}"[:400])
            torch.cuda.synchronize()
            ms = float("inf")
        worst = max_over_ranks(ms)  # inf on any rank: unavailable everywhere, and every rank joins
        paths_ms[key] = None if worst == float("inf") else worst

    # Eager: the plain, fused and routed paths' samples interleave (BarrierTimer.eager_interleaved),
    # after each was run once alone, so that a path that cannot run drops out on every rank alike.
    eager = {"cublas+nccl eager": calls_of(plain)}
    if plan is not None:
        eager["fused eager"] = calls_of(fused)
    elif ctx.rank == 0:
        print(f"{name} {tokens}: fused {fused_path} cannot run: {why}")
    if routed_path != fused_path:
        eager["routed eager"] = calls_of(routed)
    ok = {}
    for key, fns in eager.items():
        try:
            for fn in fns:
                fn()
            torch.cuda.synchronize()
            ok[key] = fns
        except Exception as exc:  # as in timed(): report, keep the other paths
            print(f"rank {ctx.rank}: {name} {tokens} {key} failed: {exc}"[:400])
            torch.cuda.synchronize()
    measured = timer.eager_interleaved(ok) if ok else {}
    for key in ("cublas+nccl eager", "fused eager", "routed eager"):
        if key in eager:  # the same keys on every rank: each joins the same max_over_ranks calls
            worst = max_over_ranks(measured.get(key, float("inf")))
            paths_ms[key] = None if worst == float("inf") else worst
    paths_ms.setdefault("fused eager", None)
    if routed_path == fused_path:
        paths_ms["routed eager"] = paths_ms["fused eager"]

    if decode:
        outs = [torch.empty((tokens, n), dtype=dtype, device="cuda") for _ in rotating]
        if plan is not None:
            timed(
                "fused graph",
                [
                    lambda x=x, w=w, o=o: gar.gemm_all_reduce(x, w, group, ws, out=o, options=one_shot)
                    for (x, w), o in zip(rotating, outs, strict=True)
                ],
                "graph",
            )
        timed("cublas+nccl graph", calls_of(plain), "graph")
        if ctx.symm_buf is not None:
            views = [ctx.symm_buf[i % 2, : tokens * n].view(tokens, n) for i in range(len(rotating))]
            gname = group.group_name

            def stock(x, w, view):
                torch.matmul(x, w.t(), out=view)
                return torch.ops.symm_mem.one_shot_all_reduce(view, "sum", gname)

            timed(
                "cublas+symm_mem graph",
                [lambda x=x, w=w, v=v: stock(x, w, v) for (x, w), v in zip(rotating, views, strict=True)],
                "graph",
            )

    # Spot check (reported, not asserted): fused vs the plain path on one operand set.
    err = float("nan")
    if paths_ms["fused eager"] is not None:
        x, w = ops[0]
        want = plain(x, w).float()
        got = fused(x, w).float()
        err = max_over_ranks(((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item())
        if ws.table.status() != 0:
            print(f"rank {ctx.rank}: {name} {tokens}: a flag wait timed out (STATUS=1): results invalid")

    floor, gemm_floor, comm_floor = floors_ms(ctx, tokens, n, k)
    modes = [("eager", "cublas+nccl eager")]
    if decode:
        stock_graph = {key: v for key, v in paths_ms.items() if key.endswith("graph") and "fused" not in key and v}
        if stock_graph:
            modes.append(("graph", min(stock_graph, key=stock_graph.get)))
    records = []
    for mode, base_key in modes:
        base_ms, fused_ms = paths_ms.get(base_key), paths_ms.get(f"fused {mode}")
        if base_ms is None or fused_ms is None:
            continue
        routed_ms = paths_ms["routed eager"] if mode == "eager" else fused_ms
        rec = {
            **ctx.common,
            "case": f"{name} {mode}",
            "tokens": tokens,
            "n": n,
            "k": k,
            "baseline": base_key if mode == "graph" else "cuBLAS F.linear + NCCL all_reduce (eager)",
            "baseline_ms": base_ms,
            "fused_ms": fused_ms,
            "speedup": base_ms / fused_ms,
            "roofline_pct": 100 * floor / fused_ms,
            "path": fused_path,
            "routed_path": routed_path if mode == "eager" else fused_path,
            "routed_ms": routed_ms,
            "routed_speedup": base_ms / routed_ms if routed_ms else None,
            "floor_ms": floor,
            "gemm_floor_ms": gemm_floor,
            "comm_floor_ms": comm_floor,
            "paths_ms": dict(paths_ms),
            "max_rel_err_vs_baseline": err,
            "config": plan.config.as_list() if plan else None,
            "chunks": len(plan.chunks) if plan else None,
            "operand_sets": n_sets,
        }
        records.append(rec)
        if ctx.rank == 0:
            print(
                f"{name:<15}{tokens:>7} {mode:<6}{base_key:<22}{base_ms:>9.4f}{fused_ms:>10.4f}"
                f"{rec['speedup']:>8.2f}{rec['roofline_pct']:>6.0f}% {rec['routed_path']:<9}"
                f"{rec['routed_speedup'] or float('nan'):>9.2f}  err {err:.1e}"
            )
    return records


# (block_n, block_k, warps, stages, split_k): unsplit decode tilings first, then split-K variants.
# Stages are cut to what fits shared memory at the point's BLOCK_M (so 256-deep K steps stay in the
# sweep at 32-64 rows, where the default takes 128: Qwen3-32B down x 32 rows ran at 0.91x).
SPLIT_SWEEP = ((64, 256, 4, 5, 1), (64, 128, 4, 5, 1), (64, 256, 8, 5, 1), (32, 256, 4, 5, 1),
               (128, 128, 4, 4, 2), (128, 128, 4, 4, 3), (128, 128, 4, 4, 4), (128, 256, 4, 3, 3),
               (64, 128, 4, 5, 2), (32, 256, 4, 5, 4))
SPLIT_SWEEP_MAX_ROWS = 64
_SMEM_BYTES = 227 * 1024


def bench_split_sweep(ctx: Context, name: str, n: int, k: int, tokens: int, ops, baseline: dict | None) -> list[dict]:
    """The one-shot of one decode point in a CUDA graph per SPLIT_SWEEP tiling (max over ranks).

    baseline: the point's "graph" record (the faster stock graph), which every sweep record is timed
    against; without one (no stock graph path ran) there is nothing to compare and nothing is swept."""
    from fusedpar.kernels.gemm import GemmConfig

    if baseline is None:
        if ctx.rank == 0:
            print(f"{name:<15}{tokens:>7} split-sweep skipped: no stock graph baseline at this point")
        return []
    floor, _, _ = floors_ms(ctx, tokens, n, k)

    gar, group, ws = ctx.gar, ctx.group, ctx.ws
    dtype = ops[0][0].dtype
    rotating = [ops[i % len(ops)] for i in range(CALLS_DECODE)]
    outs = [torch.empty((tokens, n), dtype=dtype, device="cuda") for _ in rotating]
    bm = max(16, 1 << max(0, (tokens - 1).bit_length()))
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    records = []
    for bn, bk, warps, stages, split in SPLIT_SWEEP:
        stages = min(stages, (_SMEM_BYTES - bm * bn * 4) // ((bm + bn) * bk * dtype.itemsize))
        if stages < 2:
            continue
        cfg = gar.FusedConfig(GemmConfig(bm, bn, bk, 8, warps, stages), num_sms=sms,
                              comm_rows=max(1, min(bm, 512 * warps // bn)), split_k=split)
        plan, _ = gar.fused_plan("one_shot", tokens, n, k, dtype, ws.table, config=cfg)
        if plan is None:  # a pure function of shapes: every rank skips alike
            continue
        swept = gar.GemmAllReduceOptions(path="one_shot", config=cfg)
        try:
            ms = ctx.timer.graph([
                lambda x=x, w=w, o=o, c=swept: gar.gemm_all_reduce(x, w, group, ws, out=o, options=c)
                for (x, w), o in zip(rotating, outs, strict=True)
            ])
        except Exception as exc:  # a tiling that does not compile here: report, keep the others
            print(f"rank {ctx.rank}: {name} {tokens} split-sweep {cfg.as_list()} failed: {exc}"[:400])
            torch.cuda.synchronize()
            ms = float("inf")
        worst = max_over_ranks(ms)
        if worst == float("inf"):
            continue
        base_ms = baseline["baseline_ms"]
        records.append({
            **ctx.common, "case": f"{name} graph split-sweep", "tokens": tokens, "n": n, "k": k, "sweep": True,
            "baseline": baseline["baseline"], "baseline_ms": base_ms, "fused_ms": worst,
            "speedup": base_ms / worst, "roofline_pct": 100 * floor / worst, "floor_ms": floor,
            "path": "one_shot", "config": cfg.as_list(),
            "units": plan.config.split_k * (-(-tokens // bm)) * (-(-n // bn)),
        })
        if ctx.rank == 0:
            print(f"{name:<15}{tokens:>7} split-sweep n{bn} k{bk} w{warps} s{stages} split{split}: "
                  f"{worst:.4f} ms{base_ms / worst:8.2f}{100 * floor / worst:6.0f}%")
    return records


def bench_mlp_tail(ctx: Context, name: str, n: int, k: int, tokens: int, weights: list[torch.Tensor],
                   gen: torch.Generator) -> list[dict]:
    """The decode MLP tail of a layer, act = silu(gate) * up -> down GEMM -> all-reduce -> + residual,
    each variant as a CUDA graph of CALLS_DECODE calls (max over ranks):
        stock   silu_mul + cuBLAS into symmetric memory + torch one-shot + torch add
        fused   silu_mul + our one-shot with the residual epilogue (what the layer runs)
    One record, bench gemm_all_reduce, case "<shape> mlp-tail graph"."""
    from fusedpar.kernels.swiglu import silu_mul

    one_shot = ctx.gar.GemmAllReduceOptions(path="one_shot")

    gar, group, ws, timer = ctx.gar, ctx.group, ctx.ws, ctx.timer
    if ctx.symm_buf is None:
        return []
    dtype = weights[0].dtype
    gus = [torch.randn((tokens, 2 * k), generator=gen, device="cuda").to(dtype) for _ in weights]
    res = torch.randn((tokens, n), generator=gen, device="cuda").to(dtype)
    dist.broadcast(res, 0, group=group)  # a residual stream is the same on every rank
    rotating = [(gus[i % len(weights)], weights[i % len(weights)]) for i in range(CALLS_DECODE)]
    outs = [torch.empty((tokens, n), dtype=dtype, device="cuda") for _ in rotating]
    gname = group.group_name
    views = [ctx.symm_buf[i % 2, : tokens * n].view(tokens, n) for i in range(len(rotating))]

    def stock(g, w, view):
        torch.matmul(silu_mul(g, k), w.t(), out=view)
        return res + torch.ops.symm_mem.one_shot_all_reduce(view, "sum", gname)

    variants = {
        "fused graph": [lambda g=g, w=w, o=o: gar.gemm_all_reduce(
            silu_mul(g, k), w, group, ws, residual=res, out=o, options=one_shot)
            for (g, w), o in zip(rotating, outs, strict=True)],
        "stock graph": [lambda g=g, w=w, v=v: stock(g, w, v) for (g, w), v in zip(rotating, views, strict=True)],
    }
    paths_ms: dict[str, float | None] = {}
    for key, fns in variants.items():
        try:
            ms = timer.graph(fns)
        except Exception as exc:
            print(f"rank {ctx.rank}: {name} mlp-tail {tokens} {key} failed: {exc}"[:400])
            torch.cuda.synchronize()
            ms = float("inf")
        worst = max_over_ranks(ms)
        paths_ms[key] = None if worst == float("inf") else worst
    # Spot check (reported, not asserted): fused vs the stock tail on one operand set.
    g, w = rotating[0]
    got = gar.gemm_all_reduce(silu_mul(g, k), w, group, ws, residual=res, options=one_shot).float()
    want = stock(g, w, views[0]).float()
    err = max_over_ranks(((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item())
    base, fused = paths_ms.get("stock graph"), paths_ms.get("fused graph")
    if base is None or fused is None:
        return []
    floor = max(2 * tokens * n * k / ctx.peak, (n * k + 3 * tokens * k + 3 * tokens * n) * 2 / ctx.hbm) * 1e3
    rec = {
        **ctx.common, "case": f"{name} mlp-tail graph", "tokens": tokens, "n": n, "k": k,
        "baseline": "silu_mul + cuBLAS + torch symm_mem one-shot + residual add (CUDA graph)",
        "baseline_ms": base, "fused_ms": fused, "speedup": base / fused,
        "roofline_pct": 100 * floor / fused, "floor_ms": floor, "path": "one_shot",
        "paths_ms": paths_ms, "max_rel_err_vs_baseline": err, "operand_sets": len(weights),
    }
    if ctx.rank == 0:
        print(f"{name + ' tail':<15}{tokens:>7} graph stock tail{base:>15.4f}{fused:>10.4f}{base / fused:>8.2f}"
              f"{rec['roofline_pct']:>6.0f}%  err {err:.1e}")
    return [rec]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="llama70b,qwen32b", help=f"comma list of {sorted(MODELS)}")
    p.add_argument("--gemms", default="o,down", help="comma list of o,down")
    p.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)), help="comma list of rows per rank")
    p.add_argument("--iters", type=int, default=20, help="samples per measurement (median; >= 20)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--mlp-tail", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the decode MLP tail (SwiGLU -> down -> all-reduce -> + residual) for the down "
                        "shapes at decode sizes, stock vs fused (the residual in the one-shot's epilogue)")
    p.add_argument("--split-sweep", action="store_true",
                   help=f"also time the decode one-shot (<= {SPLIT_SWEEP_MAX_ROWS} rows) in a CUDA graph per "
                        "tiling / split-K factor of SPLIT_SWEEP")
    p.add_argument("--out", default="perf/results/gemm_all_reduce.json")
    args = p.parse_args()
    if args.iters < 20:
        p.error("--iters must be >= 20")
    unknown = set(args.shapes.split(",")) - set(MODELS)
    if unknown:
        p.error(f"unknown --shapes {sorted(unknown)}; known: {sorted(MODELS)}")
    if set(args.gemms.split(",")) - {"o", "down"}:
        p.error(f"--gemms must be a comma list of o,down, got {args.gemms!r}")
    if not _bench.torchrun_available():
        print("bench_gemm_all_reduce: needs CUDA GPUs and torchrun (torchrun --nproc-per-node N ...); skipped")
        return 0

    from fusedpar.collectives.symmetric import SymmetricWorkspace
    from fusedpar.kernels import gemm_all_reduce as gar

    local, rank, world = _bench.init_distributed()
    group = dist.group.WORLD
    dtype = torch.bfloat16
    ws = SymmetricWorkspace(group, WORKSPACE_BYTES, max_blocks=WORKSPACE_FLAG_ROWS)
    timer = BarrierTimer(ws.barrier, args.iters, args.warmup)
    props = torch.cuda.get_device_properties(local)
    l2_bytes = getattr(props, "L2_cache_size", 50 << 20)
    gpu = torch.cuda.get_device_name()
    tokens_list = sorted({int(t) for t in args.tokens.split(",") if t})
    cases = layer_cases(args.shapes.split(","), set(args.gemms.split(",")))

    # torch's one-shot needs its input in symmetric memory: two buffers (alternating calls, so a
    # GEMM never overwrites what a slow peer may still read) as large as the biggest decode output,
    # written by cuBLAS (torch.matmul(..., out=view)).
    symm_buf = None
    decode_tokens = [t for t in tokens_list if t <= DECODE_MAX]
    if decode_tokens and hasattr(torch.ops, "symm_mem") and hasattr(torch.ops.symm_mem, "one_shot_all_reduce"):
        import torch.distributed._symmetric_memory as symm_mem

        n_max = max(n for _, n, _ in cases)
        symm_buf = symm_mem.empty((2, max(decode_tokens) * n_max), dtype=dtype, device="cuda")
        symm_mem.rendezvous(symm_buf, group)

    peak, hbm, bus = measure_ceilings(timer, group, world)
    common = {
        "bench": "gemm_all_reduce",
        "world": world,
        "gpu": gpu,
        **_bench.run_info(world),
        "peak_tflops": peak / 1e12,
        "hbm_gbps": hbm / 1e9,
        "nccl_bus_gbps": bus / 1e9,
    }
    if rank == 0:
        print(
            f"{gpu} x{world}, bf16; cuBLAS {peak / 1e12:.0f} TFLOP/s, HBM {hbm / 1e9:.0f} GB/s, "
            f"NCCL all-reduce bus {bus / 1e9:.0f} GB/s (256 MiB); median of {args.iters}, max over ranks"
        )
        print(f"{'case':<15}{'tokens':>7} {'mode':<6}{'baseline':<22}{'base ms':>9}{'fused ms':>10}{'speedup':>8}"
              f"{'%roof':>7} {'routed':<9}{'routed x':>9}")
    gen = torch.Generator(device="cuda").manual_seed(1234 + rank)
    ctx = Context(group, ws, timer, rank, world, symm_buf, peak, hbm, bus, common, gar)
    records = []
    for name, n, k in cases:
        # One weight per set, all different; enough sets that the weights exceed the L2 cache 3x.
        n_sets = min(4, max(2, math.ceil(3 * l2_bytes / (n * k * 2))))
        weights = [make_weight(n, k, dtype, gen) for _ in range(n_sets)]
        for tokens in tokens_list:
            xs = [torch.randn((tokens, k), generator=gen, device="cuda").to(dtype) for _ in range(n_sets)]
            point = bench_point(ctx, name, n, k, tokens, list(zip(xs, weights, strict=True)))
            records += point
            if args.split_sweep and tokens <= SPLIT_SWEEP_MAX_ROWS:
                graph_rec = next((r for r in point if r["case"].endswith(" graph")), None)
                records += bench_split_sweep(ctx, name, n, k, tokens, list(zip(xs, weights, strict=True)), graph_rec)
            del xs
            if args.mlp_tail and name.endswith(".down") and tokens <= DECODE_MAX:
                records += bench_mlp_tail(ctx, name, n, k, tokens, weights, gen)
            torch.cuda.empty_cache()
        del weights
        torch.cuda.empty_cache()

    if rank == 0:
        # What the router thresholds (fusedpar.kernels.routing one_shot_max_rows / two_shot_min_rows) should
        # be set from: where each fused path loses to its baseline, and where the router itself does.
        for mode, path in (("eager", "one_shot"), ("graph", "one_shot"), ("eager", "two_shot")):
            lose = sorted({(r["case"].split()[0], r["tokens"]) for r in records
                           if r["case"].endswith(mode) and r["path"] == path and r["speedup"] < 1.0
                           and not r.get("sweep")})
            print(f"{path} ({mode}) slower than its baseline at: {lose or 'nowhere'}")
        slow = [(r["case"], r["tokens"], round(r["routed_speedup"], 3)) for r in records
                if r.get("routed_speedup") is not None and r["routed_speedup"] < 0.97]
        print(f"router below 0.97x of the baseline at: {slow or 'nowhere'}")
        _bench.write_records(records, args.out)
    _bench.finish_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
