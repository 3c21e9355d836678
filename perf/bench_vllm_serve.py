"""Benchmark: the bursty trace of perf/serve_bench.py served by vLLM's engine, plain vLLM TP=P and DP=P against
fusedpar's layouts and layout policies inside vLLM.

    python perf/bench_vllm_serve.py --world 4 [--shape llama8b] [--cases tp,dp,shift,dp_fusedpar]
        [--policies load,auto] [--section 'auto={"shift_threshold": 512}'] [--out perf/results/vllm_serve.json]
    python perf/bench_vllm_serve.py --cpu [--world 2] [--cases tp,dp,dp_fusedpar]   # vLLM's CPU build: smoke run

Trace: serve_bench's (perf/_serve/trace.py, through serve_bench.trace_of / flood_of, same options and seed):
Poisson arrivals in alternating low-load and burst phases, prompt and output lengths uniform in --prompt /
--output, prompt token ids from _serve.trace.prompt_ids; --priority-frac of the requests high priority (sent
with vLLM's per-request priority 0, the others 1, under --scheduling-policy priority). Every case serves the
same requests.

Cases (one vLLM engine each, vllm.v1 AsyncLLM, in a process of its own, one after the other on the same
P GPUs; load_format "dummy", prefix caching off, the same engine settings everywhere):
  tp           plain vLLM, tensor_parallel_size=P
  dp           plain vLLM, data_parallel_size=P (tensor_parallel_size=1): AsyncLLM starts P engine cores on
               one node (vLLM's internal load balancer, DPLBAsyncMPClient, sends each request to the least
               loaded core); for a dense model the cores are independent (vLLM 0.26 and 0.32 alike), each
               with its own token budget and sequence limit
  shift        fusedpar, tensor_parallel_size=P, {"sequence_parallel_size": P}: base SP=P above the shift
               threshold, vLLM's TP=P at or below it
  dp_fusedpar  fusedpar's DP layout, tensor_parallel_size=P, {"sequence_parallel_size": P, "layouts":
               ["dp{P}"], "policy": "dp"} (one engine: budget and sequence limit engine-wide)
  NAME         each name of --policies: tensor_parallel_size=P, {"sequence_parallel_size": P, "layouts":
               ["dp{P}"], "policy": NAME}, with the keys of --section NAME=JSON merged over it; a section the
               plugin refuses is reported as that case's error
--threshold T adds "shift_threshold": T to every fusedpar section.

Per case: the engine starts (startup_s); the first --warmup-requests requests of the trace are served at once,
untimed; the fusedpar counters are reset; the trace is replayed in real time (each request submitted at its
arrival time, its output streamed: the first output with tokens stamps its first token, every later output
its tokens); then, with --saturate N, N more requests (serve_bench's flood) all submitted at once.
Metrics (_serve.metrics, the definitions of serve_bench): TTFT = first token - arrival; TPOT = (last token -
first token) / (output - 1); p50 / p99 of both, over all requests, the high-priority ones and (TPOT) those
arriving in low-load phases (tpot_p50_low_ms); output throughput per load phase; peak throughput = most
output tokens in one --peak-window window / the window; saturated throughput = the flood's output tokens /
the time to finish it (capacity). Where the plugin runs: fusedpar.integrations.vllm.stats per worker after
the trace and after the flood, summarised as steps per layout (every `<layout>_steps` counter; the max over
workers), switches and recomputed tokens (max over workers), KV bytes moved (sum over workers); a counter
this plugin version does not report is null.

Records (--out, a JSON list the records are appended to): bench "vllm_serve", one per case, case "<case>
<model>", tokens = prompt + output tokens of the trace, baseline plain vLLM TP=P: baseline_ms / fused_ms =
p50 TTFT of TP / of the case, speedup their ratio, roofline_pct null; ratios: ttft_p50_vs_tp, ttft_p99_vs_tp,
tpot_p50_vs_tp, tpot_p50_low_vs_tp (case / TP) and peak_vs_dp, saturated_vs_dp (case / plain vLLM DP=P).
A run without tp or dp takes that baseline from the latest record of the same trace, model, world and
engine settings already in --out, so cases can be split over runs.

Every case runs under --timeout seconds (startup included); a case that times out, fails to start (e.g. a
section the plugin refuses) or loses requests is reported with the end of its log and writes no record;
the script then exits 1 after writing the other cases' records.

--cpu runs on vLLM's CPU build (gloo, fp32, enforce_eager, VLLM_CPU_KVCACHE_SPACE=1 GiB and
VLLM_CPU_OMP_THREADS_BIND=nobind unless set): a tiny random Llama (2 layers, hidden 128, 4 q / 2 kv heads of
32, vocab 512), a dozen short requests over a few seconds: a smoke run of every path, not a measurement.
The GPU side needs vLLM (the `vllm` extra or the wheel bundle of docs/vllm.md); without CUDA and without
--cpu the script prints a message and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fusedpar from this checkout

FIXED_CASES = ("tp", "dp", "shift", "dp_fusedpar")
TINY = {"hidden": 128, "intermediate": 256, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 32, "vocab": 512}
GPU_DEFAULTS = dict(shape="llama8b", dtype="bf16", requests=400, prompt="100,2000", output="50,500", low_seconds=20.0,
                    burst_seconds=5.0, saturate=256, max_batch_tokens=2048, max_seqs=256, warmup_requests=16,
                    timeout=1800.0, progress_s=30.0)
CPU_DEFAULTS = dict(shape="tiny", dtype="fp32", requests=12, prompt="4,40", output="2,12", low_seconds=2.0,
                    burst_seconds=1.0, saturate=8, max_batch_tokens=32, max_seqs=16, warmup_requests=2,
                    timeout=420.0, progress_s=5.0)
RESULT_LINE = "RESULT written"
SHUTDOWN_GRACE_S = 60.0  # after its result, a case's engine gets this long to shut down before it is killed
GROUP_EXIT_S = 30.0  # after SIGKILL, how long the case's processes get to be gone before the next case starts
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# the options the trace is made of (serve_bench's names); records of one trace share these
TRACE_KEYS = ("requests", "seed", "low_rate", "burst_rate", "low_seconds", "burst_seconds", "rate_scale", "prompt",
              "output", "priority_frac")
# keys of _serve.metrics.summarize that describe serve_bench's own loop, not an engine seen from outside
LOOP_ONLY = ("steps", "switches", "switches_total", "switch_s", "swap_s", "graph_capture_s", "kv_bytes_received_rank0",
             "time_in_layout_s")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model and machine")
    g.add_argument("--world", type=int, default=None,
                   help="P: GPUs (tensor_parallel_size / data_parallel_size of every case); default: the GPUs "
                        "torch sees, --cpu: 2")
    g.add_argument("--cpu", action="store_true", help="vLLM's CPU build, a tiny random model: a smoke run")
    g.add_argument("--shape", help="model shape: llama8b, llama70b, qwen32b (perf/shapes.py), or tiny; default "
                   "llama8b, --cpu: tiny")
    g.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    g.add_argument("--dtype", choices=sorted(DTYPES), help="default bf16, --cpu: fp32")
    g = p.add_argument_group("cases")
    g.add_argument("--cases", default=",".join(FIXED_CASES),
                   help=f"comma-separated subset of {','.join(FIXED_CASES)} (default all; order kept)")
    g.add_argument("--policies", default="",
                   help="comma-separated fusedpar policy names, one case each after --cases (e.g. load,auto): "
                        "section {\"sequence_parallel_size\": P, \"layouts\": [\"dp{P}\"], \"policy\": NAME}")
    g.add_argument("--section", action="append", default=[], metavar="NAME=JSON",
                   help="keys merged over the fusedpar section of case NAME (a --policies name, shift or "
                        "dp_fusedpar), e.g. 'load={\"layouts\": [\"dp4\", \"dp2xtp2\"]}'; repeatable")
    g.add_argument("--threshold", type=int, default=None,
                   help="shift_threshold of every fusedpar section (default: the plugin's)")
    g = p.add_argument_group("trace (serve_bench's)")
    g.add_argument("--requests", type=int, help="requests in the trace (default 400, --cpu: 12)")
    g.add_argument("--seed", type=int, default=0, help="seed of the trace and the prompts (default 0)")
    g.add_argument("--low-rate", default="2,5", help="low-load phases: arrival rate range, req/s (default 2,5)")
    g.add_argument("--burst-rate", default="10,30", help="burst phases: arrival rate range, req/s (default 10,30)")
    g.add_argument("--low-seconds", type=float, help="duration of a low-load phase, s (default 20, --cpu: 2)")
    g.add_argument("--burst-seconds", type=float, help="duration of a burst phase, s (default 5, --cpu: 1)")
    g.add_argument("--rate-scale", type=float, default=1.0, help="multiplies every arrival rate (default 1)")
    g.add_argument("--prompt", help="prompt tokens, uniform in lo,hi (default 100,2000, --cpu: 4,40)")
    g.add_argument("--output", help="output tokens, uniform in lo,hi (default 50,500, --cpu: 2,12)")
    g.add_argument("--priority-frac", type=float, default=0.0,
                   help="fraction of high-priority requests (default 0); sent with vLLM's priority 0 (others 1) "
                        "when --scheduling-policy is priority")
    g.add_argument("--saturate", type=int, metavar="N",
                   help="then N more requests at once: saturated throughput (default 256, --cpu: 8; 0: none)")
    g.add_argument("--peak-window", type=float, default=2.0, help="window of the peak throughput, s (default 2)")
    g = p.add_argument_group("engine (the same for every case)")
    g.add_argument("--max-batch-tokens", type=int, help="max_num_batched_tokens (default 2048, --cpu: 32)")
    g.add_argument("--max-seqs", type=int, help="max_num_seqs (default 256, --cpu: 16)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="max_model_len (default: the longest request of the trace and flood, rounded up to 256)")
    g.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="vLLM's scheduling policy (default fcfs; priority: requests carry the trace's priorities)")
    g.add_argument("--eager", action="store_true", help="enforce_eager (no CUDA graphs, no torch.compile; "
                   "always on with --cpu)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="default 0.85")
    g = p.add_argument_group("run and output")
    g.add_argument("--warmup-requests", type=int, help="untimed warm-up: the trace's first N requests at once "
                   "(default 16, --cpu: 2; 0: none)")
    g.add_argument("--timeout", type=float, help="seconds each case may take, engine start included (default "
                   "1800, --cpu: 420); then its processes are killed and the case reported as timed out")
    g.add_argument("--progress-s", type=float, help="a progress line per case every this many seconds (default "
                   "30, --cpu: 5)")
    g.add_argument("--out", default=None, help="JSON list the records are appended to (relative: to the repo "
                   "root); default: print only")
    g.add_argument("--logs", default=None, metavar="DIR", help="write each engine's whole output to DIR/<case>.log")
    g.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p


def _pair(text: str, kind=float) -> tuple:
    lo, hi = (kind(x) for x in text.split(","))
    return lo, hi


def resolve(a: argparse.Namespace, p: argparse.ArgumentParser) -> dict:
    """The options with the GPU or --cpu defaults filled in, the cases and their engine settings (a plain dict)."""
    o = dict(vars(a))
    for k, v in (CPU_DEFAULTS if a.cpu else GPU_DEFAULTS).items():
        if o.get(k) is None:
            o[k] = v
    bad = []
    if o["world"] is None:
        o["world"] = 2 if a.cpu else _gpu_count()
    P = o["world"]
    if P < 2:
        bad.append(f"--world {P}: needs P >= 2 (plain TP=P against DP=P)")
    if o["shape"] != "tiny" and o["shape"] not in ARCHITECTURE:
        bad.append(f"--shape {o['shape']!r}: one of {sorted(ARCHITECTURE)} or tiny")
    cases = [c for c in o["cases"].split(",") if c]
    unknown = [c for c in cases if c not in FIXED_CASES]
    if unknown:
        bad.append(f"--cases {unknown}: known cases are {list(FIXED_CASES)} (policies go to --policies)")
    policies = [c for c in o["policies"].split(",") if c]
    for name in policies:
        if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or name in FIXED_CASES:
            bad.append(f"--policies {name!r}: a policy name (lower case, not one of {list(FIXED_CASES)})")
    names = cases + policies
    if len(set(names)) != len(names) or not names:
        bad.append(f"cases {names}: want at least one, each once")
    sections = {"shift": {"sequence_parallel_size": P},
                "dp_fusedpar": {"sequence_parallel_size": P, "layouts": [f"dp{P}"], "policy": "dp"}}
    for name in policies:
        if name not in FIXED_CASES:
            sections[name] = {"sequence_parallel_size": P, "layouts": [f"dp{P}"], "policy": name}
    for item in o["section"]:
        name, _, text = item.partition("=")
        try:
            extra = json.loads(text)
        except json.JSONDecodeError as e:
            bad.append(f"--section {item!r}: not NAME=JSON ({e})")
            continue
        if name not in sections or name not in names or not isinstance(extra, dict):
            ours = [n for n in names if n in sections]
            bad.append(f"--section {item!r}: NAME must be a fusedpar case of this run ({ours}) and JSON an object")
            continue
        sections[name].update(extra)
    if o["threshold"] is not None:
        for s in sections.values():
            s.setdefault("shift_threshold", o["threshold"])
    for key in ("low_rate", "burst_rate", "prompt", "output"):
        try:
            _pair(o[key], int if key in ("prompt", "output") else float)
        except ValueError:
            bad.append(f"--{key.replace('_', '-')} {o[key]!r}: want lo,hi")
    if not 0 <= o["priority_frac"] <= 1:
        bad.append(f"--priority-frac {o['priority_frac']}: in [0, 1]")
    if o["saturate"] < 0 or o["warmup_requests"] < 0 or o["requests"] < 1:
        bad.append("--requests >= 1, --saturate and --warmup-requests >= 0")
    if bad:
        p.error("; ".join(bad))
    o["case_list"] = names
    o["sections"] = {n: sections[n] for n in names if n in sections}
    o["eager"] = bool(o["eager"] or o["cpu"])
    return o


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


# ---------------------------------------------------------------------------------------- the trace
def trace(o: dict):
    """(requests, phases, flood) of the options: serve_bench's generators on serve_bench's option names."""
    import serve_bench

    so = {k: o[k] for k in TRACE_KEYS}
    so["saturate"] = o["saturate"]
    requests, phases = serve_bench.trace_of(so)
    return requests, phases, serve_bench.flood_of(so)


def vocab_of(o: dict) -> int:
    if o["shape"] == "tiny":
        return TINY["vocab"]
    import shapes

    return shapes.shape(o["shape"]).vocab


ARCHITECTURE = {"qwen32b": "Qwen3ForCausalLM", "llama70b": "LlamaForCausalLM", "llama8b": "LlamaForCausalLM"}


def write_model_dir(o: dict, path: Path) -> None:
    """A config-only model directory (load_format "dummy" makes the weights)."""
    if o["shape"] == "tiny":
        cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": TINY["hidden"],
               "intermediate_size": TINY["intermediate"], "num_hidden_layers": o["layers"] or TINY["layers"],
               "num_attention_heads": TINY["heads"], "num_key_value_heads": TINY["kv_heads"],
               "head_dim": TINY["head_dim"], "vocab_size": TINY["vocab"], "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
               "max_position_embeddings": 4096, "torch_dtype": "float32", "tie_word_embeddings": False,
               "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(cfg))
        return
    import bench_vllm

    bench_vllm.write_model_dir(o["shape"], o["layers"], path)


def engine_kwargs(o: dict, case: str, model_dir: str, max_model_len: int) -> dict:
    """AsyncEngineArgs keywords of one case (the same engine settings for every case but the parallel layout)."""
    P = o["world"]
    kw = dict(model=model_dir, load_format="dummy", dtype=DTYPES[o["dtype"]], skip_tokenizer_init=True,
              max_model_len=max_model_len, enable_prefix_caching=False, seed=0,
              max_num_batched_tokens=o["max_batch_tokens"], max_num_seqs=o["max_seqs"], enforce_eager=o["eager"],
              scheduling_policy=o["scheduling_policy"])
    if not o["cpu"]:
        kw["gpu_memory_utilization"] = o["gpu_memory_utilization"]
    if case == "dp":
        kw.update(data_parallel_size=P, tensor_parallel_size=1)
    else:
        kw["tensor_parallel_size"] = P
    if case in o["sections"]:
        kw["additional_config"] = {"fusedpar": o["sections"][case]}
    return kw


# ---------------------------------------------------------------------------------------- engine side
async def _serve(engine, reqs, prompts: dict, tag: str, start: float, priorities: bool, progress) -> dict:
    """Submit every request at start + its arrival, stream its outputs; per request its first-token and
    last-token times and every output's (time, new tokens), relative to start."""
    from vllm import SamplingParams

    out: dict = {}

    async def one(r):
        await asyncio.sleep(max(0.0, start + r.arrival - time.perf_counter()))
        params = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True, detokenize=False)
        progress["submitted"] += 1
        marks, last, seen = [], None, 0
        kw = {"priority": r.priority} if priorities else {}
        async for last in engine.generate({"prompt_token_ids": prompts[r.rid]}, params, f"{tag}{r.rid}", **kw):
            now = time.perf_counter() - start
            n = len(last.outputs[0].token_ids)  # cumulative outputs: every token so far
            if n > seen:
                marks.append((now, n - seen))
                progress["tokens"] += n - seen
                seen = n
        progress["done"] += 1
        out[r.rid] = {"first": marks[0][0] if marks else None, "done": marks[-1][0] if marks else None,
                      "emitted": marks, "tokens": list(last.outputs[0].token_ids) if last is not None else []}

    await asyncio.gather(*[one(r) for r in reqs])
    return out


