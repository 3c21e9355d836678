"""Time the decode GEMM (fusedpar.kernels.gemv.skinny_matmul) against cuBLAS and fusedpar.matmul on
one GPU, on every per-rank decode GEMM of Qwen3-32B and Llama-3-70B at TP=4 and TP=8.

Per-rank shard shapes (perf/shapes.py; C[M, N] = A[M, K] @ W[N, K]^T):
    qkv      N = (heads + 2 kv_heads) head_dim / TP,  K = hidden
    o        N = hidden,                              K = heads head_dim / TP
    gate_up  N = 2 intermediate / TP,                 K = hidden
    down     N = hidden,                              K = intermediate / TP
for M in 1, 8, 32, 64 rows. Each implementation is timed with CUDA events around CUDA-graph replays
of --calls back-to-back calls (so launch overhead is not measured), over enough weight copies (each
call the next copy) that they exceed the L2 cache: every call streams its weight from HBM, as a
decode step's layers do. GB/s = weight bytes / time per call; "of copy" = that over the measured
bandwidth of a large device-to-device copy (read + write bytes / time) in the same run. Results are
checked against a float64 product (max abs error reported); a config that fails is reported, not fatal.
gate_up is also timed with skinny_matmul's SwiGLU epilogue (swiglu_block = N / 2, one block).

    python perf/tools/bench_gemv.py --out perf/tools/out/gemv.json
    python perf/tools/bench_gemv.py --sweep --out perf/tools/out/gemv_sweep.json   # + every candidate tiling

--sweep also times candidate SkinnyConfigs (BLOCK_N 32-128, BLOCK_K 128-512, 2-4 stages, 4 or 8 warps,
programs: choose_programs', one per N tile, split-K to >= #SMs, stream-K over #SMs and twice that;
CUDA-core products at M <= 2) per shape and M and
prints the best, to tune fusedpar/kernels/gemv/config.py:GPU_TABLE; this script changes nothing by
itself. Each case's sweep compiles and times ~100 tilings, within an even share of --sweep-budget-s
(the picked tiling first): narrow the cases (e.g. --models qwen32b --tp 4 --rows 1) or raise the
budget to try them all.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # perf/: shapes
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository (fusedpar) when not installed
import shapes

MODELS = ("qwen32b", "llama70b")
TPS = (4, 8)
ROWS = (1, 8, 32, 64)
L2_MULTIPLE = 4  # weight copies per case span >= this many L2 caches
MIN_ROTATION_BYTES = 256 * 2**20


def rank_gemms(key: str, tp: int) -> list[tuple[str, int, int]]:
    """(name, N, K) of the four per-rank decode GEMMs of one layer of `key` at tensor parallelism tp."""
    s = shapes.shape(key)
    return [("qkv", (s.heads + 2 * s.kv_heads) * s.head_dim // tp, s.hidden),
            ("o", s.hidden, s.heads * s.head_dim // tp),
            ("gate_up", 2 * s.intermediate // tp, s.hidden),
            ("down", s.hidden, s.intermediate // tp)]


def copy_bandwidth(nbytes: int = 2**30, iters: int = 20) -> float:
    """GB/s of a device-to-device copy of nbytes (read + write bytes counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / iters
    del src, dst
    return 2 * nbytes / seconds / 1e9


def graph_time_ms(calls: list, replays: int) -> float:
    """Milliseconds per call: a CUDA graph of `calls` (thunks) in sequence, replayed; median of replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls[:2]:  # warm-up on the capture stream (allocator pools, lazy init)
            c()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    del graph
    return sorted(times)[len(times) // 2]


_WEIGHTS: dict = {}  # the last shape's weight copies: cases come shape by shape, M inner


def rotating_weights(n: int, k: int, dtype: torch.dtype, l2_bytes: int, gen: torch.Generator) -> list:
    """A random [n, k] weight (entries ~ N(0, 1/k)) in enough copies to span L2_MULTIPLE L2 caches."""
    key = (n, k, dtype)
    if key not in _WEIGHTS:
        _WEIGHTS.clear()
        torch.cuda.empty_cache()
        nbytes = n * k * torch.finfo(dtype).bits // 8
        copies = max(2, math.ceil(max(MIN_ROTATION_BYTES, L2_MULTIPLE * l2_bytes) / nbytes))
        base = (torch.randn((n, k), generator=gen, device="cuda") / math.sqrt(k)).to(dtype)
        _WEIGHTS[key] = [base] + [base.clone() for _ in range(copies - 1)]
    return _WEIGHTS[key]


class Case:
    """One (N, K) weight in enough copies to exceed L2, and M rows of A."""

    def __init__(self, n: int, k: int, m: int, dtype: torch.dtype, l2_bytes: int, gen: torch.Generator):
        self.n, self.k, self.m = n, k, m
        self.weight_bytes = n * k * torch.finfo(dtype).bits // 8
        self.weights = rotating_weights(n, k, dtype, l2_bytes, gen)
        self.a = torch.randn((m, k), generator=gen, device="cuda").to(dtype)
        self.expected = self.a.double() @ self.weights[0].double().T

    def calls(self, fn, out: torch.Tensor) -> list:
        return [lambda w=w: fn(self.a, w, out) for w in self.weights]

    def run(self, fn, replays: int, swiglu: bool = False) -> dict:
        """Time fn(a, w, out); swiglu: fn is the gate_up GEMM with its SwiGLU epilogue ([M, N / 2] out)."""
        out = torch.empty((self.m, self.n // 2 if swiglu else self.n), dtype=self.a.dtype, device="cuda")
        result = fn(self.a, self.weights[0], out)  # eager: compiles, and the result is checked
        torch.cuda.synchronize()
        expected = self.expected
        if swiglu:
            gate, up = expected.split(self.n // 2, dim=1)
            expected = torch.nn.functional.silu(gate) * up
        err = (result.double() - expected).abs().max().item()
        calls = self.calls(fn, out)
        reps = max(1, math.ceil(40 / len(calls)))  # >= 40 calls per graph
        ms = graph_time_ms(calls * reps, replays)
        return {"ms": ms, "gbps": self.weight_bytes / (ms * 1e-3) / 1e9, "max_abs_err": err}


def implementations():
    from fusedpar.kernels import gemm, gemv

    return {
        "skinny_matmul": lambda a, w, out: gemv.skinny_matmul(a, w, out=out),
        "cublas": lambda a, w, out: torch.nn.functional.linear(a, w),  # F.linear has no out=
        "fusedpar.matmul": lambda a, w, out: gemm.matmul(a, w, out=out),
    }


def sweep_candidates(m: int, n: int, k: int, num_sms: int, dtype: torch.dtype) -> list:
    from fusedpar.kernels import gemv
    from fusedpar.kernels.gemv import config as cfgmod

    out = []
    picked = gemv.pick_config(m, n, k, dtype=dtype, num_sms=num_sms, interpret=False)
    row = cfgmod.table_row(m, interpret=False)
    for bn, bk, stages, warps in itertools.product((32, 64, 128), (128, 256, 512), (2, 3, 4), (4, 8)):
        if warps == 8 and bn < 128:
            continue
        base = gemv.SkinnyConfig(bn, bk, 1, warps, stages)
        if cfgmod.shared_memory_bytes(base, m, 2) > cfgmod.SMEM_BYTES:
            continue
        n_tiles = -(-n // bn)
        chosen = gemv.choose_programs(n, k, bn, bk, slots=num_sms * row[5], min_steps=row[6])
        for programs in sorted({chosen, n_tiles, n_tiles * -(-num_sms // n_tiles), num_sms, 2 * num_sms}):
            out.append(gemv.SkinnyConfig(bn, bk, programs, warps, stages, dot=True))
            if m <= 2 and bn * bk <= 64 * 256:  # CUDA-core products: a [bn, m, bk] fp32 tile in registers
                out.append(gemv.SkinnyConfig(bn, bk, programs, warps, stages, dot=False))
    return [picked] + [c for c in out if c != picked]  # the picked tiling first: its time always comes back


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--tp", default=",".join(map(str, TPS)))
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--out", default=None, help="JSON file for the records")
    parser.add_argument("--sweep", action="store_true", help="also time candidate tilings of skinny_matmul")
    parser.add_argument("--sweep-budget-s", type=float, default=420.0, help="stop sweeping after this long")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemv: no CUDA device; nothing to time")
        return 0

    from fusedpar.kernels import gemv
    from fusedpar.kernels.gemv import launch as gemv_launch

    dtype = getattr(torch, args.dtype)
    props = torch.cuda.get_device_properties(0)
    num_sms = props.multi_processor_count
    l2_bytes = getattr(props, "L2_cache_size", 50 * 2**20)
    t0 = time.time()
    copy_gbps = copy_bandwidth()
    print(f"{props.name}: {num_sms} SMs, L2 {l2_bytes / 2**20:.0f} MiB, copy bandwidth {copy_gbps:.0f} GB/s "
          f"(read + write), dtype {args.dtype}", flush=True)

    cases = []
    for key, tp in itertools.product(args.models.split(","), [int(t) for t in args.tp.split(",")]):
        for name, n, k in rank_gemms(key, tp):
            cases.extend((key, tp, name, n, k, m) for m in (int(r) for r in args.rows.split(",")))
    impls = implementations()
    records, sweeps = [], []
    gen = torch.Generator(device="cuda").manual_seed(0)
    sweep_deadline = None
    tol = 0.05 if dtype == torch.bfloat16 else 0.01  # max abs error against float64 (outputs are O(1))
    for i, (key, tp, name, n, k, m) in enumerate(cases):
        head = f"[{i + 1}/{len(cases)} {time.time() - t0:5.0f}s] {key} TP={tp} {name:7s} M={m:2d} N={n:5d} K={k:5d}"
        try:
            case = Case(n, k, m, dtype, l2_bytes, gen)
        except Exception as exc:
            print(f"{head}: setup failed: {exc!r}", flush=True)
            continue
        rec = {"model": key, "tp": tp, "gemm": name, "m": m, "n": n, "k": k, "weight_bytes": case.weight_bytes}
        parts = []
        for impl, fn in impls.items():
            try:
                r = case.run(fn, args.replays)
                r["of_copy"] = r["gbps"] / copy_gbps
                parts.append(f"{impl} {r['ms'] * 1e3:7.1f} us {r['gbps']:5.0f} GB/s")
            except Exception as exc:
                r = {"error": f"{type(exc).__name__}: {exc}"[:500]}
                parts.append(f"{impl} FAILED ({type(exc).__name__})")
                traceback.print_exc(limit=2)
            rec[impl] = r
        if name == "gate_up":  # the SwiGLU epilogue: same weight bytes, half the output, no activation pass
            try:
                def fused(a, w, out, block=n // 2):
                    return gemv.skinny_matmul(a, w, out=out, swiglu_block=block)

                r = case.run(fused, args.replays, swiglu=True)
                r["of_copy"] = r["gbps"] / copy_gbps
                parts.append(f"+swiglu {r['ms'] * 1e3:7.1f} us")
            except Exception as exc:
                r = {"error": f"{type(exc).__name__}: {exc}"[:500]}
                parts.append(f"+swiglu FAILED ({type(exc).__name__})")
                traceback.print_exc(limit=2)
            rec["skinny_matmul+swiglu"] = r
        records.append(rec)
        print(f"{head}: " + " | ".join(parts), flush=True)

        if args.sweep:
            sweep_deadline = sweep_deadline or time.time() + args.sweep_budget_s
            # what is left of the budget, shared evenly by this case and the ones after it
            case_deadline = time.time() + (sweep_deadline - time.time()) / (len(cases) - i)
            results = []
            for cfg in sweep_candidates(m, n, k, num_sms, dtype):
                if time.time() > case_deadline:
                    print("    sweep: this case's share of --sweep-budget-s is spent", flush=True)
                    break
                try:
                    fn = lambda a, w, out, cfg=cfg: gemv_launch._launch(a, w, out, cfg)  # noqa: E731
                    r = case.run(fn, max(3, args.replays // 2))
                    if not r["max_abs_err"] <= tol:
                        raise AssertionError(f"max abs error {r['max_abs_err']:.3g}")
                    results.append((r["ms"], cfg))
                except Exception as exc:
                    print(f"    sweep {cfg}: FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            if results:
                results.sort(key=lambda x: x[0])
                best_ms, best = results[0]
                picked_ms = rec["skinny_matmul"].get("ms")
                picked = "failed" if picked_ms is None else f"{picked_ms * 1e3:.1f} us"
                print(f"    sweep: best of {len(results)}: {best} {best_ms * 1e3:.1f} us "
                      f"({case.weight_bytes / best_ms / 1e6:.0f} GB/s); picked config {picked}", flush=True)
                sweeps.append({**{x: rec[x] for x in ("model", "tp", "gemm", "m", "n", "k")},
                               "results": [{"ms": t, "config": vars(c)} for t, c in results[:10]]})
        del case

    print(f"\n{'model':9s} {'TP':>2s} {'gemm':7s} {'M':>2s} {'N':>5s} {'K':>5s} | "
          + " | ".join(f"{impl:>24s}" for impl in impls) + " | skinny speed-up vs cuBLAS")
    print(" " * 37 + "| " + " | ".join(f"{'us':>7s} {'GB/s':>6s} {'%copy':>7s} " for _ in impls)
          + "| (! = max abs error > " + f"{tol:g})")
    for rec in records:
        cells = []
        for impl in impls:
            r = rec[impl]
            cells.append("error".rjust(24) if "error" in r else
                         f"{r['ms'] * 1e3:7.1f} {r['gbps']:6.0f} {100 * r['of_copy']:6.1f}%"
                         + ("!" if not r["max_abs_err"] <= tol else " "))
        ratio = ""
        if "ms" in rec["skinny_matmul"] and "ms" in rec["cublas"]:
            ratio = f"{rec['cublas']['ms'] / rec['skinny_matmul']['ms']:5.2f}x"
        sw = rec.get("skinny_matmul+swiglu", {})
        if "ms" in sw:
            flag = "!" if not sw["max_abs_err"] <= tol else ""
            ratio += f"  (+SwiGLU epilogue {sw['ms'] * 1e3:.1f} us{flag})"
        elif "error" in sw:
            ratio += "  (+SwiGLU epilogue: error)"
        print(f"{rec['model']:9s} {rec['tp']:2d} {rec['gemm']:7s} {rec['m']:2d} {rec['n']:5d} {rec['k']:5d} | "
              + " | ".join(cells) + " | " + ratio)
    print(f"done in {time.time() - t0:.0f} s", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "device": props.name, "num_sms": num_sms, "copy_gbps": copy_gbps, "dtype": args.dtype,
            "torch": torch.__version__, "records": records, "sweep": sweeps}, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
