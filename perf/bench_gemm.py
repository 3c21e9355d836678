"""Benchmark: persistent Triton GEMM (fusedpar.kernels.gemm) vs cuBLAS, per-rank GEMMs of one TP=4 layer.

For each model (Llama-3-70B, Qwen3-32B) and token count M, times C[M, N] = A[M, K] @ W[N, K]^T
for the four per-rank GEMMs of a TP=4 decoder layer:
    qkv      N = (h + 2 h_kv) d / 4,  K = hidden      (column-parallel)
    o        N = hidden,              K = h d / 4      (row-parallel)
    gate_up  N = 2 I / 4,             K = hidden      (column-parallel)
    down     N = hidden,              K = I / 4       (row-parallel)
By default W is what shift mode really uses: block 1 of a 4-block base weight (a `narrow` view:
a row range for column-parallel, a non-contiguous column range for row-parallel). The baseline
is torch.nn.functional.linear (cuBLAS) on the very same view, in the same process.

Protocol: CUDA events around each call, after a GPU-side spin (torch.cuda._sleep) so the host's
launch cost is not in the measurement; warm-up first (includes Triton compilation); median of
--iters samples; inputs and weights rotate over enough sets to exceed the L2 cache, so every
call reads its operands from HBM as a real layer would. The roofline of each case is
max(2 M N K / peak, bytes / bandwidth), where peak is a cuBLAS 8192^3 GEMM and bandwidth a 1 GiB
device copy, both measured in this run.

FP8 (--fp8, bench "gemm_fp8", perf/results/gemm_fp8.json): the FP8 linear layer of fusedpar.kernels.fp8
(activation quantisation + e4m3 GEMM, bf16 in and out) on the same per-rank shapes and shift views for
1 .. 16384 tokens, per weight scheme (--schemes): "channel" (per-output-channel weight scales,
per-token activation scales) and "block" (128 x 128 weight blocks, 1 x 128 activation groups). fused_ms
times fusedpar.kernels.fp8.fp8_matmul (quantise + GEMM, one op); baseline_ms the same layer in vLLM when
it is importable: per channel `scaled_fp8_quant(x, use_per_token_if_dynamic=True)` +
`_custom_ops.cutlass_scaled_mm` (its CUTLASS FP8 GEMM), per block `per_token_group_quant_fp8(x, 128,
column_major_scales=True)` + `_custom_ops.cutlass_scaled_mm` with block scales (vLLM's CUTLASS block-FP8
path on Hopper), else its Triton `w8a8_block_fp8_matmul` / `w8a8_triton_block_scaled_mm`. Without vLLM,
per channel: fusedpar's quantiser + `torch._scaled_mm` with row-wise scales (block: no baseline, not
timed). Where a baseline refuses the strided view it runs on a contiguous copy (recorded in
baseline_weight). Each record also carries the GEMMs alone (fused_gemm_ms, baseline_gemm_ms). The FP8
peak is a `torch._scaled_mm` 8192^3 e4m3 GEMM measured in this run; fp8_peak_pct = 2 M N K / peak over
fused_ms; roofline_pct uses max(FLOPs / FP8 peak, bytes / bandwidth), bytes = the bf16 input, the e4m3
activations written and read, the e4m3 weight and the bf16 output.

Usage (on a GPU machine, from the repo root):
    python perf/bench_gemm.py [--shapes llama70b,qwen32b] [--tokens 8,64,4096] [--iters 20]
                              [--out perf/results/gemm.json]
    python perf/bench_gemm.py --fp8 [--schemes channel,block] [--out perf/results/gemm_fp8.json]
Without a GPU it prints a message and exits 0.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench  # setup, timing and records shared by the benchmarks
import shapes

TP = 4  # per-rank shapes of a TP=4 layer; the shift view is block SHIFT_BLOCK of TP blocks
SHIFT_BLOCK = 1  # not 0, so the view really starts at an offset
SLEEP_CYCLES = 1_000_000  # GPU spin ahead of each timed call (~0.5 ms): longer than the host's launch of
# the call on slow hosts, which a shorter spin let into the timings
BASELINE = "cuBLAS torch.nn.functional.linear"

MODELS = ("llama70b", "qwen32b")  # keys of shapes.SHAPES
DEFAULT_TOKENS = [2**i for i in range(3, 15)]  # 8 .. 16384
DEFAULT_FP8_TOKENS = [2**i for i in range(15)]  # 1 .. 16384
FP8_SCHEMES = ("channel", "block")


@dataclass(frozen=True)
class Case:
    model: str
    gemm: str
    n: int
    k: int
    parallel: str  # "column" (shift view = row range of W) or "row" (column range of W)

    @property
    def name(self) -> str:
        return f"{self.model}.{self.gemm}"


def layer_cases(model: str) -> list[Case]:
    m = shapes.shape(model)
    hidden, d = m.hidden, m.head_dim
    return [
        Case(model, "qkv", (m.heads + 2 * m.kv_heads) * d // TP, hidden, "column"),
        Case(model, "o", hidden, m.heads * d // TP, "row"),
        Case(model, "gate_up", 2 * m.intermediate // TP, hidden, "column"),
        Case(model, "down", hidden, m.intermediate // TP, "row"),
    ]


def make_weight(case: Case, dtype: torch.dtype, layout: str, device) -> torch.Tensor:
    """W [N, K] for the case: the shift view of a 4-block base weight, or a contiguous tensor."""
    n, k = case.n, case.k
    if layout == "contiguous":
        return torch.randn((n, k), device=device, dtype=dtype) / math.sqrt(k)
    if case.parallel == "column":
        base = torch.randn((TP * n, k), device=device, dtype=dtype) / math.sqrt(k)
        return base.narrow(0, SHIFT_BLOCK * n, n)
    base = torch.randn((n, TP * k), device=device, dtype=dtype) / math.sqrt(k)
    return base.narrow(1, SHIFT_BLOCK * k, k)


def time_ms(fn, arg_sets, iters: int, warmup: int) -> float:
    """Median GPU time (ms) of fn(*arg_sets[i % len]) over `iters` calls, each timed alone."""
    for i in range(warmup):
        fn(*arg_sets[i % len(arg_sets)])
    torch.cuda.synchronize()
    sleep = getattr(torch.cuda, "_sleep", None)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        if sleep is not None:
            sleep(SLEEP_CYCLES)  # the GPU is busy while the host enqueues the timed call
        starts[i].record()
        fn(*arg_sets[(warmup + i) % len(arg_sets)])
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def measure_ceilings(dtype: torch.dtype, iters: int, device) -> tuple[float, float]:
    """(peak FLOP/s of a cuBLAS 8192^3 GEMM, HBM bytes/s of a 1 GiB device copy), this run."""
    size = 8192
    mats = [(torch.randn((size, size), device=device, dtype=dtype),) * 2 for _ in range(2)]
    t = time_ms(torch.matmul, mats, iters, warmup=3)
    peak = 2 * size**3 / (t * 1e-3)
    del mats
    n = (1 << 30) // 4
    copies = [(torch.empty(n, device=device), torch.rand(n, device=device))]
    t = time_ms(torch.Tensor.copy_, copies, iters, warmup=3)
    bandwidth = 2 * (1 << 30) / (t * 1e-3)  # read + write
    del copies
    torch.cuda.empty_cache()
    return peak, bandwidth


def rotation_sets(m: int, n: int, k: int, dtype: torch.dtype, l2_bytes: int) -> int:
    """Operand sets (A, W, C of one GEMM) so that one rotation is 3x the L2 size (2..8 sets)."""
    return min(8, max(2, math.ceil(3 * l2_bytes / ((m * k + n * k + m * n) * dtype.itemsize))))


def bench_case(case, tokens, args, dtype, peak, bandwidth, l2_bytes, gemm, device) -> dict:
    m, n, k = tokens, case.n, case.k
    n_sets = rotation_sets(m, n, k, dtype, l2_bytes)
    sets = [
        (torch.randn((m, k), device=device, dtype=dtype), make_weight(case, dtype, args.weight, device))
        for _ in range(n_sets)
    ]

    base_out = gemm.matmul_reference(*sets[0])
    fused_out = gemm.matmul(*sets[0])
    scale = base_out.float().abs().max().item() or 1.0
    max_rel_diff = (fused_out.float() - base_out.float()).abs().max().item() / scale
    del base_out, fused_out

    baseline_ms = time_ms(gemm.matmul_reference, sets, args.iters, args.warmup)
    fused_ms = time_ms(gemm.matmul, sets, args.iters, args.warmup)

    flops = 2 * m * n * k
    floor_compute_ms = flops / peak * 1e3
    floor_memory_ms = (m * k + n * k + m * n) * dtype.itemsize / bandwidth * 1e3
    floor_ms = max(floor_compute_ms, floor_memory_ms)
    cfg = gemm.pick_config(
        m,
        n,
        k,
        dtype=dtype,
        num_sms=torch.cuda.get_device_properties(device).multi_processor_count,
        interpret=False,
        tma=gemm.tma_compatible(*sets[0]),  # what matmul's launcher picks for these operands
    )
    return {
        "m": m,
        "n": n,
        "k": k,
        "weight": f"{args.weight} ({case.parallel}-parallel, block {SHIFT_BLOCK} of {TP})"
        if args.weight == "view"
        else "contiguous",
        "weight_strides": list(sets[0][1].stride()),
        "dtype": str(dtype).removeprefix("torch."),
        "baseline_ms": baseline_ms,
        "fused_ms": fused_ms,
        "speedup": baseline_ms / fused_ms,
        "roofline_pct": 100 * floor_ms / fused_ms,
        "baseline_roofline_pct": 100 * floor_ms / baseline_ms,
        "floor_ms": floor_ms,
        "bound": "compute" if floor_compute_ms >= floor_memory_ms else "memory",
        "max_rel_diff_vs_baseline": max_rel_diff,
        "triton_config": vars(cfg),
        "operand_sets": n_sets,
    }


def diagnose_tma(args, dtype, l2_bytes, gemm, device) -> None:
    """Why a TMA tiling can time slower here than in perf/tools/tune_gemm.py: GPU time of the pointer-load
    and the TMA pick on this bench's operand sets (a separate weight per set, so weights are cold)
    and on one shared weight (tune_gemm's setup), and the host us per launch of each (printed)."""
    import time

    from fusedpar.kernels.gemm.launch import _launch

    print(f"{'case':<18}{'tokens':>7}  {'path':<8}{'cold w ms':>10}{'shared w ms':>12}{'host us':>9}  config")
    for model in args.shapes.split(","):
        for case in layer_cases(model):
            if case.gemm not in set(args.gemms.split(",")):
                continue
            for m in (int(t) for t in args.tokens.split(",") if t):
                n, k = case.n, case.k
                n_sets = rotation_sets(m, n, k, dtype, l2_bytes)
                cold = [(torch.randn((m, k), device=device, dtype=dtype), make_weight(case, dtype, args.weight, device),
                         torch.empty((m, n), device=device, dtype=dtype)) for _ in range(n_sets)]
                shared = [(a, cold[0][1], o) for a, _, o in cold]
                sms = torch.cuda.get_device_properties(device).multi_processor_count
                for path, tma in (("pointer", False), ("tma", True)):
                    cfg = gemm.pick_config(m, n, k, dtype=dtype, num_sms=sms, interpret=False, tma=tma)

                    def call(a, w, o, c=cfg):
                        _launch(a, w, o, config=c)

                    cold_ms = time_ms(call, cold, args.iters, args.warmup)
                    shared_ms = time_ms(call, shared, args.iters, args.warmup)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for i in range(20):
                        call(*cold[i % n_sets])
                    host_us = (time.perf_counter() - t0) / 20 * 1e6
                    torch.cuda.synchronize()
                    print(f"{case.name:<18}{m:>7}  {path:<8}{cold_ms:>10.4f}{shared_ms:>12.4f}{host_us:>9.1f}  "
                          f"{cfg.block_m}x{cfg.block_n}{f'+{cfg.block_n2}' if cfg.block_n2 else ''}x{cfg.block_k} "
                          f"w{cfg.num_warps} s{cfg.num_stages}", flush=True)
                del cold, shared


# ============================================================================ FP8 (--fp8)


def measure_fp8_peak(iters: int, device) -> float:
    """FLOP/s of a torch._scaled_mm 8192^3 e4m3 GEMM (tensor-wise scales, bf16 out), this run."""
    size = 8192
    a = torch.randn((size, size), device=device).to(torch.float8_e4m3fn)
    b = torch.randn((size, size), device=device).to(torch.float8_e4m3fn).T  # column-major, as _scaled_mm wants
    one = torch.ones((), device=device)
    t = time_ms(lambda x, y: torch._scaled_mm(x, y, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                [(a, b)], iters, warmup=3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * size**3 / (t * 1e-3)


def make_fp8_weight(case: Case, scheme, layout: str, device):
    """(e4m3 W [N, K], its fp32 scales) for the case: the shift view of a 4-block base weight with the
    scales of the blocks it covers (fusedpar's FP8Weight.narrow), or a contiguous weight."""
    from fusedpar.layers.fp8_weights import FP8Weight

    n, k = case.n, case.k
    if layout == "contiguous":
        w = FP8Weight.quantize(torch.randn((n, k), device=device) / math.sqrt(k), scheme)
    elif case.parallel == "column":
        w = FP8Weight.quantize(torch.randn((TP * n, k), device=device) / math.sqrt(k), scheme)
        w = w.narrow(0, SHIFT_BLOCK * n, n)
    else:
        w = FP8Weight.quantize(torch.randn((n, TP * k), device=device) / math.sqrt(k), scheme)
        w = w.narrow(1, SHIFT_BLOCK * k, k)
    return w.q, w.scale


def vllm_fp8_ops():
    """vLLM's FP8 linear pieces, or None where vLLM (with its CUDA ops) is not importable:
    {"ops": vllm._custom_ops, "group_quant": per_token_group_quant_fp8, "triton_block": the Triton block
    GEMM or None, "version": vllm.__version__}."""
    try:
        import vllm
        from vllm import _custom_ops as ops
        from vllm.model_executor.layers.quantization.utils import fp8_utils
    except Exception:  # not installed, or a build without CUDA ops
        return None
    if not hasattr(ops, "cutlass_scaled_mm") or not hasattr(ops, "scaled_fp8_quant"):
        return None
    triton_block = getattr(fp8_utils, "w8a8_triton_block_scaled_mm", None) or getattr(
        fp8_utils, "w8a8_block_fp8_matmul", None)
    return {"ops": ops, "group_quant": getattr(fp8_utils, "per_token_group_quant_fp8", None),
            "triton_block": triton_block, "version": vllm.__version__}


def fp8_baseline(scheme_name: str, vllm_ops, device):
    """(name, quantise(x) -> (q, s), gemm(q, s, qw, sw) -> bf16 out) of the baseline, or None."""
    from fusedpar.kernels import fp8

    if vllm_ops is not None:
        ops = vllm_ops["ops"]
        if scheme_name == "channel":
            def quant(x):
                return ops.scaled_fp8_quant(x, use_per_token_if_dynamic=True)

            def gemm(q, s, qw, sw):
                return ops.cutlass_scaled_mm(q, qw.T, scale_a=s, scale_b=sw, out_dtype=torch.bfloat16)

            return f"vLLM {vllm_ops['version']} scaled_fp8_quant (per token) + cutlass_scaled_mm", quant, gemm
        group_quant = vllm_ops["group_quant"]
        cap = torch.cuda.get_device_capability(device)
        cutlass_block = hasattr(ops, "cutlass_scaled_mm_supports_block_fp8") and \
            ops.cutlass_scaled_mm_supports_block_fp8(cap[0] * 10 + cap[1])
        if group_quant is not None and cutlass_block:
            def quant(x):
                return group_quant(x, 128, column_major_scales=True)

            def gemm(q, s, qw, sw):
                return ops.cutlass_scaled_mm(q, qw.T, scale_a=s, scale_b=sw.T, out_dtype=torch.bfloat16)

            return (f"vLLM {vllm_ops['version']} per_token_group_quant_fp8 + cutlass_scaled_mm (128x128 blocks)",
                    quant, gemm)
        if group_quant is not None and vllm_ops["triton_block"] is not None:
            block_mm = vllm_ops["triton_block"]

            def quant(x):
                return group_quant(x, 128)

            def gemm(q, s, qw, sw):
                return block_mm(q, qw, s, sw, [128, 128], output_dtype=torch.bfloat16)

            return f"vLLM {vllm_ops['version']} per_token_group_quant_fp8 + {block_mm.__name__}", quant, gemm
        return None
    if scheme_name != "channel":
        return None

    def quant(x):
        return fp8.fp8_quantize(x, x.shape[1])

    def gemm(q, s, qw, sw):
        return torch._scaled_mm(q, qw.T, scale_a=s, scale_b=sw.reshape(1, -1), out_dtype=torch.bfloat16)

    return "fusedpar fp8_quantize + torch._scaled_mm (row-wise scales)", quant, gemm


def bench_fp8_case(case, tokens, scheme_name, args, peak, bandwidth, l2_bytes, baseline, device) -> dict:
    from fusedpar.kernels import fp8
    from fusedpar.kernels.gemm import tma_compatible

    scheme = fp8.FP8Scheme(scheme_name)
    m, n, k = tokens, case.n, case.k
    name, quant, base_gemm = baseline
    per_set = m * k * 2 + n * k * TP + m * n * 2  # the bf16 input, the whole e4m3 base weight, the output
    n_sets = min(8, max(2, math.ceil(3 * l2_bytes / per_set)))
    sets = [(torch.randn((m, k), device=device, dtype=torch.bfloat16), *make_fp8_weight(case, scheme, args.weight,
                                                                                          device))
            for _ in range(n_sets)]
    w_tile, group = scheme.weight_tile((n, k)), scheme.activation_tile(k)

    def fused(x, qw, sw):
        return fp8.fp8_matmul(x, qw, sw, scheme)

    padding = {"rows": 1}  # the baseline's token count is padded to a multiple of this (see below)

    def base_quant(x):
        if x.shape[0] % padding["rows"]:
            x = torch.nn.functional.pad(x, (0, 0, 0, padding["rows"] - x.shape[0] % padding["rows"]))
        return quant(x)

    def base(x, qw, sw):
        q, s = base_quant(x)
        return base_gemm(q, s, qw, sw)[: x.shape[0]]

    def contiguous():
        return [(x, qw.contiguous(), sw.contiguous()) for x, qw, sw in sets]

    x0, qw0, sw0 = sets[0]
    # the view as is; a contiguous copy where the baseline's kernel refuses the strided view; then also
    # tokens padded to a multiple of 4, as vLLM's CUTLASS block-FP8 GEMM needed on Hopper in some releases
    attempts = [(lambda: sets, 1, "the same view"),
                (contiguous, 1, "a contiguous copy (the baseline refuses the strided view)"),
                (contiguous, 4, "a contiguous copy, tokens padded to a multiple of 4 (the baseline needs both)")]
    for i, (make_sets, rows, where) in enumerate(attempts):
        padding["rows"] = rows
        candidate = make_sets()
        try:
            base_out = base(*candidate[0])
        except Exception:
            if i == len(attempts) - 1:
                raise
            continue
        base_sets, baseline_weight = candidate, where
        break
    fused_out = fused(x0, qw0, sw0)
    want = fp8.fp8_linear(x0, qw0, sw0, scheme)
    scale = want.float().abs().max().item() or 1.0
    max_rel_diff = (fused_out.float() - want.float()).abs().max().item() / scale
    baseline_rel_diff = (base_out.float() - want.float()).abs().max().item() / scale
    del base_out, fused_out, want

    baseline_ms = time_ms(base, base_sets, args.iters, args.warmup)
    fused_ms = time_ms(fused, sets, args.iters, args.warmup)
    # the GEMMs alone, on operands quantised beforehand
    q_sets = [(*fp8.fp8_quantize(x, group), qw, sw) for x, qw, sw in sets]
    fused_gemm_ms = time_ms(lambda q, s, qw, sw: fp8.fp8_scaled_mm(q, s, qw, sw, w_tile, group), q_sets, args.iters,
                            args.warmup)
    bq_sets = [(*base_quant(x), qw, sw) for x, qw, sw in base_sets]
    baseline_gemm_ms = time_ms(base_gemm, bq_sets, args.iters, args.warmup)

    flops = 2 * m * n * k
    floor_compute_ms = flops / peak * 1e3
    floor_memory_ms = (m * k * 2 + 2 * m * k + n * k + m * n * 2) / bandwidth * 1e3
    floor_ms = max(floor_compute_ms, floor_memory_ms)
    cfg = fp8.pick_fp8_config(m, n, k, out_dtype=torch.bfloat16,
                              num_sms=torch.cuda.get_device_properties(device).multi_processor_count,
                              interpret=False, tma=m > 64 and tma_compatible(q_sets[0][0], q_sets[0][2]))
    return {
        "m": m,
        "n": n,
        "k": k,
        "scheme": scheme_name,
        "baseline": name,
        "weight": f"{args.weight} ({case.parallel}-parallel, block {SHIFT_BLOCK} of {TP})"
        if args.weight == "view" else "contiguous",
        "weight_strides": list(qw0.stride()),
        "baseline_weight": baseline_weight,
        "dtype": "float8_e4m3fn (bf16 in / out)",
        "baseline_ms": baseline_ms,
        "fused_ms": fused_ms,
        "speedup": baseline_ms / fused_ms,
        "baseline_gemm_ms": baseline_gemm_ms,
        "fused_gemm_ms": fused_gemm_ms,
        "gemm_speedup": baseline_gemm_ms / fused_gemm_ms,
        "roofline_pct": 100 * floor_ms / fused_ms,
        "baseline_roofline_pct": 100 * floor_ms / baseline_ms,
        "fp8_peak_pct": 100 * floor_compute_ms / fused_ms,
        "baseline_fp8_peak_pct": 100 * floor_compute_ms / baseline_ms,
        "floor_ms": floor_ms,
        "bound": "compute" if floor_compute_ms >= floor_memory_ms else "memory",
        "max_rel_diff_vs_reference": max_rel_diff,
        "baseline_max_rel_diff_vs_reference": baseline_rel_diff,
        "triton_config": vars(cfg),
        "operand_sets": n_sets,
    }


def main_fp8(args, device, gpu: str, props, l2_bytes: int) -> int:
    import triton

    vllm_ops = vllm_fp8_ops()
    peak = measure_fp8_peak(max(args.iters, 20), device)
    _, bandwidth = measure_ceilings(torch.bfloat16, max(args.iters, 20), device)
    print(f"{gpu}: torch._scaled_mm e4m3 8192^3 {peak / 1e12:.0f} TFLOP/s, device copy {bandwidth / 1e9:.0f} GB/s, "
          f"L2 {l2_bytes / 2**20:.0f} MiB, {props.multi_processor_count} SMs; torch {torch.__version__}, "
          f"triton {triton.__version__}; vLLM: {vllm_ops['version'] if vllm_ops else 'not importable'}")
    common = {"bench": "gemm_fp8", "world": 1, "gpu": gpu, **_bench.run_info(python=True),
              "peak_tflops": peak / 1e12, "peak_kind": "torch._scaled_mm e4m3 8192^3", "hbm_gbps": bandwidth / 1e9}
    header = (f"{'case':<18}{'scheme':>8}{'tokens':>7}{'N':>7}{'K':>7}{'base ms':>10}{'fused ms':>10}{'speedup':>9}"
              f"{'gemm x':>8}{'%fp8 peak':>10}{'%roof':>7}  config")
    records = []
    for scheme_name in args.schemes.split(","):
        baseline = fp8_baseline(scheme_name, vllm_ops, device)
        if baseline is None:
            print(f"scheme {scheme_name}: no baseline here (vLLM not importable); not timed")
            continue
        print(f"scheme {scheme_name}: baseline {baseline[0]}")
        print(header)
        print("-" * len(header))
        for model in args.shapes.split(","):
            for case in layer_cases(model):
                if case.gemm not in set(args.gemms.split(",")):
                    continue
                for tokens in [int(t) for t in args.tokens.split(",") if t]:
                    record = {**common, "case": f"{case.name}.{scheme_name}", "tokens": tokens, "baseline": baseline[0]}
                    try:
                        record |= bench_fp8_case(case, tokens, scheme_name, args, peak, bandwidth, l2_bytes, baseline,
                                                 device)
                    except Exception as exc:  # one failing shape must not lose the others (unattended run)
                        record |= {"error": f"{type(exc).__name__}: {exc}"[:2000]}
                        print(f"{case.name:<18}{scheme_name:>8}{tokens:>7}  ERROR {record['error'][:200]}")
                        records.append(record)
                        torch.cuda.empty_cache()
                        continue
                    records.append(record)
                    cfg = record["triton_config"]
                    warn = "" if record["max_rel_diff_vs_reference"] < 3e-2 else "  WARNING: differs from the reference"
                    print(f"{case.name:<18}{scheme_name:>8}{tokens:>7}{case.n:>7}{case.k:>7}{record['baseline_ms']:>10.4f}"
                          f"{record['fused_ms']:>10.4f}{record['speedup']:>9.2f}{record['gemm_speedup']:>8.2f}"
                          f"{record['fp8_peak_pct']:>9.1f}%{record['roofline_pct']:>6.0f}%  "
                          f"{cfg['block_m']}x{cfg['block_n']}x{cfg['block_k']} w{cfg['num_warps']} s{cfg['num_stages']}"
                          f"{' tma' if cfg.get('tma') else ''}{warn}", flush=True)
                    torch.cuda.empty_cache()
            _bench.write_records(records, args.out)  # per model: a run stopped later keeps what it measured
    _bench.write_records(records, args.out)
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="llama70b,qwen32b", help=f"comma list of {sorted(MODELS)}")
    p.add_argument("--gemms", default="qkv,o,gate_up,down", help="comma list of qkv,o,gate_up,down")
    p.add_argument("--tokens", default=None,
                   help="comma list of token counts (M); default 8 .. 16384 (--fp8: 1 .. 16384)")
    p.add_argument("--iters", type=int, default=20, help="timed calls per measurement (median taken)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument("--weight", choices=("view", "contiguous"), default="view")
    p.add_argument("--diagnose-tma", action="store_true",
                   help="instead of the benchmark: pointer vs TMA tiling, cold vs shared weight, host us per launch")
    p.add_argument("--fp8", action="store_true",
                   help="the FP8 linear layer (bench gemm_fp8) against vLLM's FP8 GEMMs instead of the bf16 GEMM")
    p.add_argument("--schemes", default=",".join(FP8_SCHEMES), help=f"--fp8: comma list of {FP8_SCHEMES}")
    p.add_argument("--out", default=None, help="default perf/results/gemm.json (--fp8: perf/results/gemm_fp8.json)")
    args = p.parse_args(argv)
    if args.tokens is None:
        args.tokens = ",".join(map(str, DEFAULT_FP8_TOKENS if args.fp8 else DEFAULT_TOKENS))
    if args.out is None:
        args.out = "perf/results/gemm_fp8.json" if args.fp8 else "perf/results/gemm.json"
    bad_schemes = set(args.schemes.split(",")) - set(FP8_SCHEMES)
    if bad_schemes:
        p.error(f"unknown --schemes {sorted(bad_schemes)}; known: {list(FP8_SCHEMES)}")
    unknown = set(args.shapes.split(",")) - set(MODELS)
    if unknown:
        p.error(f"unknown --shapes {sorted(unknown)}; known: {sorted(MODELS)}")
    if args.iters < 20:
        print(f"note: --iters {args.iters} is below the protocol's 20")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemm: no CUDA GPU visible; nothing measured (run this on a GPU machine).")
        return 0
    _bench.add_repo_to_path()  # run from a checkout without `pip install -e .`
    import triton

    from fusedpar.kernels import gemm

    device = torch.device("cuda", torch.cuda.current_device())
    dtype = getattr(torch, args.dtype)
    props = torch.cuda.get_device_properties(device)
    l2_bytes = getattr(props, "L2_cache_size", 50 * 2**20)
    gpu = torch.cuda.get_device_name(device)
    tokens_list = [int(t) for t in args.tokens.split(",") if t]
    gemms = set(args.gemms.split(","))

    if args.diagnose_tma:
        diagnose_tma(args, dtype, l2_bytes, gemm, device)
        return 0
    if args.fp8:
        return main_fp8(args, device, gpu, props, l2_bytes)
    peak, bandwidth = measure_ceilings(dtype, max(args.iters, 20), device)
    print(
        f"{gpu}: cuBLAS {args.dtype} 8192^3 {peak / 1e12:.0f} TFLOP/s, "
        f"device copy {bandwidth / 1e9:.0f} GB/s, "
        f"L2 {l2_bytes / 2**20:.0f} MiB, {props.multi_processor_count} SMs; "
        f"torch {torch.__version__}, triton {triton.__version__}"
    )
    header = (
        f"{'case':<18}{'tokens':>7}{'N':>7}{'K':>7}{'cuBLAS ms':>11}{'fused ms':>10}{'speedup':>9}"
        f"{'fused %roof':>12}{'cuBLAS %roof':>13}  bound   config"
    )
    print(header)
    print("-" * len(header))

    common = {
        "bench": "gemm",
        "world": 1,
        "gpu": gpu,
        "baseline": BASELINE,
        **_bench.run_info(python=True),
        "peak_tflops": peak / 1e12,
        "hbm_gbps": bandwidth / 1e9,
    }
    records = []
    for model in args.shapes.split(","):
        for case in layer_cases(model):
            if case.gemm not in gemms:
                continue
            for tokens in tokens_list:
                record = {**common, "case": case.name, "tokens": tokens}
                try:
                    record |= bench_case(case, tokens, args, dtype, peak, bandwidth, l2_bytes, gemm, device)
                except Exception as exc:
                    # Unattended run: one failing shape (Triton compile or shared-memory error,
                    # OOM) is recorded with its message and must not lose the other results.
                    record |= {"error": f"{type(exc).__name__}: {exc}"[:2000]}
                    print(f"{case.name:<18}{tokens:>7}  ERROR {record['error'][:200]}")
                    records.append(record)
                    torch.cuda.empty_cache()
                    continue
                records.append(record)
                cfg = record["triton_config"]
                warn = "" if record["max_rel_diff_vs_baseline"] < 3e-2 else "  WARNING: results differ"
                print(
                    f"{case.name:<18}{tokens:>7}{case.n:>7}{case.k:>7}{record['baseline_ms']:>11.4f}"
                    f"{record['fused_ms']:>10.4f}{record['speedup']:>9.2f}{record['roofline_pct']:>11.1f}%"
                    f"{record['baseline_roofline_pct']:>12.1f}%  {record['bound']:<7} "
                    f"{cfg['block_m']}x{cfg['block_n']}{'+' + str(cfg['block_n2']) if cfg.get('block_n2') else ''}"
                    f"x{cfg['block_k']} w{cfg['num_warps']} s{cfg['num_stages']}"
                    f"{' tma' if cfg.get('tma') else ''}{'' if cfg.get('flatten', True) else ' nested'}{warn}"
                )
                torch.cuda.empty_cache()

    _bench.write_records(records, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