async def _progress(label: str, total: int, state: dict, every: float, t0: float) -> None:
    while True:
        await asyncio.sleep(every)
        print(f"PROGRESS {label}: {time.perf_counter() - t0:.0f}s, submitted {state['submitted']}/{total}, "
              f"done {state['done']}, output tokens {state['tokens']}", flush=True)


async def run_case(spec: dict) -> dict:
    from _serve.trace import prompt_ids
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    o = spec["options"]
    requests, _, flood = trace(o)
    vocab = vocab_of(o)
    prompts = {r.rid: prompt_ids(r, vocab, o["seed"]).tolist() for r in requests}
    flood_prompts = {r.rid: prompt_ids(r, vocab, o["seed"] + 1).tolist() for r in flood}
    fusedpar = spec["case"] in o["sections"]
    priorities = o["scheduling_policy"] == "priority"
    t0 = time.perf_counter()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**spec["engine"]))
    res: dict = {"startup_s": time.perf_counter() - t0}
    print(f"PROGRESS engine ready after {res['startup_s']:.0f}s", flush=True)

    async def stats(reset: bool) -> list | None:
        if not fusedpar:
            return None
        got = await engine.collective_rpc("fusedpar_reset_stats" if reset else "fusedpar_stats")
        return None if reset else got

    async def timed(label, reqs, reqs_prompts, tag):
        state = {"submitted": 0, "done": 0, "tokens": 0}
        start = time.perf_counter()
        ticker = asyncio.ensure_future(_progress(label, len(reqs), state, o["progress_s"], start))
        try:
            got = await _serve(engine, reqs, reqs_prompts, tag, start, priorities, state)
        finally:
            ticker.cancel()
        return got, time.perf_counter() - start

    try:
        if o["warmup_requests"]:
            warm = [dataclasses.replace(r, arrival=0.0) for r in requests[:o["warmup_requests"]]]
            _, res["warmup_s"] = await timed("warm-up", warm, prompts, "w")
        await stats(reset=True)
        res["trace"], res["trace_wall_s"] = await timed("trace", requests, prompts, "t")
        res["fusedpar_stats"] = await stats(reset=False)
        if flood:
            await stats(reset=True)
            res["flood"], res["flood_wall_s"] = await timed("saturated", flood, flood_prompts, "s")
            res["fusedpar_stats_saturated"] = await stats(reset=False)
        _write_result(spec, res)  # before the engine's shutdown, which the driver may cut short
    finally:
        engine.shutdown()
    return res


