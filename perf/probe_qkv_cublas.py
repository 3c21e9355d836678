"""Probe: can cuBLAS GEMMs feed the qkv all-to-all faster than the fused Triton kernel (issue 3, "within 1.10x")?

The fused qkv_all_to_all's GEMM is a Triton GEMM with the owners' receive buffers as its epilogue
target; at 1024-2048 rows per rank it trails cuBLAS (the layer profile of GPU run 104: its GEMM
phase 270-293 us against cuBLAS's 230 us for the same Llama-70B base shape). The receive layout
lets the GEMM be split by owner instead: rank s's share for owner g is x_s @ w[g*blk:(g+1)*blk]^T,
a contiguous [m, blk] block of g's buffer (rows s*m ..), so W plain cuBLAS calls produce the
exchange. Paths timed here, each one call per sample after a device barrier and a GPU spin
(_bench.SpinTimer, max over ranks of the per-rank medians), same inputs:
    gemm_cublas   F.linear(x, w): the GEMM alone (the target's reference)
    fused         qkv_all_to_all(..., fused=True): the library's kernel
    owner_local   the W per-owner cuBLAS GEMMs into local memory, no exchange: the split's own cost
    cublas_peer   arrival barrier (READY: every peer finished reading the last result), the W
                  per-owner GEMMs written straight into the owners' buffers (peer-mapped symmetric
                  memory as cuBLAS's output: its epilogue stores cross NVLink), remote owners first
                  in rotated order, own block last; arrival barrier (DONE)
    cublas_ce     as cublas_peer, but each remote block goes to a local staging slot and a side
                  stream copies it to the owner (cudaMemcpy: the copy engines, no SM), overlapping
                  the next block's GEMM; own block direct
    ce_side_ready cublas_ce with the READY barrier on the side stream, beside the first GEMM
    lib_kernel / lib_ce   the library: qkv_all_to_all(..., copy_engine=False / True)
                  (ulysses.launch_qkv_copy_engine is ce_side_ready with its views cached per table)
and the host time per call (launching only, behind a long GPU spin) of cublas_ce, lib_kernel and lib_ce.
Shapes: the bench's llama70b / qwen32b base shapes at SP = world, and *_half (half the heads): at
SP=2 their blk is 2560, the per-owner GEMM of the full models at SP=4, so a 2-GPU host measures the
4-GPU host's per-owner GEMM shape (with one remote owner instead of three).
Checks every path's result against cuBLAS + pack + NCCL all_to_all_single. Prints a table; no records.

GPU runs 181 and 183 (2x H200, perf/results/gpu_run_h200x2_run181.log / run183.log): the copy-engine
variants beat the kernel's GPU time by 3-15% at 1024-2048 rows per rank, cuBLAS storing into the peers
directly lost to both, and the library's copy-engine path cost 300-670 us of host time per call against
the kernel's 110-240 us; in the layer it gained nothing (run 184), so it stays opt-in
(ulysses.QKV_COPY_ENGINE_TOKEN_RANGES).

Usage: torchrun --nproc-per-node N perf/probe_qkv_cublas.py [--shapes ...] [--tokens 512,1024,2048,4096]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench
import bench_qkv_all_to_all as bq

_bench.add_repo_to_path()

bq.MODELS.update({
    "llama70b_half": {"hidden": 8192, "heads": 32, "kv_heads": 4, "head_dim": 128},
    "qwen32b_half": {"hidden": 5120, "heads": 32, "kv_heads": 4, "head_dim": 128},
})
PATHS = ("gemm_cublas", "fused", "owner_local", "cublas_peer", "cublas_ce", "ce_side_ready", "lib_kernel", "lib_ce")


def probe(model: str, m: int, W: int, rank: int, group, ws_fused, ws_peer, timer) -> dict[str, float]:
    from fusedpar.collectives import comm
    from fusedpar.kernels import ulysses as u

    dm = bq.dims(model, W)
    blk = dm["blk"]
    xs, wts = bq.operands(model, m, W)
    w_blocks = [[w[g * blk:(g + 1) * blk] for g in range(W)] for w in wts]
    recv = u.qkv_recv_view(ws_peer, m, blk, torch.bfloat16)
    peer_rows = [ws_peer.peer_view(g, torch.bfloat16, W * m * blk).view(W * m, blk)[rank * m:(rank + 1) * m]
                 for g in range(W)]
    order = [(rank + 1 + j) % W for j in range(W)]  # remote owners first (rotated), own block last
    local = torch.empty((W, m, blk), device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    done = [torch.cuda.Event() for _ in range(W)]
    table = ws_peer.table

    def gemm_cublas(i):
        return F.linear(xs[i % bq.SETS], wts[i % bq.SETS])

    def fused(i):
        return u.qkv_all_to_all(xs[i % bq.SETS], wts[i % bq.SETS], ws_fused, fused=True)

    def owner_local(i):
        x, wb = xs[i % bq.SETS], w_blocks[i % bq.SETS]
        for g in order:
            torch.mm(x, wb[g].t(), out=local[g])
        return local

    def cublas_peer(i):
        x, wb = xs[i % bq.SETS], w_blocks[i % bq.SETS]
        u._launch_arrival(table)
        for g in order:
            torch.mm(x, wb[g].t(), out=peer_rows[g])
        u._launch_arrival(table)
        return recv

    def cublas_ce(i, ready_on_side=False):
        x, wb = xs[i % bq.SETS], w_blocks[i % bq.SETS]
        cur = torch.cuda.current_stream()
        if ready_on_side:  # READY beside the first GEMM (only the copies need it)
            side.wait_stream(cur)
            with torch.cuda.stream(side):
                u._launch_arrival(table)
        else:
            u._launch_arrival(table)
        for g in order:
            if g == rank:
                torch.mm(x, wb[g].t(), out=peer_rows[g])
                continue
            torch.mm(x, wb[g].t(), out=local[g])
            done[g].record(cur)
            side.wait_event(done[g])
            with torch.cuda.stream(side):
                peer_rows[g].copy_(local[g])
        cur.wait_stream(side)
        u._launch_arrival(table)
        return recv

    def ce_side_ready(i):
        return cublas_ce(i, ready_on_side=True)

    def lib_kernel(i):
        return u.qkv_all_to_all(xs[i % bq.SETS], wts[i % bq.SETS], ws_peer, fused=True, copy_engine=False)

    def lib_ce(i):
        return u.qkv_all_to_all(xs[i % bq.SETS], wts[i % bq.SETS], ws_peer, fused=True, copy_engine=True)

    ref = comm.seq_to_head_all_to_all(F.linear(xs[0], wts[0]), group).float()
    scale = ref.abs().max().item()
    fns = {"gemm_cublas": gemm_cublas, "fused": fused, "owner_local": owner_local, "cublas_peer": cublas_peer,
           "cublas_ce": cublas_ce, "ce_side_ready": ce_side_ready, "lib_kernel": lib_kernel, "lib_ce": lib_ce}
    for name in ("fused", "cublas_peer", "cublas_ce", "ce_side_ready", "lib_kernel", "lib_ce"):
        fn = fns[name]
        recv.fill_(float("nan"))
        torch.cuda.synchronize()
        ws_peer.barrier()
        got = fn(0).float()
        torch.cuda.synchronize()
        local_rel = (got - ref).abs().max().item() / scale if bool(got.isfinite().all()) else float("inf")
        rel = _bench.max_over_ranks(local_rel)  # collective: every rank calls it
        if rank == 0 and not rel <= 1e-2:
            print(f"  {model} m={m} {name}: WRONG, max rel diff {rel:.3g} vs cuBLAS + NCCL", flush=True)
    u.check_status(ws_fused)
    u.check_status(ws_peer)
    res = {name: timer(fn) for name, fn in fns.items()}
    for name in ("cublas_ce", "lib_kernel", "lib_ce"):  # host time per call (launching only)
        fn = fns[name]
        torch.cuda.synchronize()
        ws_peer.barrier()
        torch.cuda._sleep(50_000_000)  # ~25 ms of GPU spin: the calls below only queue work
        t0 = time.perf_counter()
        for i in range(10):
            fn(i)
        res[f"host_{name}"] = (time.perf_counter() - t0) / 10 * 1e-3 * 1e6  # in "ms" units of the table (x1e3 = us)
        torch.cuda.synchronize()
    u.check_status(ws_peer)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="llama70b,qwen32b,llama70b_half,qwen32b_half")
    p.add_argument("--tokens", default="512,1024,2048,4096", help="comma list of rows per rank (m)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args(argv)
    if not _bench.torchrun_available():
        print("probe_qkv_cublas: needs CUDA GPUs and torchrun; nothing measured")
        return 0
    from fusedpar.collectives.symmetric import SymmetricWorkspace
    from fusedpar.kernels import ulysses as u

    _, rank, W = _bench.init_distributed()
    group = SimpleNamespace(size=W, pg=dist.group.WORLD)
    models = args.shapes.split(",")
    tokens = [int(t) for t in args.tokens.split(",") if t]
    need = max(u.qkv_workspace_bytes(max(tokens), bq.dims(mo, W)["blk"], W, torch.bfloat16) for mo in models)
    ws_fused = SymmetricWorkspace(dist.group.WORLD, need)
    ws_peer = SymmetricWorkspace(dist.group.WORLD, need)
    timer = _bench.SpinTimer(ws_fused.barrier, args.iters, args.warmup)
    if rank == 0:
        print(f"probe_qkv_cublas: world {W}, {torch.cuda.get_device_name()}; us per call (max over ranks of "
              f"medians of {args.iters}); x = over gemm_cublas", flush=True)
    for model in models:
        for m in tokens:
            res = probe(model, m, W, rank, group, ws_fused, ws_peer, timer)
            if rank == 0:
                base = res["gemm_cublas"]
                blk = bq.dims(model, W)["blk"]
                print(f"{model:14s} m={m:5d} blk={blk:5d}  " + "  ".join(
                    f"{k} {res[k] * 1e3:7.1f} ({res[k] / base:4.2f}x)" for k in PATHS), flush=True)
                print(f"{'':14s} host us per call: " + "  ".join(
                    f"{k} {res[k] * 1e3:6.1f}" for k in res if k.startswith("host_")), flush=True)
    _bench.finish_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
