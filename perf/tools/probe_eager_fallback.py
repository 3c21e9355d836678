"""GPU time of eager row-parallel GEMM + all-reduce call forms, interleaved: where does the
router's eager fallback (gemm_all_reduce -> F.linear + sum_over_group_) lose to the plain path?

    torchrun --nproc-per-node 4 perf/tools/probe_eager_fallback.py [--tokens 8,64,512] [--n 8192 --k 2048]

Variants (each: 10 calls per sample on rotating operands, CUDA events around the sample after a
device barrier, median of 30 interleaved samples, max over ranks):
    plain        F.linear + dist.all_reduce
    pg direct    F.linear + sum_over_group_(y, pg) (what the router runs, without its checks)
    routed       fusedpar gemm_all_reduce(x, w, group, workspace)
    plain+cap    plain with torch.cuda.is_current_stream_capturing() before it (the router's test)
    fused        the Triton one-shot forced eagerly (path="one_shot"): not a fallback; here so that
                 the others' samples sometimes follow a Triton launch, as in bench_gemm_all_reduce
The samples run in a seeded random order per round (_bench.interleaved_order); a second line per
size gives plain's and routed's medians by the variant sampled just before them.
A diagnosis tool: prints a table, no records, nothing asserted.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # perf/: the shared bench modules
import _bench

_bench.add_repo_to_path()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="8,64,512")
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--k", type=int, default=2048)
    args = p.parse_args()
    if not _bench.torchrun_available():
        print("probe_eager_fallback: needs CUDA GPUs and a torchrun launch; nothing to do")
        return 0
    _, rank, _ = _bench.init_distributed()
    from fusedpar.collectives.symmetric import SymmetricWorkspace
    from fusedpar.kernels.allreduce import sum_over_group_
    from fusedpar.kernels.gemm_all_reduce import GemmAllReduceOptions, gemm_all_reduce

    group = dist.group.WORLD
    ws = SymmetricWorkspace(group, 64 << 20, max_blocks=256)
    timer = _bench.BarrierTimer(ws.barrier, 30, 3)
    gen = torch.Generator(device="cuda").manual_seed(rank)
    for m in (int(t) for t in args.tokens.split(",")):
        ops = [(torch.randn(m, args.k, device="cuda", dtype=torch.bfloat16, generator=gen),
                torch.randn(args.n, args.k, device="cuda", dtype=torch.bfloat16, generator=gen) / 50)
               for _ in range(10)]

        def plain(x, w):
            y = torch.nn.functional.linear(x, w)
            dist.all_reduce(y, group=group)

        def pg_direct(x, w):
            sum_over_group_(torch.nn.functional.linear(x, w), group)

        def routed(x, w):
            gemm_all_reduce(x, w, group, ws)

        def plain_cap(x, w):
            torch.cuda.is_current_stream_capturing()
            plain(x, w)

        def fused(x, w):
            gemm_all_reduce(x, w, group, ws, options=GemmAllReduceOptions(path="one_shot"))

        variants = {name: [lambda x=x, w=w, f=f: f(x, w) for x, w in ops]
                    for name, f in (("plain", plain), ("pg direct", pg_direct), ("routed", routed),
                                    ("plain+cap", plain_cap), ("fused", fused))}
        after: dict[tuple[str, str], float] = {}
        ms = timer.eager_interleaved(variants, by_predecessor=after)
        worst = {name: _bench.max_over_ranks(v) for name, v in ms.items()}
        prev = {key: _bench.max_over_ranks(after.get(key, 0.0)) for name in ("plain", "routed")
                for key in ((name, p) for p in variants if p != name)}
        if rank == 0:
            row = "  ".join(f"{name} {v * 1e3:7.1f} us ({worst['plain'] / v:4.2f}x)" for name, v in worst.items())
            print(f"m={m:5d} n={args.n} k={args.k}: {row}", flush=True)
            row = "  ".join(f"{a} after {b} {v * 1e3:6.1f}" for (a, b), v in prev.items() if v)
            print(f"m={m:5d}   by predecessor (us): {row}", flush=True)
    _bench.exit_without_teardown(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
