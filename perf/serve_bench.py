"""Benchmark: bursty-traffic serving over the fusedpar stack, one layout policy after another on one trace.

A trace-driven continuous-batching loop (a benchmark harness, not a serving engine): paged KV
(PagedKVCache), chunked prefill under a token budget per step and replica, greedy decode (the sp == 1
layouts replay CUDA graphs of their decode and mixed prefill + decode steps on GPUs, base-mode steps
run eagerly; everything is eager on CPU). The model: the
--model decoder shape (perf/shapes.py) x --layers with random weights, a replicated embedding and
lm_head. W = world size; layouts tpW (tp=W), spW (sp=W), dpW (dp=W, one rank per replica).

Trace (perf/_serve/trace.py): Poisson arrivals in alternating phases, low load (--low-rate req/s for
--low-seconds) and bursts (--burst-rate for --burst-seconds), each phase's rate uniform in its range;
prompts and outputs uniform in --prompt / --output; --priority-frac of the requests high priority;
--seed fixes it. Every policy serves the same trace.

Policies (--policies; fusedpar.layers.layout_policy):
  tp      static tpW                           ShiftThresholdPolicy(tpW)
  dp      static dpW                           ShiftThresholdPolicy(dpW)
  sp      static spW (base mode every step)    ShiftThresholdPolicy(spW, threshold=0)
  shift   spW above --shift-threshold tokens, tpW at or below (no KV moves: same heads, weight views)
  load    dpW <-> tpW by requests in flight    LoadPolicy(low, high, urgent = priority 0 when priorities)
          (KV migrated along kv_plan with migrate_kv at each switch)
  pd      prefill in one layout, decode in another, through the host KV tier (PrefillDecodePolicy +
          HostKVTier: prompts done go to the tier, the decode phase swaps them in)
  auto    AutoPolicy over tpW, spW, dpW from step-time curves measured at start-up on this machine
          (fusedpar.layers.measure_step_times: a prefill step per token count and a decode step per
          sequence count, per layout, on the path serving takes: graph replays for the sp == 1 layouts)
          and a dp <-> tp switch cost measured the same way (unless --auto-switch-s), plus the queue the
          scheduler sees.

Clock (perf/_serve/loop.py): virtual. Every iteration of the loop is timed on the wall clock (max over
ranks) and the clock advances by it; when nothing runs or waits the clock jumps to the next arrival.
On GPUs this is a real-time replay without the idle sleeps; on CPU, slow steps still replay the whole
trace (loads relative to step times are then far lower than on GPUs: --rate-scale raises them).
--fixed-step-s replaces the measured time by a constant per iteration (a simulated, reproducible clock).

Output per policy: p50 / p99 TTFT and TPOT (all and high priority), output throughput per load phase
(low, burst, drain) and peak (--peak-window), steps and time per layout, switches per direction, time
spent switching and swapping; with --saturate N (GPU default 256) the same policy then serves N more
requests that all arrive at once, and saturated_tok_s (their output tokens over the time to finish
them) measures its capacity, which the windowed peak of a trace it keeps up with does not. One
record per policy is appended to --out (a JSON list; bench "serve", the keys of every benchmark:
baseline = static tpW, baseline_ms / fused_ms = p50 TTFT ms of the baseline / the policy, speedup
their ratio, roofline_pct null), and a timeline plot is drawn (--plot; offered load, layout in
use, TTFT) when matplotlib is installed.

Duration: every policy replays the whole trace, on GPUs in about its real length. Policies can be
split over runs with --policies: the records append to --out, and a run without tp takes its
baseline from the static tp record of the same trace there.

Usage (repo root):
    torchrun --nproc-per-node 4 perf/serve_bench.py [--policies tp,shift] [--requests 2000] [--out ...]
    python perf/serve_bench.py --cpu --world 2 [--requests 24]   # gloo processes, a tiny model
Without CUDA or torchrun (and without --cpu) it prints a message and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fusedpar from this checkout
import _bench  # setup and records shared by the benchmarks
import shapes
import torch

POLICIES = ("tp", "dp", "sp", "shift", "load", "pd", "auto")
TINY = dict(hidden=64, heads=8, kv_heads=4, head_dim=16, intermediate=128, layers=2, vocab=256)
# defaults that differ between a GPU run and a --cpu run (tiny model, fp32, a few dozen short requests)
GPU_DEFAULTS = dict(model="llama8b", dtype="bf16", requests=2000, prompt="100,2000", output="50,500",
                    low_seconds=20.0, burst_seconds=5.0, max_batch_tokens=2048, max_seqs=256, block_size=16,
                    host_tier_tokens=32768, load_low=8, load_high=32, curve_points="1,16,64,256,1024,2048",
                    curve_iters=3, warmup_requests=16, saturate=256)
CPU_DEFAULTS = dict(model="tiny", dtype="fp32", requests=24, prompt="4,40", output="2,12", low_seconds=3.0,
                    burst_seconds=1.0, max_batch_tokens=32, max_seqs=16, block_size=4, host_tier_tokens=256,
                    load_low=2, load_high=6, curve_points="1,4,16,32", curve_iters=2, warmup_requests=4, saturate=0)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _pair(text: str, kind=float) -> tuple:
    lo, hi = (kind(x) for x in text.split(","))
    return lo, hi


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model and machine")
    g.add_argument("--model", help="a perf/shapes.py key, or 'tiny' (2 layers, hidden 64, 8 q / 4 kv heads of "
                   "16, vocab 256); default llama8b, --cpu: tiny")
    g.add_argument("--layers", type=int, help="decoder layers (default: the model's)")
    g.add_argument("--vocab", type=int, help="vocabulary of the embedding and lm_head (default: the model's)")
    g.add_argument("--dtype", choices=sorted(DTYPES), help="weights, activations and KV (default bf16, --cpu: fp32)")
    g.add_argument("--cpu", action="store_true", help="spawn --world gloo processes on this machine's CPU")
    g.add_argument("--world", type=int, default=2, help="--cpu processes (default 2; >= 2)")
    g.add_argument("--no-graphs", action="store_true", help="GPU: decode steps eager (no CUDA graphs)")
    g = p.add_argument_group("trace")
    g.add_argument("--requests", type=int, help="requests in the trace (default 2000, --cpu: 24)")
    g.add_argument("--seed", type=int, default=0, help="seed of the trace, the prompts and the weights (default 0)")
    g.add_argument("--low-rate", default="2,5", help="low-load phases: arrival rate range, req/s (default 2,5)")
    g.add_argument("--burst-rate", default="10,30", help="burst phases: arrival rate range, req/s (default 10,30)")
    g.add_argument("--low-seconds", type=float, help="duration of a low-load phase, s (default 20, --cpu: 3)")
    g.add_argument("--burst-seconds", type=float, help="duration of a burst phase, s (default 5, --cpu: 1)")
    g.add_argument("--rate-scale", type=float, default=1.0, help="multiplies every arrival rate (default 1)")
    g.add_argument("--prompt", help="prompt tokens, uniform in lo,hi (default 100,2000, --cpu: 4,40)")
    g.add_argument("--output", help="output tokens, uniform in lo,hi (default 50,500, --cpu: 2,12)")
    g.add_argument("--priority-frac", type=float, default=0.0,
                   help="fraction of high-priority requests (e.g. 0.1); they are admitted first and make the load "
                        "policy go to TP at once (default 0: no priorities)")
    g = p.add_argument_group("scheduler")
    g.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated subset of {','.join(POLICIES)} "
                   "(default all; order kept)")
    g.add_argument("--max-batch-tokens", type=int, help="token budget of a step, per replica (default 2048, "
                   "--cpu: 32)")
    g.add_argument("--max-seqs", type=int, help="resident sequences per replica (default 256, --cpu: 16)")
    g.add_argument("--block-size", type=int, help="KV block size in tokens (default 16, --cpu: 4)")
    g.add_argument("--kv-blocks", type=int, default=0,
                   help="KV pool per rank, in blocks of ONE kv head (a layout with h kv heads per rank gets "
                        "kv_blocks // h blocks); default 0: 30%% of the free GPU memory, 4096 on CPU")
    g = p.add_argument_group("policies")
    g.add_argument("--shift-threshold", type=int, default=None,
                   help="shift: tpW at or below this many tokens per step (default: the library's, 1024)")
    g.add_argument("--load-low", type=int, help="load: back to tpW at <= this many requests in flight (default 8, "
                   "--cpu: 2)")
    g.add_argument("--load-high", type=int, help="load: to dpW at >= this many requests in flight (default 32, "
                   "--cpu: 6)")
    g.add_argument("--pd-layouts", default="dp,tp", help="pd: prefill layout,decode layout (default dp,tp)")
    g.add_argument("--host-tier-tokens", type=int,
                   help="pd: host KV tier budget in tokens of request footprint (prompt + output - 1) over all live "
                        "requests (default 32768, --cpu: 256)")
    g.add_argument("--auto-ttft-goal", type=float, default=1.0, help="auto: latency goal of waiting requests, s "
                   "(default 1.0)")
    g.add_argument("--auto-decode-steps", type=int, default=32, help="auto: decode steps in its serve estimate "
                   "(default 32)")
    g.add_argument("--auto-switch-s", type=float, default=None,
                   help="auto: cost of a switch, s (default: a dp <-> tp switch of one budget of KV per replica, "
                        "measured at start-up)")
    g.add_argument("--curve-points", help="auto: tokens per step of the measured curves (default "
                   "1,16,64,256,1024,2048, --cpu: 1,4,16,32), capped at what one step of the layout takes "
                   "(--max-batch-tokens x its replicas), which is always a point")
    g.add_argument("--curve-iters", type=int, help="auto: timed steps per curve point (median; default 3, --cpu: 2)")
    g = p.add_argument_group("run and output")
    g.add_argument("--warmup-requests", type=int, help="untimed warm-up: the first N requests under static tp, sp, "
                   "dp before the policies (compiles the kernels, opens the groups; default 16, --cpu: 4), after "
                   "one eager sp step per shape the scheduler can make (Engine.warm_base); 0: no warm-up")
    g.add_argument("--fixed-step-s", type=float, default=0.0,
                   help="advance the clock by this many seconds per loop iteration instead of the measured time "
                        "(a simulated clock: reproducible schedules on any machine; TTFT/TPOT then count "
                        "iterations, not speed; default 0: measured)")
    g.add_argument("--progress-s", type=float, default=5.0, help="a progress line every this many wall seconds")
    g.add_argument("--saturate", type=int, metavar="N",
                   help="then serve N more requests arriving at once, per policy: its saturated throughput, i.e. "
                        "capacity (default 256, --cpu: 0 = no saturated run)")
    g.add_argument("--peak-window", type=float, default=2.0, help="window of the peak throughput, s (default 2)")
    g.add_argument("--out", default="perf/results/serve.json", help="JSON list the records are appended to "
                   "(relative: to the repo root)")
    g.add_argument("--plot", default=None, help="timeline PNG (default: --out with the suffix _timeline.png)")
    g.add_argument("--tokens-out", default=None, help="also write every policy's greedy tokens per request as JSON "
                   "{policy: {request id: [tokens]}}")
    g.add_argument("--timeout", type=float, default=1800.0, help="--cpu: seconds before the processes are killed")
    return p


def resolve(a: argparse.Namespace) -> dict:
    """The options with the GPU or --cpu defaults filled in, as a plain dict (picklable for the ranks)."""
    opts = dict(vars(a))
    for k, v in (CPU_DEFAULTS if a.cpu else GPU_DEFAULTS).items():
        if opts.get(k) is None:
            opts[k] = v
    unknown = [p for p in opts["policies"].split(",") if p not in POLICIES]
    if unknown:
        raise SystemExit(f"unknown policies {unknown}; known: {list(POLICIES)}")
    if opts["model"] == "tiny":
        opts["shape"] = dict(TINY)
    else:
        s = shapes.shape(opts["model"])
        opts["shape"] = dict(hidden=s.hidden, heads=s.heads, kv_heads=s.kv_heads, head_dim=s.head_dim,
                             intermediate=s.intermediate, layers=s.layers, vocab=s.vocab, rope_theta=s.rope_theta,
                             qk_norm=s.qk_norm, name=s.name)
    opts["layers"] = opts["layers"] or opts["shape"]["layers"]
    opts["vocab"] = opts["vocab"] or opts["shape"]["vocab"]
    return opts


def decoder_config(o: dict):
    from fusedpar.layers import DecoderConfig

    s = o["shape"]
    return DecoderConfig(hidden_size=s["hidden"], num_q_heads=s["heads"], num_kv_heads=s["kv_heads"],
                         head_dim=s["head_dim"], intermediate_size=s["intermediate"],
                         rope_theta=s.get("rope_theta", 10000.0), qk_norm=s.get("qk_norm", False))


def trace_of(o: dict):
    """(requests, phases) of the options' trace."""
    from _serve.trace import make_trace

    return make_trace(_spec(o))