def _write_result(spec: dict, res: dict) -> None:
    Path(spec["result"]).write_text(json.dumps(res))
    print(RESULT_LINE, flush=True)


def child_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    try:
        asyncio.run(run_case(spec))
    except BaseException as e:  # the driver reports it; the traceback goes to the case's log
        import traceback

        traceback.print_exc()
        if not Path(spec["result"]).is_file():
            _write_result(spec, {"error": f"{type(e).__name__}: {e}"[:4000]})
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # engine teardown threads must not hold the process


# ---------------------------------------------------------------------------------------- driver side
def run_child(o: dict, case: str, spec: dict, work: Path) -> dict:
    """The case's engine in a process group of its own, under o["timeout"]; its result, or {"error", "log_tail"}."""
    spec_path, result_path = work / f"{case}.json", work / f"{case}.result.json"
    spec = {**spec, "result": str(result_path)}
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ)
    repo = str(Path(__file__).resolve().parents[1])  # vLLM's own processes load this checkout's fusedpar
    env["PYTHONPATH"] = os.pathsep.join(x for x in (repo, env.get("PYTHONPATH")) if x)
    env.setdefault("VLLM_HOST_IP", "127.0.0.1")  # one node: its process groups need no routable address
    if o["cpu"]:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    else:
        env.setdefault("NCCL_NVLS_ENABLE", "0")
        env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        env.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)  # its engine cores and workers: one group to kill
    lines: list[str] = []

    def read():
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(("PROGRESS", RESULT_LINE)) or "FusedparConfigError" in line or "Error:" in line:
                print(f"   [{case} {time.perf_counter() - t0:5.0f}s] {line.rstrip()[:400]}", flush=True)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    timed_out, result_at = False, None
    while proc.poll() is None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=1.0)
        now = time.perf_counter() - t0
        if result_at is None and result_path.is_file():
            result_at = now
        if result_at is not None and now - result_at > SHUTDOWN_GRACE_S:
            break  # the result is in; the engine's shutdown hangs
        if result_at is None and now > o["timeout"]:
            timed_out = True
            break
    _kill_group(proc)
    reader.join(timeout=10)
    if o["logs"]:
        Path(o["logs"]).mkdir(parents=True, exist_ok=True)
        (Path(o["logs"]) / f"{case}.log").write_text("".join(lines))
    tail = "".join(lines[-40:])
    if timed_out:
        return {"error": f"case {case}: no result within --timeout {o['timeout']:.0f} s (engine start included); "
                         "its processes were killed", "log_tail": tail}
    if not result_path.is_file():
        return {"error": f"case {case}: the engine process exited with {proc.returncode} and no result",
                "log_tail": tail}
    result = json.loads(result_path.read_text())
    if "error" in result:
        result["log_tail"] = tail
    return result


