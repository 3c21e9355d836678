"""Benchmark: fused all_to_all_o_proj (fusedpar.kernels.ulysses) vs NCCL all-to-all (head_to_seq) + cuBLAS GEMM.

Base-mode O projection of one decoder layer with SP = world (TP = 1), per-rank shapes:
    attn [SP*m, C] (all tokens of the step, this rank's q heads, C = q * hd, q = h / SP),
    w_o [d, SP*C], out [m, d] (m = tokens per rank)
    Llama-3-70B: d 8192, 64 q heads, hd 128;  Qwen3-32B: d 5120, 64 q heads, hd 128.
Paths, same inputs, same process:
    baseline     F.linear(comm.head_to_seq_all_to_all(attn, sp), w_o): NCCL all_to_all_single,
                 unpack (reshape/transpose/reshape), cuBLAS GEMM - what the reference layer does
    fused        all_to_all_o_proj(attn, w_o, workspace, fused=True, out=out): one kernel; comm
                 programs push rows to their owners band by band, GEMM programs start on their
                 own chunk and wait per band (the best --comm-programs value is reported)
    gemm_cublas  F.linear(a, w_o) on an [m, SP*C] operand: the GEMM alone
    gemm_triton  fusedpar.kernels.gemm.matmul on the same operand
Target (issue 3): fused >= 1.15x baseline.

Protocol and roofline as perf/bench_qkv_all_to_all.py: per sample a device barrier, a GPU spin,
CUDA events around one call; warm-up first; median of --iters samples, max over ranks; 2 rotating
operand sets. floor = max(2 m d (SP C) / peak, hbm_bytes / hbm_bw, link_bytes / link_bw) with
peak (cuBLAS 8192^3), hbm_bw (1 GiB copy) and link_bw (NCCL all-to-all bus bandwidth, 256 MiB)
measured in this run; hbm_bytes = attn + w_o + out + staging written and read, link_bytes =
(SP-1) m C elements (what leaves the GPU). roofline_pct = 100 * floor / fused_ms.

Records (rank 0 writes --out): bench, case, tokens, world, gpu, baseline, baseline_ms, fused_ms,
speedup, roofline_pct, torch, triton, date, command, plus gemm_cublas_ms, gemm_triton_ms,
fused_by_comm_programs, floor terms, routed, max_rel_diff_vs_baseline, triton_config. At the end
it prints the token ranges where the fused path wins (O_PROJ_FUSED_TOKEN_RANGES form).

Usage (GPU machine, repo root):
    torchrun --nproc-per-node 4 perf/bench_all_to_all_o_proj.py [--shapes llama70b,qwen32b]
        [--tokens 8,1024,16384] [--comm-programs 8] [--iters 20] [--out perf/results/all_to_all_o_proj.json]
Without CUDA or outside torchrun it prints a message and exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

# Before torch.distributed initialises anything: multicast (NVLS) is off on our machines.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch
import torch.distributed as dist
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

BENCH = "all_to_all_o_proj"
BASELINE = "NCCL all_to_all_single + unpack (comm.head_to_seq_all_to_all) + cuBLAS F.linear"
MODELS = {
    "llama70b": {"hidden": 8192, "heads": 64, "head_dim": 128},
    "qwen32b": {"hidden": 5120, "heads": 64, "head_dim": 128},
}
DEFAULT_TOKENS = ",".join(str(2**i) for i in range(3, 15))  # 8 .. 16384
SLEEP_CYCLES = 100_000  # ~50 us GPU spin ahead of each timed call
SETS = 2
LINK_BYTES = 256 << 20


# ---------------------------------------------------------------- harness (same in both benches)


def max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


class Timer:
    """Median per-call ms of fn(i) over samples, each: device barrier, GPU spin, event, call, event."""

    def __init__(self, barrier: Callable[[], None], iters: int, warmup: int):
        self.barrier, self.iters, self.warmup = barrier, iters, warmup
        self.sleep = getattr(torch.cuda, "_sleep", None)

    def __call__(self, fn: Callable[[int], object]) -> float:
        for i in range(self.warmup):
            fn(i)
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.iters)]
        for i in range(self.iters):
            self.barrier()
            if self.sleep is not None:
                self.sleep(SLEEP_CYCLES)
            starts[i].record()
            fn(self.warmup + i)
            ends[i].record()
        torch.cuda.synchronize()
        return max_over_ranks(statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)))


def measure_ceilings(timer: Timer, group) -> dict[str, float]:
    """peak FLOP/s (cuBLAS bf16 8192^3), HBM B/s (1 GiB copy), link B/s (NCCL all-to-all bus bw, 256 MiB)."""
    n = 8192
    a = torch.randn((n, n), device="cuda", dtype=torch.bfloat16)
    t = timer(lambda i, a=a: torch.matmul(a, a))
    peak = 2 * n**3 / (t * 1e-3)
    del a
    nel = (1 << 30) // 4
    src, dst = torch.rand(nel, device="cuda"), torch.empty(nel, device="cuda")
    t = timer(lambda i, dst=dst, src=src: dst.copy_(src))
    hbm = 2 * (1 << 30) / (t * 1e-3)
    del src, dst
    W = group.size
    send = torch.randn(LINK_BYTES // 2, device="cuda", dtype=torch.bfloat16)
    recv = torch.empty_like(send)
    t = timer(lambda i, r=recv, s=send: dist.all_to_all_single(r, s, group=group.pg))
    link = (W - 1) / W * LINK_BYTES / (t * 1e-3)
    del send, recv
    torch.cuda.empty_cache()
    return {"peak_flops": peak, "hbm_bps": hbm, "link_bps": link}


def token_ranges(wins: dict[int, bool]) -> tuple[tuple[int, int | None], ...]:
    """Inclusive ranges of the measured token counts where the fused path won (last one open-ended)."""
    ms = sorted(wins)
    ranges, lo = [], None
    for i, m in enumerate(ms):
        if wins[m] and lo is None:
            lo = m
        if lo is not None and (not wins[m] or i == len(ms) - 1):
            hi = None if wins[m] else ms[i - 1]
            ranges.append((lo if lo != ms[0] else 1, hi))
            lo = None
    return tuple(ranges)


# ------------------------------------------------------------------------------------ bench


def dims(model: str, sp: int) -> dict[str, int]:
    cfg = MODELS[model]
    q = cfg["heads"] // sp
    return {"d": cfg["hidden"], "C": q * cfg["head_dim"], "q": q}


def bench_case(model, m, W, group, ws, timer, ceil, comm_programs: list[int]) -> dict:
    from fusedpar.collectives import comm
    from fusedpar.kernels import gemm
    from fusedpar.kernels import ulysses as u

    dm = dims(model, W)
    d, C = dm["d"], dm["C"]
    gen = torch.Generator(device="cuda").manual_seed(1000 * dist.get_rank() + m)
    attns = [torch.randn((W * m, C), generator=gen, device="cuda").to(torch.bfloat16) for _ in range(SETS)]
    wts = [(torch.randn((d, W * C), generator=gen, device="cuda") / (W * C) ** 0.5).to(torch.bfloat16)
           for _ in range(SETS)]
    a_local = [torch.randn((m, W * C), generator=gen, device="cuda").to(torch.bfloat16) for _ in range(SETS)]
    out = torch.empty((m, d), device="cuda", dtype=torch.bfloat16)

    def baseline(i):
        return F.linear(comm.head_to_seq_all_to_all(attns[i % SETS], group), wts[i % SETS])

    def fused_with(cfg):
        return lambda i: u.all_to_all_o_proj(attns[i % SETS], wts[i % SETS], ws, fused=True, out=out, config=cfg)

    def gemm_cublas(i):
        return F.linear(a_local[i % SETS], wts[i % SETS])

    def gemm_triton(i):
        return gemm.matmul(a_local[i % SETS], wts[i % SETS])

    ref = baseline(0)
    got = fused_with(None)(0).clone()
    torch.cuda.synchronize()
    u.check_status(ws)
    rel = ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()
    del ref, got
    res = {"baseline": timer(baseline), "gemm_cublas": timer(gemm_cublas), "gemm_triton": timer(gemm_triton)}
    by_comm = {c: timer(fused_with(u.OProjConfig(comm_programs=c))) for c in comm_programs}
    u.check_status(ws)
    best = min(by_comm, key=by_comm.get)
    fused_ms = by_comm[best]

    flops = 2 * m * d * W * C
    hbm_bytes = 2 * (W * m * C + d * W * C + m * d + 2 * W * m * C)
    link_bytes = 2 * (W - 1) * m * C
    terms = {
        "compute_ms": flops / ceil["peak_flops"] * 1e3,
        "hbm_ms": hbm_bytes / ceil["hbm_bps"] * 1e3,
        "link_ms": link_bytes / ceil["link_bps"] * 1e3,
    }
    floor = max(terms.values())
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    gcfg = gemm.pick_config(m, d, W * C, dtype=torch.bfloat16, num_sms=num_sms, interpret=False)
    routed = "fused" if u.use_fused(m, u.O_PROJ_FUSED_TOKEN_RANGES) else "plain"
    return {
        "case": f"{model}.sp{W}",
        "tokens": m,
        "shape": {"m": m, "d": d, "C": C, "q_heads": dm["q"], "k": W * C},
        "baseline_ms": res["baseline"],
        "fused_ms": fused_ms,
        "speedup": res["baseline"] / fused_ms,
        "roofline_pct": 100 * floor / fused_ms,
        "gemm_cublas_ms": res["gemm_cublas"],
        "gemm_triton_ms": res["gemm_triton"],
        "fused_over_gemm": fused_ms / res["gemm_cublas"],
        "comm_programs": best,
        "fused_by_comm_programs": {str(c): t for c, t in by_comm.items()},
        "floor_ms": floor,
        "floor_terms_ms": terms,
        "bound": max(terms, key=terms.get).removesuffix("_ms"),
        "routed": routed,
        "routed_ms": fused_ms if routed == "fused" else res["baseline"],
        "max_rel_diff_vs_baseline": max_over_ranks(rel),
        "triton_config": vars(gcfg),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="llama70b,qwen32b")
    p.add_argument("--tokens", default=DEFAULT_TOKENS, help="comma list of tokens per rank (m)")
    p.add_argument("--comm-programs", default="8", help="comma list of OProjConfig.comm_programs to try")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=f"perf/results/{BENCH}.json")
    args = p.parse_args(argv)
    if args.iters < 20:
        p.error("--iters must be >= 20 (DESIGN.md section 9)")
    unknown = set(args.shapes.split(",")) - set(MODELS)
    if unknown:
        p.error(f"unknown --shapes {sorted(unknown)}; known {sorted(MODELS)}")
    if not torch.cuda.is_available() or "LOCAL_RANK" not in os.environ:
        print(f"bench_{BENCH}: needs CUDA GPUs and torchrun (torchrun --nproc-per-node N ...); nothing measured")
        return 0

    import triton

    from fusedpar.collectives.symmetric import SymmetricWorkspace
    from fusedpar.kernels import ulysses as u

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, W = dist.get_rank(), dist.get_world_size()
    group = SimpleNamespace(size=W, pg=dist.group.WORLD)
    models = args.shapes.split(",")
    tokens = [int(t) for t in args.tokens.split(",") if t]
    comm_programs = [int(c) for c in args.comm_programs.split(",") if c]
    need = max(u.o_proj_workspace_bytes(max(tokens), dims(mo, W)["C"], W, torch.bfloat16) for mo in models)
    # 128 flag rows: up to 127 push bands, so the GEMM's first wave waits for little data.
    ws = SymmetricWorkspace(dist.group.WORLD, need, max_blocks=128)
    timer = Timer(ws.barrier, args.iters, args.warmup)
    ceil = measure_ceilings(timer, group)
    gpu = torch.cuda.get_device_name()
    common = {
        "bench": BENCH,
        "world": W,
        "gpu": gpu,
        "baseline": BASELINE,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["torchrun", f"--nproc-per-node {W}", *sys.argv]),
        "peak_tflops": ceil["peak_flops"] / 1e12,
        "hbm_gbps": ceil["hbm_bps"] / 1e9,
        "link_gbps": ceil["link_bps"] / 1e9,
    }
    if rank == 0:
        print(
            f"{gpu} x{W}: cuBLAS bf16 {common['peak_tflops']:.0f} TFLOP/s, HBM {common['hbm_gbps']:.0f} GB/s, "
            f"NCCL all-to-all bus {common['link_gbps']:.0f} GB/s; "
            f"torch {torch.__version__}, triton {triton.__version__}"
        )
        print(f"{'case':<14}{'tokens':>7}{'base ms':>10}{'fused ms':>10}{'speedup':>9}{'cuBLAS ms':>11}"
              f"{'fused/gemm':>11}{'triton ms':>11}{'%roof':>7}  bound   comm routed")
    records = []
    for model in models:
        for m in tokens:
            record = {**common, "case": f"{model}.sp{W}", "tokens": m}
            try:
                record |= bench_case(model, m, W, group, ws, timer, ceil, comm_programs)
            except Exception as exc:
                # Unattended run: record the failure (compile error, OOM, a timed-out flag wait)
                # and go on; every rank runs the same code, so they fail alike.
                record["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                torch.cuda.synchronize()
                dist.barrier()
            records.append(record)
            if rank == 0:
                if "error" in record:
                    print(f"{record['case']:<14}{m:>7}  ERROR {record['error'][:200]}")
                else:
                    r = record
                    print(f"{r['case']:<14}{m:>7}{r['baseline_ms']:>10.4f}{r['fused_ms']:>10.4f}{r['speedup']:>9.2f}"
                          f"{r['gemm_cublas_ms']:>11.4f}{r['fused_over_gemm']:>11.2f}{r['gemm_triton_ms']:>11.4f}"
                          f"{r['roofline_pct']:>6.0f}%  {r['bound']:<7} {r['comm_programs']:>4} {r['routed']}")
            torch.cuda.empty_cache()

    if rank == 0:
        wins: dict[int, bool] = {}
        for r in records:
            if "error" not in r:
                wins[r["tokens"]] = wins.get(r["tokens"], True) and r["speedup"] >= 1.0
        print(f"fused wins (every model) at tokens {sorted(m for m, w in wins.items() if w)}; "
              f"O_PROJ_FUSED_TOKEN_RANGES = {token_ranges(wins)}")
        out = Path(args.out)
        if not out.is_absolute():
            out = REPO / out
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(records, indent=1) + "\n")
        print(f"wrote {len(records)} records to {out}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