def flood_of(o: dict) -> list:
    """The --saturate requests (all arriving at t = 0; [] without a saturated run)."""
    from _serve.trace import make_flood

    return make_flood(_spec(o), o["saturate"]) if o["saturate"] else []


def _spec(o: dict):
    from _serve.trace import TraceSpec

    return TraceSpec(
        requests=o["requests"], seed=o["seed"], low_rate=_pair(o["low_rate"]), burst_rate=_pair(o["burst_rate"]),
        low_seconds=o["low_seconds"], burst_seconds=o["burst_seconds"], prompt=_pair(o["prompt"], int),
        output=_pair(o["output"], int), priority_frac=o["priority_frac"], rate_scale=o["rate_scale"])


def policy_label(key: str, world: int, o: dict) -> str:
    a, b = o["pd_layouts"].split(",")
    return {"tp": f"static tp{world}", "dp": f"static dp{world}", "sp": f"static sp{world}",
            "shift": f"shift sp{world}<->tp{world}", "load": f"load dp{world}<->tp{world}",
            "pd": f"pd {a}{world}->{b}{world} host tier", "auto": "auto"}[key]


def make_policy(key: str, e, o: dict, curves: dict | None, switch_s: float | None, decode_curves: dict | None = None):
    from fusedpar.layers import AutoPolicy, LoadPolicy, PrefillDecodePolicy, ShiftThresholdPolicy

    L = e.layouts
    if key in ("tp", "dp"):
        return ShiftThresholdPolicy(L[key])
    if key == "sp":
        return ShiftThresholdPolicy(L["sp"], threshold=0)
    if key == "shift":
        return ShiftThresholdPolicy(L["sp"], threshold=o["shift_threshold"])
    if key == "load":
        return LoadPolicy(L["dp"], L["tp"], low=o["load_low"], high=o["load_high"],
                          urgent_priority=0 if o["priority_frac"] > 0 else None, initial=L["tp"])
    if key == "pd":
        a, b = o["pd_layouts"].split(",")
        return PrefillDecodePolicy(L[a], L[b])
    return AutoPolicy({L[k]: curves[k] for k in ("tp", "sp", "dp")}, latency_goal_s=o["auto_ttft_goal"],
                      decode_steps=o["auto_decode_steps"], switch_s=switch_s, initial=L["tp"],
                      decode_curves={L[k]: decode_curves[k] for k in ("tp", "sp", "dp")})