def _kill_group(proc: subprocess.Popen) -> None:
    """End the case's process group (the child, its engine cores and workers), which only this script started."""
    with contextlib.suppress(ProcessLookupError, PermissionError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.perf_counter() + GROUP_EXIT_S  # the next case needs the devices its workers held
    while time.perf_counter() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.5)
    print(f"   processes of the case's group {proc.pid} still exist {GROUP_EXIT_S:.0f} s after SIGKILL", flush=True)


def run_result(served: dict, name: str):
    """serve_bench's RunResult (_serve.loop) of a served request set as a case's process reports it."""
    from _serve.loop import RunResult

    got = {int(k): v for k, v in served.items()}
    rr = RunResult(policy=name)
    for rid, g in got.items():
        if g["first"] is not None:
            rr.first_t[rid], rr.done_t[rid] = g["first"], g["done"]
        rr.outputs[rid] = g["tokens"]
        rr.emitted.extend((t, n) for t, n in g["emitted"])
    rr.end = max((g["done"] for g in got.values() if g["done"] is not None), default=0.0)
    return rr


def metrics(res: dict, part: str, requests, phases, peak_window: float) -> dict:
    """serve_bench's metrics (_serve.metrics) of one served request set of a case."""
    from _serve.metrics import percentile, summarize

    rr = run_result(res[part], part)
    rr.wall_s = res[f"{part}_wall_s"]
    m = summarize(rr, requests, phases, peak_window)
    for key in LOOP_ONLY:
        m.pop(key, None)
    low = {i for i, ph in enumerate(phases) if ph.kind == "low"}
    tpot_low = [(rr.done_t[r.rid] - rr.first_t[r.rid]) / (r.output_len - 1) for r in requests
                if r.phase in low and r.output_len > 1 and r.rid in rr.done_t]
    p50 = percentile(tpot_low, 50)
    m["tpot_p50_low_ms"] = None if p50 is None else p50 * 1e3
    return m


