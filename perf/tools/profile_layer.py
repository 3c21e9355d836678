"""Where a decoder layer step spends GPU time: torch.profiler kernel tables of one layer, per mode.

    torchrun --nproc-per-node 4 perf/tools/profile_layer.py [--model qwen32b] [--prefill 4096] [--decode 8]
                                                      [--context 4096] [--out perf/tools/out/profile_layer.txt]
                                                      [--layer-only [--aligned] [--host-profile]]

Profiles (rank 0's kernels, 5 steps each after warm-up): fused base prefill of --prefill tokens
(one sequence), plain TP prefill (cuBLAS + NCCL) of the same, and the CUDA-graph replay of a
--decode-sequence shift decode step, fused and stock (cuBLAS + NCCL). Writes
the per-kernel tables (total / count / mean GPU us, share of the step) and, per run, the sum of
kernel time vs the wall time of the step (the gap is launch latency and idle time).
With --layer-only, also per rank and per prefill run: the host time to launch one layer call vs
its GPU time (a layer whose launches take longer than its kernels leaves the GPU idle and turns
host jitter into rank skew); --pipelined K times K calls back to back per sample instead (the
steady state of a deep model).
With --host-profile, also rank 0's Python profile (cProfile) of 20 layer calls: where the host time
to launch a layer goes (the part before the first collective decides how late the slowest rank joins).
A diagnosis tool: nothing here is a benchmark record.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # perf/: the shared bench modules
import _bench
import shapes
from bench_layer import MODELS, full_weights

_bench.add_repo_to_path()


def kernel_table(prof, steps: int) -> tuple[list[tuple[str, float, int]], float]:
    """[(kernel name, total us per step, launches per step)] sorted by time, and the sum."""
    acc: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            a = acc[e.name[:90]]
            a[0] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            a[1] += 1
    rows = sorted(((k, v[0] / steps, round(v[1] / steps)) for k, v in acc.items()), key=lambda r: -r[1])
    return rows, sum(r[1] for r in rows)


def idle_summary(prof, steps: int) -> dict:
    """Where this rank's GPU sat idle inside the profiled window: the span from the first kernel's
    start to the last one's end, the busy time (union of kernel intervals, so overlapping streams
    count once) and the idle gaps summed per (kernel before, kernel after) pair; all per step, with
    each pair's longest single gap (one long gap in the first step = the host starting late)."""
    iv = sorted((e.time_range.start, e.time_range.end, e.name[:70]) for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA)
    if not iv:
        return {"span_us": 0.0, "busy_us": 0.0, "gaps": []}
    gaps: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0, 0.0])
    busy, run_start, run_end, last = 0.0, iv[0][0], iv[0][1], iv[0][2]
    for start, end, name in iv[1:]:
        if start > run_end:
            g = gaps[(last, name)]
            g[0] += start - run_end
            g[1] += 1
            g[2] = max(g[2], start - run_end)
            busy += run_end - run_start
            run_start = start
        if end >= run_end:
            run_end, last = end, name
    busy += run_end - run_start
    top = sorted(gaps.items(), key=lambda kv: -kv[1][0])[:12]
    return {"span_us": (run_end - iv[0][0]) / steps, "busy_us": busy / steps,
            "gaps": [(a, b, us / steps, n / steps, longest) for (a, b), (us, n, longest) in top]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="qwen32b")
    p.add_argument("--prefill", type=int, default=4096)
    p.add_argument("--decode", type=int, default=8)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--layer-only", action="store_true",
                   help="prefill: profile the decoder layer alone on a step planned once (bench_layer.layer_time_ms), "
                        "without the stack's per-step planning, metadata upload and output all-gather")
    p.add_argument("--aligned", action="store_true",
                   help="with --layer-only: synchronize and barrier the ranks before every profiled layer call, so a "
                        "fused kernel's time is its own work, not the wait for a late peer (the barrier's small NCCL "
                        "kernel appears in the table)")
    p.add_argument("--pipelined", type=int, default=1, metavar="K",
                   help="with --layer-only: each per-rank sample runs K layer calls back to back (as a deep model's "
                        "layers run, the host ahead of the GPU) and reports per call")
    p.add_argument("--host-profile", action="store_true",
                   help="with --layer-only: cProfile 20 layer calls on rank 0 and print the functions by own and "
                        "cumulative host time")
    p.add_argument("--o-a2a", action="store_true",
                   help="also profile the fused base layer with o_scatter=False (attention into a local buffer, "
                        "then all_to_all_o_proj): the A/B of the base-mode return all-to-all's two plans")
    p.add_argument("--shift-prefill", action="store_true",
                   help="also profile the fused stack's prefill in shift mode (TP over the zero-copy views), the "
                        "mode the policy runs at or below its threshold")
    p.add_argument("--no-decode", dest="decode_replays", action="store_false",
                   help="skip the shift-mode decode replays (prefill profiles only)")
    p.add_argument("--out", default="perf/tools/out/profile_layer.txt")
    args = p.parse_args()
    if args.pipelined < 1 or (args.pipelined > 1 and not args.layer_only):
        p.error("--pipelined K needs K >= 1 and --layer-only")
    if args.host_profile and not args.layer_only:
        p.error("--host-profile needs --layer-only (it profiles the layer call alone)")
    if not _bench.torchrun_available():
        print("profile_layer: needs CUDA GPUs and a torchrun launch; nothing to do")
        return 0
    _, rank, world = _bench.init_distributed()
    from torch.profiler import ProfilerActivity, profile

    from fusedpar import ParallelLayout
    from fusedpar.collectives import ParallelContext
    from fusedpar.layers import DecoderConfig, ShiftParallelStack, ShiftPolicy, StepBatch

    dev, dtype = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    cfg = DecoderConfig(**shapes.decoder_config_kwargs(args.model))
    full = full_weights(cfg, dev, dtype, seed=0)

    def build(sp, tp, fuse_comm, o_scatter=True):
        ctx = ParallelContext(ParallelLayout(world, sp=sp, tp=tp))
        stack = ShiftParallelStack.from_full_weights(cfg, ctx, [full], ShiftPolicy(1024))
        _bench.enable_stack(stack, max_tokens=args.prefill, fused=fuse_comm, o_scatter=o_scatter)
        cache = stack.make_cache(block_size=16, num_blocks=(args.decode * (args.context + 64) + args.prefill) // 16
                                 + 64, dtype=dtype)
        return stack, cache

    out_lines: list[str] = []
    gen = torch.Generator(device=dev).manual_seed(1)
    steps = 5

    def report(label: str, fn) -> None:
        for i in range(3):
            fn(i)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for i in range(steps):
                fn(3 + i)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / steps * 1e6
        rows, total = kernel_table(prof, steps)
        idle = [None] * world
        torch.distributed.all_gather_object(idle, idle_summary(prof, steps))
        if rank == 0:
            mark = len(out_lines)
            out_lines.append(f"\n== {label}: kernel time {total:.0f} us per step, wall {wall:.0f} us per step")
            for name, us, n in rows[:25]:
                out_lines.append(f"  {us:8.1f} us  {100 * us / total:5.1f}%  x{n:<3d} {name}")
            between = " (steps started on an idle GPU: the gaps between steps are host sync + barrier)" \
                if args.aligned and "prefill" in label else ""
            out_lines.append(f"   GPU idle per step, first kernel start to last kernel end{between}:")
            for r, d in enumerate(idle):
                out_lines.append(f"     rank {r}: span {d['span_us']:8.1f} us  busy {d['busy_us']:8.1f} us  "
                                 f"idle {d['span_us'] - d['busy_us']:7.1f} us")
            out_lines.append("   rank 0's largest idle gaps per step (us, gaps per step, the longest single gap, "
                             "kernel before -> after):")
            for before, after, us, n, longest in idle[0]["gaps"]:
                out_lines.append(f"     {us:8.1f} us  x{n:<4.1f} (max {longest:7.1f}) {before[:50]} -> {after[:50]}")
            print("\n".join(out_lines[mark:]), flush=True)

    def layer_diagnostics(stack, layer_call) -> None:
        """Per rank: host launch time vs GPU time of one layer call."""
        import statistics

        layer_call()  # warm-up
        host, gpu = [], []
        for _ in range(steps):
            torch.cuda.synchronize()
            if args.aligned:
                torch.distributed.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            for _ in range(args.pipelined):
                layer_call()
            host.append((time.perf_counter() - t0) * 1e6 / args.pipelined)
            end.record()
            torch.cuda.synchronize()
            gpu.append(start.elapsed_time(end) * 1e3 / args.pipelined)
        mine = {"host_us": statistics.median(host), "gpu_us": statistics.median(gpu)}
        per_rank = [None] * world
        torch.distributed.all_gather_object(per_rank, mine)
        if rank == 0:
            batch = f" of {args.pipelined} calls back to back, per call" if args.pipelined > 1 else ""
            out_lines.append(f"   per rank, median of {steps} samples{batch} (host: launching the call; gpu: events "
                             "around it):")
            for r, d in enumerate(per_rank):
                out_lines.append(f"     rank {r}: host {d['host_us']:7.0f} us  gpu {d['gpu_us']:7.0f} us")
            print("\n".join(out_lines[-world - 1:]), flush=True)
        if args.host_profile:
            host_profile(layer_call)

    def host_profile(layer_call, calls: int = 20) -> None:
        """Rank 0's cProfile of `calls` layer calls, each started on an idle GPU (synchronize + barrier
        before it, outside the profile), so the host never blocks on a full launch queue."""
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        for _ in range(calls):
            torch.cuda.synchronize()
            torch.distributed.barrier()
            if rank == 0:
                prof.enable()
            layer_call()
            if rank == 0:
                prof.disable()
        torch.cuda.synchronize()
        if rank == 0:
            for key, n in (("tottime", 30), ("cumulative", 40)):
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).strip_dirs().sort_stats(key).print_stats(n)
                text = buf.getvalue().strip().splitlines()
                start = next((i for i, line in enumerate(text) if "ncalls" in line), 0)
                out_lines.append(f"   rank 0 host profile of {calls} layer calls, by {key} (seconds in total):")
                out_lines.extend("     " + line for line in text[:1] + text[start:])
                print("\n".join(out_lines[-(len(text) - start + 2):]), flush=True)

    x_pre = torch.randn((args.prefill, cfg.hidden_size), generator=gen, device=dev, dtype=dtype)
    sid = iter(range(10**9))
    prefill_runs = [("fused base prefill", world, 1, True, "base", True),
                    ("plain SP prefill", world, 1, False, "base", True),
                    ("plain TP prefill", 1, world, False, "shift", True)]
    if args.o_a2a:
        prefill_runs.insert(1, ("fused base prefill, o all-to-all plan", world, 1, True, "base", False))
    if args.shift_prefill:
        prefill_runs.insert(1, ("fused shift prefill", world, 1, True, "shift", True))
    for label, sp, tp, fuse, mode, o_scatter in prefill_runs:
        stack, cache = build(sp, tp, fuse, o_scatter=o_scatter)

        def prefill(i, stack=stack, cache=cache, mode=mode):
            s = next(sid)
            stack(x_pre, StepBatch((s,), (args.prefill,), (0,)), cache, mode=mode)
            cache.free(s)

        if args.layer_only:
            step = stack.plan(StepBatch((next(sid),), (args.prefill,), (0,)), cache, mode)
            x = stack.layer_input(x_pre, step)

            def layer_step(i, layer=stack.layers[0], x=x, step=step, cache=cache):
                if args.aligned:
                    torch.cuda.synchronize()
                    torch.distributed.barrier()
                layer(x, step, cache)

            what = f"{label} {args.prefill} tokens (layer only{', aligned' if args.aligned else ''})"
            report(what, layer_step)
            layer_diagnostics(stack, lambda layer=stack.layers[0], x=x, step=step, cache=cache: layer(x, step, cache))
        else:
            report(f"{label} {args.prefill} tokens", prefill)
        timeouts = stack.fused.spin_timeouts() if fuse else []
        if timeouts:  # a bounded flag wait gave up: that run's output (and timing) is not trustworthy
            print(f"rank {rank}: {label}: flag waits timed out on {timeouts}", flush=True)
        del stack, cache
    n = args.decode
    x_dec = torch.randn((n, cfg.hidden_size), generator=gen, device=dev, dtype=dtype)
    decode_runs = (("fused shift decode replay", world, 1, True),
                   ("stock TP decode replay (NCCL)", 1, world, False))
    for label, sp, tp, fuse in decode_runs if args.decode_replays else ():
        stack, cache = build(sp, tp, fuse)
        graphs = stack.capture_decode_graphs(cache, max_context=args.context + 64, sizes=(n,))
        ids = tuple(next(sid) for _ in range(n))
        cache.begin_step(StepBatch(ids, (args.context,) * n, (0,) * n))
        st = graphs.stage(x_dec, StepBatch(ids, (1,) * n, (args.context,) * n))
        report(f"{label} {n} x {args.context} context", lambda i, g=st.graph: g.replay())
    if rank == 0:
        Path(args.out).write_text("\n".join(out_lines) + "\n")
        print(f"wrote {args.out}")
    _bench.exit_without_teardown(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
