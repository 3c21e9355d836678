"""Host cost of one eager call, per path: where an eager decode step spends its CPU time.

    torchrun --nproc-per-node 4 perf/tools/host_cost.py [--tokens 8] [--n 8192] [--k 2048]

An eager call whose host cost exceeds its GPU time leaves the GPU waiting for launches, so at
decode sizes the eager timing of a path is its host cost. This times, on every rank, the HOST
time of each call only (time.perf_counter around `--calls` calls, the GPU synchronised between
batches of calls so its queue never fills and blocks the host), median over --iters batches:
    linear            F.linear(x, w) on the row-parallel weight view (cuBLAS launch)
    nccl              dist.all_reduce(y) (in place)
    cublas+nccl       both: the plain path of a row-parallel GEMM + all-reduce
    pg allreduce      fusedpar sum_over_group_(y, pg): the process group's allreduce + wait, without
                      dist.all_reduce's Python wrapper
    all_reduce        fusedpar all_reduce(y, group, workspace, inplace=True) (eager: NCCL)
    gar routed        fusedpar gemm_all_reduce(x, w, group, workspace) (eager: cuBLAS + NCCL)
    gar one_shot      gemm_all_reduce(..., path="one_shot") (one Triton launch)
    one_shot_ar       fusedpar one_shot_all_reduce(y, workspace, out=) (one Triton launch)
    capturing?        torch.cuda.is_current_stream_capturing()
Prints per path the median us per call on rank 0 and the max over ranks. A diagnosis tool: no
records, nothing asserted.

--profile NAME[,NAME...] also runs cProfile over --profile-calls calls of each named path on rank 0
(every rank makes the calls: the fused paths are collective) and prints its top functions by own
time and by cumulative time: where the host time of that path goes.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # perf/: the shared bench modules
import _bench

_bench.add_repo_to_path()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8, help="rows of x per rank")
    p.add_argument("--n", type=int, default=8192, help="output features (Llama-70B hidden)")
    p.add_argument("--k", type=int, default=2048, help="input features per rank (Llama-70B o-projection at TP=4)")
    p.add_argument("--calls", type=int, default=20, help="calls per timed batch")
    p.add_argument("--iters", type=int, default=30, help="timed batches (median)")
    p.add_argument("--profile", default="", help="comma-separated path names to profile with cProfile (rank 0)")
    p.add_argument("--profile-calls", type=int, default=400, help="calls per profiled path")
    args = p.parse_args()
    if not _bench.torchrun_available():
        print("host_cost: needs CUDA GPUs and a torchrun launch; nothing to do")
        return 0
    from fusedpar.collectives.symmetric import SymmetricWorkspace
    from fusedpar.kernels.allreduce import all_reduce, one_shot_all_reduce, sum_over_group_
    from fusedpar.kernels.gemm_all_reduce import GemmAllReduceOptions, gemm_all_reduce, required_workspace

    _, rank, world = _bench.init_distributed()
    group = dist.group.WORLD
    dev, dtype = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    nbytes, blocks = required_workspace("one_shot", args.tokens, args.n, args.k, dtype, world, num_sms=num_sms)
    ws = SymmetricWorkspace(group, max(nbytes, 1 << 20), max_blocks=max(blocks, 64))
    gen = torch.Generator(device=dev).manual_seed(rank)
    x = torch.randn((args.tokens, args.k), generator=gen, device=dev, dtype=dtype)
    base = torch.randn((args.n, world * args.k), generator=gen, device=dev, dtype=dtype) / args.k
    w = base[:, rank * args.k:(rank + 1) * args.k]  # the shift-mode column view, as the layer has it
    y = torch.nn.functional.linear(x, w)
    out = torch.empty_like(y)

    def plain():
        z = torch.nn.functional.linear(x, w)
        dist.all_reduce(z, group=group)

    paths = {
        "linear": lambda: torch.nn.functional.linear(x, w),
        "nccl": lambda: dist.all_reduce(y, group=group),
        "cublas+nccl": plain,
        "pg allreduce": lambda: sum_over_group_(y, group),
        "all_reduce": lambda: all_reduce(y, group, ws, inplace=True),
        "gar routed": lambda: gemm_all_reduce(x, w, group, ws),
        "gar one_shot": lambda: gemm_all_reduce(x, w, group, ws, options=GemmAllReduceOptions(path="one_shot")),
        "one_shot_ar": lambda: one_shot_all_reduce(y, ws, out=out),
        "capturing?": torch.cuda.is_current_stream_capturing,
    }
    rows = []
    for name, fn in paths.items():
        for _ in range(3):  # warm-up: compiles, NCCL setup
            fn()
        torch.cuda.synchronize()
        per_call = []
        for _ in range(args.iters):
            torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            per_call.append((time.perf_counter() - t0) / args.calls * 1e6)
        torch.cuda.synchronize()
        mine = statistics.median(per_call)
        rows.append((name, mine, _bench.max_over_ranks(mine)))
    if rank == 0:
        print(f"host us per call, {args.tokens} x {args.k} @ [{args.n}, {args.k}] view, bf16, {world} ranks "
              f"(median of {args.iters} batches of {args.calls})")
        for name, mine, worst in rows:
            print(f"  {name:<14} rank 0 {mine:8.1f}   max over ranks {worst:8.1f}")
    for name in filter(None, args.profile.split(",")):
        fn = paths[name]
        torch.cuda.synchronize()
        dist.barrier()
        prof = cProfile.Profile()
        prof.enable()
        for i in range(args.profile_calls):
            fn()
            if i % args.calls == args.calls - 1:
                torch.cuda.synchronize()  # keep the GPU queue short, as in the timing above
        prof.disable()
        torch.cuda.synchronize()
        if rank == 0:
            for order in ("tottime", "cumulative"):
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats(order).print_stats(28)
                print(f"== cProfile of {args.profile_calls} calls of {name!r}, by {order}")
                print("\n".join(line for line in buf.getvalue().splitlines() if line.strip())[:6000])
    _bench.exit_without_teardown(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