def fusedpar_summary(workers: list[dict] | None) -> dict | None:
    """Steps per layout, switches, KV bytes moved and recomputed tokens from stats(llm)'s per-worker dicts."""
    if workers is None:
        return None

    def counter(key):
        vals = [w[key] for w in workers if key in w]
        vals = [sum(v.values()) if isinstance(v, dict) else v for v in vals]
        return vals

    steps = {}
    for w in workers:
        for k, v in w.items():
            if k.endswith("_steps") and isinstance(v, int):
                steps[k.removesuffix("_steps")] = max(steps.get(k.removesuffix("_steps"), 0), v)
    switches, moved, recomputed = counter("switches"), counter("kv_bytes_moved"), counter("recomputed_tokens")
    slim = [{k: (len(v) if isinstance(v, list) and k.endswith("_requests") else v) for k, v in w.items()}
            for w in workers]
    return {"steps": steps, "switches": max(switches) if switches else None,
            "kv_bytes_moved": sum(moved) if moved else None,
            "recomputed_tokens": max(recomputed) if recomputed else None, "workers": slim}


def _label(case: str, P: int) -> str:
    return {"tp": f"plain vLLM TP={P}", "dp": f"plain vLLM DP={P}", "shift": f"fusedpar shift SP={P}<->TP={P}",
            "dp_fusedpar": f"fusedpar dp{P}"}.get(case, f"fusedpar policy {case}")


