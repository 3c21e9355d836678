"""Benchmark: paged Triton attention (fusedpar.kernels.attention) vs torch SDPA (flash backend).

Shapes: per-rank heads of a Llama-3-70B layer at P=4 (16 q / 2 kv heads, head_dim 128), bf16.
  attention_prefill  one or four sequences totalling T tokens (512 .. 16384), causal, no cached
                     context. Fused: qkv [T, (16+2*2)*128] in the all-to-all layout, new k/v written
                     into a paged cache (16-token blocks, shuffled), RoPE on q/k, attention read back
                     through the block table. SDPA: q/k/v already split into contiguous [B, H, L, d]
                     tensors (no RoPE, no cache write), is_causal=True, enable_gqa=True.
  attention_decode   B sequences (1 .. 64) x 4096 cached tokens + 1 new token each. Fused: the
                     paged cache (shuffled blocks) incl. the new token's RoPE + cache write. SDPA: a
                     contiguous [B, 2, 4097, d] cache, which favours SDPA (no block-table gather, no
                     cache write); that is the stock baseline a paged kernel has to meet.
Both columns are also reported for the fused kernel without RoPE/cache write
(`fused_attention_only_ms`: write_kv=False, no RoPE), the like-for-like attention time.
The full path's like-for-like baseline (`baseline_full_ms`, `speedup_full`; default tilings only) is
the same steps in stock ops: RoPE on q/k (torch.compile'd), the new k/v stored into the paged cache
(index_copy_), then the SDPA call above (decode: the new token appended to SDPA's contiguous cache).
Its output is checked against the fused full path's (`max_rel_diff_full_vs_stock`).

Decode graph records ("case": "decode Bx4096 graph", "timing": "cuda graph"; the eager record of
the same shape carries "timing": "eager"). In the layer stack a decode step runs as one CUDA-graph
replay, so the host's launch cost is not paid per kernel there; timed eagerly, the decode shapes
(1 .. 8 sequences) measure the host instead: the fused path is three Triton launches plus Python
argument handling against SDPA's one launch. So every decode shape run
with pick_config's tiling is also timed with both sides captured: per side one graph holding one
call on each operand set in turn (SDPA; the fused full path; the fused attention-only path), so
one replay still rotates the operands through L2 and amortises the replay's own launch. ms per
call = median replay time (CUDA events after a GPU spin, warm-up replays first, --iters replays)
/ calls per replay. A capture that fails is recorded as the eager record's graph_error and the
graph record is left out. Decode sweep tilings get graph records too (the sweep's decode choice is
made on them); prefill sweep records are eager, except under --short-prefill-sweep (graph records
too: small prefills are where launch overlap matters). Prefill shapes with pick_config's tiling also get
graph records ("prefill BxL graph"): the GPU time of both sides without the host's launch gaps, which
the eager figure of a two-launch fused path (write kernel, attention) against SDPA's one launch
includes at a few hundred tokens. In a layer a prefill's launches queue behind its GEMMs, so there
the GPU time is what counts; both records are kept.

Protocol (as perf/bench_gemm.py): CUDA events around each call after a GPU
spin, warm-up first (includes Triton compilation), median of --iters, inputs and caches rotate
over enough sets to exceed 3x the L2 cache. roofline_pct = 100 * floor / fused_ms with
floor = max(FLOPs / peak, bytes / bandwidth): peak = a cuBLAS 8192^3 bf16 GEMM and bandwidth =
a 1 GiB device copy, both measured in this run. FLOPs = 4 * Hq * d * (causal query-key pairs);
bytes = the minimum traffic (prefill: qkv read + out write + k/v write; decode: the K/V read).

--sweep (default on, time-capped by --sweep-budget-s) also times explicit tilings (AttentionConfig,
incl. prerotate_q) on prefill 1x4096, 4x1024 and 4x256 and on decode 1x4096, 8x4096 (the layer
benchmark's decode case) and 64x4096, to tune pick_config on the GPU. Sweep records ("sweep": true) are measured like
the others: fused_ms is the full path the layer runs (RoPE on q/k + KV-cache write + attention)
with that tiling, fused_attention_only_ms the attention alone with it (write_kv=False, no RoPE).
Both matter: the attention-only time hid the cost of the in-kernel q norm/RoPE prologue, which is
what prerotate_q removes. Each tiling compiles its kernels once;
a tiling that fails (compile error, shared memory) is recorded with its error, the sweep goes on.

Usage (GPU machine, repo root):
    python perf/bench_attention.py [--iters 20] [--out perf/results/attention.json] [--no-sweep]
Without a GPU it prints a message and exits 0.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench  # setup, timing and records shared by the benchmarks
import shapes
from bench_gemm import SLEEP_CYCLES, measure_ceilings, time_ms  # one timing protocol for every benchmark

_SHAPE, _P = shapes.shape("llama70b"), 4  # per-rank heads of a Llama-3-70B layer at P = 4: 16 q / 2 kv of 128
NQ, NKV, HD = _SHAPE.heads // _P, _SHAPE.kv_heads // _P, _SHAPE.head_dim
ROPE_THETA = _SHAPE.rope_theta
PAGE = 16
DECODE_CONTEXT = 4096
PREFILL_TOKENS = [512, 1024, 2048, 4096, 8192, 16384]
PREFILL_SEQS = [1, 4]
DECODE_BATCH = [1, 4, 16, 64]
BASELINE = "torch SDPA flash (contiguous [B, H, L, d] q/k/v, enable_gqa; decode: contiguous KV cache)"
BASELINE_GRAPH = BASELINE + " - both sides captured in one CUDA graph per operand rotation (ms per call)"


class PagedInputs:
    """One rotation set: qkv, a paged cache holding `context` tokens per sequence, metadata."""

    def __init__(self, seq_lens: list[int], context: int, device, dtype, gen):
        self.seq_lens, self.context = seq_lens, context
        n = sum(seq_lens)
        width = (NQ + 2 * NKV) * HD
        self.qkv = torch.randn((n, width), device=device, dtype=dtype, generator=gen)
        need = [math.ceil((context + q) / PAGE) for q in seq_lens]
        num_blocks = sum(need)
        perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(num_blocks))  # scattered
        shape = (num_blocks, PAGE, NKV, HD)
        self.k_cache = torch.randn(shape, device=device, dtype=dtype, generator=gen)
        self.v_cache = torch.randn(shape, device=device, dtype=dtype, generator=gen)
        bt = torch.zeros((len(seq_lens), max(need)), dtype=torch.int32)
        slots, positions, off = [], [], 0
        self.tables = []
        for i, (q, k) in enumerate(zip(seq_lens, need, strict=True)):
            table = perm[off : off + k]
            off += k
            bt[i, :k] = table.to(torch.int32)
            pos = torch.arange(context, context + q)
            slots.append(table[pos // PAGE] * PAGE + pos % PAGE)
            positions.append(pos)
            self.tables.append(table)
        self.block_tables = bt.to(device)
        self.slots = torch.cat(slots).to(device)
        self.positions = torch.cat(positions).to(device)
        cu = [0]
        for q in seq_lens:
            cu.append(cu[-1] + q)
        self.cu = torch.tensor(cu, dtype=torch.int32, device=device)
        self.ctx = torch.full((len(seq_lens),), context, dtype=torch.int32, device=device)
        self.out = torch.empty((n, NQ * HD), device=device, dtype=dtype)

    def kwargs(self, *, rope: bool, write_kv: bool) -> dict:
        return dict(
            num_tokens=self.qkv.shape[0], num_q_heads=NQ, cu_seqlens_q=self.cu, context_lens=self.ctx,
            block_tables=self.block_tables, k_cache=self.k_cache, v_cache=self.v_cache,
            slots=self.slots if write_kv else None, positions=self.positions,
            max_query_len=max(self.seq_lens), max_kv_len=self.context + max(self.seq_lens),
            rope_theta=ROPE_THETA if rope else None, write_kv=write_kv, out=self.out,
        )

    def sdpa_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Contiguous q [B, Hq, L, d] and k/v [B, Hkv, ctx + L, d] holding the same values (equal L)."""
        b, L = len(self.seq_lens), self.seq_lens[0]
        q = self.qkv[:, : NQ * HD].reshape(b, L, NQ, HD).transpose(1, 2).contiguous()
        pos = torch.arange(self.context + L)
        rows = torch.stack([t[pos // PAGE] * PAGE + pos % PAGE for t in self.tables]).to(self.qkv.device)
        k = self.k_cache.view(-1, NKV, HD)[rows].transpose(1, 2).contiguous()
        v = self.v_cache.view(-1, NKV, HD)[rows].transpose(1, 2).contiguous()
        return q, k, v


def _rope_stock(qkv, cos_sin, positions):
    """HF rotate-half RoPE on the q and k of packed qkv rows (fp32 math, cos/sin gathered from a table
    by position, as vLLM's rotary embedding does). Returns roped q [T, NQ, d], roped k and v [T, NKV, d]."""
    t = qkv.shape[0]
    q = qkv[:, : NQ * HD].view(t, NQ, HD)
    k = qkv[:, NQ * HD : (NQ + NKV) * HD].view(t, NKV, HD)
    v = qkv[:, (NQ + NKV) * HD :].view(t, NKV, HD)
    cos, sin = cos_sin[positions].chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rope(x):
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rope(q), rope(k), v


# torch.compile'd RoPE (Inductor fuses it into one kernel): the best stock form of that step;
# compiled lazily on first use, so importing this file compiles nothing. The cache write stays
# eager: with it inside the compiled function the stock step cost about one copy of the whole
# cache, which an in-place write into a functionalised input would explain.
_rope_compiled = None


def stock_full(s, cos_sin, contiguous_kv, causal: bool):
    """Stock full path of one PagedInputs set: RoPE (compiled) + paged cache write (two index_copy_)
    + SDPA flash. Prefill attends over the new tokens (no context); decode appends the new token's
    k/v to a contiguous [B, NKV, ctx + 1, d] cache (`contiguous_kv`, last position) and attends over it."""
    global _rope_compiled
    if _rope_compiled is None:
        _rope_compiled = torch.compile(_rope_stock, fullgraph=True)
    q, k, v = _rope_compiled(s.qkv, cos_sin, s.positions)
    s.k_cache.view(-1, NKV, HD).index_copy_(0, s.slots, k)
    s.v_cache.view(-1, NKV, HD).index_copy_(0, s.slots, v)
    b, L = len(s.seq_lens), s.seq_lens[0]
    q = q.view(b, L, NQ, HD).transpose(1, 2)
    if causal:
        k, v = k.view(b, L, NKV, HD).transpose(1, 2), v.view(b, L, NKV, HD).transpose(1, 2)
    else:
        kc, vc = contiguous_kv
        kc[:, :, -1:].copy_(k.view(b, L, NKV, HD).transpose(1, 2))
        vc[:, :, -1:].copy_(v.view(b, L, NKV, HD).transpose(1, 2))
        k, v = kc, vc
    return sdpa(q, k, v, causal)


def stock_full_baseline(probe, sets, sdpa_sets, sdpa_in, cos_sin, causal, args, time_ms) -> dict:
    """Time stock_full over the rotation sets (eager) after checking that it gives the fused full
    path's output on the probe set (both apply RoPE and write the cache)."""
    from fusedpar.kernels import attention

    fused_out = attention.paged_attention(probe.qkv, **probe.kwargs(rope=True, write_kv=True)).clone()
    stock_out = stock_full(probe, cos_sin, sdpa_in[1:], causal).transpose(1, 2).reshape(fused_out.shape)
    diff = ((stock_out.float() - fused_out.float()).abs().max() / stock_out.float().abs().max()).item()
    for s, t in zip(sets, sdpa_sets, strict=True):
        s.sdpa_kv = t[1:]  # each set's own contiguous decode cache (unused by prefill)
    full_ms = time_ms(lambda s: stock_full(s, cos_sin, s.sdpa_kv, causal), [(s,) for s in sets],
                      args.iters, args.warmup)
    return {"baseline_full": "RoPE(q, k) + paged KV-cache write (torch.compile'd) + " + BASELINE,
            "baseline_full_ms": full_ms, "max_rel_diff_full_vs_stock": diff}


def rope_table(max_pos: int, device) -> torch.Tensor:
    """fp32 [max_pos, d] = cat(cos, sin) of HF RoPE angles pos * theta^(-2i/d), i < d/2."""
    inv_freq = ROPE_THETA ** (-torch.arange(0, HD, 2, dtype=torch.float64) / HD)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float().to(device)


def sdpa(q, k, v, causal: bool):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def graph_ms(graph: torch.cuda.CUDAGraph, per_replay_calls: int, iters: int, warmup: int) -> float:
    """Median GPU time (ms) of one replay of `graph` over `iters` replays, divided by its calls."""
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    sleep = getattr(torch.cuda, "_sleep", None)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(iters):
        if sleep is not None:
            sleep(SLEEP_CYCLES)  # as time_ms: the GPU is busy while the host launches the replay
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples) / per_replay_calls


def captured_ms(calls: list[Callable[[], object]], iters: int, warmup: int) -> float:
    """ms per call of `calls` captured in order in one CUDA graph (see graph_ms)."""
    for c in calls:  # eager first: Triton compiles, lazy device state (RoPE table) is set up, outside capture
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    outs = []  # SDPA returns fresh tensors from the graph's pool: held until the timing is done
    with torch.cuda.graph(g):
        for c in calls:
            outs.append(c())
    ms = graph_ms(g, len(calls), iters, warmup)
    del g, outs
    return ms


def bench_case(kind, seq_lens, context, args, ctx, config=None) -> dict:
    """Time SDPA, fused (RoPE + cache write + attention) and fused attention-only on one shape."""
    from fusedpar.kernels import attention

    device, dtype, time_ms = ctx["device"], ctx["dtype"], ctx["time_ms"]
    gen = torch.Generator(device=device).manual_seed(0)
    probe = PagedInputs(seq_lens, context, device, dtype, gen)
    sdpa_in = probe.sdpa_tensors()
    set_bytes = sum(t.numel() * t.element_size() for t in (probe.qkv, probe.k_cache, probe.v_cache, *sdpa_in))
    n_sets = min(8, max(2, math.ceil(3 * ctx["l2_bytes"] / set_bytes)))
    sets = [probe] + [PagedInputs(seq_lens, context, device, dtype, gen) for _ in range(n_sets - 1)]
    sdpa_sets = [sdpa_in] + [s.sdpa_tensors() for s in sets[1:]]
    causal = kind == "prefill"

    # Accuracy vs SDPA on identical q/k/v: no RoPE, and the cache holds raw k/v (written by the call).
    options = attention.AttentionOptions(config=config)
    fused_out = attention.paged_attention(probe.qkv, **probe.kwargs(rope=False, write_kv=True), options=options)
    q, k, v = probe.sdpa_tensors()  # re-read: decode's new token is now in the cache
    ref = sdpa(q, k, v, causal).transpose(1, 2).reshape(fused_out.shape)
    max_rel_diff = ((fused_out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    del ref, q, k, v

    def run_fused(s, rope=True, write_kv=True):
        attention.paged_attention(s.qkv, **s.kwargs(rope=rope, write_kv=write_kv), options=options)

    baseline_ms = time_ms(lambda qq, kk, vv: sdpa(qq, kk, vv, causal), sdpa_sets, args.iters, args.warmup)
    # The like-for-like baseline of the full path: the same RoPE + cache write done by stock ops.
    cos_sin = rope_table(context + max(seq_lens), device)
    full = {}
    if config is None:
        try:
            full = stock_full_baseline(probe, sets, sdpa_sets, sdpa_in, cos_sin, causal, args, time_ms)
        except Exception as exc:  # the stock baseline is extra: its failure must not lose the record
            full = {"baseline_full_error": f"{type(exc).__name__}: {exc}"[:2000]}
    attn_only_ms = time_ms(lambda s: run_fused(s, False, False), [(s,) for s in sets], args.iters, args.warmup)
    # The full path for sweep records too: a tiling is only as good as the layer's call with it.
    fused_ms = time_ms(run_fused, [(s,) for s in sets], args.iters, args.warmup)
    if "baseline_full_ms" in full:
        full["speedup_full"] = full["baseline_full_ms"] / fused_ms

    # Decode runs inside a CUDA graph in the layer stack, where eager timing mostly measures host
    # launch cost: every decode record (sweep tilings too) is also timed captured; so is every
    # default-tiling prefill record (GPU time without launch gaps; module docstring).
    graph_times: dict[str, float | str] = {}
    if kind == "decode" or config is None or args.short_prefill_sweep:
        try:
            # The fused calls pass max_query_len / max_kv_len (PagedInputs.kwargs): no host sync in
            # capture. write_kv rewrites the same slot with the same k/v on every replay (idempotent).
            base_g = captured_ms([functools.partial(sdpa, *t, causal) for t in sdpa_sets], args.iters, args.warmup)
            fused_g = captured_ms([functools.partial(run_fused, s) for s in sets], args.iters, args.warmup)
            attn_g = captured_ms(
                [functools.partial(run_fused, s, False, False) for s in sets], args.iters, args.warmup
            )
            graph_times = {"baseline_graph_ms": base_g, "fused_graph_ms": fused_g,
                           "fused_attention_only_graph_ms": attn_g, "speedup_graph": base_g / fused_g}
            if "baseline_full_ms" in full:
                try:
                    full_g = captured_ms([functools.partial(stock_full, s, cos_sin, s.sdpa_kv, causal) for s in sets],
                                         args.iters, args.warmup)
                    graph_times |= {"baseline_full_graph_ms": full_g, "speedup_full_graph": full_g / fused_g}
                except Exception as exc:
                    graph_times["baseline_full_graph_error"] = f"{type(exc).__name__}: {exc}"[:2000]
        except Exception as exc:
            # The eager timings above stand on their own: keep them, record why the graph failed.
            graph_times = {"graph_error": f"{type(exc).__name__}: {exc}"[:2000]}

    tokens = sum(seq_lens)
    pairs = sum(context * q + q * (q + 1) // 2 for q in seq_lens)  # causal query-key pairs
    flops = 4 * NQ * HD * pairs
    elem = torch.empty((), dtype=dtype).element_size()
    kv_tok = 2 * NKV * HD * elem
    if kind == "prefill":
        bytes_ = tokens * ((NQ + 2 * NKV) * HD * elem + NQ * HD * elem + kv_tok)
    else:
        bytes_ = len(seq_lens) * (context + 1) * kv_tok
    floor_ms = max(flops / ctx["peak"], bytes_ / ctx["bandwidth"]) * 1e3
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    cfg = config or attention.pick_config(
        head_dim=HD, group=NQ // NKV, num_seqs=len(seq_lens), num_kv_heads=NKV, max_query_len=max(seq_lens),
        max_kv_len=context + max(seq_lens), dtype=dtype, num_sms=num_sms, interpret=False,
    )
    return {
        "seqs": len(seq_lens),
        "seq_len": seq_lens[0],
        "context": context,
        "heads": f"{NQ} q / {NKV} kv, hd {HD}",
        "page_size": PAGE,
        "dtype": str(dtype).removeprefix("torch."),
        "baseline_ms": baseline_ms,
        "fused_ms": fused_ms,
        "fused_attention_only_ms": attn_only_ms,
        "speedup": baseline_ms / fused_ms,
        "speedup_attention_only": baseline_ms / attn_only_ms,
        "roofline_pct": 100 * floor_ms / fused_ms,
        "baseline_roofline_pct": 100 * floor_ms / baseline_ms,
        "floor_ms": floor_ms,
        "bound": "compute" if flops / ctx["peak"] >= bytes_ / ctx["bandwidth"] else "memory",
        "max_rel_diff_vs_baseline": max_rel_diff,
        "triton_config": vars(cfg),
        "fused_includes": "RoPE(q, k) + KV-cache write + attention"
        + (" with the record's triton_config (sweep)" if config is not None else ""),
        "operand_sets": n_sets,
        **full,
        **graph_times,
    }


# Prefill tilings: (block_m, block_n, warps, stages, prerotate_q, page_prefetch). The first two are
# earlier pick_config choices (3 / 4 stages, no page prefetch; the 32-key tile for sequences over
# 1024 tokens), the third its current choice. Without page_prefetch the K/V
# addresses come from a block-table load in the same loop iteration, and Triton 3.6's pipeliner
# gives such indirect loads about (stages - 2) // 2 tiles of lookahead (5-8 stages were not
# faster); with it the entries are loaded a tile ahead and stages - 1 tiles are in flight.
PREFILL_SWEEP = (
    (128, 64, 8, 3, True, False), (128, 32, 4, 4, True, False), (128, 64, 8, 3, True, True),
    (128, 64, 8, 4, True, True),
)
PREFILL_SWEEP_SHAPES = ([16384], [4096] * 4, [256] * 4, [128] * 4)
# --short-prefill-sweep: batches of short sequences, where the full path (write kernel + attention)
# trailed SDPA. Optional 7th field: more AttentionConfig fields (pdl). On an H200, PDL saves time per
# launch pair and q pre-rotation stays ahead of or ties with the unrotated path; 64-row tiles are
# slower. Records: the "sweep" ones in perf/results/attention.json.
SHORT_PREFILL_SWEEP_SHAPES = ([128] * 4, [256] * 4, [512] * 4, [1024] * 4, [512], [1024], [2048])
SHORT_PREFILL_SWEEP = (
    (128, 64, 8, 3, True, True, {"pdl": False}), (128, 64, 8, 3, True, True),
    (128, 64, 8, 3, False, True, {"pdl": False}), (128, 64, 8, 3, False, True),
    (64, 64, 4, 3, True, True),
)
# Decode tilings, block_m 16: (block_n, warps, stages, num_splits, page_prefetch). 8 x 4096 is the
# layer benchmark's decode case. The first of each is an earlier pick (_attend_tiles, 4
# stages, splits >= 4 tiles long), the second pick_config's current choice (page prefetch, 2 stages,
# ~4 programs per SM).
DECODE_SWEEP = {
    1: ((64, 4, 4, 17, False), (64, 4, 2, 64, True), (32, 4, 3, 64, True), (64, 4, 1, 64, True)),
    8: ((64, 4, 4, 17, False), (64, 4, 2, 33, True), (64, 4, 2, 16, True), (64, 4, 3, 16, True),
        (64, 4, 3, 32, True)),
    16: ((64, 4, 4, 16, False), (64, 4, 2, 16, True), (64, 4, 2, 8, True), (64, 4, 3, 8, True)),
    64: ((64, 4, 4, 4, False), (64, 4, 2, 4, True), (64, 4, 2, 2, True), (64, 4, 3, 2, True), (64, 4, 4, 2, True)),
}


def sweep_cases(kinds: tuple[str, ...] = ("prefill", "decode"), prefill_shapes=PREFILL_SWEEP_SHAPES,
                prefill_tilings=PREFILL_SWEEP) -> list[tuple]:
    """(kind, seq_lens, context, case name, AttentionConfig) of every sweep record of `kinds`, in run order."""
    from fusedpar.kernels.attention import AttentionConfig

    g = NQ // NKV
    cases = []
    for seq_lens in prefill_shapes if "prefill" in kinds else ():
        name = f"prefill {len(seq_lens)}x{seq_lens[0]} sweep"
        for bm, bn, w, s, pre, prefetch, *more in prefill_tilings:
            cfg = AttentionConfig(bm, bn, bm // g, w, s, prerotate_q=pre, page_prefetch=prefetch, **(more or [{}])[0])
            cases.append(("prefill", seq_lens, 0, name, cfg))
    for b, tilings in DECODE_SWEEP.items() if "decode" in kinds else ():
        name = f"decode {b}x{DECODE_CONTEXT} sweep"
        for bn, w, s, splits, loop in tilings:
            # prerotate_q off as pick_config has it for decode (one token per program: tiny prologue).
            cfg = AttentionConfig(16, bn, 1, w, s, splits, page_prefetch=loop)
            cases.append(("decode", [1] * b, DECODE_CONTEXT, name, cfg))
    return cases


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefill-tokens", default=",".join(map(str, PREFILL_TOKENS)))
    p.add_argument("--prefill-seqs", default=",".join(map(str, PREFILL_SEQS)))
    p.add_argument("--decode-batch", default=",".join(map(str, DECODE_BATCH)))
    p.add_argument("--iters", type=int, default=20, help="timed calls per measurement (median taken)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--sweep-kinds", default="prefill,decode",
                   help="which sweeps to run: prefill, decode or both (comma-separated)")
    # Sized for the whole sweep (34 tilings, each compiling its kernels and timing SDPA, attention-only
    # and the full path, decode ones also in graphs: ~200 s expected) with headroom; the cap only
    # guards against a slow machine.
    p.add_argument("--short-prefill-sweep", action="store_true",
                   help="prefill sweep over short prefills (4 x 128 .. 4 x 1024, 1 x 512 .. 1 x 2048) with q "
                        "pre-rotation and PDL on/off and 64-row q tiles, all also timed in CUDA graphs, instead "
                        "of the default sweep shapes and tilings")
    p.add_argument("--sweep-budget-s", type=float, default=300.0, help="stop sweeping after this many seconds")
    p.add_argument("--out", default="perf/results/attention.json")
    args = p.parse_args(argv)
    if args.iters < 20:
        print(f"note: --iters {args.iters} is below the protocol's 20")
    return args


def print_row(record: dict) -> None:
    """One table line of a measured record (the header is printed in main)."""
    c = record["triton_config"]
    warn = "" if record["max_rel_diff_vs_baseline"] < 2e-2 else "  WARNING: results differ"
    full = f" | vs stock RoPE+write+SDPA {record['speedup_full']:.2f}x" if "speedup_full" in record else ""
    if record.get("max_rel_diff_full_vs_stock", 0.0) >= 2e-2:
        full += "  WARNING: stock full path differs"
    print(
        f"{record['bench']:<18}{record['case']:<26}{record['tokens']:>7}{record['baseline_ms']:>10.4f}"
        f"{record['fused_ms']:>10.4f}{record['fused_attention_only_ms']:>10.4f}{record['speedup']:>9.2f}"
        f"{record['roofline_pct']:>6.1f}%  "
        f"m{c['block_m']} n{c['block_n']} q{c['block_q']} w{c['num_warps']} s{c['num_stages']} "
        f"splits{c['num_splits']} prerotate_q={c.get('prerotate_q', False)}"
        f"{' page_prefetch' if c.get('page_prefetch') else ''} pdl={c.get('pdl', False)}{warn}{full}"
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention: no CUDA GPU visible; nothing measured (run this on a GPU machine).")
        return 0
    _bench.add_repo_to_path()
    import triton

    device = torch.device("cuda", torch.cuda.current_device())
    dtype = torch.bfloat16
    props = torch.cuda.get_device_properties(device)
    gpu = torch.cuda.get_device_name(device)
    peak, bandwidth = measure_ceilings(dtype, max(args.iters, 20), device)
    ctx = {"device": device, "dtype": dtype, "time_ms": time_ms, "peak": peak, "bandwidth": bandwidth,
           "l2_bytes": getattr(props, "L2_cache_size", 50 * 2**20)}
    print(
        f"{gpu}: cuBLAS bf16 {peak / 1e12:.0f} TFLOP/s, device copy {bandwidth / 1e9:.0f} GB/s, "
        f"{props.multi_processor_count} SMs; torch {torch.__version__}, triton {triton.__version__}"
    )
    header = (f"{'bench':<18}{'case':<26}{'tokens':>7}{'SDPA ms':>10}{'fused ms':>10}{'attn-only':>10}"
              f"{'speedup':>9}{'%roof':>7}  config")
    print(header)
    print("-" * len(header))
    common = {
        "world": 1, "gpu": gpu, "baseline": BASELINE, **_bench.run_info(python=True),
        "peak_tflops": peak / 1e12, "hbm_gbps": bandwidth / 1e9,
    }

    cases = []
    for total in (int(t) for t in args.prefill_tokens.split(",") if t):
        for nseq in (int(s) for s in args.prefill_seqs.split(",") if s):
            if total % nseq == 0 and total // nseq >= 128:
                cases.append(("prefill", [total // nseq] * nseq, 0, f"prefill {nseq}x{total // nseq}", None))
    for b in (int(x) for x in args.decode_batch.split(",") if x):
        cases.append(("decode", [1] * b, DECODE_CONTEXT, f"decode {b}x{DECODE_CONTEXT}", None))
    if args.sweep:
        kinds = tuple(k for k in args.sweep_kinds.split(",") if k)
        unknown = set(kinds) - {"prefill", "decode"}
        if unknown:
            raise SystemExit(f"bench_attention: --sweep-kinds takes prefill and/or decode, got {sorted(unknown)}")
        if args.short_prefill_sweep:
            cases += sweep_cases(kinds, SHORT_PREFILL_SWEEP_SHAPES, SHORT_PREFILL_SWEEP)
        else:
            cases += sweep_cases(kinds)

    records, sweep_start = [], None
    for kind, seq_lens, context, name, cfg in cases:
        if cfg is not None:
            sweep_start = sweep_start or time.monotonic()
            if time.monotonic() - sweep_start > args.sweep_budget_s:
                print(f"sweep budget of {args.sweep_budget_s:.0f} s spent; skipping the remaining configs")
                break
        record = {**common, "bench": f"attention_{kind}", "case": name, "tokens": sum(seq_lens),
                  "sweep": cfg is not None}
        try:
            record |= bench_case(kind, seq_lens, context, args, ctx, cfg)
        except Exception as exc:
            # Unattended run: one failing shape or tiling (compile error, shared memory, OOM) is
            # recorded with its message and must not lose the other results.
            record |= {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            print(f"{record['bench']:<18}{name:<26}{sum(seq_lens):>7}  ERROR {record['error'][:200]}")
            records.append(record)
            torch.cuda.empty_cache()
            continue
        graph_record = None
        if kind == "decode" or cfg is None or args.short_prefill_sweep:
            record["timing"] = "eager"
            if "graph_error" not in record:
                base_g, fused_g, attn_g = (record["baseline_graph_ms"], record["fused_graph_ms"],
                                           record["fused_attention_only_graph_ms"])
                graph_record = record | {
                    "case": f"{name} graph",
                    "baseline": BASELINE_GRAPH,
                    "baseline_ms": base_g,
                    "fused_ms": fused_g,
                    "fused_attention_only_ms": attn_g,
                    "speedup": record["speedup_graph"],
                    "speedup_attention_only": base_g / attn_g,
                    "roofline_pct": 100 * record["floor_ms"] / fused_g,
                    "baseline_roofline_pct": 100 * record["floor_ms"] / base_g,
                    "timing": "cuda graph",
                }
                if "baseline_full_graph_ms" in record:  # the stock full path, captured likewise
                    graph_record |= {"baseline_full_ms": record["baseline_full_graph_ms"],
                                     "speedup_full": record["speedup_full_graph"]}
        records.append(record)
        print_row(record)
        if "graph_error" in record:
            print(f"{record['bench']:<18}{name + ' graph':<26}{sum(seq_lens):>7}  ERROR {record['graph_error'][:200]}")
        if graph_record is not None:
            records.append(graph_record)
            print_row(graph_record)
        torch.cuda.empty_cache()

    _bench.write_records(records, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
