"""Benchmark: fused qkv_all_to_all (fusedpar.kernels.ulysses) vs cuBLAS GEMM + pack + NCCL all_to_all_single.

Base-mode QKV projection of one decoder layer with SP = world (TP = 1), per-rank shapes:
    x [m, d] (m = tokens per rank), w [SP*blk, d], blk = (q + 2 kv) * hd, q = h / SP,
    kv = max(1, h_kv / SP) (kv columns duplicated per block when SP > h_kv)
    Llama-3-70B: d 8192, 64 q / 8 kv heads, hd 128;  Qwen3-32B: d 5120, 64 / 8, hd 128.
Paths, each on the same inputs in the same process:
    baseline     comm.seq_to_head_all_to_all(F.linear(x, w), sp): cuBLAS GEMM, pack
                 (reshape/transpose/contiguous), NCCL all_to_all_single - what the reference layer does
    fused        qkv_all_to_all(x, w, workspace, options=FUSED): the fused Triton kernel, GEMM tiles stored
                 into the owners' symmetric receive buffers, completion included (the result is ready to read)
    gemm_cublas  F.linear(x, w) alone: the target is fused <= 1.10 x this at m >= 1024
    gemm_triton  fusedpar.kernels.gemm.matmul(x, w) alone: the fused kernel's GEMM core
Targets: fused >= 1.25x baseline and <= 1.10x gemm_cublas at m >= 1024.

Protocol: per sample a stream-ordered device barrier across ranks, a GPU
spin (torch.cuda._sleep, so host launch cost is off the clock and ranks start together), CUDA
events around ONE call; warm-up first (Triton compilation, NCCL setup); median of --iters
samples per rank, then the MAX over ranks (an all-to-all is as slow as its slowest rank).
Inputs rotate over 2 operand sets (each weight alone exceeds the 50 MiB L2).

Roofline (floor of one fused call), every constant measured in this run:
    floor = max(2 m N d / peak,  hbm_bytes / hbm_bw,  link_bytes / link_bw)
    peak     cuBLAS bf16 8192^3 GEMM FLOP/s;      hbm_bw   1 GiB device copy (read + write) B/s
    link_bw  NCCL all_to_all_single bus bandwidth on 256 MiB ((W-1)/W * bytes / time: per-GPU
             outgoing bytes per second, the best the stock stack reaches over NVLink)
    hbm_bytes = x + w + recv written;  link_bytes = (W-1)/W of the GEMM output (what leaves the GPU)
roofline_pct = 100 * floor / fused_ms.

Records (rank 0 writes --out, a JSON list), one per (model, tokens): bench, case, tokens (rows per
rank in the GEMM), world, gpu, baseline, baseline_ms, fused_ms, speedup, roofline_pct, torch,
triton, date, command, plus gemm_cublas_ms, gemm_triton_ms, fused_over_gemm, floor terms,
routed (the path the size-based router takes now), max_rel_diff_vs_baseline, triton_config.
At the end it prints the token ranges where the fused path wins on every model, in the form of
fusedpar.kernels.routing (qkv_fused_rows).

Usage (GPU machine, repo root):
    torchrun --nproc-per-node 4 perf/bench_qkv_all_to_all.py [--shapes llama70b,qwen32b]
        [--tokens 8,1024,16384] [--iters 20] [--out perf/results/qkv_all_to_all.json]
Without CUDA or outside torchrun it prints a message and exits 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench  # setup, timing and records shared by the benchmarks
import shapes
from _bench import max_over_ranks

_bench.add_repo_to_path()

BENCH = "qkv_all_to_all"
BASELINE = "cuBLAS F.linear + pack + NCCL all_to_all_single (comm.seq_to_head_all_to_all)"
MODELS = ("llama70b", "qwen32b")  # keys of shapes.SHAPES
DEFAULT_TOKENS = ",".join(str(2**i) for i in range(3, 15))  # 8 .. 16384
SETS = 2
# --sweep-configs: tilings tried for the fused kernel, each within Hopper's 227 KiB of shared memory in bf16:
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, TMA loads, nested tile/K loops instead of one flattened loop,
# [BLOCK_N2: split tiles of BLOCK_N + BLOCK_N2 columns, [GROUP_M]])
SWEEP_CONFIGS = ((128, 128, 64, 4, 5, 0, 0), (128, 128, 64, 8, 4, 0, 0), (128, 256, 64, 8, 3, 0, 0),
                 (256, 128, 64, 8, 3, 0, 0), (64, 256, 64, 4, 4, 0, 0), (64, 128, 128, 4, 4, 0, 0),
                 (128, 128, 64, 8, 4, 0, 1), (128, 256, 64, 8, 3, 0, 1),
                 (128, 128, 64, 4, 5, 1, 0), (128, 128, 64, 8, 4, 1, 0), (128, 256, 64, 8, 3, 1, 0),
                 (128, 128, 64, 4, 5, 1, 1), (128, 128, 64, 8, 4, 1, 1), (128, 128, 64, 8, 5, 1, 1),
                 (128, 256, 64, 8, 3, 1, 1), (128, 256, 64, 8, 4, 1, 1), (256, 128, 64, 8, 3, 1, 1),
                 # split tiles (blk 2560 = 8 x 320): 64 x 320 as the plain GEMM's pick, and 128 x 320
                 (64, 256, 64, 4, 4, 1, 1, 64), (64, 256, 64, 4, 4, 1, 1, 64, 16), (64, 256, 64, 4, 4, 1, 0, 64),
                 (64, 256, 64, 4, 3, 1, 1, 64), (64, 256, 64, 4, 4, 0, 0, 64),
                 (128, 256, 64, 8, 3, 1, 1, 64), (128, 256, 64, 8, 3, 1, 1, 64, 16))


# ------------------------------------------------------------------------------------ bench


def dims(model: str, sp: int) -> dict[str, int]:
    cfg = shapes.shape(model)
    q = cfg.heads // sp
    kv = max(1, cfg.kv_heads // sp)
    return {"d": cfg.hidden, "blk": (q + 2 * kv) * cfg.head_dim, "q": q, "kv": kv}


def operands(model: str, m: int, W: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """SETS (x [m, d], w [W*blk, d]) bf16 operand pairs of this rank, seeded by (rank, m)."""
    dm = dims(model, W)
    d, n = dm["d"], W * dm["blk"]
    gen = torch.Generator(device="cuda").manual_seed(1000 * dist.get_rank() + m)
    xs = [torch.randn((m, d), generator=gen, device="cuda").to(torch.bfloat16) for _ in range(SETS)]
    wts = [(torch.randn((n, d), generator=gen, device="cuda") / d**0.5).to(torch.bfloat16) for _ in range(SETS)]
    return xs, wts


def sweep_configs(model, m, W, ws, timer, match: str = "") -> list[tuple[str, float]]:
    """The fused kernel's time (max over ranks) with its default tiling, in the plain and in the rotated
    tile order (ulysses.config.QKV_ROTATE_ROWS), and with each of SWEEP_CONFIGS (those whose name
    contains `match`)."""
    from fusedpar.collectives.symmetric import as_peer_table
    from fusedpar.kernels import ulysses as u
    FUSED = u.UlyssesOptions(path="fused")
    from fusedpar.kernels.gemm import GemmConfig

    xs, wts = operands(model, m, W)
    ref = u.qkv_all_to_all(xs[0], wts[0], ws, options=FUSED).clone()
    out = [("default", timer(lambda i: u.qkv_all_to_all(xs[i % SETS], wts[i % SETS], ws, options=FUSED)))]
    table = as_peer_table(ws)
    for name, rotate in (("plain order", False), ("rotated", True)):
        ms = timer(lambda i, r=rotate: u.launch_qkv_all_to_all(xs[i % SETS], wts[i % SETS], table, rotate=r))
        out.append((name, ms))
    for bm, bn, bk, warps, stages, tma, nested, *rest in SWEEP_CONFIGS:
        n2 = rest[0] if rest else 0
        group_m = rest[1] if len(rest) > 1 else 8
        name = (f"{bm}x{bn}{f'+{n2}' if n2 else ''}x{bk} w{warps} s{stages}{' tma' if tma else ''}"
                f"{' nested' if nested else ''}{f' g{group_m}' if group_m != 8 else ''}")
        if match and match not in name:
            continue
        cfg = GemmConfig(bm, bn, bk, group_m=group_m, num_warps=warps, num_stages=stages, tma=bool(tma),
                         flatten=not nested, block_n2=n2)
        try:
            got = u.qkv_all_to_all(xs[0], wts[0], ws, options=u.UlyssesOptions(path="fused", qkv_config=cfg))
        except Exception as e:  # a tiling Triton cannot compile fails before any launch, on every rank
            print(f"rank {dist.get_rank()}: {model} m={m} {cfg}: {type(e).__name__}: {str(e)[:200]}")
            continue
        rel = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        if rel > 1e-2:  # tilings only reorder the fp32 accumulation: anything larger is a bug
            print(f"rank {dist.get_rank()}: {model} m={m} {cfg}: differs from the default tiling by {rel:.3g} (rel)")
        opts = u.UlyssesOptions(path="fused", qkv_config=cfg)
        ms = timer(lambda i, o=opts: u.qkv_all_to_all(xs[i % SETS], wts[i % SETS], ws, options=o))
        out.append((name, ms))
    u.check_status(ws)
    return out


def bench_case(model, m, W, group, ws, timer, ceil) -> dict:
    from fusedpar.collectives import comm
    from fusedpar.kernels import gemm, routing
    from fusedpar.kernels import ulysses as u
    from fusedpar.kernels.ulysses.config import pick_qkv_config
    FUSED = u.UlyssesOptions(path="fused")

    dm = dims(model, W)
    d, blk = dm["d"], dm["blk"]
    n = W * blk
    xs, wts = operands(model, m, W)

    def baseline(i):
        return comm.seq_to_head_all_to_all(F.linear(xs[i % SETS], wts[i % SETS]), group)

    def fused(i):
        return u.qkv_all_to_all(xs[i % SETS], wts[i % SETS], ws, options=FUSED)

    def gemm_cublas(i):
        return F.linear(xs[i % SETS], wts[i % SETS])

    def gemm_triton(i):
        return gemm.matmul(xs[i % SETS], wts[i % SETS])

    ref = baseline(0).float()
    rel = {}
    for name, fn in (("fused", fused),):
        ws.table.buffer.fill_(0xFF)  # NaN: an element nobody wrote fails the comparison
        got = fn(0).float()
        torch.cuda.synchronize()
        rel[name] = max_over_ranks(
            ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item() if bool(got.isfinite().all())
            else float("inf"))
        del got
    u.check_status(ws)
    del ref
    res = {name: timer(fn) for name, fn in (("baseline", baseline), ("fused", fused), ("gemm_cublas", gemm_cublas),
                                              ("gemm_triton", gemm_triton))}
    u.check_status(ws)

    flops = 2 * m * n * d
    hbm_bytes = 2 * (m * d + n * d + m * n)
    link_bytes = 2 * m * n * (W - 1) / W
    terms = {
        "compute_ms": flops / ceil["peak_flops"] * 1e3,
        "hbm_ms": hbm_bytes / ceil["hbm_bps"] * 1e3,
        "link_ms": link_bytes / ceil["link_bps"] * 1e3,
    }
    floor = max(terms.values())
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = pick_qkv_config(m, n, d, blk, torch.bfloat16, num_sms, tma_ok=True)  # contiguous x and w
    routed = "fused" if routing.in_ranges(m, routing.thresholds(xs[0].device, W).qkv_fused_rows) else "plain"
    return {
        "case": f"{model}.sp{W}",
        "tokens": m,
        "shape": {"m": m, "d": d, "blk": blk, "q_heads": dm["q"], "kv_heads": dm["kv"], "n": n},
        "baseline_ms": res["baseline"],
        "fused_ms": res["fused"],
        "speedup": res["baseline"] / res["fused"],
        "roofline_pct": 100 * floor / res["fused"],
        "gemm_cublas_ms": res["gemm_cublas"],
        "gemm_triton_ms": res["gemm_triton"],
        "fused_over_gemm": res["fused"] / res["gemm_cublas"],
        "floor_ms": floor,
        "floor_terms_ms": terms,
        "bound": max(terms, key=terms.get).removesuffix("_ms"),
        "routed": routed,
        "routed_ms": res["fused"] if routed == "fused" else res["baseline"],
        "max_rel_diff_vs_baseline": rel["fused"],
        "triton_config": vars(cfg),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="llama70b,qwen32b")
    p.add_argument("--tokens", default=DEFAULT_TOKENS, help="comma list of tokens per rank (m)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--sweep-configs", action="store_true",
                   help="instead of the benchmark: time the fused kernel with each tiling of SWEEP_CONFIGS and in "
                        "both tile orders at every --tokens (printed, no records): the data behind "
                        "ulysses.config.pick_qkv_config and QKV_ROTATE_ROWS")
    p.add_argument("--sweep-match", default="",
                   help="with --sweep-configs: only the tilings whose printed name contains this (e.g. '+64' for "
                        "the split tiles); the default tiling is always timed, in both tile orders")
    p.add_argument("--out", default=f"perf/results/{BENCH}.json")
    args = p.parse_args(argv)
    if args.iters < 20:
        p.error("--iters must be >= 20")
    unknown = set(args.shapes.split(",")) - set(MODELS)
    if unknown:
        p.error(f"unknown --shapes {sorted(unknown)}; known {sorted(MODELS)}")
    if not _bench.torchrun_available():
        print(f"bench_{BENCH}: needs CUDA GPUs and torchrun (torchrun --nproc-per-node N ...); nothing measured")
        return 0

    from fusedpar.collectives.symmetric import SymmetricWorkspace
    from fusedpar.kernels import ulysses as u
    from fusedpar.kernels.ulysses.config import pick_qkv_config

    _, rank, W = _bench.init_distributed()
    group = SimpleNamespace(size=W, pg=dist.group.WORLD)
    models = args.shapes.split(",")
    tokens = [int(t) for t in args.tokens.split(",") if t]
    need = max(u.qkv_workspace_bytes(max(tokens), dims(mo, W)["blk"], W, torch.bfloat16) for mo in models)
    ws = SymmetricWorkspace(dist.group.WORLD, need)
    timer = _bench.SpinTimer(ws.barrier, args.iters, args.warmup)
    if args.sweep_configs:
        num_sms = torch.cuda.get_device_properties(0).multi_processor_count
        for model in models:
            for m in tokens:
                dm = dims(model, W)
                default = pick_qkv_config(m, W * dm["blk"], dm["d"], dm["blk"], torch.bfloat16, num_sms, tma_ok=True)
                row = sweep_configs(model, m, W, ws, timer, args.sweep_match)
                if rank == 0:
                    best = min(row, key=lambda r: r[1])
                    cells = "  ".join(f"{name} {ms * 1e3:6.1f}" for name, ms in row)
                    print(f"{model} m={m:5d} (default {default.block_m}x{default.block_n}"
                          f"{f'+{default.block_n2}' if default.block_n2 else ''}x{default.block_k} "
                          f"w{default.num_warps} s{default.num_stages}{' tma' if default.tma else ''}"
                          f"{'' if default.flatten else ' nested'}) us: {cells}  | best {best[0]}", flush=True)
        _bench.finish_distributed()
        return 0
    ceil = _bench.measure_link_ceilings(timer, group)
    common = _bench.sp_common(BENCH, W, BASELINE, ceil)
    if rank == 0:
        _bench.print_sp_header(common)
    records = _bench.run_sp_cases(
        models, tokens, W, rank, common,
        lambda model, m: bench_case(model, m, W, group, ws, timer, ceil),
        _bench.sp_row,
    )
    if rank == 0:
        _bench.print_fused_wins(records, "routing.Thresholds.qkv_fused_rows")
        _bench.write_records(records, args.out)
    _bench.finish_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