def records(o: dict, results: dict, requests, phases, flood, gpu: str, existing: list[dict]) -> list[dict]:
    import vllm
    from _bench import run_info
    from _serve.metrics import summarize_saturated

    P = o["world"]
    model = o["shape"]
    engine = {k: o[k] for k in ("max_batch_tokens", "max_seqs", "scheduling_policy", "eager", "dtype")}
    common = {"bench": "vllm_serve", "world": P, "gpu": gpu, "vllm": vllm.__version__, **run_info(python=True),
              "model": model, "layers": o["layers"] or (TINY["layers"] if model == "tiny" else None),
              "trace": {k: o[k] for k in TRACE_KEYS}, "saturate": o["saturate"], "peak_window_s": o["peak_window"],
              "engine": engine, "tokens": sum(r.prompt_len + r.output_len for r in requests)}
    out = []
    for case, res in results.items():
        if "error" in res:
            continue
        m = metrics(res, "trace", requests, phases, o["peak_window"])
        if flood:
            m.update(summarize_saturated(run_result(res["flood"], "saturated"), flood))
            for key in ("steps", "switches"):
                m["saturated"].pop(key, None)
        rec = {**common, "case": f"{case} {model}", "case_key": case, "label": _label(case, P),
               "engine_args": {k: v for k, v in engine_kwargs(o, case, "MODEL", 0).items()
                               if k in ("tensor_parallel_size", "data_parallel_size", "additional_config")},
               "startup_s": res["startup_s"], "warmup_s": res.get("warmup_s"), **m,
               "fusedpar": fusedpar_summary(res.get("fusedpar_stats")),
               "fusedpar_saturated": fusedpar_summary(res.get("fusedpar_stats_saturated"))}
        out.append(rec)
    _baselines(out, existing, P)
    return out