def curve_ms(curve) -> list[list]:
    """A StepTimeCurve as [[tokens, ms], ...] (the records' form)."""
    return [[n, s * 1e3] for n, s in zip(curve.tokens, curve.seconds, strict=True)]


def _check_room(e, requests, o: dict) -> None:
    """Every request fits every layout's KV cache and the host tier (else no policy could serve it)."""
    worst = max(r.footprint for r in requests)
    blocks = -(-worst // o["block_size"])
    room = min(e.pool.num_blocks // len(h) for h in e.heads.values()) - 1
    if blocks > room:
        raise ValueError(f"a request of {worst} tokens needs {blocks} KV blocks, a layout's cache holds {room}: "
                         f"raise --kv-blocks (now {e.pool.num_blocks})")
    if "pd" in o["policies"].split(",") and worst > o["host_tier_tokens"]:
        raise ValueError(f"a request of {worst} tokens exceeds --host-tier-tokens {o['host_tier_tokens']}")


def worker(rank: int, world: int, o: dict) -> dict | None:
    """Every policy over the trace on this rank; rank 0 returns {"records", "outputs", "plot"}."""
    from _serve.engine import Engine, EngineOptions
    from _serve.loop import SLOW_STEP_S, PolicyRun
    from _serve.metrics import summarize, summarize_saturated
    from _serve.trace import prompt_ids

    t_start = time.perf_counter()

    def log(msg: str) -> None:
        if rank == 0:
            print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    device = torch.device("cpu") if o["cpu"] else torch.device("cuda", torch.cuda.current_device())
    cfg = decoder_config(o)
    requests, phases = trace_of(o)
    prompts = {r.rid: prompt_ids(r, o["vocab"], o["seed"]) for r in requests}
    flood = flood_of(o)
    flood_prompts = {r.rid: prompt_ids(r, o["vocab"], o["seed"] + 1) for r in flood}
    eo = EngineOptions(cfg=cfg, layers=o["layers"], vocab=o["vocab"], dtype=DTYPES[o["dtype"]], seed=o["seed"],
                       block_size=o["block_size"], kv_blocks=o["kv_blocks"], max_batch_tokens=o["max_batch_tokens"],
                       max_seqs=o["max_seqs"], max_context=max(r.prompt_len + r.output_len for r in requests + flood),
                       graphs=not o["no_graphs"])
    log(f"trace: {len(requests)} requests over {requests[-1].arrival:.1f}s in {len(phases)} phases; building "
        f"the model ({o['layers']} layers, {o['dtype']}) on {world} ranks")
    e = Engine(eo, rank, world, device, log)
    _check_room(e, requests + flood, o)
    keys = o["policies"].split(",")
    curves, switch_s, decode_curves = None, o["auto_switch_s"], None
    if "auto" in keys:
        asked, budget = [int(x) for x in o["curve_points"].split(",")], o["max_batch_tokens"]
        # each layout up to the tokens one of its steps can take: the budget per replica times its replicas
        pts = {k: sorted({min(n, budget * e.layouts[k].dp) for n in asked} | {budget * e.layouts[k].dp})
               for k in ("tp", "sp", "dp")}
        curves = {k: e.step_curve(k, pts[k], o["curve_iters"]) for k in ("tp", "sp", "dp")}
        # decode steps run other paths (TP / DP: decode graphs): their own curve, up to max_seqs sequences
        dec = sorted({min(n, o["max_seqs"]) for n in asked})
        decode_curves = {k: e.step_curve(k, dec, o["curve_iters"], decode=True) for k in ("tp", "sp", "dp")}
        if switch_s is None:
            switch_s = e.switch_cost(o["max_batch_tokens"], o["curve_iters"])
        log("auto: step-time curves (tokens:ms) " + "; ".join(
            f"{k}: " + " ".join(f"{n}:{s:.2f}" for n, s in curve_ms(c)) for k, c in curves.items())
            + "; decode (sequences:ms) " + "; ".join(
            f"{k}: " + " ".join(f"{n}:{s:.2f}" for n, s in curve_ms(c)) for k, c in decode_curves.items())
            + f"; switch {switch_s * 1e3:.2f} ms")
    if o["warmup_requests"]:
        steps = e.warm_base("sp", log)
        log(f"warm-up sp: {steps} base-mode step shapes")
        warm = requests[:o["warmup_requests"]]
        for key in ("tp", "sp", "dp"):
            PolicyRun(e, f"warm-up {key}", make_policy(key, e, o, None, None), warm, prompts, priorities=False,
                      progress_s=o["progress_s"], log=log).run()
        log("warm-up done")
    def serve(name: str, pol, reqs: list, reqs_prompts: dict):
        return PolicyRun(e, name, pol, reqs, reqs_prompts, priorities=o["priority_frac"] > 0,
                         host_tier_tokens=o["host_tier_tokens"], fixed_step_s=o["fixed_step_s"],
                         progress_s=o["progress_s"], log=log).run()

    results, labels, policies, saturated = [], [], [], []
    for key in keys:
        label = policy_label(key, world, o)
        pol = make_policy(key, e, o, curves, switch_s, decode_curves)
        policies.append(pol)
        log(f"policy {label}: {pol!r}")
        results.append(serve(label, pol, requests, prompts))
        labels.append(key)
        r = results[-1]
        log(f"policy {label}: done in {r.wall_s:.1f}s wall, {r.end:.2f}s on the clock; longest iteration "
            f"{r.max_step_s * 1e3:.1f} ms, {len(r.slow_steps)} over {SLOW_STEP_S * 1e3:.0f} ms, Triton compiles "
            f"{dict(r.compiles) or 0}")
        if flood:  # the same policy, fresh, on requests that all arrive at once
            saturated.append(serve(f"{label} saturated", make_policy(key, e, o, curves, switch_s, decode_curves),
                                   flood, flood_prompts))
            log(f"policy {label}: {len(flood)} requests at once served in {saturated[-1].end:.2f}s on the clock")
    if rank != 0:
        return None
    metrics = [summarize(res, requests, phases, o["peak_window"]) for res in results]
    for m, sat in zip(metrics, saturated, strict=False):
        m.update(summarize_saturated(sat, flood))
    base = metrics[labels.index("tp")] if "tp" in labels else metrics[0]
    base_label = results[labels.index("tp")].policy if "tp" in labels else results[0].policy
    model = o["shape"].get("name", "tiny")
    common = {"world": world, "gpu": "cpu" if o["cpu"] else torch.cuda.get_device_name(),
              **_bench.run_info(None if o["cpu"] else world), "model": model, "layers": o["layers"],
              "dtype": o["dtype"], "clock": (f"simulated: {o['fixed_step_s']} s per iteration" if o["fixed_step_s"]
                        else "virtual: measured iteration times, idle gaps skipped"),
              "trace": {k: o[k] for k in ("requests", "seed", "low_rate", "burst_rate", "low_seconds", "burst_seconds",
                                          "rate_scale", "prompt", "output", "priority_frac")},
              "max_batch_tokens": o["max_batch_tokens"], "max_seqs": o["max_seqs"], "block_size": o["block_size"],
              "kv_blocks": e.pool.num_blocks, "cuda_graphs": bool(e.cuda and not o["no_graphs"])}
    tokens = sum(r.prompt_len + r.output_len for r in requests)
    records = []
    for key, pol, res, m in zip(labels, policies, results, metrics, strict=True):
        rec = {**common, "bench": "serve", "case": f"{res.policy} {model}", "tokens": tokens,
               "baseline": base_label, "baseline_ms": base["ttft_p50_ms"], "fused_ms": m["ttft_p50_ms"],
               "speedup": base["ttft_p50_ms"] / m["ttft_p50_ms"], "roofline_pct": None, "policy": key,
               "policy_repr": repr(pol), **m, "max_iteration_ms": res.max_step_s * 1e3,
               "slow_iterations": [{"clock_s": round(t, 3), "ms": round(d * 1e3, 1), "layout": lay, "tokens": n,
                                    "sequences": q} for t, d, lay, n, q in res.slow_steps[:20]],
               "slow_iterations_total": len(res.slow_steps), "triton_compiles": dict(res.compiles)}
        if key == "auto":
            rec["curves_ms"] = {k: curve_ms(c) for k, c in curves.items()}
            rec["decode_curves_ms"] = {k: curve_ms(c) for k, c in decode_curves.items()}
            rec["auto_switch_ms"] = switch_s * 1e3
        if key == "pd":
            rec["host_tier_tokens"] = o["host_tier_tokens"]
        if key == "shift":
            rec["shift_threshold"] = pol.rule.threshold
        records.append(rec)
    return {"records": records, "outputs": {res.policy: res.outputs for res in (*results, *saturated)},
            "metrics": list(zip([r.policy for r in results], metrics, strict=True)),
            "results": results, "requests": requests}


def _rebase(records: list[dict], existing: list[dict]) -> None:
    """Records of a call without the static tp policy take their baseline from the latest static tp record
    in `existing` of the same trace, model, layers, dtype and world (policies split over several calls)."""
    if any(r["policy"] == "tp" for r in records):
        return
    same = ("trace", "model", "layers", "dtype", "world", "max_batch_tokens")
    base = [r for r in existing if r.get("bench") == "serve" and r.get("policy") == "tp"
            and all(r.get(k) == records[0][k] for k in same)]
    if base:
        for r in records:
            r["baseline"], r["baseline_ms"] = base[-1]["case"].removesuffix(" " + r["model"]), base[-1]["ttft_p50_ms"]
            r["speedup"] = r["baseline_ms"] / r["fused_ms"]


def report(out: dict, o: dict, world: int) -> None:
    """Print the table, append the records to --out, draw the plot, write --tokens-out (rank 0)."""
    from _serve.metrics import plot, print_table

    print_table(out["metrics"])
    path = Path(o["out"])
    path = path if path.is_absolute() else _bench.REPO / path
    existing = []
    if path.is_file():
        existing = json.loads(path.read_text())
        if not isinstance(existing, list):
            raise SystemExit(f"{path} holds no JSON list of records; not appending to it")
    _rebase(out["records"], existing)
    _bench.write_records(existing + out["records"], str(path))
    plot_path = Path(o["plot"]) if o["plot"] else path.with_name(path.stem + "_timeline.png")
    rec = out["records"][0]
    plot(out["results"], out["requests"], plot_path,
         f"{rec['model']} x{rec['layers']} layers, {rec['dtype']}, {world}x {rec['gpu']}: {len(out['requests'])} "
         "requests, bursty Poisson trace")
    if o["tokens_out"]:
        Path(o["tokens_out"]).write_text(json.dumps(
            {p: {str(k): v for k, v in sorted(toks.items())} for p, toks in out["outputs"].items()}))


def main(argv: list[str] | None = None) -> int:
    o = resolve(parser().parse_args(argv))
    if o["cpu"]:
        from fusedpar.testing.dist import run_distributed

        out = run_distributed(worker, o["world"], o, timeout=o["timeout"])[0]
        report(out, o, o["world"])
        return 0
    if not _bench.torchrun_available():
        print("serve_bench: needs CUDA GPUs and torchrun (torchrun --nproc-per-node N ...), or --cpu; skipped")
        return 0
    _, rank, world = _bench.init_distributed()
    out = worker(rank, world, o)
    if rank == 0:
        report(out, o, world)
    if o["no_graphs"]:
        _bench.finish_distributed()
        return 0
    _bench.exit_without_teardown(0)  # CUDA graphs with NCCL work: leave without tearing the group down
    return 0


if __name__ == "__main__":
    sys.exit(main())
