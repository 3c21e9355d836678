"""Probe: does warming the o-projection weight into L2 during decode attention shorten the step?

One GPU, Qwen3-32B / Llama-3-70B TP=4 decode shapes (16 q / 2 kv heads local, head_dim 128, a
4096-token paged context, --seqs sequences): a CUDA graph of `sets` steps, each
    attention (fusedpar paged attention, RoPE + cache write)  ->  o GEMM [seqs, K_o] x W_o^T
with W_o the shift view (a column slice of a 4-block base weight) rotating over enough copies to
defeat L2, timed three ways: no prefetch; fusedpar.kernels.prefetch.l2_prefetch(W_o) on a side
stream forked before attention (joined before the GEMM); the prefetch launched on the main
stream before attention. GEMM: cuBLAS F.linear and fusedpar's Triton matmul. Also: the GEMM alone
with W_o cold vs just read (hot). Prints per-step microseconds; --out writes records.

Usage: python perf/probe_l2_prefetch.py [--model qwen32b] [--seqs 1] [--out perf/results/l2_prefetch.json]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench
import bench_attention
import bench_gemm


def replay_us(calls_per_set, sets: int, iters: int = 30) -> float:
    for c in calls_per_set:
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls_per_set:
            c()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / sets)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen32b", choices=sorted(bench_gemm.MODELS))
    p.add_argument("--seqs", type=int, default=1)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_l2_prefetch: no CUDA GPU visible; nothing measured.")
        return 0
    _bench.add_repo_to_path()
    from fusedpar.kernels import attention, gemm
    from fusedpar.kernels.prefetch import l2_prefetch

    device, dtype = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    case = next(c for c in bench_gemm.layer_cases(args.model) if c.gemm == "o")
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    w_bytes = case.n * case.k * 2
    sets = min(8, max(3, math.ceil(3 * l2 / w_bytes)))
    gen = torch.Generator(device=device).manual_seed(0)
    inputs = [bench_attention.PagedInputs([1] * args.seqs, args.context, device, dtype, gen) for _ in range(sets)]
    weights = [bench_gemm.make_weight(case, dtype, "view", device) for _ in range(sets)]
    acts = [torch.randn((args.seqs, case.k), device=device, dtype=dtype) for _ in range(sets)]
    outs = [torch.empty((args.seqs, case.n), device=device, dtype=dtype) for _ in range(sets)]
    side = torch.cuda.Stream()
    print(f"{args.model} o-proj W [{case.n}, {case.k}] view, {w_bytes / 2**20:.1f} MiB, {sets} sets; "
          f"{args.seqs} seq x {args.context} ctx; L2 {l2 / 2**20:.0f} MiB; prefetch launched: "
          f"{l2_prefetch(weights[0])}")

    def attn(i):
        return lambda: attention.paged_attention(inputs[i].qkv, **inputs[i].kwargs(rope=True, write_kv=True))

    def gemm_call(i, triton):
        if triton:
            return lambda: gemm.matmul(acts[i], weights[i], out=outs[i])
        return lambda: torch.matmul(acts[i], weights[i].t(), out=outs[i])

    def fork(i):
        def run():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                l2_prefetch(weights[i])
        return run

    def join():
        torch.cuda.current_stream().wait_stream(side)

    records = []
    for triton in (False, True):
        name = "triton" if triton else "cublas"
        plain = [c for i in range(sets) for c in (attn(i), gemm_call(i, triton))]
        side_pf = [c for i in range(sets) for c in (fork(i), attn(i), join, gemm_call(i, triton))]
        main_pf = [c for i in range(sets) for c in ((lambda i=i: l2_prefetch(weights[i])), attn(i),
                                                     gemm_call(i, triton))]
        gemm_cold = [gemm_call(i, triton) for i in range(sets)]
        gemm_hot = [c for i in range(sets) for c in (gemm_call(i, triton), gemm_call(i, triton))]
        attn_only = [attn(i) for i in range(sets)]
        r = {
            "gemm": name,
            "attn_then_gemm_us": replay_us(plain, sets),
            "side_stream_prefetch_us": replay_us(side_pf, sets),
            "main_stream_prefetch_us": replay_us(main_pf, sets),
            "attention_alone_us": replay_us(attn_only, sets),
            "gemm_cold_us": replay_us(gemm_cold, sets),
            "gemm_cold_then_hot_pair_us": replay_us(gemm_hot, sets),
        }
        r["gemm_hot_us"] = r["gemm_cold_then_hot_pair_us"] - r["gemm_cold_us"]
        print("  ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()))
        records.append({"bench": "l2_prefetch_probe", "model": args.model, "seqs": args.seqs,
                        "context": args.context, "weight_mib": w_bytes / 2**20, **r, **_bench.run_info()})
    if args.out:
        _bench.write_records(records, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
