"""Benchmark: fused all_to_all_o_proj (fusedpar.kernels.ulysses) vs NCCL all-to-all (head_to_seq) + cuBLAS GEMM.

Base-mode O projection of one decoder layer with SP = world (TP = 1), per-rank shapes:
    attn [SP*m, C] (all tokens of the step, this rank's q heads, C = q * hd, q = h / SP),
    w_o [d, SP*C], out [m, d] (m = tokens per rank)
    Llama-3-70B: d 8192, 64 q heads, hd 128;  Qwen3-32B: d 5120, 64 q heads, hd 128.
Paths, same inputs, same process:
    baseline     F.linear(comm.head_to_seq_all_to_all(attn, sp), w_o): NCCL all_to_all_single,
                 unpack (reshape/transpose/reshape), cuBLAS GEMM - what the reference layer does
    fused        all_to_all_o_proj(attn, w_o, workspace, out=out, options=FUSED): one kernel; comm
                 programs push rows to their owners band by band, GEMM programs start on their
                 own chunk and wait per band (the best --comm-programs value is reported)
    gemm_cublas  F.linear(a, w_o) on an [m, SP*C] operand: the GEMM alone
    gemm_triton  fusedpar.kernels.gemm.matmul on the same operand
Target: fused >= 1.15x baseline.
--with-attention (m <= 4096) adds case "<model>.sp<W> +attention": the return exchange as the decoder
layer does it since the o_scatter change, where the attention's own stores replace the all-to-all,
so the attention kernel must be inside the timed region on both sides:
    baseline     Triton paged attention into a local [SP*m, C] buffer, then the baseline above
    fused        the same attention storing every row into its owner's staging (ScatterOut), then
                 scattered_o_proj: arrival barrier + cuBLAS GEMM on the staging
    attention_ms the local-output attention alone (what both sides share)
The step: SP*m tokens of 4096-token prefill sequences (the last one shorter), this rank's q heads and
max(1, 8 / SP) kv heads of 128, RoPE, a paged cache; each sample rewrites the same cache slots.

Protocol and roofline as perf/bench_qkv_all_to_all.py: per sample a device barrier, a GPU spin,
CUDA events around one call; warm-up first; median of --iters samples, max over ranks; 2 rotating
operand sets. floor = max(2 m d (SP C) / peak, hbm_bytes / hbm_bw, link_bytes / link_bw) with
peak (cuBLAS 8192^3), hbm_bw (1 GiB copy) and link_bw (NCCL all-to-all bus bandwidth, 256 MiB)
measured in this run; hbm_bytes = attn + w_o + out + staging written and read, link_bytes =
(SP-1) m C elements (what leaves the GPU). roofline_pct = 100 * floor / fused_ms.

Records (rank 0 writes --out): bench, case, tokens, world, gpu, baseline, baseline_ms, fused_ms,
speedup, roofline_pct, torch, triton, date, command, plus gemm_cublas_ms, gemm_triton_ms,
fused_by_comm_programs, floor terms, routed, max_rel_diff_vs_baseline, triton_config. At the end
it prints the token ranges where the fused path wins (fusedpar.kernels.routing's o_proj_fused_rows form).

Usage (GPU machine, repo root):
    torchrun --nproc-per-node 4 perf/bench_all_to_all_o_proj.py [--shapes llama70b,qwen32b]
        [--tokens 8,1024,16384] [--comm-programs 8] [--iters 20] [--out perf/results/all_to_all_o_proj.json]
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

BENCH = "all_to_all_o_proj"
BASELINE = "NCCL all_to_all_single + unpack (comm.head_to_seq_all_to_all) + cuBLAS F.linear"
MODELS = ("llama70b", "qwen32b")  # keys of shapes.SHAPES
DEFAULT_TOKENS = ",".join(str(2**i) for i in range(3, 15))  # 8 .. 16384
SETS = 2


# ------------------------------------------------------------------------------------ bench


def dims(model: str, sp: int) -> dict[str, int]:
    cfg = shapes.shape(model)
    q = cfg.heads // sp
    return {"d": cfg.hidden, "C": q * cfg.head_dim, "q": q}


def bench_case(model, m, W, group, ws, timer, ceil, comm_programs: list[int]) -> dict:
    from fusedpar.collectives import comm
    from fusedpar.kernels import gemm, routing
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
        opts = u.UlyssesOptions(path="fused", o_config=cfg)
        return lambda i: u.all_to_all_o_proj(attns[i % SETS], wts[i % SETS], ws, out=out, options=opts)

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
    routed = "fused" if routing.in_ranges(m, routing.thresholds(out.device, W).o_proj_fused_rows) else "plain"
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


def bench_attention_case(model, m, W, group, ws, timer, ceil) -> dict:
    """The o-projection's return exchange with the attention in front (see --with-attention)."""
    from fusedpar.collectives import comm
    from fusedpar.kernels import attention as at
    from fusedpar.kernels import ulysses as u

    dm = dims(model, W)
    d, C, nq, hd = dm["d"], dm["C"], dm["q"], shapes.shape(model).head_dim
    nkv, n, page = max(1, shapes.shape(model).kv_heads // W), W * m, 16
    lens = [4096] * (n // 4096) + ([n % 4096] if n % 4096 else [])
    gen = torch.Generator(device="cuda").manual_seed(7000 * dist.get_rank() + m)
    qkv = torch.randn((n, (nq + 2 * nkv) * hd), generator=gen, device="cuda").to(torch.bfloat16)
    w_o = (torch.randn((d, W * C), generator=gen, device="cuda") / (W * C) ** 0.5).to(torch.bfloat16)
    blocks = [-(-q // page) for q in lens]
    k_cache = torch.zeros((sum(blocks) + 1, page, nkv, hd), device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    tables = torch.zeros((len(lens), max(blocks)), dtype=torch.int32)
    first = 0
    for i, b in enumerate(blocks):
        tables[i, :b] = torch.arange(first, first + b, dtype=torch.int32)
        first += b
    positions = torch.cat([torch.arange(q) for q in lens]).to("cuda")
    slots = torch.cat([tables[i, torch.arange(q) // page].long() * page + torch.arange(q) % page
                       for i, q in enumerate(lens)]).to("cuda")
    kw = dict(num_tokens=n, num_q_heads=nq, k_cache=k_cache, v_cache=v_cache, slots=slots, positions=positions,
              cu_seqlens_q=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                                        device="cuda"),
              context_lens=torch.zeros(len(lens), dtype=torch.int32, device="cuda"), block_tables=tables.cuda(),
              max_query_len=max(lens), max_kv_len=max(lens), rope_theta=500000.0)
    local = torch.empty((n, C), device="cuda", dtype=torch.bfloat16)
    target = u.o_scatter_target(ws, m, C, torch.bfloat16)

    def attention_only(i):
        return at.paged_attention(qkv, out=local, **kw)

    def baseline(i):
        return F.linear(comm.head_to_seq_all_to_all(at.paged_attention(qkv, out=local, **kw), group), w_o)

    def fused(i):
        at.paged_attention(qkv, scatter=target, **kw)
        return u.scattered_o_proj(w_o, ws, tokens=m, num_tokens=n, c=C)

    ref = baseline(0)
    ws.barrier()  # the staging is free: every rank is past its previous use (the layer's qkv exchange)
    got = fused(0)
    torch.cuda.synchronize()
    u.check_status(ws)
    rel = ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()
    del ref, got
    res = {"baseline": timer(baseline), "fused": timer(fused), "attention": timer(attention_only)}
    u.check_status(ws)
    flops = 2 * m * d * W * C
    return {
        "case": f"{model}.sp{W} +attention",
        "tokens": m,
        "shape": {"m": m, "d": d, "C": C, "q_heads": nq, "kv_heads": nkv, "k": W * C, "seq_lens": lens},
        "baseline": "Triton paged attention into a local buffer + NCCL all_to_all_single + unpack + cuBLAS F.linear",
        "fused": "the same attention storing rows into the owners' staging (ScatterOut) + scattered_o_proj "
                 "(arrival barrier + cuBLAS F.linear)",
        "baseline_ms": res["baseline"],
        "fused_ms": res["fused"],
        "speedup": res["baseline"] / res["fused"],
        "attention_ms": res["attention"],
        "exchange_and_gemm_speedup": (res["baseline"] - res["attention"]) / (res["fused"] - res["attention"]),
        "roofline_pct": 100 * (flops / ceil["peak_flops"] * 1e3 + res["attention"]) / res["fused"],
        "floor_ms": flops / ceil["peak_flops"] * 1e3 + res["attention"],
        "floor_terms_ms": {"compute_ms": flops / ceil["peak_flops"] * 1e3, "attention_ms": res["attention"]},
        "bound": "compute",
        "routed": "fused",
        "routed_ms": res["fused"],
        "max_rel_diff_vs_baseline": max_over_ranks(rel),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="llama70b,qwen32b")
    p.add_argument("--tokens", default=DEFAULT_TOKENS, help="comma list of tokens per rank (m)")
    p.add_argument("--comm-programs", default="8", help="comma list of OProjConfig.comm_programs to try")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--with-attention", action="store_true",
                   help="also time the exchange the decoder layer uses: attention storing into the owners' "
                        "staging + scattered_o_proj, vs attention + NCCL all-to-all + GEMM (m <= 4096)")
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

    _, rank, W = _bench.init_distributed()
    group = SimpleNamespace(size=W, pg=dist.group.WORLD)
    models = args.shapes.split(",")
    tokens = [int(t) for t in args.tokens.split(",") if t]
    comm_programs = [int(c) for c in args.comm_programs.split(",") if c]
    need = max(u.o_proj_workspace_bytes(max(tokens), dims(mo, W)["C"], W, torch.bfloat16) for mo in models)
    # 128 flag rows: up to 127 push bands, so the GEMM's first wave waits for little data.
    ws = SymmetricWorkspace(dist.group.WORLD, need, max_blocks=128)
    timer = _bench.SpinTimer(ws.barrier, args.iters, args.warmup)
    ceil = _bench.measure_link_ceilings(timer, group)
    common = _bench.sp_common(BENCH, W, BASELINE, ceil)
    if rank == 0:
        _bench.print_sp_header(common, "comm ")
    records = _bench.run_sp_cases(
        models, tokens, W, rank, common,
        lambda model, m: bench_case(model, m, W, group, ws, timer, ceil, comm_programs),
        lambda r: _bench.sp_row(r, f"{r['comm_programs']:>4} "),
    )
    if rank == 0:
        _bench.print_fused_wins(records, "routing.Thresholds.o_proj_fused_rows")
    if args.with_attention:
        for model in models:
            for m in (t for t in tokens if t <= 4096):
                r = {**common, **bench_attention_case(model, m, W, group, ws, timer, ceil)}
                records.append(r)
                if rank == 0:
                    print(f"{r['case']:>22} m={m:6d}: attention + exchange + GEMM {r['baseline_ms']:.4f} -> "
                          f"{r['fused_ms']:.4f} ms ({r['speedup']:.3f}x; attention alone {r['attention_ms']:.4f}, "
                          f"exchange + GEMM {r['exchange_and_gemm_speedup']:.3f}x)", flush=True)
    if rank == 0:
        _bench.write_records(records, args.out)
    _bench.finish_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
