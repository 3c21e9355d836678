"""One decoder layer per step: fusedpar's fused communication vs plain cuBLAS + NCCL, per mode.

    torchrun --nproc-per-node 4 perf/bench_layer.py [--model llama70b] [--tokens 1,8,64,512,2048,4096,16384]
                                                   [--out perf/results/layer.json]

Modes on P GPUs, all with the same Triton paged attention (so only the communication differs):
  plain TP      sp=1, tp=P: cuBLAS GEMMs + NCCL all-reduces (torch symm_mem one-shot up to 64 rows)
  plain SP      sp=P: cuBLAS + NCCL all-to-all (Ulysses) + NCCL
  fused base    sp=P (or SP=P/--base-tp x TP=--base-tp): qkv_all_to_all, attention storing its rows
                into the owners' o staging (the return all-to-all), cuBLAS o GEMM, gemm_all_reduce
  fused base o-a2a   the same stack with o_scatter=False (prefill sizes; --no-o-scatter-ab skips it):
                attention into a local buffer, then all_to_all_o_proj (routed by size): the A/B of
                the return all-to-all's two plans, records layer_base with case "... o-a2a"
  fused shift   sp=P layout run in shift mode (TP=P over zero-copy views), fused reductions
  fused policy  the StepModeRule's choice at that size (--threshold)
Steps: tokens <= 64 -> decode: that many sequences, one new token each, against --context cached
tokens; larger -> prefill of one sequence of that many tokens. Time = eager step latency: CUDA
events around the whole step after a barrier (host launch cost included, as an eager engine sees
it), median of --iters, max over ranks. Shift-mode prefill sizes (64 < tokens <= --threshold) are also
timed as PrefillGraphs replays, plain TP (NCCL) and fused shift, with the same graph / replay /
replay pipelined records as decode; their layer_shift_policy "replay pipelined (shift)" record takes
the better of plain TP's replays and plain SP's eager layer pipelined (base mode is never captured).
Decode sizes are also timed as CUDA-graph replays
(DecodeGraphs; the time includes the host's input staging): plain TP with NCCL and fused shift;
the layer_shift "decode graph" record compares fused shift with the plain-TP graph; the
"decode replay" record times the graph replay alone (inputs staged once: the layer's GPU time,
which a 64-layer model pays per layer, while the host staging is paid once per step); "decode replay
pipelined" replays it 8 times back to back per sample (per replay): one replay after a barrier carries
the ranks' start skew (the first all-reduce waits for the latest rank), which a model's graph of all
its layers pays once per step, not per layer. Each fused mode's
output is checked against plain SP / plain TP on the same input (max relative difference).
Prefill sizes are also timed as the decoder layer alone (layer_time_ms: the step planned once, then
only layer(x, step, cache) per sample; records case "<model> prefill layer"): what each layer of a
deep model costs, without the per-step planning, metadata upload and base-mode output all-gather
that the "eager" step records charge to this one-layer stack. One call after a barrier still
carries the slowest rank's host launch of the layer's first kernels (the first collective waits
for it); case "<model> prefill layer pipelined" times 8 calls back to back per sample (per call),
as the layers of a deep model run with the host ahead of the GPU.
Records: bench layer_base / layer_shift (speedup vs plain TP) and layer_shift_policy (vs the
better of plain TP and plain SP: for the eager step, and in the steady state, case "... layer
pipelined (<mode>)" for prefill sizes and "... replay pipelined (shift)" for decode sizes),
plus the plain modes' times; roofline_pct against
max(GEMM FLOPs at the cuBLAS TFLOP/s, weight-shard bytes at the HBM bandwidth) measured here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench  # the shared torchrun / record helpers
import bench_gemm  # measure_ceilings: cuBLAS TFLOP/s and HBM bandwidth, this run
import shapes

_bench.add_repo_to_path()

PLAIN = "(cuBLAS + NCCL / symm_mem one-shot, Triton attention)"  # perf/_bench.enable_stack
PLAIN_TP = f"plain TP {PLAIN}"

MODELS = ("llama70b", "qwen30b_a3b_attn", "qwen32b")  # keys of shapes.SHAPES


def full_weights(cfg, device, dtype, seed: int) -> dict[str, torch.Tensor]:
    """Random full weights made on the GPU (same values on every rank: same seed, same generator)."""
    from fusedpar.layers import weight_shapes

    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape in weight_shapes(cfg).items():
        if len(shape) == 1:
            out[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen, device=device, dtype=dtype)
        else:
            out[name] = torch.randn(shape, generator=gen, device=device, dtype=dtype) / shape[1] ** 0.5
    return out


PIPELINED_CALLS = 8  # layer calls per sample of the "layer pipelined" records


def step_time_ms(fn, iters: int, warmup: int, host: list | None = None) -> float:
    """GPU time of fn (CUDA events around it, each sample started on an idle GPU after a barrier):
    median over iters, max over ranks. host: if given, gets the same statistic of the host time
    fn took to return (its launches), appended."""
    import time

    import torch.distributed as dist

    for i in range(warmup):
        fn(i)
    times, host_times = [], []
    for i in range(iters):
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn(warmup + i)
        host_times.append((time.perf_counter() - t0) * 1e3)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    if host is not None:
        host.append(_bench.max_over_ranks(statistics.median(host_times)))
    return _bench.max_over_ranks(statistics.median(times))


def layer_time_ms(stack, cache, x: torch.Tensor, n: int, mode: str | None, iters: int, warmup: int,
                  pipelined_calls: int = PIPELINED_CALLS) -> tuple[float, float, float]:
    """Eager time of the decoder layer alone for a prefill of n tokens: the step is planned once
    (cache slots, attention metadata upload, base-mode row slice) and every sample runs only
    layer(x, step, cache), rewriting the same cache slots. A model pays this per layer; the
    stack's per-step work (planning, host->device metadata copies, the base-mode all-gather of
    the output) once per step, whatever its depth, so the step records (case "... eager")
    charge a one-layer stack all of it.

    Returns (one call, pipelined): one call starts on an idle GPU after a barrier, so the slowest
    rank's host launch of the layer's first kernels is in it (every rank waits for it at the
    first collective); pipelined = `pipelined_calls` calls back to back in one sample, per call,
    which is how the layers of a deep model run (the host launches ahead of the GPU whenever a
    layer's launch cost is below its GPU time, so that skew is paid once per step, not per layer).
    Third: the host time to launch one call in the pipelined samples (max over ranks). Where it
    reaches the pipelined GPU time the layer is host-bound: the GPU waits for the slowest rank's
    Python, and the time says more about the host's CPU than about the kernels."""
    from fusedpar.layers import StepBatch

    sid = -1 - n  # a sequence id of its own, freed below
    step = stack.plan(StepBatch((sid,), (n,), (0,)), cache, mode)
    x = stack.layer_input(x, step)
    layer = stack.layers[0]
    one = step_time_ms(lambda i: layer(x, step, cache), iters, warmup)

    def calls(i):
        for _ in range(pipelined_calls):
            layer(x, step, cache)

    host: list[float] = []
    pipelined = step_time_ms(calls, iters, 1, host) / pipelined_calls
    cache.free(sid)
    return one, pipelined, host[0] / pipelined_calls


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="llama70b")
    p.add_argument("--tokens", default="1,8,64,512,2048,4096,16384")
    p.add_argument("--context", type=int, default=4096, help="cached tokens per sequence in decode steps")
    p.add_argument("--threshold", type=int, default=1024, help="policy: shift mode at or below this many tokens")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--base-tp", type=int, default=1,
                   help="TP degree of the fused modes' base layout (SP = world / base TP; default 1: pure SP). "
                        "E.g. 2 on 8 GPUs: base (SP=4, TP=2) <-> shift TP=8; plain TP / plain SP stay TP=P / SP=P")
    p.add_argument("--no-graphs", dest="graphs", action="store_false",
                   help="skip the CUDA-graph decode runs (plain TP with NCCL, fused shift)")
    p.add_argument("--no-o-scatter-ab", dest="o_scatter_ab", action="store_false",
                   help="skip the fused base stack with o_scatter=False (the previous return all-to-all plan)")
    p.add_argument("--out", default="perf/results/layer.json")
    args = p.parse_args()
    if not _bench.torchrun_available():
        print("bench_layer: needs CUDA GPUs and a torchrun launch; nothing to do")
        return 0
    _, rank, world = _bench.init_distributed()
    if args.base_tp < 1 or world % args.base_tp:
        raise SystemExit(f"--base-tp {args.base_tp} must divide the world size {world}")
    from fusedpar import ParallelLayout
    from fusedpar.collectives import ParallelContext
    from fusedpar.layers import DecoderConfig, ShiftParallelStack, StepBatch, StepModeRule

    dev, dtype = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    cfg = DecoderConfig(**shapes.decoder_config_kwargs(args.model))
    tokens = [int(t) for t in args.tokens.split(",")]
    max_tokens = max(tokens)
    full = full_weights(cfg, dev, dtype, seed=0)
    iters_total = args.warmup + args.iters + 1

    decode_sizes = tuple(t for t in tokens if t <= 64)
    # shift-mode prefill sizes, also timed as PrefillGraphs replays (one fresh sequence per step)
    prefill_graph_sizes = tuple(t for t in tokens if 64 < t <= args.threshold) if args.graphs else ()
    max_context = args.context + 2 * iters_total + 8

    def build(sp: int, tp: int, fuse_comm: bool, weights: dict[str, torch.Tensor], o_scatter=True,
              graphs_ok=True, prefill_graphs_ok=False):
        ctx = ParallelContext(ParallelLayout(world, sp=sp, tp=tp))
        stack = ShiftParallelStack.from_full_weights(cfg, ctx, [weights], StepModeRule(args.threshold))
        _bench.enable_stack(stack, max_tokens=max_tokens, fused=fuse_comm, o_scatter=o_scatter)
        need = max(max([t for t in tokens if t > 64], default=1),
                   max(decode_sizes, default=1) * (max_context + 16))
        cache = stack.make_cache(block_size=16, num_blocks=2 * need // 16 + 64, dtype=dtype)
        graphs = pgraphs = None
        if graphs_ok and decode_sizes and args.graphs and (sp == 1 or max(decode_sizes) <= args.threshold):
            graphs = stack.capture_decode_graphs(cache, max_context=max_context, sizes=decode_sizes)
            stack.graphs = None  # attached only for the graph runs
        if prefill_graphs_ok and prefill_graph_sizes:
            pgraphs = stack.capture_prefill_graphs(cache, max_context=max(prefill_graph_sizes),
                                                   sizes=prefill_graph_sizes, max_seqs=1)
            stack.prefill_graphs = None
        return stack, cache, graphs, pgraphs

    stacks = {"plain TP": build(1, world, False, full, prefill_graphs_ok=True),
              "plain SP": build(world, 1, False, full),
              "fused": build(world // args.base_tp, args.base_tp, True, full, prefill_graphs_ok=True)}
    if args.o_scatter_ab and any(t > 64 for t in tokens):
        stacks["fused o-a2a"] = build(world // args.base_tp, args.base_tp, True, full, o_scatter=False,
                                      graphs_ok=False)
    del full
    torch.cuda.empty_cache()
    peak, hbm = bench_gemm.measure_ceilings(dtype, 10, dev)
    layer_params = (cfg.hidden_size * (2 * cfg.q_size + 2 * cfg.kv_size)
                    + 3 * cfg.hidden_size * cfg.intermediate_size)

    def floor_ms(n: int) -> float:
        """Per GPU: GEMM work at the measured TFLOP/s, or reading the weight shard at HBM speed."""
        return max(2 * n * layer_params / world / peak, 2 * layer_params / world / hbm) * 1e3

    policy = StepModeRule(args.threshold)
    runs = [("plain TP", "plain TP", None), ("plain SP", "plain SP", "base"), ("fused base", "fused", "base"),
            ("fused shift", "fused", "shift"), ("fused policy", "fused", None)]
    gen = torch.Generator(device=dev).manual_seed(1)
    results: dict[int, dict[str, float]] = {}
    diffs: dict[int, dict[str, float]] = {}
    host_ms: dict[int, dict[str, float]] = {}  # per prefill size and mode: host launch ms per pipelined call
    sid = iter(range(10**9))
    graph_runs = [("plain TP graph", "plain TP"), ("fused shift graph", "fused")]
    for n in tokens:
        x = torch.randn((n, cfg.hidden_size), generator=gen, device=dev, dtype=dtype)
        results[n], diffs[n], outs, host_ms[n] = {}, {}, {}, {}
        todo = [(label, key, mode, False) for label, key, mode in runs]
        if n > 64 and "fused o-a2a" in stacks:
            todo.insert(3, ("fused base o-a2a", "fused o-a2a", "base", False))
        if n <= 64 and args.graphs:
            todo += [(label, key, "shift", True) for label, key in graph_runs if key in stacks]
        if n in prefill_graph_sizes:
            todo += [(label, key, "shift", True) for label, key in graph_runs
                     if key in stacks and stacks[key][3] is not None]  # stacks with prefill graphs
        for label, key, mode, use_graph in todo:
            stack, cache, graphs, pgraphs = stacks[key]
            stack.graphs = graphs if use_graph else None
            stack.prefill_graphs = pgraphs if use_graph else None
            if n <= 64:  # decode: n sequences with `context` cached tokens (values irrelevant to timing)
                ids = tuple(next(sid) for _ in range(n))
                cache.begin_step(StepBatch(ids, (args.context,) * n, (0,) * n))

                def fn(i, stack=stack, cache=cache, ids=ids, mode=mode, x=x, n=n):
                    return stack(x, StepBatch(ids, (1,) * n, (args.context + i,) * n), cache, mode=mode)
            else:  # prefill of one fresh sequence per call (freed right after)

                def fn(i, stack=stack, cache=cache, mode=mode, x=x, n=n):
                    s = next(sid)
                    y = stack(x, StepBatch((s,), (n,), (0,)), cache, mode=mode)
                    cache.free(s)
                    return y

            outs[label] = fn(iters_total + 100).float() if n > 64 else None
            graph_before = stack.graph_steps
            results[n][label] = step_time_ms(fn, args.iters, args.warmup)
            if use_graph and stack.graph_steps - graph_before != args.iters + args.warmup:
                raise RuntimeError(f"{label}: {stack.graph_steps - graph_before} of {args.iters + args.warmup} "
                                   f"steps replayed a graph")
            if use_graph:  # the replay alone: the layer's GPU time, host staging excluded
                if n <= 64:
                    st = graphs.stage(x, StepBatch(ids, (1,) * n, (cache.seq_len(ids[0]),) * n))
                else:  # one fresh sequence staged once; freed after the timing
                    ids = (next(sid),)
                    st = pgraphs.stage(x, StepBatch(ids, (n,), (0,)))
                results[n][label.replace("graph", "replay")] = step_time_ms(lambda i, g=st.graph: g.replay(),
                                                                            args.iters, args.warmup)

                def replays(i, g=st.graph):
                    for _ in range(PIPELINED_CALLS):
                        g.replay()

                results[n][label.replace("graph", "replay pipelined")] = step_time_ms(
                    replays, args.iters, 1) / PIPELINED_CALLS
            stack.graphs = stack.prefill_graphs = None
            if n <= 64 or use_graph:
                for s in ids:
                    cache.free(s)
            elif label != "fused policy":  # the decoder layer alone, on a step planned once
                results[n][f"{label} layer"], results[n][f"{label} layer pipelined"], host_ms[n][label] = \
                    layer_time_ms(stack, cache, x, n, mode, args.iters, args.warmup)
        if n > 64:  # fused vs plain on the same input (prefill: fresh cache state, comparable)
            for label, ref in (("fused base", "plain SP"), ("fused shift", "plain TP"), ("fused policy", "plain SP"),
                               ("fused base o-a2a", "plain SP"),
                               ("fused shift graph", "plain TP"),
                               ("plain TP graph", "plain TP")):
                if label not in outs:
                    continue
                d = (outs[label] - outs[ref]).abs().max() / outs[ref].abs().max()
                diffs[n][label] = d.item()
        if rank == 0:
            row = "  ".join(f"{k} {v:.3f}" for k, v in results[n].items())
            print(f"{args.model} tokens {n:6d}: {row} (ms){'  diffs ' + str(diffs[n]) if diffs[n] else ''}",
                  flush=True)
            if host_ms[n]:
                bound = {k: v >= 0.9 * results[n][f"{k} layer pipelined"] for k, v in host_ms[n].items()}
                print(f"{args.model} tokens {n:6d}: host launch ms per pipelined layer call: "
                      + "  ".join(f"{k} {v:.3f}{' (host-bound)' if bound[k] else ''}" for k, v in host_ms[n].items()),
                      flush=True)

    if rank == 0:
        info = _bench.run_info(world)
        records = []
        for n, r in results.items():
            best_plain = min(r["plain TP"], r["plain SP"])
            runs_here = [
                ("layer_base", "fused base", PLAIN_TP, r["plain TP"], "eager"),
                ("layer_shift", "fused shift", PLAIN_TP, r["plain TP"], "eager"),
                ("layer_shift_policy", "fused policy", "better of plain TP and plain SP", best_plain, "eager"),
                ("layer_plain_sp", "plain SP", PLAIN_TP, r["plain TP"], "eager"),
            ]
            if "plain TP layer" in r:  # prefill: the layer alone (layer_time_ms)
                runs_here += [
                    ("layer_base", "fused base layer", f"plain TP layer {PLAIN}",
                     r["plain TP layer"], "layer"),
                    ("layer_shift", "fused shift layer", f"plain TP layer {PLAIN}",
                     r["plain TP layer"], "layer"),
                    ("layer_plain_sp", "plain SP layer", f"plain TP layer {PLAIN}",
                     r["plain TP layer"], "layer"),
                ]
                if "fused base o-a2a layer" in r:  # the A/B of the return all-to-all's plans
                    runs_here += [
                        ("layer_base", f"fused base o-a2a{kind}", f"plain TP{kind} {PLAIN}",
                         r[f"plain TP{kind}"], f"{kind.strip() or 'eager'} o-a2a")
                        for kind in ("", " layer", " layer pipelined")
                    ]
                pipe = f"plain TP layer pipelined ({PIPELINED_CALLS} calls back to back, per call)"
                runs_here += [
                    ("layer_base", "fused base layer pipelined", pipe, r["plain TP layer pipelined"],
                     "layer pipelined"),
                    ("layer_shift", "fused shift layer pipelined", pipe, r["plain TP layer pipelined"],
                     "layer pipelined"),
                    ("layer_plain_sp", "plain SP layer pipelined", pipe, r["plain TP layer pipelined"],
                     "layer pipelined"),
                ]
            for kind in ("graph", "replay", "replay pipelined"):
                if f"fused shift {kind}" in r and f"plain TP {kind}" in r:
                    runs_here.append(("layer_shift", f"fused shift {kind}",
                                      f"plain TP in a CUDA graph ({kind}), NCCL / symm_mem one-shot all-reduce",
                                      r[f"plain TP {kind}"], kind))
            # The policy in the steady state of a deep model: its mode's per-layer time against the
            # faster plain mode's, measured the same way (the "eager" policy record above charges a
            # one-layer stack the whole step's host work, which swings widely between samples).
            policy_mode = policy.mode(n, world // args.base_tp)
            if "plain TP layer pipelined" in r:
                runs_here.append((
                    "layer_shift_policy", f"fused {policy_mode} layer pipelined",
                    f"better of plain TP and plain SP, layer pipelined ({PIPELINED_CALLS} calls back to back, "
                    "per call)", min(r["plain TP layer pipelined"], r["plain SP layer pipelined"]),
                    f"layer pipelined ({policy_mode})"))
            stock = [r[k] for k in ("plain TP replay pipelined",) if k in r]
            if policy_mode == "shift" and "fused shift replay pipelined" in r and stock and n <= 64:
                runs_here.append((
                    "layer_shift_policy", "fused shift replay pipelined",
                    f"better of plain TP and plain SP: plain TP in a CUDA graph, {PIPELINED_CALLS} replays back to "
                    "back, NCCL all-reduce (plain SP reads every weight on every rank: "
                    "slower at decode sizes, see the eager records)", min(stock), "replay pipelined (shift)"))
            elif policy_mode == "shift" and "fused shift replay pipelined" in r and stock:
                # shift-mode prefill in PrefillGraphs; plain SP's base mode is not captured, so its
                # steady state is its eager layer pipelined
                runs_here.append((
                    "layer_shift_policy", "fused shift replay pipelined",
                    f"better of plain TP in a CUDA graph ({PIPELINED_CALLS} replays back to back, NCCL) and plain SP "
                    f"layer pipelined (eager: base mode is not captured)",
                    min(*stock, r["plain SP layer pipelined"]), "replay pipelined (shift)"))
            for bench, label, base_label, base_ms, kind in runs_here:
                records.append({
                    "bench": bench, "case": f"{args.model} {'decode' if n <= 64 else 'prefill'} {kind}", "tokens": n,
                    "world": world, "gpu": torch.cuda.get_device_name(dev), "baseline": base_label,
                    "baseline_ms": base_ms, "fused_ms": r[label], "speedup": base_ms / r[label],
                    "roofline_pct": 100 * floor_ms(n) / r[label], "floor_ms": floor_ms(n),
                    "max_rel_diff_vs_plain": diffs[n].get(label),
                    "fused_base_layout": f"SP={world // args.base_tp} x TP={args.base_tp}",
                    "all_modes_ms": r, **info,
                })
                if "pipelined" in kind and "replay" not in kind:
                    # host launch time per call of both sides; host-bound: the GPU waited for the host
                    fused_mode = label.replace(" layer pipelined", "")
                    base_modes = [m for m in ("plain TP", "plain SP") if base_label.startswith(m)] or \
                        ["plain TP", "plain SP"]
                    hosts = {m: host_ms[n][m] for m in [fused_mode, *base_modes] if m in host_ms[n]}
                    records[-1]["host_ms_per_call"] = hosts
                    records[-1]["host_bound"] = any(
                        v >= 0.9 * r[f"{m} layer pipelined"] for m, v in hosts.items())
        _bench.write_records(records, args.out)
    _bench.exit_without_teardown(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
