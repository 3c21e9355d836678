"""Model-level benchmark: TTFT, TPOT and combined throughput of a whole decoder model, plain TP=P vs
plain SP=P vs fusedpar shift (SP=P <-> TP=P), on P GPUs in one run.

    torchrun --nproc-per-node 4 perf/model_bench.py [--model qwen32b] [--layers 64]
        [--prompt 4096] [--decode-steps 64] [--requests 64 --request-prompt 2000 --request-output 250]
        [--max-batch-tokens 8192] [--threshold 1024] [--out perf/results/model.json]

The model: the --model layer shape (perf/shapes.py; qwen32b = Qwen3-32B: hidden 5120, 64 q /
8 kv heads of 128, MLP 25600, q/k-norm, vocab 151936) x --layers, random bf16 weights made on the
GPUs (no checkpoint), a replicated embedding table and a vocab-parallel lm_head (each rank scores
V/P tokens; the greedy token is the max over ranks) - identical in every mode, so only the
decoder stack differs:
  plain TP      layout sp=1, tp=P: cuBLAS GEMMs + NCCL (symm_mem one-shot <= 64 rows), Triton attention; decode
                steps replay CUDA graphs
  plain SP      layout sp=P: Ulysses with cuBLAS + NCCL all-to-all, every step (eager; base mode
                is never captured)
  fusedpar      layout sp=P, StepModeRule(--threshold): base mode on the fused kernels above the
                threshold, shift mode (TP=P over zero-copy views of the same weights) at or below
                it, decode replaying CUDA graphs of the fused shift step
  fusedpar o-a2a  (only when named in --modes) fusedpar with _bench.enable_stack(o_scatter=False): base-mode
                attention into a local buffer, then all_to_all_o_proj, instead of the attention
                storing its rows into the owners' o staging (the A/B of that change; all_modes only)
plain SP and fusedpar share one copy of the SP=P weights; plain TP has its own.

Workloads (each mode, same token ids):
  TTFT        one --prompt-token prompt on an empty cache: prefill + the first greedy token
              (median of --iters, max over ranks)
  TPOT        batch 1: after that prompt, --decode-steps greedy decode steps; wall time per step
              (the host waits for each token, as a serving loop does); also the GPU time of the
              batch-1 decode graph alone (decode_graph_replay_ms in all_modes: the layer stack
              without the step's staging, lm_head and token sync; None for eager modes)
              TTFT and TPOT are measured in --rounds rounds, each round visiting every mode in
              turn, and reported as the median over rounds (per-round values in all_modes): a
              host's speed drifts over a run, and timing each mode once, one after another,
              put that drift into the ratios (a few % of TPOT between runs of the same code)
  throughput  --requests requests of --request-prompt prompt / --request-output output tokens:
              prompts prefilled whole, packed into steps of <= --max-batch-tokens tokens, then
              every request decodes together; (prompt + output tokens) / wall time (after one
              untimed pass of the same prefill steps and a decode step: Triton compiles per shape)
Records (perf/results/model.json, the schema of every benchmark): bench model_ttft / model_tpot /
model_throughput, case "<mode> <model>", baseline plain TP, speedup = plain TP ms / mode ms
(throughput: mode tokens/s / plain TP tokens/s), roofline_pct = the GEMM-FLOP / weight-read floor
of the same work (measured cuBLAS TFLOP/s and HBM bandwidth of this run) over the measured time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench  # the shared torchrun / record helpers
import bench_gemm  # measure_ceilings
import shapes
from bench_layer import MODELS

_bench.add_repo_to_path()


class Model:
    """Embedding (replicated), final norm and vocab-parallel lm_head around one decoder stack."""

    def __init__(self, cfg, vocab: int, rank: int, world: int, device, dtype, seed: int):
        if vocab % world:
            raise ValueError(f"vocab {vocab} must divide over {world} ranks for the vocab-parallel lm_head")
        gen = torch.Generator(device=device).manual_seed(seed)
        d = cfg.hidden_size
        self.cfg, self.world, self.shard = cfg, world, vocab // world
        self.embed = torch.randn((vocab, d), generator=gen, device=device, dtype=dtype)
        self.norm = 1.0 + 0.1 * torch.randn((d,), generator=gen, device=device, dtype=dtype)
        head = torch.randn((vocab, d), generator=gen, device=device, dtype=dtype) / d**0.5
        self.lm_head = head[rank * self.shard:(rank + 1) * self.shard].clone()
        del head

    def greedy(self, h_last: torch.Tensor) -> torch.Tensor:
        """[S, d] final hidden states -> [S] greedy token ids (int64), identical on every rank."""
        import torch.distributed as dist

        from fusedpar.kernels.reference import rms_norm

        logits = torch.nn.functional.linear(rms_norm(h_last, self.norm, self.cfg.rms_norm_eps), self.lm_head)
        best, idx = logits.float().max(dim=-1)
        rank = dist.get_rank()
        packed = torch.stack([best, (idx + rank * self.shard).float()], dim=0)  # ids < 2^24: exact in fp32
        gathered = [torch.empty_like(packed) for _ in range(self.world)]
        dist.all_gather(gathered, packed)
        allv = torch.stack(gathered)  # [P, 2, S]
        winner = allv[:, 0].argmax(dim=0)  # first rank wins ties, the same everywhere
        return allv[winner, 1, torch.arange(allv.shape[2], device=allv.device)].long()


class Engine:
    """One mode: a stack, its cache and the model; step() runs one scheduled batch."""

    def __init__(self, name: str, stack, cache, model: Model):
        self.name, self.stack, self.cache, self.model = name, stack, cache, model
        self._next_id = 0

    def new_ids(self, n: int) -> tuple[int, ...]:
        ids = tuple(range(self._next_id, self._next_id + n))
        self._next_id += n
        return ids

    def step(self, tokens: torch.Tensor, batch, last_rows: torch.Tensor) -> torch.Tensor:
        h = self.stack(self.model.embed[tokens], batch, self.cache)
        return self.model.greedy(h[last_rows])


def sync_barrier() -> None:
    import torch.distributed as dist

    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()


def measure_ttft(engine: Engine, prompt: torch.Tensor, iters: int, warmup: int) -> tuple[float, torch.Tensor]:
    from fusedpar.layers import StepBatch

    n = prompt.numel()
    last = torch.tensor([n - 1], device=prompt.device)
    times, first = [], None
    for i in range(warmup + iters):
        (sid,) = engine.new_ids(1)
        sync_barrier()
        t0 = time.perf_counter()
        tok = engine.step(prompt, StepBatch((sid,), (n,), (0,)), last)
        first = int(tok.item())
        dt = time.perf_counter() - t0
        engine.cache.free(sid)
        if i >= warmup:
            times.append(dt * 1e3)
    return _bench.max_over_ranks(statistics.median(times)), first


def measure_tpot(engine: Engine, prompt: torch.Tensor, steps: int, warmup: int) -> tuple[float, list[int]]:
    from fusedpar.layers import StepBatch

    n = prompt.numel()
    (sid,) = engine.new_ids(1)
    zero = torch.zeros(1, dtype=torch.long, device=prompt.device)
    tok = engine.step(prompt, StepBatch((sid,), (n,), (0,)), torch.tensor([n - 1], device=prompt.device))
    ctx, out = n, []
    for i in range(warmup + steps):
        if i == warmup:
            sync_barrier()
            t0 = time.perf_counter()
        tok = engine.step(tok, StepBatch((sid,), (1,), (ctx,)), zero)
        out.append(int(tok.item()))  # the serving loop waits for the token
        ctx += 1
    dt = (time.perf_counter() - t0) / steps * 1e3
    engine.cache.free(sid)
    return _bench.max_over_ranks(dt), out


def graph_replay_ms(engine: Engine, iters: int = 20) -> float | None:
    """GPU ms of one replay of the batch-1 decode graph (the whole layer stack of a TPOT step)
    alone, max over ranks; TPOT minus this is the step's host work, lm_head and token sync."""
    graphs = engine.stack.graphs
    if graphs is None or 1 not in graphs.sizes:
        return None  # this mode decodes eagerly
    sync_barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graphs.replay_last(1)
    end.record()
    end.synchronize()
    return _bench.max_over_ranks(start.elapsed_time(end) / iters)


