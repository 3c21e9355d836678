"""Probe: copy-engine pulls from peers' symmetric memory against NCCL's all-to-all, alone and beside row moves.

A KV migration exchanges each rank's rows with every peer. With NCCL the exchange is a kernel that
shares the SMs and HBM with the row gathers and scatters around it. Here each rank's rows for every
peer sit in a torch symmetric-memory buffer, and each rank pulls its part from every peer with
cudaMemcpyAsync (tensor.copy_ of a peer view: the copy engines over NVLink, no SMs), between two
device barriers. Timed on W GPUs (torchrun), --mib MiB received per rank: NCCL all_to_all_single
alone, the pull alone, then each beside a row gather of --move-mib MiB (fusedpar.kernels.kv_rows)
on another stream. Prints; no records.

Usage: torchrun --nproc-per-node 2 perf/tools/probe_peer_copy.py [--mib 384] [--move-mib 512]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # perf/: the shared bench modules
import _bench

_bench.add_repo_to_path()
from fusedpar.kernels.kv_rows import move_kv_rows  # noqa: E402  (after the repo is on the path)


def _time(fn, iters: int) -> float:
    """Median wall ms of fn over iters (device synchronised and ranks barriered before each), max over ranks."""
    out = []
    for i in range(iters + 2):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i >= 2:
            out.append((time.perf_counter() - t0) * 1e3)
    t = torch.tensor([statistics.median(out)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=384, help="MiB each rank receives")
    p.add_argument("--move-mib", type=int, default=512, help="MiB the concurrent row gather moves")
    p.add_argument("--iters", type=int, default=10)
    a = p.parse_args(argv)
    if not _bench.torchrun_available():
        print("probe_peer_copy: needs CUDA GPUs and torchrun; skipped")
        return 0
    import torch.distributed._symmetric_memory as symm_mem

    _, rank, world = _bench.init_distributed()
    peers = [r for r in range(world) if r != rank]
    part = (a.mib << 20) // (world - 1) // 256 * 256  # bytes this rank takes from each peer
    # staging: slot r of rank p's buffer holds what p sends to r
    staging = symm_mem.empty(world * part, dtype=torch.uint8, device="cuda")
    staging.random_(0, 255)
    hdl = symm_mem.rendezvous(staging, dist.group.WORLD)
    views = {q: hdl.get_buffer(q, (world * part,), torch.uint8) for q in peers}
    recv = torch.empty(world * part, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    engines = [torch.cuda.Stream() for _ in peers]

    def pull(streams=None):
        hdl.barrier(channel=0)
        cur = torch.cuda.current_stream()
        for i, q in enumerate(peers):
            s = cur if streams is None else streams[i]
            s.wait_stream(cur)
            with torch.cuda.stream(s):
                recv[q * part:(q + 1) * part].copy_(views[q][rank * part:(rank + 1) * part])
        for s in streams or ():
            cur.wait_stream(s)
        hdl.barrier(channel=0)

    send = torch.empty(world * part, dtype=torch.uint8, device="cuda")

    def a2a():
        dist.all_to_all_single(recv, send)

    hd, layers = 128, 32
    rows = (a.move_mib << 20) // (2 * layers * hd * 2)
    pool = torch.randn(2, layers, 2 * rows, hd, dtype=torch.bfloat16, device="cuda")
    idx = torch.randperm(2 * rows, device="cuda")[:rows]
    chunk = torch.empty(2, layers, rows, hd, dtype=torch.bfloat16, device="cuda")

    def move():
        move_kv_rows(pool[0], pool[1], idx, chunk, scatter=False)

    def beside(fn):
        def both():
            cur = torch.cuda.current_stream()
            side.wait_stream(cur)
            with torch.cuda.stream(side):
                move()
            fn()
            cur.wait_stream(side)
        return both

    # check: the pulled bytes are the peers' slots for this rank
    pull()
    torch.cuda.synchronize()
    ok = all(torch.equal(recv[q * part:(q + 1) * part], views[q][rank * part:(rank + 1) * part]) for q in peers)
    res = {"nccl a2a": _time(a2a, a.iters), "pull (one stream)": _time(pull, a.iters),
           "pull (stream per peer)": _time(lambda: pull(engines), a.iters), "row gather alone": _time(move, a.iters),
           "nccl a2a || gather": _time(beside(a2a), a.iters),
           "pull || gather": _time(beside(lambda: pull(engines)), a.iters)}
    if rank == 0:
        got = (world - 1) * part
        print(f"world {world}: {got / 2**20:.0f} MiB into each rank, row gather {a.move_mib} MiB; "
              f"pulled bytes ok: {ok}")
        for k, ms in res.items():
            print(f"{k:<26}{ms:>9.3f} ms   {got / (ms * 1e-3) / 1e9:>7.1f} GB/s of the exchange's bytes")
    _bench.finish_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
