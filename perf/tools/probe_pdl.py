"""Probe: what Programmatic Dependent Launch (PDL) saves between dependent kernels in a CUDA graph.

A decode step of the shift layer is a chain of ~11 short kernels replayed from one CUDA graph
(perf/tools/profile_layer.py: 157 us of kernels in a 167 us replay on 4x H200), and its row-parallel
GEMMs are weight-read bound. PDL (sm_90+) lets kernel i+1 start while kernel i finishes: it
waits for kernel i's memory with `griddepcontrol.wait` (tl.extra.cuda.gdc_wait) and may do
independent work before that, e.g. pull its weights towards L2. This probe measures both
effects on one GPU, without touching the library's kernels:

  chain      16 dependent elementwise kernels (y = 1.0001 x + 1 over 64 Ki bf16), PDL off / on
  gemv       8 x (elementwise -> weight-bound GEMV [8192 x 2048] bf16 reading the elementwise
             output), PDL off / on (wait first) / on with an L2 prefetch of the GEMV's weight
             slice issued before the wait

Each variant is captured in one CUDA graph; ms per graph replay = median over --iters replays
after warm-up (CUDA events, a GPU spin before each so host launch time stays out). Outputs are
checked against the PDL-off run (exact: same kernels, same order of operations).

Usage (GPU machine): python perf/tools/probe_pdl.py [--iters 50] [--out perf/tools/out/pdl_probe.json]
Without a GPU it prints a message and exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # perf/: the shared bench modules
import _bench  # run info shared by the benchmarks


@triton.jit
def _scale_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()  # x is the previous kernel's output
        tl.extra.cuda.gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + offs, mask=ok).to(tl.float32)
    tl.store(y_ptr + offs, (x * 1.0001 + 1.0).to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gemv_kernel(w_ptr, x_ptr, y_ptr, N, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PDL: tl.constexpr, PREFETCH: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    if PREFETCH:
        # One prefetch per 128-byte line of this program's weight rows: the weights do not depend
        # on the previous kernel, so they can move towards L2 before the wait.
        lines = tl.arange(0, BLOCK_K // 64)
        for k0 in range(0, K, BLOCK_K):
            p = w_ptr + rows[:, None].to(tl.int64) * stride_w + k0 + lines[None, :] * 64
            tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [p], dtype=tl.int32, is_pure=False,
                                      pack=1)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK_N], tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_w + (k0 + offs_k)[None, :], mask=row_ok[:, None])
        x = tl.load(x_ptr + k0 + offs_k)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], 1)
    tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=row_ok)


def scale(x, y, pdl: bool):
    n = x.numel()
    _scale_kernel[(triton.cdiv(n, 1024),)](x, y, n, BLOCK=1024, PDL=pdl, launch_pdl=pdl, num_warps=4)


def gemv(w, x, y, pdl: bool, prefetch: bool):
    N, K = w.shape
    _gemv_kernel[(triton.cdiv(N, 64),)](w, x, y, N, K, w.stride(0), BLOCK_N=64, BLOCK_K=256, PDL=pdl,
                                        PREFETCH=prefetch, launch_pdl=pdl, num_warps=8)


def replay_ms(fn, iters: int) -> float:
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(iters):
        torch.cuda._sleep(1_000_000)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default="perf/tools/out/pdl_probe.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_pdl: no CUDA GPU visible; nothing measured (run this on a GPU machine).")
        return 0
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(0)
    bf = torch.bfloat16
    records = []

    # chain: 16 dependent elementwise kernels
    bufs = [torch.randn(64 * 1024, device=dev, dtype=bf, generator=gen) for _ in range(17)]

    def chain(pdl):
        def run():
            for i in range(16):
                scale(bufs[i], bufs[i + 1], pdl)
        return run

    outs = {}
    for pdl in (False, True):
        ms = replay_ms(chain(pdl), args.iters)
        outs[pdl] = bufs[16].clone()
        records.append({"case": "chain16", "pdl": pdl, "prefetch": False, "ms": ms, "kernels": 16})
        print(f"chain16  pdl={pdl!s:<5}            {ms * 1e3:8.2f} us per replay")
    assert torch.equal(outs[False], outs[True]), "PDL changed the chain's result"

    # gemv: 8 x (elementwise -> weight-bound GEMV); a fresh weight per pair (8 x 32 MiB > L2)
    N, K = 8192, 2048
    ws = [torch.randn(N, K, device=dev, dtype=bf, generator=gen) for _ in range(8)]
    xs = [torch.randn(K, device=dev, dtype=bf, generator=gen) for _ in range(9)]
    hs = [torch.empty(K, device=dev, dtype=bf) for _ in range(8)]
    ys = [torch.empty(N, device=dev, dtype=bf) for _ in range(8)]

    def pairs(pdl, prefetch):
        def run():
            for i in range(8):
                scale(xs[i], hs[i], pdl)
                gemv(ws[i], hs[i], ys[i], pdl, prefetch)
        return run

    ref = None
    for pdl, prefetch in ((False, False), (True, False), (True, True), (False, True)):
        ms = replay_ms(pairs(pdl, prefetch), args.iters)
        got = torch.stack(ys).clone()
        if ref is None:
            ref = got
        assert torch.equal(ref, got), f"gemv pdl={pdl} prefetch={prefetch} changed the result"
        floor_us = 8 * N * K * 2 / 4.2e12 * 1e6
        records.append({"case": "gemv8", "pdl": pdl, "prefetch": prefetch, "ms": ms, "kernels": 16,
                        "weight_read_floor_ms_at_4.2TBps": floor_us / 1e3})
        print(f"gemv8    pdl={pdl!s:<5} prefetch={prefetch!s:<5} {ms * 1e3:8.2f} us per replay "
              f"(weight-read floor {floor_us:.1f} us)")

    info = {"bench": "pdl_probe", "gpu": torch.cuda.get_device_name(dev), **_bench.run_info(python=True)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps([info | r for r in records], indent=1) + "\n")
    print(f"wrote {len(records)} records to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
