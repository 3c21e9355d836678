"""Benchmark: our one-shot all-reduce (fusedpar.kernels.allreduce) vs NCCL and torch symm_mem one_shot.

Decode-sized bf16 all-reduces over all ranks of the job, 16 KiB .. 1 MiB (the row-parallel
outputs of a decode step), and on up to 16 MiB to show where one-shot stops paying. Paths, each
eager and as a CUDA graph of 10 calls:
    nccl       torch.distributed.all_reduce (in place)
    symm_mem   torch.ops.symm_mem.one_shot_all_reduce on a symmetric input (if this torch has it)
    fusedpar   fusedpar one_shot_all_reduce (copies x into the workspace, out of place)
    routed     fusedpar all_reduce(x, group, workspace, inplace=True): the library's router (one-shot
               inside a graph up to the routing table's all_reduce_one_shot_max_bytes, NCCL otherwise and always eager)

Protocol: warm-up first (Triton compilation, NCCL/graph setup); every
sample is a stream-ordered device barrier, a CUDA event, 10 calls (or one replay of a 10-call
graph), a CUDA event; per-call time = sample / 10; median of --iters samples per rank; the
reported figure is the MAX over ranks of those medians (an all-reduce is as slow as its slowest
rank). Inputs rotate over 10 tensors (one per call of a sample). Eager samples include the host
launch cost, as eager decode does.

Roofline (floor per call) = t_fixed + 2 (W-1)/W * bytes / B_bus, with both constants measured in
this run:
    t_fixed  the fastest graph-mode per-call time of ANY path on a 16-byte message: what one
             launch + one cross-GPU synchronisation costs on this machine at best;
    B_bus    NCCL all-reduce bus bandwidth on 256 MiB (2 (W-1)/W * bytes / time), the best
             link rate the stock stack reaches; 2 (W-1)/W * bytes is what any all-reduce must
             move per GPU (one-shot moves (W-1) * bytes, so it falls behind at large sizes by
             design: that is the crossover to NCCL / two-shot).
roofline_pct = floor / fused time * 100.

Records (rank 0 writes --out, a JSON list): one per size and mode ("graph": our graph vs the
best stock graph path, the decode-relevant comparison; "eager": our eager vs the best stock
eager path), with the keys bench, case, tokens (rows of hidden 8192 bf16 = bytes / 16384),
world, gpu, baseline, baseline_ms, fused_ms, speedup, roofline_pct, torch, triton, date,
command, plus bytes, paths_ms (every path's time) and routed_ms / routed_vs_nccl (the router's time
and NCCL's time over it, same mode: the "never below 0.97x of the plain path" check).

Usage (GPU machine, repo root):
    torchrun --nproc-per-node 4 perf/bench_one_shot_all_reduce.py [--sizes 16K,64K,1M] [--iters 30]
                                                                  [--out perf/results/one_shot_all_reduce.json]
Without CUDA or outside torchrun it prints a message and exits 0.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench  # setup, timing and records shared by the benchmarks
import shapes
from _bench import max_over_ranks

_bench.add_repo_to_path()  # run as a script from anywhere

CALLS = 10  # calls per sample / per captured graph
HIDDEN = shapes.shape("llama70b").hidden  # tokens = bytes / (2 * HIDDEN)
DEFAULT_SIZES = "16K,32K,64K,128K,256K,512K,1M,2M,4M,8M,16M"
TINY_BYTES = 16  # message for t_fixed
BUS_BYTES = 256 << 20  # message for B_bus
MODES = ("eager", "graph")
PATHS = ("nccl", "symm_mem", "fusedpar", "routed")
OURS = ("fusedpar", "routed")  # never a baseline


def parse_size(s: str) -> int:
    """'16K' -> 16384, '1M' -> 1048576, '512' -> 512 (bytes)."""
    s = s.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(s[:-1] if mult > 1 else s) * mult


def label(nbytes: int) -> str:
    """1048576 -> '1MiB', 16384 -> '16KiB', 16 -> '16B'."""
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size and nbytes % size == 0:
            return f"{nbytes // size}{unit}"
    return f"{nbytes}B"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated message sizes (bytes, K, M)")
    p.add_argument("--iters", type=int, default=30, help="samples per measurement (median; >= 20)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--block", type=int, default=None, help="OneShotConfig.block (default: library default)")
    p.add_argument("--num-warps", type=int, default=None)
    p.add_argument("--max-blocks", type=int, default=None)
    p.add_argument("--out", default="perf/results/one_shot_all_reduce.json")
    args = p.parse_args()
    if args.iters < 20:
        p.error("--iters must be >= 20")
    if not _bench.torchrun_available():
        print("bench_one_shot_all_reduce: needs CUDA GPUs and torchrun (torchrun --nproc-per-node N ...); skipped")
        return 0

    from fusedpar.collectives.symmetric import SymmetricWorkspace
    from fusedpar.kernels.allreduce import AllReduceOptions, OneShotConfig, all_reduce, one_shot_all_reduce

    _, rank, world = _bench.init_distributed()
    group = dist.group.WORLD
    sizes = sorted({parse_size(s) for s in args.sizes.split(",") if s.strip()})
    max_bytes = max([*sizes, TINY_BYTES])
    dtype = torch.bfloat16
    esize = 2

    default_cfg = OneShotConfig()
    cfg = OneShotConfig(
        block=args.block or default_cfg.block,
        num_warps=args.num_warps or default_cfg.num_warps,
        max_blocks=args.max_blocks or default_cfg.max_blocks,
    )
    opts = AllReduceOptions(config=cfg)
    ws = SymmetricWorkspace(group, 2 * max_bytes, max_blocks=max(64, cfg.max_blocks))
    timer = _bench.BarrierTimer(ws.barrier, args.iters, args.warmup)

    # torch's own one-shot: needs its input in symmetric memory (two rotating buffers).
    symm_inputs = None
    if hasattr(torch.ops, "symm_mem") and hasattr(torch.ops.symm_mem, "one_shot_all_reduce"):
        import torch.distributed._symmetric_memory as symm_mem

        symm_inputs = []
        for _ in range(2):
            t = symm_mem.empty(max_bytes // esize, dtype=dtype, device="cuda")
            symm_mem.rendezvous(t, group)
            symm_inputs.append(t)
    gen = torch.Generator(device="cuda").manual_seed(1234 + rank)

    def measure(nbytes: int) -> dict[str, float | None]:
        """{f'{path} {mode}': max-over-ranks per-call ms, or None when the path is unavailable}."""
        n = nbytes // esize
        xs = [torch.randn(n, generator=gen, device="cuda").to(dtype) for _ in range(CALLS)]
        outs = [torch.empty_like(x) for x in xs]
        calls: dict[str, list[Callable[[], object]] | None] = {
            "nccl": [lambda x=x: dist.all_reduce(x, group=group) for x in xs],
            "fusedpar": [
                lambda x=x, o=o: one_shot_all_reduce(x, ws, out=o, options=opts) for x, o in zip(xs, outs, strict=True)
            ],
            "symm_mem": None,
            "routed": [lambda x=x: all_reduce(x, group, ws, inplace=True, options=opts) for x in xs],
        }
        if symm_inputs is not None:
            views = [symm_inputs[i % 2][:n] for i in range(CALLS)]
            for v, x in zip(views, xs, strict=True):
                v.copy_(x)
            gname = group.group_name
            calls["symm_mem"] = [lambda v=v: torch.ops.symm_mem.one_shot_all_reduce(v, "sum", gname) for v in views]
        res: dict[str, float | None] = {}
        for path in PATHS:
            fns = calls[path]
            if fns is None:
                res.update({f"{path} {mode}": None for mode in MODES})
                continue
            for mode in MODES:
                try:
                    ms = timer.graph(fns) if mode == "graph" else timer.eager(fns)
                except (RuntimeError, NotImplementedError) as exc:  # e.g. a stock op this build lacks
                    print(f"rank {rank}: {path} {mode} at {label(nbytes)} failed: {exc}"[:300])
                    torch.cuda.synchronize()
                    ms = float("inf")
                # inf on any rank -> unavailable everywhere, and every rank joins the reduction.
                worst = max_over_ranks(ms)
                res[f"{path} {mode}"] = None if worst == float("inf") else worst
        # Correctness spot check (no assert: a benchmark reports). NCCL ran in place on xs many
        # times, so compare on fresh data.
        x = torch.randn(n, generator=gen, device="cuda").to(dtype)
        ref = x.clone()
        dist.all_reduce(ref, group=group)
        got = one_shot_all_reduce(x, ws, options=opts)
        err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()
        res["max_rel_err_vs_nccl"] = max_over_ranks(err)
        return res

    # Ceilings measured in this run.
    tiny = measure(TINY_BYTES)
    t_fixed = min(v for k, v in tiny.items() if k.endswith("graph") and v is not None)
    big = torch.randn(BUS_BYTES // esize, generator=gen, device="cuda").to(dtype)
    bus_ms = max_over_ranks(timer.eager([lambda b=big: dist.all_reduce(b, group=group)] * CALLS))
    del big
    bus_bw = 2 * (world - 1) / world * BUS_BYTES / (bus_ms * 1e-3)  # bytes/s
    gpu = torch.cuda.get_device_name()
    common = {
        "bench": "one_shot_all_reduce",
        "world": world,
        "gpu": gpu,
        **_bench.run_info(world),
    }
    if rank == 0:
        print(
            f"{gpu} x{world}, {dtype}, {CALLS} calls per sample, median of {args.iters}, max over ranks; config {cfg}"
        )
        print(
            f"t_fixed (best graph path, {TINY_BYTES} B) = {t_fixed * 1e3:.1f} us; "
            f"NCCL bus bandwidth at {label(BUS_BYTES)} = {bus_bw / 1e9:.0f} GB/s"
        )
        cols = [f"{p} {m}" for p in PATHS for m in MODES]
        print(f"{'bytes':>8} {'tokens':>7} " + " ".join(f"{c:>15}" for c in cols) + "   (us per call)")

    records = []
    for nbytes in sizes:
        res = measure(nbytes)
        floor_ms = t_fixed + 2 * (world - 1) / world * nbytes / bus_bw * 1e3
        tokens = nbytes / (esize * HIDDEN)
        paths_ms = {k: v for k, v in res.items() if k != "max_rel_err_vs_nccl"}
        if any(paths_ms[f"fusedpar {mode}"] is None for mode in MODES):
            raise RuntimeError(f"fusedpar one-shot failed at {label(nbytes)}; see the messages above")
        for mode in MODES:
            stock = {k: v for k, v in paths_ms.items() if k.endswith(mode) and not k.startswith(OURS) and v}
            base_name = min(stock, key=stock.get)
            fused = paths_ms[f"fusedpar {mode}"]
            records.append(
                {
                    **common,
                    "case": f"{label(nbytes)} {mode}",
                    "tokens": tokens,
                    "bytes": nbytes,
                    "baseline": base_name,
                    "baseline_ms": stock[base_name],
                    "fused_ms": fused,
                    "speedup": stock[base_name] / fused,
                    "roofline_pct": 100.0 * floor_ms / fused,
                    "paths_ms": paths_ms,
                    "max_rel_err_vs_nccl": res["max_rel_err_vs_nccl"],
                    "routed_ms": paths_ms[f"routed {mode}"],
                    "routed_vs_nccl": (paths_ms[f"nccl {mode}"] / paths_ms[f"routed {mode}"]
                                       if paths_ms[f"routed {mode}"] else None),
                }
            )
        if rank == 0:
            cells = " ".join(
                f"{paths_ms[c] * 1e3:>15.1f}" if paths_ms[c] is not None else f"{'n/a':>15}"
                for c in (f"{p} {m}" for p in PATHS for m in MODES)
            )
            g = records[-1]
            print(
                f"{label(nbytes):>8} {tokens:>7.2f} {cells}   graph speedup {g['speedup']:.2f}x vs "
                f"{g['baseline']}, {g['roofline_pct']:.0f}% of floor, rel err {res['max_rel_err_vs_nccl']:.1e}; "
                f"routed vs NCCL eager {records[-2]['routed_vs_nccl']:.2f}x, graph {g['routed_vs_nccl']:.2f}x"
            )

    if rank == 0:
        _bench.write_records(records, args.out)
    _bench.finish_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
