"""Benchmark: one tensor-parallel rank's decode step on one GPU, against plain vLLM TP=1 on the same shard
shape and the weight + KV read floor.

    torchrun --standalone --nproc-per-node 1 perf/bench_decode.py [--shapes qwen32b:4,qwen32b:8,llama70b:4,llama70b:8]
        [--batches 1,8,32,64] [--contexts 1024,8192] [--layers N] [--cases fused,plain,vllm] [--steps 32]
        [--out perf/results/decode.json]

A TP=T rank's decode step is a one-GPU step on the rank's shard (shapes.rank_shape: q heads, kv heads,
MLP and vocabulary split T ways, every layer) plus two all-reduces per layer; this times the first.
Each --shapes entry MODEL:T is such a shard, run as a model of its own (random bf16 weights, no
checkpoint), with --batches sequences of each --contexts tokens already cached:
  fused   fusedpar's shift-mode stack on the fused path (FusedComm), decode steps replaying its CUDA
          graphs (fusedpar.layers.graphs.DecodeGraphs)
  plain   the same stack and graphs with PlainComm: cuBLAS GEMMs around the same Triton attention and norms
  vllm    plain vLLM, tensor_parallel_size=1, on a config of the same shard (load_format "dummy", its
          compiled model and CUDA graphs), in a process of its own: the baseline a user would pick
Time per step: fusedpar, wall time per step of a serving loop (the stack, the final norm, the lm_head
shard and a greedy argmax whose tokens the host waits for, fed back as the next input), mean over
--steps after warm-up steps, and the GPU time of one graph replay of the stack alone (graph_ms);
vLLM, the steady time per output token of the batch (bench_vllm.steady_tpot: the window where every
request decodes, after vLLM's chunked prefill of the prompts), median of the requests, second of two rounds.
Floor: the bytes a step must read (the decoder weights, the lm_head shard, the batch's cached K and V)
at the bandwidth of a 1 GiB device copy measured in this run. A batch whose KV does not fit beside the
weights on this GPU is left out (printed), for every case alike.

Records (perf/results/decode.json): bench decode, case "<fused|plain> <shard> ctx <C>", tokens = batch,
world 1, baseline plain vLLM TP=1 on the shard, speedup = vLLM ms / fusedpar ms, roofline_pct =
100 * floor / fusedpar ms (baseline_roofline_pct: vLLM's), graph_ms, floor_ms, gpu, commit.
The vllm case needs vLLM installed (docs/vllm.md: the wheel bundle); without it --cases must leave it out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench
import shapes

CASES = ("fused", "plain", "vllm")
BLOCK = 16
MAX_BATCH_TOKENS = 8192  # vLLM's chunked-prefill step
KV_MARGIN = 4 << 30  # bytes left free beside the weights and the KV (activations, graphs, workspaces)
WARMUP_STEPS = 3


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qwen32b:4,qwen32b:8,llama70b:4,llama70b:8",
                   help="comma-separated MODEL:TP (MODEL a key of perf/shapes.py; the TP rank's shard is timed)")
    p.add_argument("--batches", default="1,8,32,64", help="sequences per decode step, comma-separated")
    p.add_argument("--contexts", default="1024,8192", help="cached tokens per sequence, comma-separated")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {CASES}")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per batch (default 32)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.88, help="vLLM's share of the GPU memory")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for one vLLM engine's process")
    p.add_argument("--profile", action="store_true",
                   help="print the kernels of fusedpar's graph replay at the first batch and context (torch profiler)")
    p.add_argument("--out", default="perf/results/decode.json")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = sorted(set(args.cases) - set(CASES))
    problems = [f"unknown cases {bad} (known: {', '.join(CASES)})"] if bad else []
    try:
        args.batches = sorted({int(x) for x in args.batches.split(",")})
        args.contexts = sorted({int(x) for x in args.contexts.split(",")})
    except ValueError:
        problems.append(f"--batches ({args.batches!r}) and --contexts ({args.contexts!r}) take comma-separated ints")
    else:
        if min(args.batches) < 1 or min(args.contexts) < 1:
            problems.append(f"--batches {args.batches} and --contexts {args.contexts} must be >= 1")
    if args.steps < 1:
        problems.append(f"--steps must be >= 1, got {args.steps}")
    args.shape_list = []
    for entry in args.shapes.split(","):
        model, _, tp = entry.strip().partition(":")
        try:
            shapes.rank_shape(model, int(tp or 1))
            args.shape_list.append((model, int(tp or 1)))
        except ValueError as e:
            problems.append(f"--shapes {entry!r}: {e}")
    if args.layers is not None and args.layers < 1:
        problems.append(f"--layers must be >= 1, got {args.layers}")
    if problems:
        p.error("; ".join(problems))
    return args


# ---------------------------------------------------------------------------------------- the floor
def kv_bytes_per_token(s: shapes.ModelShape, layers: int, itemsize: int = 2) -> int:
    return 2 * layers * s.kv_heads * s.head_dim * itemsize


def step_bytes(s: shapes.ModelShape, layers: int, batch: int, context: int, itemsize: int = 2) -> int:
    """What one decode step must read: every decoder weight, the lm_head shard, the batch's cached K and V."""
    d = s.hidden
    per_layer = d * (s.q_size + 2 * s.kv_size) + s.q_size * d + 3 * d * s.intermediate
    return itemsize * (layers * per_layer + s.vocab * d) + batch * context * kv_bytes_per_token(s, layers, itemsize)


