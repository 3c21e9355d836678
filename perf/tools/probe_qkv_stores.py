"""Probe: where the fused qkv all-to-all loses time against its own GEMM (target: within 1.10x).

On 4x H200 the fused kernel ran 16-28% slower than the GEMM alone at 1024-2048 rows per rank but
within 1% at 4096 (Llama-3-70B). This times, on the same
inputs and tiling (ulysses.config.pick_qkv_config), one call per sample after a device barrier and a
GPU spin (_bench.SpinTimer, max over ranks of the per-rank medians):
    fused            the kernel in the plain tile order (READY wait, GEMM + peer stores, DONE wait)
    fused_rotated    the same with each rank's tile order rotated to start at its own block (the
                     kernel's ROTATE), so that at any moment the ranks store into different owners
    no_flags_remote  the same launch with use_flags=False: no READY / DONE traffic, tiles still
                     stored into the owners' buffers (the kernel's end waits for its stores);
                     _rotated: in the rotated order
    no_flags_local   use_flags=False and every owner's address replaced by this rank's own buffer:
                     the same kernel, instruction for instruction, with local stores only (all
                     owners' tiles land on one [m, blk] region: a quarter of the bytes reach HBM)
    gemm_same_cfg    fusedpar.kernels.gemm with the same GemmConfig (the fused kernel's GEMM core)
    gemm_cublas      F.linear
    fused x4         4 fused calls back to back, per call (the steady state: no barrier between)
fused - no_flags_remote is the flags' cost, no_flags_remote - no_flags_local the remote stores',
no_flags_local - gemm_same_cfg the kernel structure's. Prints a table; no records.

On 4x H200 at 1024-2048 rows per rank the remote stores cost 25-55 us, the flags 4-16 us, the kernel
structure 0-2%; a TMA-store epilogue (bulk async stores from shared memory) measured the same as
pointer stores, so the cost is not the epilogue's warps waiting; the rotated order saved 2-5%.

Usage: torchrun --nproc-per-node 4 perf/tools/probe_qkv_stores.py [--shapes llama70b,qwen32b]
           [--tokens 512,1024,2048,4096]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # perf/: the shared bench modules
import _bench
from bench_qkv_all_to_all import MODELS, SETS, dims, operands

_bench.add_repo_to_path()


def probe(model: str, m: int, W: int, ws, timer) -> dict[str, float]:
    from fusedpar.collectives.symmetric import as_peer_table
    from fusedpar.kernels import gemm
    from fusedpar.kernels import ulysses as u
    from fusedpar.kernels.ulysses.config import pick_qkv_config

    dm = dims(model, W)
    d, blk = dm["d"], dm["blk"]
    n = W * blk
    xs, wts = operands(model, m, W)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = pick_qkv_config(m, n, d, blk, torch.bfloat16, num_sms, tma_ok=True)
    table = as_peer_table(ws)
    own = table.buffer_ptrs[table.rank].item()
    local = dataclasses.replace(table, buffer_ptrs=torch.full_like(table.buffer_ptrs, own))
    outs = [torch.empty((m, n), device="cuda", dtype=torch.bfloat16) for _ in range(SETS)]

    def launch(i, tbl=table, rotate=False, **kw):
        return u.launch_qkv_all_to_all(xs[i % SETS], wts[i % SETS], tbl, config=cfg, rotate=rotate, **kw)

    res = {
        "fused": timer(launch),
        "fused_rotated": timer(lambda i: launch(i, rotate=True)),
        "no_flags_remote": timer(lambda i: launch(i, use_flags=False)),
        "no_flags_remote_rotated": timer(lambda i: launch(i, rotate=True, use_flags=False)),
        "no_flags_local": timer(lambda i: launch(i, local, use_flags=False)),
        "gemm_same_cfg": timer(lambda i: gemm._launch(xs[i % SETS], wts[i % SETS], outs[i % SETS], config=cfg)),
        "gemm_cublas": timer(lambda i: F.linear(xs[i % SETS], wts[i % SETS])),
    }

    def fused4(i, rotate=False):
        for j in range(4):
            launch(i + j, rotate=rotate)

    res["fused_x4_per_call"] = timer(fused4) / 4
    res["fused_rotated_x4_per_call"] = timer(lambda i: fused4(i, True)) / 4
    launch(0)
    ref = u.qkv_recv_view(table, m, blk, torch.bfloat16).clone()
    launch(0, rotate=True)
    got = u.qkv_recv_view(table, m, blk, torch.bfloat16)
    rel = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    res["rel_rotated"] = _bench.max_over_ranks(rel)
    u.check_status(ws)
    res["cfg"] = f"{cfg.block_m}x{cfg.block_n}{f'+{cfg.block_n2}' if cfg.block_n2 else ''}x{cfg.block_k} " \
                 f"w{cfg.num_warps} s{cfg.num_stages}{' tma' if cfg.tma else ''}{'' if cfg.flatten else ' nested'}"
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="llama70b,qwen32b")
    p.add_argument("--tokens", default="512,1024,2048,4096")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)
    unknown = set(args.shapes.split(",")) - set(MODELS)
    if unknown:
        p.error(f"unknown --shapes {sorted(unknown)}; known {sorted(MODELS)}")
    if not _bench.torchrun_available():
        print("probe_qkv_stores: needs CUDA GPUs and torchrun; nothing measured")
        return 0
    from fusedpar.collectives.symmetric import SymmetricWorkspace
    from fusedpar.kernels import ulysses as u

    _, rank, W = _bench.init_distributed()
    models = args.shapes.split(",")
    tokens = [int(t) for t in args.tokens.split(",") if t]
    need = max(u.qkv_workspace_bytes(max(tokens), dims(mo, W)["blk"], W, torch.bfloat16) for mo in models)
    ws = SymmetricWorkspace(dist.group.WORLD, need)
    timer = _bench.SpinTimer(ws.barrier, args.iters, args.warmup)
    keys = ("fused", "fused_rotated", "no_flags_remote", "no_flags_remote_rotated", "no_flags_local", "gemm_same_cfg",
            "gemm_cublas", "fused_x4_per_call", "fused_rotated_x4_per_call")
    if rank == 0:
        print("us per call (max over ranks of medians):", "  ".join(keys))
    for model in models:
        for m in tokens:
            r = probe(model, m, W, ws, timer)
            if rank == 0:
                cells = "  ".join(f"{k} {r[k] * 1e3:7.1f}" for k in keys)
                print(f"{model} m={m:5d} [{r['cfg']}]  {cells}  (rotated vs plain order: max rel diff "
                      f"{r['rel_rotated']:.2g})", flush=True)
    _bench.finish_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
