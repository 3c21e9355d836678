"""`fusedpar demo`: a Hugging Face Llama model served with static TP, static SP, shift parallelism,
data parallelism and live re-sharding between layouts.

With no arguments: a small built-in Llama-architecture transformers model (4 layers, hidden 256,
16 q / 4 kv heads, vocab 1024, seeded random fp32 weights; no model is downloaded) is sharded by
fusedpar.integrations.hf.parallelize on 4 local CPU processes (gloo) and runs a mixed workload:
3 long prompts (237, 150, 93 tokens) generating 8 tokens each, then 16 short requests (5-20
tokens) generating 24 tokens each, greedy. Modes: static TP (every step TP over all processes),
static SP (every step Ulysses SP), shift (base SP x TP for steps above --threshold tokens, TP
over all processes for smaller ones: here the prefills run base, the decode steps shift) and, when
it is distinct, the mixed shift layout SP=2 x TP=W/2.

Then, on CPU by default (--dp / --no-dp choose), three data-parallel modes, in which each
replica of the model runs a contiguous block of every batch's rows and every rank gets the whole
batch's logits: static DP=W (W replicas, full weights on every rank); DP=W <-> TP=W, where each
phase prefills and decodes in TP=W, then switches live (model.reshard) to DP=W halfway through its
decode steps, the live sequences' KV moving to the replicas that run their rows; and prefill
SP=W -> decode DP=W, where each phase prefills in Ulysses SP=W and switches to DP=W right after
the prefill. The switching modes keep the weights of both layouts (views: no weight byte moves).

Each mode's logits at every real position of every step, and its greedy tokens, are checked
against the unsharded model (one teacher-forced forward per request on rank 0). Prints one
table: TTFT (prefill latency, mean over requests), TPOT (decode step latency, mean over
requests), tokens/s (prompt + generated tokens over the summed step latencies), steps run in
the base layout / the others (shift steps, TP over all W processes, except those marked DP: steps
a replica smaller than W ran on its own rows), max |logit error|; then a line per switching mode:
its switches, the weight and KV bytes they moved, and their time.
Exit status: 0 all modes match, 1 a mismatch (or a worker failed), 2 impossible options.
"""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_THRESHOLD = 64
RTOL = {"cpu": 1e-4, "cuda": 5e-2}  # max |logit err| / max |logit|: fp32 on CPU, bf16 on CUDA


def build_parser() -> argparse.ArgumentParser:
    from fusedpar import __version__

    p = argparse.ArgumentParser(prog="fusedpar", description="fusedpar: shift-parallel transformer layers.")
    p.add_argument("--version", action="version", version=f"fusedpar {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser(
        "demo",
        help="serve a small HF Llama model on local processes in up to seven modes: static TP, static SP, "
             "shift parallelism (SP <-> TP, and SP=2xTP <-> TP when distinct), static DP, DP <-> TP switched "
             "live mid-decode and prefill SP -> decode DP (the DP modes by default on CPU only); check every "
             "mode against the unsharded model, print latency and errors",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d.add_argument("--world-size", type=int, default=4, metavar="W",
                   help="number of local processes, one per GPU with --device cuda (default 4; >= 2). "
                        "Static TP and static SP use all W; the built-in model needs W to divide 16 "
                        "(its q heads) and 512 (its MLP width)")
    d.add_argument("--sp", type=int, default=None,
                   help="SP degree of the shift mode's base configuration (default W / --tp). "
                        "--sp x --tp must equal --world-size and --sp must be >= 2 (SP=1 is static TP); the shift "
                        "configuration is always TP = W")
    d.add_argument("--tp", type=int, default=None,
                   help="TP degree of the shift mode's base configuration (default W / --sp, i.e. 1 "
                        "when neither is given)")
    d.add_argument("--threshold", type=int, default=DEFAULT_THRESHOLD,
                   help="shift threshold: a step with at most this many tokens runs in shift mode (TP = W), "
                        f"a larger one in base mode (SP x TP); default {DEFAULT_THRESHOLD}, so the prefills "
                        "(200 and 480 tokens) run base and the decode steps (3 or 16 tokens) run shift; 0 = always "
                        "base")
    d.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu (default): W processes on gloo, fp32 weights, tolerance 1e-4 x max |logit|. "
                        "cuda: one process per GPU (W <= number of GPUs), NCCL, bf16 weights and fusedpar's "
                        "fused Triton kernels; the reference runs in bf16 on GPU 0, tolerance 5e-2 x max |logit|")
    d.add_argument("--model", metavar="PATH", default=None,
                   help="a local Hugging Face checkpoint directory (config.json + safetensors; Llama, Mistral, "
                        "Qwen2 or Qwen3) instead of the built-in model. Each rank reads only its shards "
                        "(load_parallel); prompts are random token ids within the vocabulary. The check loads "
                        "the full unsharded model on rank 0 (after its shards are freed) and so needs the memory "
                        "of the whole model on one device; --no-check skips it for big models")
    d.add_argument("--dp", action=argparse.BooleanOptionalAction, default=None,
                   help="run the data-parallel modes after the others: static DP=W, DP=W <-> TP=W (each phase "
                        "switches from TP=W to DP=W halfway through its decode, moving the live KV) and prefill "
                        "SP=W -> decode DP=W (switch right after each prefill). Default: on with --device cpu, "
                        "off with --device cuda (these modes are checked on CPU only so far); --no-dp leaves "
                        "them out")
    d.add_argument("--no-check", action="store_true",
                   help="skip the unsharded reference (timings only; ranks must still agree on the tokens)")
    d.add_argument("--rtol", type=float, default=None,
                   help="tolerance of the check, relative to the largest |logit| of the reference "
                        "(default 1e-4 on cpu / fp32, 5e-2 on cuda / bf16)")
    d.add_argument("--layers", type=int, default=None,
                   help="decoder layers of the built-in model (default 4; not with --model)")
    d.add_argument("--seed", type=int, default=0, help="seed of the built-in model's weights and of the prompts "
                                                      "(default 0)")
    d.add_argument("--inject-fault", default=None, help=argparse.SUPPRESS)  # test hook: a mode label
    d.set_defaults(parser=d)  # option errors are reported against the demo's own usage line
    return p


