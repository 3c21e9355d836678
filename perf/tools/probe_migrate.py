"""Probe: a KV migration's time against its number of layer groups, and where its host time goes.

On W GPUs (torchrun) this times fusedpar.layers.reshard.migrate_kv DP=W -> TP=W and back on the
Llama-3-8B shape (8 sequences x 2048 tokens, bf16, block 16; bench_reshard.py's setup): wall / host /
device ms, max over ranks of the median, beside NCCL all_to_all_single of the same bytes, for

  - the all-to-all path, per group count of --groups (the module's group size and cap overridden);
  - the push path through a symmetric staging (push_kv_rows) that holds the busiest receiver's KV, in
    1, 2, 4 and 8 layer groups, and through one of half that (four groups, its halves alternating).

Then, for the first and last group count and for one and four pushes: the CPU ops with the most self
time under torch.profiler on rank 0 and its kernels by device time (--trace DIR also writes each
rank's chrome trace there); for one and four pushes, the host timeline of one migration without a
profiler (when the host enters and leaves each launch and planning step); last, the host cost per
call of each launch a migration makes. Prints; no records.

Usage: torchrun --nproc-per-node 4 perf/tools/probe_migrate.py [--groups 1,2,4,8] [--iters 10] [--trace DIR]
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # perf/: the shared bench modules
import _bench
import bench_reshard as br
import shapes

_bench.add_repo_to_path()
from fusedpar.collectives.symmetric import SymmetricWorkspace  # noqa: E402  (after the repo is on the path)
from fusedpar.layers import reshard  # noqa: E402
from fusedpar.layouts import ModelDims, kv_plan  # noqa: E402


def _ops(fn, top: int, trace: Path | None = None) -> tuple[str, str]:
    """(CPU ops by self CPU time, GPU kernels and copies by self device time) of one call of fn; trace: a
    chrome trace of it written there (host launches against kernel start times)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    if trace:
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
    ops = prof.key_averages()
    return (ops.table(sort_by="self_cpu_time_total", row_limit=top),
            ops.table(sort_by="self_device_time_total", row_limit=top))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", default="1,2,4,8", help="layer group counts to time (comma-separated)")
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--top", type=int, default=15, help="CPU ops listed per profile")
    p.add_argument("--trace", default=None, help="a directory: chrome traces of the profiled migrations, per rank")
    a = p.parse_args(argv)
    if not _bench.torchrun_available():
        print("probe_migrate: needs CUDA GPUs and torchrun (torchrun --nproc-per-node N ...); skipped")
        return 0
    _, rank, world = _bench.init_distributed()
    s = shapes.shape("llama8b")
    cfg = dict(layers=s.layers, heads=s.heads, kv_heads=s.kv_heads, head_dim=s.head_dim, seqs=a.seqs,
               tokens=a.tokens, block=16)
    env = br.Env(rank, world, torch.device("cuda", torch.cuda.current_device()), a.iters, 2)
    dtype = torch.bfloat16
    dims = ModelDims(s.heads, s.kv_heads, s.head_dim, s.intermediate)
    lays = br._layouts(world)
    seqs = list(range(a.seqs))
    per_seq = -(-a.tokens // cfg["block"])
    base = br._pool(env, cfg, (0,), -(-a.seqs // world) * per_seq * s.kv_heads + s.kv_heads, dtype)
    counts = [int(g) for g in a.groups.split(",")]
    for src_key, dst_key in (("dp", "tp"), ("tp", "dp")):
        src, dst = lays[src_key], lays[dst_key]
        rep = {q: (q % src.dp, q % dst.dp) for q in seqs}
        plan = kv_plan(src, dst, dims, rep)
        heads = src.head_placement(s.heads, s.kv_heads).kv_heads(rank, "base")
        target = dst.head_placement(s.heads, s.kv_heads).kv_heads(rank, "base")
        sequences = {q: (src.coords(rank).dp == rep[q][0], dst.coords(rank).dp == rep[q][1], a.tokens) for q in seqs}
        state: dict = {}

        def setup(heads=heads, src=src, rep=rep, state=state):
            state["cache"] = base.reinterpret(heads)
            br._fill(state["cache"], cfg, [q for q in seqs if src.coords(rank).dp == rep[q][0]], dtype, env)

        def fn(plan=plan, target=target, sequences=sequences, state=state, staging=None):
            state["out"] = reshard.migrate_kv(state["cache"], rank, plan, target, sequences, staging=staging)

        rows = []
        for g in counts:
            reshard._GROUP_BYTES, reshard._MAX_GROUPS = 1, g
            t = env.time(fn, setup)
            received = env.max(state["out"][1])
            rows.append((f"{g}", t))
            if g in (counts[0], counts[-1]):
                setup()
                host, device = _ops(fn, a.top, a.trace and Path(a.trace) / f"{src_key}{world}-{dst_key}{world}-"
                                    f"a2a{g}-rank{rank}.json")
                if rank == 0:
                    print(f"\n{src_key}{world}->{dst_key}{world}, {g} group(s): CPU ops of one migration "
                          f"on rank 0\n{host}\nits device time per kernel\n{device}")
        # through a symmetric staging (push_kv_rows) that holds the busiest receiver's KV, in 1, 2, 4 and 8
        # layer groups (a region each), then through half of it (four groups, its halves alternating)
        most = int(env.max(float(received)))
        for label, nbytes, least in (("push 1", most, 1), ("push 2", most, 2), ("push 4", most, 4),
                                     ("push 8", most, 8), ("push 4 short", most // 2 + 512, 1)):
            staging = SymmetricWorkspace(dist.group.WORLD, nbytes)
            reshard._PUSH_GROUPS = least
            t = env.time(functools.partial(fn, staging=staging), setup)
            rows.append((label, t))
            if label in ("push 1", "push 4"):
                line = _host_timeline(functools.partial(fn, staging=staging), setup, staging)
                if rank == 0:
                    print(f"\n{src_key}{world}->{dst_key}{world}, {label}: host timeline of one migration on rank 0 "
                          f"(us from the call, enter-exit; median of 5)\n{line}")
                setup()
                host, device = _ops(functools.partial(fn, staging=staging), a.top, a.trace and Path(
                    a.trace) / f"{src_key}{world}-{dst_key}{world}-{label.replace(' ', '')}-rank{rank}.json")
                if rank == 0:
                    print(f"\n{src_key}{world}->{dst_key}{world}, {label}: CPU ops of one migration "
                          f"on rank 0\n{host}\nits device time per kernel\n{device}")
            del staging
        reshard._PUSH_GROUPS = 1
        n = max(world, int(received * world / max(world - 1, 1)) // 2 // world * world)
        send = torch.empty(n, dtype=torch.bfloat16, device=env.device)
        recv = torch.empty_like(send)
        a2a = env.time(lambda send=send, recv=recv: dist.all_to_all_single(recv, send))["wall"]
        if rank == 0:
            print(f"\n{src_key}{world}->{dst_key}{world}: {received / 2**20:.0f} MiB into the busiest rank; "
                  f"all_to_all_single {a2a:.3f} ms")
            print(f"{'groups':>8} {'wall ms':>9} {'host ms':>9} {'device ms':>10} {'% a2a':>7}")
            for g, t in rows:
                print(f"{g:>8} {t['wall']:>9.3f} {t['host']:>9.3f} {t['device']:>10.3f} {100 * a2a / t['wall']:>6.0f}%")
        state.clear()
    _host_costs(base, world, rank)
    _bench.finish_distributed()
    return 0


def _host_timeline(fn, setup, staging, runs: int = 5) -> str:
    """When the host enters and leaves each launch and planning step of a migration (fn), in us from the
    call: the median over `runs` calls (without a profiler's overhead)."""
    import statistics
    import time

    names = ["push_kv_rows", "move_kv_rows", "_target", "_row_index"]
    saved = {n: getattr(reshard, n) for n in names}
    barrier = staging.barrier
    log: list = []

    def wrap(name, f):
        def inner(*args, **kw):
            t = time.perf_counter()
            out = f(*args, **kw)
            log.append((name, t, time.perf_counter()))
            return out
        return inner

    runs_out = []
    try:
        for n in names:
            setattr(reshard, n, wrap(n, saved[n]))
        staging.barrier = wrap("barrier", barrier)
        for _ in range(runs):
            setup()
            torch.cuda.synchronize()
            dist.barrier()
            log.clear()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            runs_out.append(([(n, (a - t0) * 1e6, (b - t0) * 1e6) for n, a, b in log], (t1 - t0) * 1e6))
    finally:
        for n in names:
            setattr(reshard, n, saved[n])
        staging.barrier = barrier
    rows = []
    for i, (name, _, _) in enumerate(runs_out[0][0]):
        a = statistics.median(r[0][i][1] for r in runs_out)
        b = statistics.median(r[0][i][2] for r in runs_out)
        rows.append(f"  {name:14s} {a:8.0f} {b:8.0f}")
    rows.append(f"  {'return':14s} {statistics.median(r[1] for r in runs_out):8.0f}")
    return "\n".join(rows)


def _host_costs(cache, world: int, rank: int, calls: int = 200) -> None:
    """Host us per call of what a migration launches, on tiny inputs (rank 0 prints): each launcher
    against its Triton kernel launched through the JIT directly (the rest is the launcher's Python)."""
    import time
    from array import array

    from fusedpar.kernels import kv_rows
    from fusedpar.layers.kv_cache import upload

    layers, _, bs, _, hd = cache.k.shape
    flat = [t.view(layers, -1, hd) for t in (cache.k, cache.v)]
    ints = list(range(4096))
    host = torch.zeros(4096, dtype=torch.int64)
    table = torch.arange(8 * 128, dtype=torch.int64, device=cache.k.device).view(8, 128)
    pieces = torch.tensor([[i, 0, 2048, 2048 * i] for i in range(8)], dtype=torch.int64, device=cache.k.device)
    rows = torch.empty(8 * 2048, dtype=torch.int64, device=cache.k.device)
    idx = torch.arange(64, dtype=torch.int64, device=cache.k.device)
    chunk = torch.empty((64, layers, 2, 1, hd), dtype=cache.k.dtype, device=cache.k.device)
    meta = torch.tensor([chunk.data_ptr()] * world + [0] * (world - 1) + [64, 64] + [0] * world,
                        dtype=torch.int64, device=cache.k.device)[:3 * world + 1]
    staging = SymmetricWorkspace(dist.group.WORLD, 1 << 20)
    grid = (2, layers, 2)
    stream = torch.cuda.current_stream()
    cases = {
        "move_kv_rows (scatter)": lambda: kv_rows.move_kv_rows(flat[0], flat[1], idx, chunk, scatter=True),
        "  its kernel, jit[grid]": lambda: kv_rows._move_rows_kernel[grid](
            flat[0], flat[1], idx, chunk, 64, flat[0].stride(0), 1, 0, 64 * hd, layers * 64 * hd, HD=hd, HD_P2=hd,
            SCATTER=False, BLOCKED=False, BLOCK_R=32),
        "push_kv_rows": lambda: kv_rows.push_kv_rows(flat[0], flat[1], idx, meta, world=world),
        "staging.barrier()": staging.barrier,
        "upload 4096 int64 (pinned)": lambda: upload(host, cache.k.device),
        "paged_rows (8 x 128 blocks)": lambda: kv_rows.paged_rows(table, pieces, rows, block_size=bs, heads=1,
                                                                  max_tokens=2048),
        "torch.frombuffer(array) 4096": lambda: torch.frombuffer(array("q", ints), dtype=torch.int64),
        "torch.empty 512 MiB": lambda: torch.empty(1 << 29, dtype=torch.uint8, device=cache.k.device),
        "record + wait event": lambda: stream.wait_event(stream.record_event()),
    }
    out = []
    for name, fn in cases.items():
        fn()
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        out.append(f"{name:32s} {(t1 - t0) / calls * 1e6:8.1f}")
    if rank == 0:
        print("\nhost us per call (tiny inputs)\n" + "\n".join(out))


if __name__ == "__main__":
    sys.exit(main())
