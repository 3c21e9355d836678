"""Plain vLLM (TP=P) vs vLLM with fusedpar (SP <-> TP=P) on vLLM's own engine API, dummy weights.

    python perf/bench_vllm.py --world 4 [--sp 4] [--shape qwen32b] [--layers N] [--threshold T]
        [--benches ttft,tpot,throughput,online] [--cases plain,fusedpar] [--out perf/results/vllm.json]

Each case runs one engine (vllm.v1 AsyncLLM, load_format "dummy", bf16, prefix caching off,
max_num_batched_tokens --max-batch-tokens, vLLM's CUDA graphs captured up to --capture-size tokens
on every side) in a process of its own, on the same GPUs, one after the other; the same token ids everywhere.
  plain     vLLM with tensor_parallel_size=P (its compiled model, CUDA graphs, custom all-reduce)
  fusedpar  the same engine with additional_config {"fusedpar": {"sequence_parallel_size": SP,
            "shift_threshold": T}} (no threshold: fusedpar's default for P): steps above T tokens run
            base SP x TP=P/SP, the others vLLM's own TP=P path
  arctic    (only when named in --cases) Arctic Inference's shift parallelism on the same vLLM:
            ulysses_sequence_parallel_size SP x tensor_parallel_size P/SP, enable_shift_parallel,
            shift_parallel_threshold T; arctic_inference installed in --arctic-site (put on the path
            of this case alone, the only vLLM plugin it loads)
Workloads (time from submitting a request to its outputs, as a client sees it):
  ttft        one prompt of each --ttft-prompts length (default 4096), 1 output token: median of
              --iters after 3 warm-up requests (a sweep shows where base mode starts to win)
  tpot        batch 1 and 32 of 512-token prompts, 128 output tokens each, in the steady window where
              every request of the batch decodes (after the last first token, before the first
              finish: no prefill step inside): per request the window's time over its tokens in it,
              median over requests and --rounds rounds (the first warms up); also tpot_b<B>_request_ms,
              per request (finish - first token) / 127, which includes the batch's later prefill steps
  throughput  64 requests of 2000 prompt + 250 output tokens submitted at once: (prompt + output) / wall
  online      Poisson arrivals alternating low load (2-5 req/s) and bursts (10-30 req/s) for
              --online-seconds, prompts 100-2000 and outputs 50-250 tokens (uniform, seeded):
              p50 / p99 TTFT and TPOT, overall and per phase
Records (perf/results/vllm.json): bench vllm_<workload>, case "fusedpar SP=<sp> <shape>", baseline
plain vLLM TP=P, speedup = plain time / fusedpar time (throughput: of the fixed workload; online: p99
TTFT), roofline_pct = the GEMM-FLOP / weight-read floor of the work (cuBLAS TFLOP/s and HBM bandwidth
measured on GPU 0 before the engines start) over fusedpar's time; world, gpu, vllm version, commit.
The GPU side needs vLLM installed (the `vllm` extra, or the wheel bundle docs/vllm.md describes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

BENCHES = ("ttft", "tpot", "throughput", "online")
TTFT_PROMPT = 4096
TPOT_PROMPT, TPOT_OUTPUT, TPOT_BATCHES = 512, 128, (1, 32)
THR_REQUESTS, THR_PROMPT, THR_OUTPUT = 64, 2000, 250
ONLINE_LOW, ONLINE_BURST = (2.0, 5.0), (10.0, 30.0)
ONLINE_PROMPT, ONLINE_OUTPUT = (100, 2000), (50, 250)
ARCHITECTURE = {"qwen32b": "Qwen3ForCausalLM", "llama70b": "LlamaForCausalLM", "llama8b": "LlamaForCausalLM"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, required=True, help="GPUs = vLLM tensor_parallel_size P")
    p.add_argument("--sp", type=int, default=None, help="fusedpar's sequence_parallel_size (default: P)")
    p.add_argument("--shape", default="qwen32b", choices=sorted(ARCHITECTURE), help="model shape (perf/shapes.py)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's)")
    p.add_argument("--threshold", type=int, default=None,
                   help="shift threshold of fusedpar and arctic (default: fusedpar's default for --world)")
    p.add_argument("--capture-size", type=int, default=512,
                   help="vLLM's max_cudagraph_capture_size on every side (vLLM's default: 512)")
    p.add_argument("--max-batch-tokens", type=int, default=8192, help="vLLM max_num_batched_tokens")
    p.add_argument("--benches", default=",".join(BENCHES), help=f"comma-separated subset of {BENCHES}")
    p.add_argument("--cases", default="plain,fusedpar", help="comma-separated: plain, fusedpar, arctic")
    p.add_argument("--arctic-site", default=None, metavar="DIR",
                   help="a directory holding an installed arctic_inference (for the arctic case)")
    p.add_argument("--iters", type=int, default=7, help="ttft: timed requests")
    p.add_argument("--ttft-prompts", default=str(TTFT_PROMPT), help="ttft: comma-separated prompt lengths")
    p.add_argument("--rounds", type=int, default=3, help="tpot: rounds")
    p.add_argument("--online-seconds", type=float, default=40.0, help="online: seconds of arrivals")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--timeout", type=float, default=560.0, help="seconds for each engine process")
    p.add_argument("--out", default=None, help="records JSON (default: print only)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="ttft: also profile one request per case with vLLM's torch profiler; rank 0's table of "
                        "kernel times goes to DIR/<case>_profiler_out_0.txt (no records are written)")
    p.add_argument("--logs", default=None, metavar="DIR", help="write each engine's whole output to DIR/<case>.log")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.sp = args.sp or args.world
    args.threshold_given = args.threshold is not None
    if args.threshold is None:
        from fusedpar.integrations.vllm.config import default_shift_threshold

        # SP = P, bf16: base steps run as graphs (with SP < P they run eagerly)
        args.threshold = default_shift_threshold(args.world, base_graphs=args.sp == args.world,
                                                 capture_size=args.capture_size)
    bad = []
    try:
        args.ttft_prompt_list = [int(x) for x in args.ttft_prompts.split(",")]
    except ValueError:
        args.ttft_prompt_list = []
    if not args.ttft_prompt_list or min(args.ttft_prompt_list) < 1:
        bad.append(f"--ttft-prompts {args.ttft_prompts!r}: comma-separated positive token counts")
    elif max(args.ttft_prompt_list) > args.max_batch_tokens:
        bad.append(f"--ttft-prompts up to {max(args.ttft_prompt_list)} tokens exceed --max-batch-tokens "
                   f"{args.max_batch_tokens} (a TTFT prompt is one step)")
    if args.world < 2 or args.world % args.sp:
        bad.append(f"--sp {args.sp} must divide --world {args.world} (>= 2)")
    unknown = sorted(set(args.benches.split(",")) - set(BENCHES))
    if unknown:
        bad.append(f"unknown benches {unknown} (known: {list(BENCHES)})")
    cases = args.cases.split(",")
    if sorted(set(cases) - {"plain", "fusedpar", "arctic"}):
        bad.append(f"--cases {args.cases!r}: plain, fusedpar and/or arctic")
    if "arctic" in cases and not (args.arctic_site and Path(args.arctic_site, "arctic_inference").is_dir()):
        bad.append(f"the arctic case needs --arctic-site DIR with arctic_inference in it, got {args.arctic_site!r}")
    if bad:
        p.error("; ".join(bad))
    return args


# ---------------------------------------------------------------------------------------- engine side
def write_model_dir(shape_key: str, layers: int | None, path: Path, tp: int = 1) -> None:
    """A config-only model directory (load_format "dummy" makes the weights); tp > 1: the model of one
    TP=tp rank's shard (shapes.rank_shape)."""
    from shapes import rank_shape

    s = rank_shape(shape_key, tp)
    cfg = {"architectures": [ARCHITECTURE[shape_key]], "model_type": "qwen3" if shape_key.startswith("qwen") else
           "llama", "hidden_size": s.hidden, "intermediate_size": s.intermediate,
           "num_hidden_layers": layers or s.layers, "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads,
           "head_dim": s.head_dim, "vocab_size": s.vocab, "rope_theta": s.rope_theta, "rms_norm_eps": 1e-6,
           "max_position_embeddings": 40960, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
           "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 30000) for _ in range(n)]


async def _request(engine, ids: list[int], max_tokens: int, rid: str) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    t0 = time.perf_counter()
    first = None
    n = 0
    marks = []  # (perf_counter, tokens so far) at every output
    async for out in engine.generate({"prompt_token_ids": ids}, params, rid):
        n = len(out.outputs[0].token_ids)
        now = time.perf_counter()
        marks.append((now, n))
        if first is None and n:
            first = now
    end = time.perf_counter()
    return {"ttft": first - t0, "tpot": (end - first) / (n - 1) if n > 1 else None, "end": end - t0, "tokens": n,
            "marks": marks}


def steady_tpot(outs: list[dict]) -> float | None:
    """Median over the requests of a batch of the time per token in the window where all of them decode:
    from the last request's first token to the first request's last output. None if that window holds
    fewer than two outputs of some request."""
    start = max(o["marks"][0][0] for o in outs)
    stop = min(o["marks"][-1][0] for o in outs)
    per = []
    for o in outs:
        inside = [(t, n) for t, n in o["marks"] if start <= t <= stop]
        if len(inside) < 2 or inside[-1][1] == inside[0][1]:
            return None
        per.append((inside[-1][0] - inside[0][0]) / (inside[-1][1] - inside[0][1]))
    return statistics.median(per)


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


async def run_engine(spec: dict) -> dict:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    extra = {}
    Args = AsyncEngineArgs
    if spec["case"] == "arctic":
        from vllm.plugins import load_general_plugins

        load_general_plugins()  # Arctic's patches, before its engine-args class is used
        from arctic_inference.vllm.args import ArcticAsyncEngineArgs as Args

        extra.update(ulysses_sequence_parallel_size=spec["sp"], enable_shift_parallel=True,
                     shift_parallel_threshold=spec["threshold"])
    tp = spec["world"] // spec["sp"] if spec["case"] == "arctic" else spec["world"]
    if spec.get("profile"):
        extra["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": spec["profile"],
                                    "torch_profiler_with_stack": False}
    if spec["case"] == "fusedpar":
        section = {"sequence_parallel_size": spec["sp"]}
        if spec["threshold_given"]:
            section["shift_threshold"] = spec["threshold"]
        extra["additional_config"] = {"fusedpar": section}
    t0 = time.perf_counter()
    engine = AsyncLLM.from_engine_args(Args(
        model=spec["model_dir"], tensor_parallel_size=tp, load_format="dummy", dtype="bfloat16",
        skip_tokenizer_init=True, max_model_len=spec["max_model_len"], enable_prefix_caching=False, seed=0,
        gpu_memory_utilization=spec["gpu_memory_utilization"], max_num_batched_tokens=spec["max_batch_tokens"],
        compilation_config={"max_cudagraph_capture_size": spec["capture_size"]}, **extra))
    res: dict = {"startup_s": time.perf_counter() - t0}
    rng = random.Random(0)
    seq = iter(range(10**9))
    rid = lambda: f"r{next(seq)}"  # noqa: E731
    benches = spec["benches"]
    try:
        if "ttft" in benches:
            for n in spec["ttft_prompts"]:
                for _ in range(3):
                    await _request(engine, _ids(rng, n), 1, rid())
                times = [(await _request(engine, _ids(rng, n), 1, rid()))["ttft"] for _ in range(spec["iters"])]
                res[f"ttft_{n}_ms"], res[f"ttft_{n}_ms_all"] = 1e3 * statistics.median(times), [1e3 * t for t in times]
            if spec.get("profile"):
                await engine.start_profile()
                await _request(engine, _ids(rng, spec["ttft_prompts"][-1]), 1, rid())
                await engine.stop_profile()
        if "tpot" in benches:
            for b in TPOT_BATCHES:
                rounds, per_request = [], []
                for _ in range(spec["rounds"]):
                    outs = await asyncio.gather(*[_request(engine, _ids(rng, TPOT_PROMPT), TPOT_OUTPUT, rid())
                                                  for _ in range(b)])
                    per_request.append(statistics.median(o["tpot"] for o in outs))
                    steady = steady_tpot(outs)
                    rounds.append(per_request[-1] if steady is None else steady)
                res[f"tpot_b{b}_ms"] = 1e3 * statistics.median(rounds[1:] or rounds)  # round 1 warms up
                res[f"tpot_b{b}_ms_rounds"] = [1e3 * t for t in rounds]
                res[f"tpot_b{b}_request_ms"] = 1e3 * statistics.median(per_request[1:] or per_request)
        if "throughput" in benches:
            reqs = [_ids(rng, THR_PROMPT) for _ in range(THR_REQUESTS)]
            await asyncio.gather(*[_request(engine, r[:256], 8, rid()) for r in reqs[:8]])  # warm the path
            t = time.perf_counter()
            await asyncio.gather(*[_request(engine, r, THR_OUTPUT, rid()) for r in reqs])
            wall = time.perf_counter() - t
            res["throughput_s"] = wall
            res["tokens_per_s"] = THR_REQUESTS * (THR_PROMPT + THR_OUTPUT) / wall
        if "online" in benches:
            res["online"] = await _online(engine, spec["online_seconds"], rid)
        if spec["case"] == "fusedpar":
            res["fusedpar_stats"] = (await engine.collective_rpc("fusedpar_stats"))[0]
    finally:
        engine.shutdown()
    return res


def online_trace(seconds: float, seed: int = 0) -> list[tuple[float, str, int, int]]:
    """(arrival s, phase, prompt tokens, output tokens): 10 s low-load phases alternating with 5 s bursts,
    Poisson arrivals at a rate drawn per phase."""
    rng = random.Random(seed)
    out, start, burst = [], 0.0, False
    while start < seconds:
        end = min(start + (5.0 if burst else 10.0), seconds)
        rate = rng.uniform(*(ONLINE_BURST if burst else ONLINE_LOW))
        t = start + rng.expovariate(rate)
        while t < end:
            out.append((t, "burst" if burst else "low", rng.randint(*ONLINE_PROMPT), rng.randint(*ONLINE_OUTPUT)))
            t += rng.expovariate(rate)
        start, burst = end, not burst
    return out


async def _online(engine, seconds: float, rid) -> dict:
    trace = online_trace(seconds)
    rng = random.Random(1)
    start = time.perf_counter()

    async def one(at, phase, n_in, n_out):
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        return phase, await _request(engine, _ids(rng, n_in), n_out, rid())

    done = await asyncio.gather(*[one(*r) for r in trace])
    summary = {"requests": len(done), "seconds": time.perf_counter() - start}
    for name, sel in (("all", None), ("low", "low"), ("burst", "burst")):
        rs = [r for p, r in done if sel is None or p == sel]
        if not rs:
            continue
        ttft = [1e3 * r["ttft"] for r in rs]
        tpot = [1e3 * r["tpot"] for r in rs if r["tpot"] is not None]
        summary[name] = {"requests": len(rs), "ttft_p50_ms": _pct(ttft, 0.5), "ttft_p99_ms": _pct(ttft, 0.99),
                         "tpot_p50_ms": _pct(tpot, 0.5), "tpot_p99_ms": _pct(tpot, 0.99)}
    return summary


def child_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    result = asyncio.run(run_engine(spec))
    print("RESULT:" + json.dumps(result), flush=True)
    os._exit(0)  # engine teardown threads must not hold the process


# ---------------------------------------------------------------------------------------- driver side
def run_case(args, case: str, model_dir: Path, work: Path) -> dict:
    spec = {"case": case, "world": args.world, "sp": args.sp, "threshold": args.threshold,
            "threshold_given": args.threshold_given, "capture_size": args.capture_size,
            "model_dir": str(model_dir), "benches": args.benches.split(","), "iters": args.iters,
            "rounds": args.rounds, "ttft_prompts": args.ttft_prompt_list,
            "max_model_len": max(8192, max(args.ttft_prompt_list) + 64), "online_seconds": args.online_seconds,
            "max_batch_tokens": args.max_batch_tokens,
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "profile": str(work / f"profile_{case}") if args.profile else None}
    spec_path = work / f"{case}.json"
    spec_path.write_text(json.dumps(spec))
    print(f"== {case}: starting the engine (P={args.world}{f', SP={args.sp}' if case == 'fusedpar' else ''})",
          flush=True)
    result = _run_child(args, case, spec_path)
    if args.profile:
        out = Path(args.profile)
        out.mkdir(parents=True, exist_ok=True)
        for f in sorted((work / f"profile_{case}").glob("profiler_out_0.txt")):
            (out / f"{case}_{f.name}").write_text(f.read_text())
    return result


def _run_child(args, case: str, spec_path: Path) -> dict:
    t0 = time.perf_counter()
    env = dict(os.environ)
    if case == "arctic":  # Arctic on this case's path alone, and the only vLLM plugin loaded
        env["PYTHONPATH"] = os.pathsep.join(x for x in (str(Path(args.arctic_site).resolve()),
                                                        env.get("PYTHONPATH")) if x)
        env.update(ARCTIC_INFERENCE_ENABLED="1", VLLM_PLUGINS="arctic_inference")
    proc = subprocess.Popen([sys.executable, __file__, "--world", str(args.world), "--child", str(spec_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("RESULT:") or "fusedpar" in line or "Error" in line or "error" in line:
                print(f"   [{case} {time.perf_counter() - t0:5.0f}s] {line.rstrip()[:400]}", flush=True)
        proc.wait(timeout=max(1.0, args.timeout - (time.perf_counter() - t0)))
    except subprocess.TimeoutExpired:
        proc.kill()
    if args.logs:
        Path(args.logs).mkdir(parents=True, exist_ok=True)
        (Path(args.logs) / f"{case}.log").write_text("".join(lines))
    found = [x for x in lines if x.startswith("RESULT:")]
    if not found:
        tail = "".join(lines[-60:])
        return {"error": f"{case} engine exited with {proc.returncode} and no result", "log_tail": tail}
    return json.loads(found[-1][len("RESULT:"):])


def ceilings() -> tuple[float, float, str]:
    import bench_gemm
    import torch

    peak, hbm = bench_gemm.measure_ceilings(torch.bfloat16, 5, torch.device("cuda", 0))
    name = torch.cuda.get_device_name(0)
    torch.cuda.empty_cache()
    return peak, hbm, name


def records(args, results: dict, peak: float, hbm: float, gpu: str) -> list[dict]:
    import vllm
    from _bench import run_info
    from shapes import shape

    s = shape(args.shape)
    layers = args.layers or s.layers
    per_layer = (s.hidden * (s.q_size + 2 * s.kv_size) + s.q_size * s.hidden + 3 * s.hidden * s.intermediate)
    params = per_layer * layers + 2 * s.vocab * s.hidden
    P = args.world

    def floor_ms(tokens: int, steps: int = 1) -> float:
        return max(2 * tokens * params / P / peak, steps * 2 * params / P / hbm) * 1e3

    plain = results.get("plain", {})
    common = {"world": P, "gpu": gpu, "baseline": f"plain vLLM TP={P}", "vllm": vllm.__version__,
              "model": args.shape, "layers": layers, "sp": args.sp, "threshold": args.threshold,
              "capture_size": args.capture_size,
              "max_batch_tokens": args.max_batch_tokens, **run_info(python=True)}
    thr_tokens = THR_REQUESTS * (THR_PROMPT + THR_OUTPUT)

    def side(case: str, res: dict) -> list[dict]:
        """The records of one engine (fusedpar or arctic) against plain vLLM."""
        out = []

        def add(bench, tokens, base_ms, fused_ms, floor, **extra):
            if base_ms and fused_ms:
                out.append({"bench": bench, "case": case, "tokens": tokens, "baseline_ms": base_ms,
                            "fused_ms": fused_ms, "speedup": base_ms / fused_ms,
                            "roofline_pct": None if floor is None else 100 * floor / fused_ms, **extra, **common})

        for n in args.ttft_prompt_list:
            add("vllm_ttft", n, plain.get(f"ttft_{n}_ms"), res.get(f"ttft_{n}_ms"), floor_ms(n))
        for b in TPOT_BATCHES:
            add("vllm_tpot", b, plain.get(f"tpot_b{b}_ms"), res.get(f"tpot_b{b}_ms"), floor_ms(b), batch=b,
                prompt=TPOT_PROMPT, metric="steady decode window",
                plain_request_ms=plain.get(f"tpot_b{b}_request_ms"), fused_request_ms=res.get(f"tpot_b{b}_request_ms"))
        if plain.get("throughput_s") and res.get("throughput_s"):
            add("vllm_throughput", thr_tokens, 1e3 * plain["throughput_s"], 1e3 * res["throughput_s"],
                floor_ms(thr_tokens, steps=THR_OUTPUT), plain_tokens_per_s=plain["tokens_per_s"],
                fused_tokens_per_s=res["tokens_per_s"])
        po, fo = plain.get("online"), res.get("online")
        if po and fo and "all" in po and "all" in fo:
            add("vllm_online", po["requests"], po["all"]["ttft_p99_ms"], fo["all"]["ttft_p99_ms"], None,
                plain_online=po, fused_online=fo, metric="p99 TTFT over the whole trace")
        return out

    fp = results.get("fusedpar", {})
    out = side(f"fusedpar SP={args.sp} {args.shape}", fp)
    for rec in out:
        rec["fusedpar_stats"] = fp.get("fusedpar_stats")
    arctic = results.get("arctic")
    if arctic and "error" not in arctic:  # Arctic's times against the same plain baseline
        mine = {(r["bench"], r["tokens"]): r["fused_ms"] for r in out}
        for rec in side(f"arctic SP={args.sp} {args.shape}", arctic):
            out.append({**rec, "fusedpar_ms": mine.get((rec["bench"], rec["tokens"]))})
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child_main(args.child)
        return 0
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    peak, hbm, gpu = ceilings()
    print(f"{gpu}: cuBLAS {peak / 1e12:.0f} TFLOP/s, HBM {hbm / 1e12:.2f} TB/s", flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        write_model_dir(args.shape, args.layers, model_dir)
        for case in args.cases.split(","):
            results[case] = run_case(args, case, model_dir, Path(tmp))
            print(f"== {case}: {json.dumps(results[case])[:1500]}", flush=True)
    recs = records(args, results, peak, hbm, gpu)
    for r in recs:
        print(f"{r['bench']:16s} tokens {r['tokens']:>6}: plain {r['baseline_ms']:9.2f} ms  {r['case'].split()[0]:8s} "
              f"{r['fused_ms']:9.2f} ms  speedup {r['speedup']:.3f}x", flush=True)
    if args.out and recs and not args.profile:
        from _bench import write_records

        write_records(recs, args.out)
    errors = [c for c, r in results.items() if "error" in r]
    for c in errors:
        print(f"{c}: {results[c]['error']}\n{results[c].get('log_tail', '')}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