def _same_run(a: dict, b: dict) -> bool:
    return all(a.get(k) == b.get(k) for k in ("trace", "model", "layers", "world", "engine", "saturate"))


def _baselines(out: list[dict], existing: list[dict], P: int) -> None:
    """baseline (plain vLLM TP=P: p50 TTFT) and the ratios of every record, from this run's tp / dp records or
    the latest of the same run settings in `existing`; a run without any TP record compares to its first case."""
    def find(key):
        here = [r for r in out if r["case_key"] == key]
        older = [r for r in existing if r.get("bench") == "vllm_serve" and r.get("case_key") == key
                 and out and _same_run(r, out[0])]
        return (here or older or [None])[-1]

    tp, dp = find("tp"), find("dp")
    for r in out:
        base = tp or out[0]
        r["baseline"] = _label(base["case_key"], P)
        r["baseline_ms"], r["fused_ms"] = base["ttft_p50_ms"], r["ttft_p50_ms"]
        r["speedup"] = r["baseline_ms"] / r["fused_ms"]
        r["roofline_pct"] = None
        r["throughput_baseline"] = _label("dp", P) if dp else None

        def ratio(a, b):
            return None if a is None or not b else a / b

        r["ratios"] = {
            "ttft_p50_vs_tp": ratio(r["ttft_p50_ms"], tp and tp["ttft_p50_ms"]),
            "ttft_p99_vs_tp": ratio(r["ttft_p99_ms"], tp and tp["ttft_p99_ms"]),
            "tpot_p50_vs_tp": ratio(r["tpot_p50_ms"], tp and tp["tpot_p50_ms"]),
            "tpot_p50_low_vs_tp": ratio(r["tpot_p50_low_ms"], tp and tp["tpot_p50_low_ms"]),
            "peak_vs_dp": ratio(r["peak_throughput_tok_s"], dp and dp["peak_throughput_tok_s"]),
            "saturated_vs_dp": ratio(r.get("saturated_tok_s"), dp and dp.get("saturated_tok_s"))}


