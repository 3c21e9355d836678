"""Host cost of a Triton launch, and how much of each launcher's host time is Triton's.

    python perf/tools/probe_launch.py [--calls 200] [--iters 15]

A diagnosis tool (one GPU, no records, nothing asserted). Eager prefills of 512-2048 tokens are
host-bound on some hosts: one layer call launches ~7 Triton
kernels and takes 0.6-1.3 ms of host time. This separates, per launcher, the host time spent in
our Python (checks, plans, allocation) from the time inside triton's JITFunction.run (argument
binding, specialisation key, cache lookup, launch), and times the floor under it: the compiled
kernel's own launcher (CompiledKernel[grid](*args)) called directly.

Host time per call = time.perf_counter around --calls calls, the GPU synchronised between batches
so its queue never fills; median over --iters batches. "in triton run" wraps JITFunction.run with
a timer (adds ~0.2 us per launch).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # perf/: the shared bench modules
import _bench

_bench.add_repo_to_path()


def host_us(fn, calls: int, iters: int) -> float:
    """Median host microseconds per call of fn() over iters batches of calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


class RunTimer:
    """Wraps triton's JITFunction.run to add up the host time spent inside it."""

    def __init__(self):
        from triton.runtime.jit import JITFunction

        self.cls, self.orig, self.total, self.count = JITFunction, JITFunction.run, 0.0, 0

    def __enter__(self):
        orig = self.orig

        def timed(jit_self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return orig(jit_self, *args, **kwargs)
            finally:
                self.total += time.perf_counter() - t0
                self.count += 1

        self.cls.run = timed
        return self

    def __exit__(self, *exc):
        self.cls.run = self.orig


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--profile", default="", help="comma-separated substrings of case names to cProfile (own time)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("probe_launch: needs a CUDA GPU; nothing to do")
        return 0
    import triton
    from bench_attention import PagedInputs

    from fusedpar.kernels import attention, gemm, rmsnorm, swiglu

    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(4, 8192, device=dev, dtype=dt, generator=gen)
    w = torch.randn(8192, device=dev, dtype=dt, generator=gen)
    y = torch.empty_like(x)
    gu = torch.randn(16, 2 * 7168, device=dev, dtype=dt, generator=gen)
    a = torch.randn(16, 1024, device=dev, dtype=dt, generator=gen)
    wm = torch.randn(512, 1024, device=dev, dtype=dt, generator=gen)
    pre = PagedInputs([128] * 4, 0, dev, dt, gen)
    dec = PagedInputs([1] * 8, 4096, dev, dt, gen)

    # the floor: rms_norm's compiled kernel launched through CompiledKernel[grid] directly
    kern = rmsnorm._rms_norm_kernel
    rargs = (x, x, w, y, y, 8192, x.stride(0), x.stride(0), y.stride(0), y.stride(0), 1e-5)
    compiled = kern[(4,)](*rargs, HAS_DELTA=False, BLOCK=8192, num_warps=8)
    stream = torch.cuda.current_stream().cuda_stream
    direct = compiled[(4, 1, 1)]
    cases = {
        "torch.add(out=)": lambda: torch.add(x, x, out=y),
        "torch.empty_like": lambda: torch.empty_like(x),
        "rms_norm kernel, CompiledKernel[grid] (stream given)": lambda: direct(*rargs, False, 8192, stream=stream),
        "rms_norm kernel, CompiledKernel[grid]": lambda: direct(*rargs, False, 8192),
        "rms_norm kernel, jit[grid]": lambda: kern[(4,)](*rargs, HAS_DELTA=False, BLOCK=8192, num_warps=8),
        "rms_norm()": lambda: rmsnorm.rms_norm(x, w, 1e-5, out=y),
        "add_rms_norm()": lambda: rmsnorm.add_rms_norm(x, x, w, 1e-5),
        "silu_mul()": lambda: swiglu.silu_mul(gu, 7168),
        "matmul() 16x1024x512": lambda: gemm.matmul(a, wm),
        "paged_attention() prefill 4x128": lambda: attention.paged_attention(
            pre.qkv, **pre.kwargs(rope=True, write_kv=True)),
        "paged_attention() decode 8x4096": lambda: attention.paged_attention(
            dec.qkv, **dec.kwargs(rope=True, write_kv=True)),
    }
    print(f"probe_launch: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"python {sys.version.split()[0]}; host us per call, median of {args.iters} x {args.calls} calls")
    print(f"{'call':56s} {'host us':>8s} {'in triton run':>14s} {'launches':>9s}")
    for name, fn in cases.items():
        total = host_us(fn, args.calls, args.iters)
        with RunTimer() as rt:
            timed = host_us(fn, args.calls, args.iters)
        n = rt.count / ((args.iters * args.calls) + 3) if rt.count else 0
        inside = rt.total / max(rt.count, 1) * 1e6 * n
        print(f"{name:56s} {total:8.1f} {inside:8.1f} ({timed:5.1f}) {n:9.1f}")
    for name, fn in cases.items():
        if any(sub and sub in name for sub in args.profile.split(",")):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(500):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
            print(f"\n== cProfile of 500 calls of {name}, by own time\n" + buf.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
