"""Benchmark: RMSNorm fused into the following GEMM (fusedpar.kernels.norm_linear) vs the two-kernel path.

For each model (Llama-3-70B, Qwen3-32B) and decode step size M, times the two norm + GEMM pairs of a
shift-mode (TP=4) decoder layer, on the shift views of the weights (a row range of a 4-block base
weight, as the layer reads them):
    qkv      N = (h + 2 h_kv) d / 4,  K = hidden     (input RMSNorm -> qkv projection)
    gate_up  N = 2 I / 4,             K = hidden     (post-attention RMSNorm -> gate_up projection)
baseline: fusedpar's Triton rms_norm + torch.nn.functional.linear (cuBLAS), what the layer ran
before; fused: rms_norm_linear with a workspace allocated once.

Protocol: each path is captured into one CUDA graph of --calls calls (a decode step is a graph),
every call on its own operand set (x, W) rotating over enough sets to exceed the L2 cache 3x, so
every call streams its weight from HBM; per-call time = median replay time / calls, --iters
replays after warm-up. The roofline is the weight bytes at the HBM bandwidth of a 1 GiB device
copy measured in this run. --sweep also times a list of tilings per shape (the choice behind
pick_config) and prints them best first.

Usage (on a GPU machine, from the repo root):
    python perf/bench_norm_linear.py [--shapes llama70b,qwen32b] [--tokens 1,8,16] [--sweep]
                                     [--out perf/results/norm_linear.json]
Without a GPU it prints a message and exits 0.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench  # setup, timing and records shared by the benchmarks
import bench_gemm  # model shapes, shift-view weights, ceilings

BASELINE = "Triton rms_norm + cuBLAS F.linear (CUDA graph)"
EPS = 1e-6


def sweep_configs(n: int, m: int):
    """Tilings timed by --sweep: (block_n, block_k, split_k, stages), 4 warps."""
    from fusedpar.kernels.norm_linear import NormLinearConfig

    out = []
    bm = max(16, 1 << max(0, m - 1).bit_length())
    for bn in (32, 64, 128):
        for bk in (64, 128, 256):
            for split in (1, 2, 3, 4, 6, 8):
                units = -(-n // bn) * split
                if not 64 <= units <= 264:
                    continue
                for stages in (4, 5):
                    if stages * (bm + bn) * bk * 2 <= 227 * 1024:
                        out.append(NormLinearConfig(bn, bk, split, 4, stages))
    return out


def graph_ms(calls, iters: int) -> float:
    """Per-call ms of `calls` captured in one CUDA graph (median of `iters` replays)."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    del g
    return statistics.median(times)