def print_table(recs: list[dict]) -> None:
    def f(x, fmt="{:.1f}"):
        return "-" if x is None else fmt.format(x)

    print(f"{'case':<28}{'TTFT p50':>9}{'p99':>9}{'TPOT p50':>9}{'p99':>8}{'low p50':>8}{'peak':>9}"
          f"{'saturated':>10}{'TTFT/TP':>8}{'sat/DP':>7}{'switches':>9}  steps per layout")
    for r in recs:
        fp = r["fusedpar"] or {}
        print(f"{r['label']:<28}{f(r['ttft_p50_ms']):>9}{f(r['ttft_p99_ms']):>9}{f(r['tpot_p50_ms']):>9}"
              f"{f(r['tpot_p99_ms']):>8}{f(r['tpot_p50_low_ms']):>8}{f(r['peak_throughput_tok_s'], '{:.0f}'):>9}"
              f"{f(r.get('saturated_tok_s'), '{:.0f}'):>10}{f(r['ratios']['ttft_p50_vs_tp'], '{:.2f}'):>8}"
              f"{f(r['ratios']['saturated_vs_dp'], '{:.2f}'):>7}{f(fp.get('switches'), '{}'):>9}  "
              f"{fp.get('steps', '-')}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = parser()
    a = p.parse_args(argv)
    if a.child:
        child_main(a.child)
        return 0
    if not a.cpu:
        import torch

        if not torch.cuda.is_available():
            print("bench_vllm_serve: needs CUDA GPUs and vLLM, or --cpu with vLLM's CPU build; skipped")
            return 0
    o = resolve(a, p)
    requests, phases, flood = trace(o)
    longest = max(r.prompt_len + r.output_len for r in requests + flood)
    max_model_len = o["max_model_len"] or -(-(longest + 1) // 256) * 256
    print(f"trace: {len(requests)} requests over {requests[-1].arrival:.1f}s in {len(phases)} phases"
          f"{f', then {len(flood)} at once' if flood else ''}; cases {o['case_list']} on P={o['world']} "
          f"({'CPU' if o['cpu'] else 'GPU'}), model {o['shape']} {o['dtype']}, max_model_len {max_model_len}",
          flush=True)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = work / "model"
        write_model_dir(o, model_dir)
        for i, case in enumerate(o["case_list"]):
            kw = engine_kwargs(o, case, str(model_dir), max_model_len)
            shown = {k: v for k, v in kw.items() if k in ("tensor_parallel_size", "data_parallel_size",
                                                          "additional_config")}
            print(f"== case {case} ({i + 1}/{len(o['case_list'])}): {_label(case, o['world'])} {json.dumps(shown)}; "
                  f"timeout {o['timeout']:.0f}s", flush=True)
            t0 = time.perf_counter()
            results[case] = run_child(o, case, {"case": case, "options": o, "engine": kw}, work)
            res = results[case]
            if "error" in res:
                print(f"== case {case}: FAILED after {time.perf_counter() - t0:.0f}s: {res['error']}", flush=True)
            else:
                lost = [k for k, g in res["trace"].items() if g["first"] is None]
                sat = f", saturated {res['flood_wall_s']:.1f}s" if flood else ""
                print(f"== case {case}: done in {time.perf_counter() - t0:.0f}s (engine start {res['startup_s']:.0f}s, "
                      f"trace {res['trace_wall_s']:.1f}s{sat})", flush=True)
                if lost:
                    res["error"] = f"case {case}: {len(lost)} requests produced no token"
    gpu = "cpu" if o["cpu"] else _gpu_name()
    path = None
    existing: list[dict] = []
    if o["out"]:
        from _bench import REPO

        path = Path(o["out"]) if Path(o["out"]).is_absolute() else REPO / o["out"]
        if path.is_file():
            existing = json.loads(path.read_text())
            if not isinstance(existing, list):
                raise SystemExit(f"{path} holds no JSON list of records; not appending to it")
    recs = records(o, results, requests, phases, flood, gpu, existing)
    if recs:
        print_table(recs)
    if path and recs:
        from _bench import write_records

        write_records(existing + recs, str(path))
    errors = {c: r for c, r in results.items() if "error" in r}
    for c, r in errors.items():
        print(f"\ncase {c} FAILED: {r['error']}\n--- the end of its log ---\n{r.get('log_tail', '')}", file=sys.stderr)
    return 1 if errors else 0


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0)


if __name__ == "__main__":
    sys.exit(main())