def schedule_prefill(num_requests: int, prompt_len: int, max_batch_tokens: int) -> list[list[int]]:
    """Requests packed whole into prefill steps of <= max_batch_tokens tokens (at least one each)."""
    per_step = max(1, max_batch_tokens // prompt_len)
    return [list(range(i, min(i + per_step, num_requests))) for i in range(0, num_requests, per_step)]


def measure_throughput(engine: Engine, prompts: torch.Tensor, output_len: int, max_batch_tokens: int
                       ) -> tuple[float, float, dict[str, int]]:
    """(tokens/s, seconds, steps per mode) of prefilling every prompt then decoding all together."""
    from fusedpar.layers import StepBatch

    num, plen = prompts.shape
    dev = prompts.device
    ids = engine.new_ids(num)
    before = dict(engine.stack.steps)
    sync_barrier()
    t0 = time.perf_counter()
    toks = torch.empty(num, dtype=torch.long, device=dev)
    for group in schedule_prefill(num, plen, max_batch_tokens):
        batch = StepBatch(tuple(ids[r] for r in group), (plen,) * len(group), (0,) * len(group))
        last = torch.arange(1, len(group) + 1, device=dev) * plen - 1
        toks[group[0]:group[-1] + 1] = engine.step(prompts[group[0]:group[-1] + 1].flatten(), batch, last)
    rows = torch.arange(num, device=dev)
    for i in range(output_len - 1):  # the first output token came from the prefill
        toks = engine.step(toks, StepBatch(ids, (1,) * num, (plen + i,) * num), rows)
        toks.tolist()  # the scheduler reads the tokens every step (stop checks)
    seconds = time.perf_counter() - t0
    for s in ids:
        engine.cache.free(s)
    seconds = _bench.max_over_ranks(seconds)
    steps = {m: engine.stack.steps[m] - before[m] for m in before}
    return num * (plen + output_len) / seconds, seconds, steps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="qwen32b", help="layer shape (default qwen32b)")
    p.add_argument("--layers", type=int, default=64, help="decoder layers (default 64, as Qwen3-32B)")
    p.add_argument("--prompt", type=int, default=4096, help="TTFT/TPOT prompt tokens (default 4096)")
    p.add_argument("--decode-steps", type=int, default=64, help="TPOT: timed decode steps (default 64)")
    p.add_argument("--requests", type=int, default=64, help="throughput: requests (default 64)")
    p.add_argument("--request-prompt", type=int, default=2000, help="throughput: prompt tokens each (default 2000)")
    p.add_argument("--request-output", type=int, default=250, help="throughput: output tokens each (default 250)")
    p.add_argument("--max-batch-tokens", type=int, default=8192, help="throughput: prefill step size cap")
    p.add_argument("--threshold", type=int, default=None,
                   help="fusedpar shift threshold (default: fusedpar.layers.step_plan.DEFAULT_SHIFT_THRESHOLD)")
    p.add_argument("--iters", type=int, default=3, help="TTFT repetitions per round (median)")
    p.add_argument("--rounds", type=int, default=5,
                   help="TTFT/TPOT rounds, each visiting every mode in turn; median over rounds (default 5)")
    p.add_argument("--modes", default="plain TP,plain SP,fusedpar", help="comma-separated subset of the modes")
    p.add_argument("--out", default="perf/results/model.json")
    args = p.parse_args()
    if args.rounds < 1 or args.iters < 1 or args.decode_steps < 1:
        p.error(f"--rounds ({args.rounds}), --iters ({args.iters}) and --decode-steps ({args.decode_steps}) "
                f"must be >= 1")
    if not _bench.torchrun_available():
        print("model_bench: needs CUDA GPUs and a torchrun launch; nothing to do")
        return 0
    _, rank, world = _bench.init_distributed()
    from fusedpar import ParallelLayout
    from fusedpar.collectives import ParallelContext
    from fusedpar.layers import (
        DecoderConfig,
        ShardedDecoderWeights,
        ShiftParallelDecoderLayer,
        ShiftParallelStack,
        StepModeRule,
    )
    from fusedpar.layers.step_plan import DEFAULT_SHIFT_THRESHOLD

    dev, dtype = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    cfg = DecoderConfig(**shapes.decoder_config_kwargs(args.model))
    vocab = shapes.shape(args.model).vocab
    threshold = DEFAULT_SHIFT_THRESHOLD if args.threshold is None else args.threshold
    modes = [m.strip() for m in args.modes.split(",")]
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        if rank == 0:
            print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    # ---- weights: one full layer at a time on the GPU, cut into the SP=P and TP=P shards ---------
    from bench_layer import full_weights

    layouts = {"tp": ParallelLayout(world, sp=1, tp=world), "sp": ParallelLayout(world, sp=world, tp=1)}
    ctxs = {k: ParallelContext(v) for k, v in layouts.items()}
    need_tp = any(m.startswith("plain TP") for m in modes)
    need_sp = any(m in ("plain SP", "fusedpar", "fusedpar o-a2a") for m in modes)
    shards: dict[str, list] = {"tp": [], "sp": []}
    for i in range(args.layers):
        full = full_weights(cfg, dev, dtype, seed=1000 + i)
        for key, need in (("tp", need_tp), ("sp", need_sp)):
            if need:
                shards[key].append(ShardedDecoderWeights.from_full(cfg, layouts[key], rank, full))
        del full
        if i % 16 == 15 or i == args.layers - 1:
            log(f"weights: {i + 1}/{args.layers} layers")
    torch.cuda.empty_cache()
    model = Model(cfg, vocab, rank, world, dev, dtype, seed=7)

    decode_batch = args.requests
    max_context = max(args.prompt + args.decode_steps + 8, args.request_prompt + args.request_output + 8)
    tokens_needed = max(args.requests * (args.request_prompt + args.request_output), args.prompt + args.decode_steps)
    block = 16
    num_blocks = tokens_needed // block + args.requests + 64

    def stack_of(key: str, policy, fuse_comm: bool, o_scatter: bool = True):
        layers = [ShiftParallelDecoderLayer(cfg, ctxs[key], w, i) for i, w in enumerate(shards[key])]
        stack = ShiftParallelStack(cfg, ctxs[key], layers, policy)
        return _bench.enable_stack(stack, max_tokens=args.max_batch_tokens, fused=fuse_comm, o_scatter=o_scatter)

    caches = {}

    def cache_of(key: str):
        if key not in caches:
            caches[key] = stacks_any[key].make_cache(block_size=block, num_blocks=num_blocks, dtype=dtype)
        return caches[key]

    engines: dict[str, Engine] = {}
    stacks_any: dict[str, ShiftParallelStack] = {}
    graph_sizes = tuple(sorted({1, decode_batch}))
    if need_tp:
        st = stack_of("tp", StepModeRule(), False)
        stacks_any["tp"] = st
        engines["plain TP"] = Engine("plain TP", st, cache_of("tp"), model)
        st.capture_decode_graphs(cache_of("tp"), max_context=max_context, sizes=graph_sizes)
        log(f"plain TP: decode graphs captured for batch sizes {graph_sizes}")
    if "plain SP" in modes:
        st = stack_of("sp", StepModeRule(0), False)
        stacks_any["sp"] = st
        engines["plain SP"] = Engine("plain SP", st, cache_of("sp"), model)
    for label, o_scatter in (("fusedpar", True), ("fusedpar o-a2a", False)):
        if label not in modes:
            continue
        if decode_batch > threshold:
            raise SystemExit(f"--requests {decode_batch} decodes above the threshold {threshold}: base-mode decode "
                             f"is not captured; raise --threshold")
        st = stack_of("sp", StepModeRule(threshold), True, o_scatter=o_scatter)
        stacks_any["sp"] = st
        engines[label] = Engine(label, st, cache_of("sp"), model)
        st.capture_decode_graphs(cache_of("sp"), max_context=max_context, sizes=graph_sizes)
        log(f"{label}: decode graphs captured for batch sizes {graph_sizes}")
    log(f"memory: {torch.cuda.max_memory_allocated(dev) / 2**30:.1f} GiB peak allocated on rank 0's GPU")

    peak, hbm = bench_gemm.measure_ceilings(dtype, 5, dev)
    layer_params = cfg.hidden_size * (2 * cfg.q_size + 2 * cfg.kv_size) + 3 * cfg.hidden_size * cfg.intermediate_size
    params = args.layers * layer_params

    def floor_ms(tokens: int) -> float:
        """One step of `tokens` tokens: GEMM FLOPs at the measured peak or the weight read at HBM speed, per GPU."""
        return max(2 * tokens * params / world / peak, 2 * params / world / hbm) * 1e3

    gen = torch.Generator(device=dev).manual_seed(11)
    prompt = torch.randint(0, vocab, (args.prompt,), generator=gen, device=dev)
    prompts = torch.randint(0, vocab, (args.requests, args.request_prompt), generator=gen, device=dev)
    results: dict[str, dict[str, float]] = {}
    firsts: dict[str, list[int]] = {}
    for label in engines:
        results[label] = {"ttft_ms_rounds": [], "tpot_ms_rounds": []}
    for rnd in range(args.rounds):
        for label, eng in engines.items():
            r = results[label]
            ttft, first = measure_ttft(eng, prompt, args.iters, warmup=1 if rnd == 0 else 0)
            tpot, toks = measure_tpot(eng, prompt, args.decode_steps, warmup=3)
            r["ttft_ms_rounds"].append(ttft)
            r["tpot_ms_rounds"].append(tpot)
            greedy = [first, *toks[:8]]
            if firsts.setdefault(label, greedy) != greedy:  # same prompt, same weights: same tokens
                raise SystemExit(f"{label}: round {rnd} generated {greedy}, round 0 {firsts[label]}")
        log(f"round {rnd + 1}/{args.rounds}: " + "  ".join(
            f"{k} TTFT {r['ttft_ms_rounds'][-1]:.1f} / TPOT {r['tpot_ms_rounds'][-1]:.3f} ms"
            for k, r in results.items()))
    for label, eng in engines.items():
        r = results[label]
        r["ttft_ms"] = statistics.median(r["ttft_ms_rounds"])
        r["tpot_ms"] = statistics.median(r["tpot_ms_rounds"])
        r["decode_graph_replay_ms"] = graph_replay_ms(eng)
        replay = r["decode_graph_replay_ms"]
        log(f"{label}: TTFT {r['ttft_ms']:.1f} ms, TPOT {r['tpot_ms']:.3f} ms (medians of {args.rounds} rounds)"
            + ("" if replay is None else f"; the batch-1 decode graph alone: {replay:.3f} ms per replay"))
    for label, eng in engines.items():
        r = results[label]
        # warm-up: the same prefill steps and a decode step (Triton compiles per launch shape)
        measure_throughput(eng, prompts, 2, args.max_batch_tokens)
        tps, secs, steps = measure_throughput(eng, prompts, args.request_output, args.max_batch_tokens)
        r["tokens_per_s"], r["throughput_s"] = tps, secs
        r["steps"] = steps
        log(f"{label}: throughput {tps:.0f} tokens/s ({secs:.2f} s; steps {steps}, graph steps "
            f"{eng.stack.graph_steps})")

    if rank == 0:
        print("\nmode                 TTFT ms   TPOT ms   tokens/s   first tokens (greedy, agreement check)")
        for k, r in results.items():
            print(f"{k:20s} {r['ttft_ms']:8.1f} {r['tpot_ms']:9.3f} {r['tokens_per_s']:10.0f}   {firsts.get(k, '')}")
        info = _bench.run_info(world)
        gpu = torch.cuda.get_device_name(dev)
        plan = schedule_prefill(args.requests, args.request_prompt, args.max_batch_tokens)
        thr_floor = (sum(floor_ms(len(g) * args.request_prompt) for g in plan)
                     + (args.request_output - 1) * floor_ms(args.requests))
        records = []
        base = results.get("plain TP")
        total_tokens = args.requests * (args.request_prompt + args.request_output)
        for label in ("plain TP", "plain SP", "fusedpar"):
            if label not in results or base is None:
                continue
            r = results[label]
            common = {"world": world, "gpu": gpu,
                      "baseline": "plain TP (NCCL / symm_mem one-shot all-reduce; decode in CUDA graphs)",
                      **info,
                      "model": args.model, "layers": args.layers, "all_modes": {k: {m: v for m, v in x.items()
                                                                                  if m != "steps"}
                                                                               for k, x in results.items()}}
            records += [
                {"bench": "model_ttft", "case": f"{label} {args.model}", "tokens": args.prompt,
                 "baseline_ms": base["ttft_ms"], "fused_ms": r["ttft_ms"], "speedup": base["ttft_ms"] / r["ttft_ms"],
                 "roofline_pct": 100 * floor_ms(args.prompt) / r["ttft_ms"], **common},
                {"bench": "model_tpot", "case": f"{label} {args.model} batch 1", "tokens": 1,
                 "baseline_ms": base["tpot_ms"], "fused_ms": r["tpot_ms"], "speedup": base["tpot_ms"] / r["tpot_ms"],
                 "roofline_pct": 100 * floor_ms(1) / r["tpot_ms"], **common},
                {"bench": "model_throughput",
                 "case": f"{label} {args.model} {args.requests}x({args.request_prompt}+{args.request_output})",
                 "tokens": total_tokens, "baseline_ms": 1e3 * total_tokens / base["tokens_per_s"],
                 "fused_ms": 1e3 * total_tokens / r["tokens_per_s"],
                 "speedup": r["tokens_per_s"] / base["tokens_per_s"], "tokens_per_s": r["tokens_per_s"],
                 "baseline_tokens_per_s": base["tokens_per_s"],
                 "roofline_pct": 100 * thr_floor / (1e3 * r["throughput_s"]) if "throughput_s" in r else None,
                 **common},
            ]
        _bench.write_records(records, args.out)
    _bench.exit_without_teardown(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