def bench_case(case, m, args, dtype, bandwidth, l2_bytes, device, nl, rmsnorm, gemm):
    n, k = case.n, case.k
    weight_bytes = n * k * dtype.itemsize
    sets = min(8, max(2, math.ceil(3 * l2_bytes / weight_bytes)))
    ws_ = [bench_gemm.make_weight(case, dtype, "view", device) for _ in range(sets)]
    xs = [(3 * torch.randn((m, k), device=device)).to(dtype) for _ in range(sets)]
    g = (1 + 0.3 * torch.randn(k, device=device)).to(dtype)
    outs = [torch.empty((m, n), device=device, dtype=dtype) for _ in range(sets)]
    hs = [torch.empty((m, k), device=device, dtype=dtype) for _ in range(sets)]
    calls = max(args.calls, sets)

    def base_call(i):
        j = i % sets
        return lambda: torch.nn.functional.linear(rmsnorm.rms_norm(xs[j], g, EPS, out=hs[j]), ws_[j])

    baseline = [base_call(i) for i in range(calls)]
    base_ms = graph_ms(baseline, args.iters)

    def triton_call(i):  # diagnosis: the same pair with fusedpar's plain Triton GEMM instead of cuBLAS
        j = i % sets
        return lambda: gemm.matmul(rmsnorm.rms_norm(xs[j], g, EPS, out=hs[j]), ws_[j], out=outs[j])

    triton_gemm_ms = graph_ms([triton_call(i) for i in range(calls)], args.iters)
    ref = torch.nn.functional.linear(rmsnorm.rms_norm(xs[0], g, EPS), ws_[0]).float()
    if args.sweep:  # room for every tiling of sweep_configs (split <= 6, BLOCK_M <= 64)
        workspace = nl.NormLinearWorkspace(device, part_elems=n * 8 * 64, tiles=-(-n // 16))
    else:
        workspace = nl.NormLinearWorkspace.for_shapes(device, [(m, n, k)], dtype)

    def fused_ms(cfg):
        def call(i):
            j = i % sets
            if args.plain:  # the norm kernel, then the split-K Triton GEMM alone
                return lambda: nl.decode_linear(rmsnorm.rms_norm(xs[j], g, EPS, out=hs[j]), ws_[j],
                                                workspace=workspace, config=cfg, out=outs[j])
            return lambda: nl.rms_norm_linear(xs[j], g, ws_[j], EPS, workspace=workspace, config=cfg, out=outs[j])

        ms = graph_ms([call(i) for i in range(calls)], args.iters)
        diff = ((outs[0].float() - ref).abs().max() / ref.abs().max()).item()
        return ms, diff

    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    default = nl.pick_config(m, n, k, dtype=dtype, num_sms=num_sms, interpret=False)
    f_ms, diff = fused_ms(default)
    floor_ms = weight_bytes / bandwidth * 1e3
    rec = {
        "case": case.name, "tokens": m, "n": n, "k": k, "baseline_ms": base_ms, "fused_ms": f_ms,
        "speedup": base_ms / f_ms, "roofline_pct": 100 * floor_ms / f_ms,
        "baseline_roofline_pct": 100 * floor_ms / base_ms,
        "floor_ms": floor_ms, "bound": "hbm", "max_rel_diff_vs_baseline": diff, "operand_sets": sets,
        "calls_per_graph": calls, "triton_config": vars(default),
        "rms_norm_plus_triton_gemm_ms": triton_gemm_ms,
    }
    sweep = []
    if args.sweep:
        for cfg in sweep_configs(n, m):
            try:
                ms, d = fused_ms(cfg)
            except Exception as exc:  # a tiling that does not compile is reported, not fatal
                print(f"   sweep {cfg}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            sweep.append((ms, cfg, d))
        sweep.sort(key=lambda t: t[0])
        rec["sweep_top"] = [{"ms": ms, "config": vars(cfg), "rel_diff": d} for ms, cfg, d in sweep[:8]]
    return rec


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="llama70b,qwen32b", help=f"comma list of {sorted(bench_gemm.MODELS)}")
    p.add_argument("--gemms", default="qkv,gate_up", help="comma list of qkv,gate_up")
    p.add_argument("--tokens", default="1,8,16", help="comma list of decode step sizes M (<= 64)")
    p.add_argument("--iters", type=int, default=20, help="graph replays per measurement (median taken)")
    p.add_argument("--calls", type=int, default=16, help="calls per captured graph")
    p.add_argument("--sweep", action="store_true", help="also time the tilings of sweep_configs, best first")
    p.add_argument("--plain", action="store_true",
                   help="time rms_norm + decode_linear (the split-K GEMM without the norm) as the fused path")
    p.add_argument("--out", default="perf/results/norm_linear.json")
    args = p.parse_args(argv)
    unknown = set(args.shapes.split(",")) - set(bench_gemm.MODELS)
    if unknown:
        p.error(f"unknown --shapes {sorted(unknown)}; known: {sorted(bench_gemm.MODELS)}")
    if set(args.gemms.split(",")) - {"qkv", "gate_up"}:
        p.error("--gemms takes qkv and/or gate_up (the GEMMs that follow an RMSNorm)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_norm_linear: no CUDA GPU visible; nothing measured (run this on a GPU machine).")
        return 0
    _bench.add_repo_to_path()
    from fusedpar.kernels import gemm, rmsnorm
    from fusedpar.kernels import norm_linear as nl

    device = torch.device("cuda", torch.cuda.current_device())
    dtype = torch.bfloat16
    props = torch.cuda.get_device_properties(device)
    l2_bytes = getattr(props, "L2_cache_size", 50 * 2**20)
    gpu = torch.cuda.get_device_name(device)
    peak, bandwidth = bench_gemm.measure_ceilings(dtype, 20, device)
    print(f"{gpu}: device copy {bandwidth / 1e9:.0f} GB/s, L2 {l2_bytes / 2**20:.0f} MiB, "
          f"{props.multi_processor_count} SMs")
    common = {"bench": "norm_linear", "world": 1, "gpu": gpu, "baseline": BASELINE,
              **_bench.run_info(python=True), "hbm_gbps": bandwidth / 1e9, "peak_tflops": peak / 1e12}
    header = f"{'case':<18}{'M':>4}{'N':>7}{'K':>6}{'base ms':>10}{'fused ms':>10}{'speedup':>9}{'%roof':>7}  config"
    print(header)
    print("-" * len(header))
    records = []
    gemms = args.gemms.split(",")
    for model in args.shapes.split(","):
        for case in bench_gemm.layer_cases(model):
            if case.gemm not in gemms:
                continue
            for m in (int(t) for t in args.tokens.split(",") if t):
                try:
                    rec = bench_case(case, m, args, dtype, bandwidth, l2_bytes, device, nl, rmsnorm, gemm)
                except Exception as exc:  # unattended run: record the failure, keep the other shapes
                    rec = {"case": case.name, "tokens": m, "error": f"{type(exc).__name__}: {exc}"[:2000]}
                    print(f"{case.name:<18}{m:>4}  ERROR {rec['error'][:200]}")
                    records.append({**common, **rec})
                    continue
                finally:
                    torch.cuda.empty_cache()  # the case's weight sets are gone: return their memory
                records.append({**common, **rec})
                c = rec["triton_config"]
                print(f"{case.name:<18}{m:>4}{rec['n']:>7}{rec['k']:>6}{rec['baseline_ms'] * 1e3:>9.1f}u"
                      f"{rec['fused_ms'] * 1e3:>9.1f}u{rec['speedup']:>9.3f}{rec['roofline_pct']:>7.1f}  "
                      f"(rms+triton {rec['rms_norm_plus_triton_gemm_ms'] * 1e3:.1f}u)  "
                      f"bn{c['block_n']} bk{c['block_k']} s{c['split_k']} st{c['num_stages']}"
                      f"  diff {rec['max_rel_diff_vs_baseline']:.2e}")
                for t in rec.get("sweep_top", []):
                    c = t["config"]
                    print(f"{'':<22}sweep {t['ms'] * 1e3:7.1f}u  bn{c['block_n']} bk{c['block_k']} s{c['split_k']} "
                          f"st{c['num_stages']}  diff {t['rel_diff']:.2e}")
    _bench.write_records(records, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