def weight_bytes(s: shapes.ModelShape, layers: int, itemsize: int = 2) -> int:
    """Decoder weights, embedding and lm_head shard."""
    return step_bytes(s, layers, 0, 0, itemsize) + itemsize * s.vocab * s.hidden


def fitting(s: shapes.ModelShape, layers: int, batches: list[int], contexts: list[int], steps: int,
            memory: float) -> tuple[list[tuple[int, int]], list[str]]:
    """The (context, batch) pairs whose KV fits `memory` bytes (vLLM's share of the GPU) beside the weights,
    and a line per pair left out."""
    room = memory - weight_bytes(s, layers) - KV_MARGIN
    keep, left = [], []
    for c in contexts:
        for b in batches:
            need = b * (c + steps + WARMUP_STEPS + 2 * BLOCK) * kv_bytes_per_token(s, layers)
            if need <= room:
                keep.append((c, b))
            else:
                left.append(f"{s.name} ctx {c} batch {b}: KV {need / 2**30:.1f} GiB, {max(room, 0) / 2**30:.1f} GiB "
                            f"beside the weights")
    return keep, left


# ---------------------------------------------------------------------------------------- fusedpar
def fusedpar_case(kind: str, model: str, tp: int, args, pairs: list[tuple[int, int]]) -> dict:
    """{(context, batch): (step_ms, graph_ms)} of one stack on this GPU (fused or plain communicator)."""
    import torch
    import torch.nn.functional as F
    from bench_layer import full_weights

    from fusedpar import ParallelLayout
    from fusedpar.collectives import ParallelContext
    from fusedpar.kernels.reference import rms_norm
    from fusedpar.layers import (
        DecoderConfig,
        ShardedDecoderWeights,
        ShiftParallelDecoderLayer,
        ShiftParallelStack,
        StepBatch,
        StepModeRule,
    )

    s = shapes.rank_shape(model, tp)
    layers = args.layers or s.layers
    dev, dtype = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    cfg = DecoderConfig(**shapes.decoder_config_kwargs(s))
    layout = ParallelLayout(1)
    ctx = ParallelContext(layout)
    stack_layers = []
    for i in range(layers):
        w = ShardedDecoderWeights.from_full(cfg, layout, 0, full_weights(cfg, dev, dtype, seed=1000 + i))
        stack_layers.append(ShiftParallelDecoderLayer(cfg, ctx, w, i))
    stack = _bench.enable_stack(ShiftParallelStack(cfg, ctx, stack_layers, StepModeRule()),
                                max_tokens=max(args.batches), fused=kind == "fused")
    gen = torch.Generator(device=dev).manual_seed(7)
    embed = torch.randn((s.vocab, s.hidden), generator=gen, device=dev, dtype=dtype)
    norm = 1.0 + 0.1 * torch.randn((s.hidden,), generator=gen, device=dev, dtype=dtype)
    lm_head = torch.randn((s.vocab, s.hidden), generator=gen, device=dev, dtype=dtype) / s.hidden ** 0.5
    extra = args.steps + WARMUP_STEPS + 1
    blocks = max(-(-b * (c + extra) // BLOCK) + b for c, b in pairs) + 4
    cache = stack.make_cache(block_size=BLOCK, num_blocks=blocks, dtype=dtype)
    sizes = tuple(sorted({b for _, b in pairs}))
    stack.capture_decode_graphs(cache, max_context=max(c for c, _ in pairs) + extra + 1, sizes=sizes)
    out = {}
    for c, b in pairs:
        ids = tuple(range(b))
        cache.reserve(StepBatch(ids, (c,) * b, (0,) * b))  # c cached tokens each (their values do not matter)
        tok = torch.randint(0, s.vocab, (b,), generator=gen, device=dev)
        ctx_len = c
        for i in range(WARMUP_STEPS + args.steps):
            if i == WARMUP_STEPS:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            h = stack(embed[tok], StepBatch(ids, (1,) * b, (ctx_len,) * b), cache)
            tok = torch.argmax(F.linear(rms_norm(h, norm, cfg.rms_norm_eps), lm_head).float(), dim=-1)
            tok.cpu()  # the serving loop waits for the tokens
            ctx_len += 1
        step_ms = (time.perf_counter() - t0) / args.steps * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            stack.graphs.replay_last(b)
        end.record()
        end.synchronize()
        out[(c, b)] = (step_ms, start.elapsed_time(end) / 10)
        if args.profile and (c, b) == pairs[0]:
            print_kernels(functools.partial(stack.graphs.replay_last, b), f"{kind} {s.name} ctx {c} batch {b}", 5)
        for sid in ids:
            cache.free(sid)
        print(f"   {kind:5s} {s.name} ctx {c:5d} batch {b:3d}: step {step_ms:7.3f} ms, graph {out[(c, b)][1]:7.3f} ms",
              flush=True)
    stack.graphs = None
    del stack, cache, stack_layers
    ctx.close()
    torch.cuda.empty_cache()
    return out


def print_kernels(fn, title: str, reps: int) -> None:
    """The GPU kernels of `reps` calls of fn, by total time (torch profiler), per call."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t, n = rows.get(e.name, (0.0, 0))
            rows[e.name] = (t + e.device_time / reps, n + 1)
    total = sum(t for t, _ in rows.values())
    print(f"   kernels of {title}: {total / 1e3:.3f} ms in {sum(n for _, n in rows.values()) // reps} launches")
    for name, (t, n) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:20]:
        print(f"   {t / 1e3:8.3f} ms {n // reps:5d}x  {t / max(1, n // reps):8.1f} us  {name[:110]}")


# ---------------------------------------------------------------------------------------- vLLM
async def _vllm_engine(spec: dict) -> dict:
    from bench_vllm import _request, steady_tpot
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    t0 = time.perf_counter()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=spec["model_dir"], tensor_parallel_size=1, load_format="dummy", dtype="bfloat16",
        skip_tokenizer_init=True, max_model_len=spec["max_model_len"], enable_prefix_caching=False, seed=0,
        gpu_memory_utilization=spec["gpu_memory_utilization"], max_num_batched_tokens=MAX_BATCH_TOKENS,
        max_num_seqs=spec["max_seqs"]))
    print(f"   vllm  engine ready in {time.perf_counter() - t0:.0f} s", flush=True)
    rng = random.Random(0)
    seq = iter(range(10**9))
    res = {}
    try:
        for c, b in spec["pairs"]:
            out_tokens = spec["steps"] + 8 + -(-b * c // MAX_BATCH_TOKENS)  # decodes beside the later prefills
            rounds = []
            for _ in range(2):  # the first warms up
                outs = await asyncio.gather(*[
                    _request(engine, [rng.randrange(10, spec["vocab"]) for _ in range(c)], out_tokens, f"r{next(seq)}")
                    for _ in range(b)])
                rounds.append(steady_tpot(outs))
            res[f"{c},{b}"] = None if rounds[-1] is None else 1e3 * rounds[-1]
            print(f"   vllm  ctx {c:5d} batch {b:3d}: {res[f'{c},{b}']} ms per token", flush=True)
    finally:
        engine.shutdown()
    return res


def vllm_case(model: str, tp: int, args, pairs: list[tuple[int, int]], work: Path) -> dict:
    """{(context, batch): ms per output token} of plain vLLM TP=1 on the shard, run in a child process."""
    from bench_vllm import write_model_dir

    model_dir = work / f"{model}_tp{tp}"
    write_model_dir(model, args.layers, model_dir, tp=tp)
    spec = {"model_dir": str(model_dir), "pairs": pairs, "steps": args.steps,
            "vocab": shapes.rank_shape(model, tp).vocab,
            "max_model_len": max(c for c, _ in pairs) + args.steps + 128, "max_seqs": max(b for _, b in pairs),
            "gpu_memory_utilization": args.gpu_memory_utilization}
    spec_path = work / f"{model}_tp{tp}.json"
    spec_path.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items()  # the child is a one-GPU vLLM process, not a torchrun rank
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")}
    env.setdefault("VLLM_HOST_IP", "127.0.0.1")  # its one-process group needs no routable address
    log = Path(args.out).with_name(f"{Path(args.out).stem}_vllm_{model}_tp{tp}.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"   vllm  engine log: {log}", flush=True)
    t0 = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, __file__, "--child", str(spec_path)], stdout=f,
                                stderr=subprocess.STDOUT, text=True, env=env)
        seen = 0
        while True:  # the log is read as it grows, so a silent engine cannot outlast --timeout
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=2.0)
            lines = log.read_text(errors="replace").splitlines(keepends=True)
            for line in lines[seen:]:
                if line.startswith(("RESULT:", "   vllm")) or "Error" in line:
                    print(f"   [vllm {time.perf_counter() - t0:5.0f}s] {line.rstrip()[:300]}", flush=True)
            seen = len(lines)
            if proc.poll() is not None:
                break
            if time.perf_counter() - t0 > args.timeout:
                print(f"   vllm  no result within --timeout {args.timeout:.0f} s: stopped", flush=True)
                proc.kill()
                proc.wait()
                break
    found = [x for x in lines if x.startswith("RESULT:")]
    if not found:
        print("".join(lines[-40:]), flush=True)
        raise SystemExit(f"the vLLM engine for {model}:{tp} exited with {proc.returncode} and no result")
    return {tuple(int(v) for v in k.split(",")): ms for k, ms in json.loads(found[-1][len("RESULT:"):]).items()}


def child_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    spec["pairs"] = [tuple(p) for p in spec["pairs"]]
    result = asyncio.run(_vllm_engine(spec))
    print("RESULT:" + json.dumps(result), flush=True)
    os._exit(0)  # engine teardown threads must not hold the process


# ---------------------------------------------------------------------------------------- driver
def records(model: str, tp: int, args, hbm: float, results: dict, info: dict) -> list[dict]:
    s = shapes.rank_shape(model, tp)
    layers = args.layers or s.layers
    base = results.get("vllm", {})
    out = []
    for kind in ("fused", "plain"):
        for (c, b), (step_ms, graph_ms) in sorted(results.get(kind, {}).items()):
            floor = step_bytes(s, layers, b, c) / hbm * 1e3
            vllm_ms = base.get((c, b))
            if vllm_ms is None:
                print(f"   no vLLM time for {s.name} ctx {c} batch {b}: no record", flush=True)
                continue
            out.append({**info, "bench": "decode", "case": f"{kind} {model} TP={tp} rank ctx {c}", "tokens": b,
                        "world": 1, "baseline": "plain vLLM TP=1 on the rank's shard", "baseline_ms": vllm_ms,
                        "fused_ms": step_ms, "speedup": vllm_ms / step_ms, "roofline_pct": 100 * floor / step_ms,
                        "baseline_roofline_pct": 100 * floor / vllm_ms, "graph_ms": graph_ms, "floor_ms": floor,
                        "context": c, "layers": layers})
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child_main(args.child)
        return 0
    if not _bench.torchrun_available():
        print("bench_decode: needs a CUDA GPU and a torchrun launch (--nproc-per-node 1); nothing to do")
        return 0
    _bench.add_repo_to_path()
    import bench_gemm
    import torch

    _, _, world = _bench.init_distributed()
    if world != 1:
        raise SystemExit(f"bench_decode times one rank's shard on one GPU: launch it with --nproc-per-node 1, "
                         f"not {world}")
    dev = torch.device("cuda", torch.cuda.current_device())
    _, hbm = bench_gemm.measure_ceilings(torch.bfloat16, 5, dev)
    total = torch.cuda.get_device_properties(dev).total_memory
    info = {**_bench.run_info(1), "gpu": torch.cuda.get_device_name(dev), "copy_gbps": hbm / 1e9}
    print(f"{info['gpu']}: device copy {hbm / 1e9:.0f} GB/s; shapes {args.shapes}; cases {','.join(args.cases)}",
          flush=True)
    out: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for model, tp in args.shape_list:
            s = shapes.rank_shape(model, tp)
            layers = args.layers or s.layers
            pairs, left = fitting(s, layers, args.batches, args.contexts, args.steps,
                                  args.gpu_memory_utilization * total)
            for line in left:
                print(f"   left out: {line}", flush=True)
            if not pairs:
                continue
            print(f"== {s.name}: {layers} layers, {weight_bytes(s, layers) / 2**30:.1f} GiB of weights", flush=True)
            results = {}
            if "vllm" in args.cases:  # first: its engine takes its share of a GPU nothing else holds yet
                results["vllm"] = vllm_case(model, tp, args, pairs, Path(tmp))
            for kind in ("fused", "plain"):
                if kind in args.cases:
                    results[kind] = fusedpar_case(kind, model, tp, args, pairs)
            out += records(model, tp, args, hbm, results, info)
    if out:
        _bench.write_records(out, args.out)
    _bench.exit_without_teardown(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
