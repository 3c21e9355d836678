"""Probe: a KV migration's time against its number of layer groups, and where its host time goes.

fusedpar.layers.reshard.migrate_kv pipelines its gathers, all-to-alls and scatters over groups of
layers. On W GPUs (torchrun) this times DP=W -> TP=W and back on the Llama-3-8B shape (8 sequences
x 2048 tokens, bf16, block 16; bench_reshard.py's setup) for each group count of --groups (the
module's group size and cap overridden), wall / host / device ms, max over ranks of the median, beside
NCCL all_to_all_single of the same bytes, and through a symmetric staging (push_kv_rows) in one push
and in four; then, for the first and last group count and the single push, the CPU ops with
the most self time under torch.profiler on rank 0 (the host side of one migration) and its kernels and
copies by device time (the exchange against the row moves). Prints; no records.

Usage: torchrun --nproc-per-node 4 perf/tools/probe_migrate.py [--groups 1,2,4,8] [--iters 10]
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


def _ops(fn, top: int) -> tuple[str, str]:
    """(CPU ops by self CPU time, GPU kernels and copies by self device time) of one call of fn."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
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
                host, device = _ops(fn, a.top)
                if rank == 0:
                    print(f"\n{src_key}{world}->{dst_key}{world}, {g} group(s): CPU ops of one migration "
                          f"on rank 0\n{host}\nits device time per kernel\n{device}")
        # through a symmetric staging (push_kv_rows): one push, then four (the staging's halves alternating)
        most = int(env.max(float(received)))
        for label, nbytes in (("push 1", most), ("push 4", most // 2 + 512)):
            staging = SymmetricWorkspace(dist.group.WORLD, nbytes)
            t = env.time(functools.partial(fn, staging=staging), setup)
            rows.append((label, t))
            if label == "push 1":
                setup()
                host, device = _ops(functools.partial(fn, staging=staging), a.top)
                if rank == 0:
                    print(f"\n{src_key}{world}->{dst_key}{world}, {label}: CPU ops of one migration "
                          f"on rank 0\n{host}\nits device time per kernel\n{device}")
            del staging
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
    _bench.finish_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