# ---- options -> modes, validated before any process starts -----------------------------------
def _modes(args, parser) -> list:
    from fusedpar.demo_workload import ALWAYS_SHIFT, WORKLOAD, Mode

    W = args.world_size
    for opt, other in (("sp", "tp"), ("tp", "sp")):  # one degree given: the other is W / it
        v = getattr(args, opt)
        if v is not None and getattr(args, other) is None and W % v:
            parser.error(f"--{opt} {v} does not divide --world-size {W} (the {other.upper()} degree would be "
                         f"{W} / {v})")
    tp = args.tp if args.tp is not None else (W // args.sp if args.sp else 1)
    sp = args.sp if args.sp is not None else W // tp
    if sp * tp != W:
        parser.error(f"--sp {sp} x --tp {tp} = {sp * tp} must equal --world-size {W}")
    if sp == 1:
        parser.error(f"--sp 1 (--tp {W}) makes the shift mode static TP={W}, which the demo runs already: "
                     f"a shift mode needs --sp >= 2")
    shift = f"shift SP={sp} <-> TP={W}" if tp == 1 else f"shift SP={sp}xTP={tp} <-> TP={W}"
    modes = [Mode(f"static TP={W}", 1, W, ALWAYS_SHIFT), Mode(f"static SP={W}", W, 1, 0),
             Mode(shift, sp, tp, args.threshold)]
    if args.sp is None and args.tp is None and W >= 4 and W % 2 == 0:
        modes.append(Mode(f"shift SP=2xTP={W // 2} <-> TP={W}", 2, W // 2, args.threshold, optional=True))
    if args.dp or (args.dp is None and args.device == "cpu"):
        half = min(p.new_tokens for p in WORKLOAD) // 2
        modes += [Mode(f"static DP={W}", 1, 1, ALWAYS_SHIFT),
                  Mode(f"DP={W} <-> TP={W}", 1, W, ALWAYS_SHIFT, decode=(1, 1), switch_after=half),
                  Mode(f"prefill SP={W} -> decode DP={W}", W, 1, 0, decode=(1, 1), switch_after=0)]
    return modes


def _validate(args, parser):
    """Check every option and the model against every mode's layout; returns (modes, model description)."""
    if args.world_size < 2:
        parser.error(f"--world-size must be >= 2 (got {args.world_size})")
    for opt in ("sp", "tp"):
        v = getattr(args, opt)
        if v is not None and v < 1:
            parser.error(f"--{opt} must be >= 1 (got {v})")
    if args.threshold < 0:
        parser.error(f"--threshold must be >= 0 (got {args.threshold})")
    if args.rtol is not None and not 0 < args.rtol < float("inf"):
        parser.error(f"--rtol must be > 0 and finite (got {args.rtol})")
    if not 0 <= args.seed < 2**62:  # torch generators take 64-bit seeds; the workers add small offsets
        parser.error(f"--seed must be in [0, 2**62) (got {args.seed})")
    if args.model is not None and args.layers is not None:
        parser.error("--layers applies to the built-in model only, not to --model")
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers must be >= 1 (got {args.layers})")
    modes = _modes(args, parser)
    if args.device == "cuda":
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n < args.world_size:
            parser.error(f"--device cuda runs one process per GPU: --world-size {args.world_size} needs "
                         f"{args.world_size} GPUs, this machine has {n}")
    if args.model is not None and not os.path.isfile(os.path.join(args.model, "config.json")):
        parser.error(f"--model {args.model}: not a local checkpoint directory (no config.json)")

    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from fusedpar.integrations.hf import UnsupportedModelError, inspect_model
    except ImportError as e:
        raise SystemExit(f"error: the demo needs transformers and fusedpar.integrations.hf ({e}); "
                         "install with: pip install -e '.[hf]'") from None
    from fusedpar.demo_workload import WORKLOAD, builtin_config

    try:
        config = builtin_config(args.layers or 4) if args.model is None else AutoConfig.from_pretrained(
            args.model, local_files_only=True)
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError, KeyError) as e:
        parser.error(f"--model {args.model}: transformers cannot build a causal LM from its config.json: {e}")
    longest = max(max(p.prompt_lens) + p.new_tokens for p in WORKLOAD)
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and limit < longest:
        parser.error(f"the model's max_position_embeddings={limit} is shorter than the workload's longest "
                     f"request ({longest} tokens)")
    fitting = []
    for mode in modes:
        try:
            for layout in mode.layouts(args.world_size):
                inspect_model(meta, layout, max_seq_len=longest)
        except UnsupportedModelError as e:
            if mode.optional:
                continue  # the extra mixed layout: left out when the model does not fit it
            parser.error(f"{mode.label} ({', '.join(map(repr, mode.layouts(args.world_size)))}) cannot run this "
                         f"model: {e}")
        fitting.append(mode)
    heads = f"{config.num_attention_heads} q / {getattr(config, 'num_key_value_heads', None)} kv heads"
    what = (f"built-in Llama-architecture model ({config.num_hidden_layers} layers, hidden {config.hidden_size}, "
            f"{heads}, vocab {config.vocab_size}, seeded random weights)" if args.model is None else
            f"{args.model} ({config.model_type}, {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
            f"{heads}, vocab {config.vocab_size})")
    return fitting, what


# ---- results -> table --------------------------------------------------------------------------
def _summarise(job, per_rank: list[list]) -> list[dict]:
    rows = []
    phases = job.workload
    requests = sum(len(p.prompt_lens) for p in phases)
    total_tokens = sum(p.prompt_tokens + len(p.prompt_lens) * p.new_tokens for p in phases)
    for m, mode in enumerate(job.modes):
        res = [r[m] for r in per_rank]
        r0 = res[0]
        prefill = [max(r.prefill_s[j] for r in res) for j in range(len(phases))]  # slowest rank per step
        decode = [[max(r.decode_s[j][k] for r in res) for k in range(len(r0.decode_s[j]))]
                  for j in range(len(phases))]
        ttft = sum(len(p.prompt_lens) * prefill[j] for j, p in enumerate(phases)) / requests
        tpot = sum(len(p.prompt_lens) * sum(decode[j]) / max(1, len(decode[j]))
                   for j, p in enumerate(phases)) / requests
        wall = sum(prefill) + sum(sum(d) for d in decode)
        ranks_agree = len({r.token_digest for r in res}) == 1
        bitwise = len({r.digest for r in res}) == 1
        problems = []
        if not ranks_agree:
            problems.append("ranks chose different tokens")
        tol = None
        if r0.checked:
            tol = job.rtol * r0.max_abs_logit
            if not r0.max_abs_err <= tol:
                problems.append("logits")
            if r0.token_mismatches:
                problems.append(f"{r0.token_mismatches} tokens")
        rows.append(dict(label=mode.label, ttft=ttft, tpot=tpot, tps=total_tokens / wall, base=r0.steps["base"],
                         shift=r0.steps["shift"], dp=r0.steps.get("dp", 0),
                         err=r0.max_abs_err if r0.checked else None, tol=tol,
                         scale=r0.max_abs_logit, ties=r0.near_ties, bitwise=bitwise, problems=problems,
                         ok=not problems))
    return rows


def _steps_cell(r: dict) -> str:
    """'base / others': the others are shift steps, except the DP ones named in parentheses."""
    dp = r.get("dp", 0)
    cell = f"{r['base']} / {r['shift'] + dp}"
    if dp:
        cell += " (all DP)" if not r["shift"] else f" ({r['shift']} shift, {dp} DP)"
    return cell


def _table(rows: list[dict]) -> str:
    header = ("mode", "TTFT ms", "TPOT ms", "tokens/s", "steps base/shift", "max |logit err|", "check")
    cells = [header]
    for r in rows:
        err = "not checked" if r["err"] is None else f"{r['err']:.2e}"
        check = "ok" if r["ok"] else "FAIL: " + ", ".join(r["problems"])
        if r["ok"] and r["err"] is None:
            check = "ok (ranks agree)"
        cells.append((r["label"], f"{1e3 * r['ttft']:.1f}", f"{1e3 * r['tpot']:.1f}", f"{r['tps']:.0f}",
                      _steps_cell(r), err, check))
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    lines = []
    for k, c in enumerate(cells):
        lines.append("  ".join((s.ljust(w) if i in (0, 6) else s.rjust(w)) for i, (s, w)
                               in enumerate(zip(c, widths, strict=True))).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _switch_line(mode, reshards: list[dict]) -> str:
    """One line on a re-sharding mode's live switches (timed run, rank 0's view; bytes are world totals)."""
    if not reshards:
        return f"{mode.label}: no switches"
    kv = sum(r["kv_bytes_moved"] for r in reshards)
    weights = sum(r["weight_bytes_moved"] for r in reshards)
    ms = 1e3 * sum(r["seconds"] for r in reshards) / len(reshards)
    return (f"{mode.label}: {len(reshards)} live switches, {weights} weight bytes and {kv / 2**20:.2f} MiB of KV "
            f"moved in all, {ms:.1f} ms per switch (rank 0)")


def run_demo(args, parser) -> int:
    modes, what = _validate(args, parser)
    from fusedpar.demo_workload import WORKLOAD, DemoJob, run_ranks
    from fusedpar.testing.dist import run_distributed

    W = args.world_size
    rtol = args.rtol if args.rtol is not None else RTOL[args.device]
    job = DemoJob(modes=tuple(modes), device=args.device, model_path=args.model, layers=args.layers or 4,
                  seed=args.seed, check=not args.no_check, rtol=rtol, fault=args.inject_fault)
    if args.inject_fault is not None and args.inject_fault not in {m.label for m in modes}:
        parser.error(f"--inject-fault: no mode {args.inject_fault!r} (modes: {[m.label for m in modes]})")
    where = (f"{W} CPU processes (gloo), fp32" if args.device == "cpu" else
             f"{W} GPUs, one process each (NCCL), bf16")
    work = "; ".join(f"{p.name}: {len(p.prompt_lens)} x {min(p.prompt_lens)}-{max(p.prompt_lens)} tokens, "
                     f"{p.new_tokens} generated each" for p in WORKLOAD)
    print(f"fusedpar demo: {what}\n  on {where}; shift threshold {args.threshold} tokens\n  workload: {work}\n"
          f"  modes: {', '.join(m.label for m in modes)}\nstarting {W} processes ...", flush=True)
    threads = max(1, (os.cpu_count() or 1) // W) if args.device == "cpu" else 1
    try:
        per_rank = run_distributed(run_ranks, W, job, timeout=7200.0 if args.model else 900.0, threads=threads)
    except RuntimeError as e:
        print(f"error: a worker process failed:\n{e}", file=sys.stderr, flush=True)
        return 1
    rows = _summarise(job, per_rank)
    print()
    print(_table(rows))
    print()
    if job.check:
        r = rows[0]
        print(f"max |logit err|: largest |sharded - unsharded| logit over every real position of every step "
              f"(max |logit| {r['scale']:.3g}); tolerance {rtol:g} x max |logit| = {r['tol']:.2e}. Greedy tokens "
              "must equal the unsharded argmax (near ties within the tolerance excepted"
              + (f": {sum(x['ties'] for x in rows)} seen" if any(x["ties"] for x in rows) else "") + ").")
    else:
        print("--no-check: not compared with the unsharded model; every rank chose the same tokens where 'ok'.")
    for mode, r in zip(job.modes, per_rank[0], strict=True):
        if mode.decode is not None:
            print(_switch_line(mode, r.reshards))
    if not all(r["bitwise"] for r in rows):
        print("note: logits differ bitwise between ranks in " + ", ".join(r["label"] for r in rows if not r["bitwise"]))
    if args.device == "cpu":
        print("CPU: the latencies are mostly gloo's collective latency on shared cores (an all-reduce takes "
              "several message rounds, an all-to-all one); they show the mechanics, not GPU performance.")
    print("TTFT: prefill step latency; TPOT: decode step latency (both slowest rank, mean over requests); "
          "tokens/s: (prompt + generated tokens) / sum of step latencies.")
    print(f"steps base/shift: steps in the base layout (SP x TP) / the others: shift steps (TP over all {W} "
          "processes), or the DP steps the parentheses name (replicas smaller than the world, each running its "
          "own rows of the batch: neither the base nor the shift layout).")
    ok = all(r["ok"] for r in rows)
    print("All modes match the unsharded model." if ok and job.check else
          "All modes ran; ranks agree." if ok else "MISMATCH: see the FAIL rows.", flush=True)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # against the subcommand's own usage line, which lists its options
        getattr(args, "parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "demo":
        return run_demo(args, args.parser)
    return 2


if __name__ == "__main__":
    sys.exit(main())
