"""Where an HF decode step's time goes on fusedpar's adapter with decode graphs (diagnosis).

    torchrun --nproc-per-node N perf/tools/probe_hf_decode.py [--layers 32] [--batch 1] [--profile-steps 32]

A diagnosis tool (no records, nothing asserted). bench_hf_decode.py measures TPOT with decode
graphs at ~35% of the weight-read floor while the batch size barely changes it: the step is host
bound. This splits one step (the same random Llama-3-8B-shaped model and layout as that bench):
  - generate's TPOT (as the bench measures it);
  - the same decode steps called directly (model(ids, past_key_values=...), no generate around
    them): generate's own per-step host work is the difference;
  - the stack's decode graph replayed alone (GPU time per replay, CUDA events), and its kernels
    (torch.profiler over back-to-back replays: time per kernel, busy time vs span);
  - our forward's parts per step, each timed with the GPU synchronised before and after it (so each
    holds its host and GPU time; nested parts are inside their parent's);
  - cProfile of generate on rank 0 (top functions by own time and by cumulative time).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # perf/: the shared bench modules
import _bench
from bench_hf_decode import add_model_arguments, build_model, start, timed_generate

_bench.add_repo_to_path()


def direct_steps_ms(pm, ids, mask, steps: int, around=contextlib.nullcontext) -> float:
    """ms per decode step of `steps` forward calls on a prefilled cache (greedy argmax between them);
    the steps (not the prefill) run inside around()."""
    with torch.no_grad():
        out = pm(ids, attention_mask=mask, use_cache=True)
        past, m = out.past_key_values, mask
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        with around():
            for _ in range(steps):
                m = torch.cat([m, m.new_ones((m.shape[0], 1))], dim=1)
                out = pm(nxt, attention_mask=m, past_key_values=past, use_cache=True)
                past = out.past_key_values
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                nxt.cpu()  # generate looks at its tokens every step
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / steps * 1e3


def replay_ms(pm, size: int, reps: int = 50) -> float:
    g = pm.fusedpar_stack.graphs
    for _ in range(5):
        g.replay_last(size)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dist.barrier()
    start.record()
    for _ in range(reps):
        g.replay_last(size)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


_INHERITED = object()


class SplitTimer:
    """Patches (owner, attribute) callables with wrappers that synchronise the GPU around the call and
    add its wall time to a per-name total (nested parts count inside their parents as well)."""

    def __init__(self, parts: dict[str, tuple[object, str]]):
        self.parts, self.saved = parts, {}
        self.total = dict.fromkeys(parts, 0.0)
        self.calls = dict.fromkeys(parts, 0)

    def __enter__(self):
        for name, (owner, attr) in self.parts.items():
            orig = getattr(owner, attr, None)
            if orig is None:  # a part this version of the code does not have
                continue
            # restore what the owner itself held (a class may inherit the attribute: then delete ours)
            self.saved[name] = (owner, attr, vars(owner).get(attr, _INHERITED))

            def wrapper(*a, _orig=orig, _name=name, **kw):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                try:
                    return _orig(*a, **kw)
                finally:
                    torch.cuda.synchronize()
                    self.total[_name] += time.perf_counter() - t0
                    self.calls[_name] += 1

            setattr(owner, attr, wrapper)
        return self

    def __exit__(self, *exc):
        for owner, attr, orig in reversed(self.saved.values()):
            if orig is _INHERITED:
                delattr(owner, attr)
            else:
                setattr(owner, attr, orig)


def split_parts(pm) -> dict[str, tuple[object, str]]:
    from fusedpar.integrations.hf import model, runtime
    from fusedpar.layers import graphs, stack

    return {
        "model forward": (type(pm), "forward"),
        "  embed_tokens": (pm.model.embed_tokens, "forward"),
        "  _run_step": (model, "_run_step"),
        "    _check_positions": (runtime, "_check_positions"),
        "    _Runtime._reserve": (runtime._Runtime, "_reserve"),
        "      _free_collected": (runtime._Runtime, "_free_collected"),
        "    _Runtime._ready_graphs": (runtime._Runtime, "_ready_graphs"),
        "    stack.forward": (stack.ShiftParallelStack, "forward"),
        "      graphs.stage": (graphs._StackGraphs, "stage"),
        "      CUDAGraph.replay": (torch.cuda.CUDAGraph, "replay"),
        "  final norm": (pm.model.norm, "forward"),
        "  lm_head": (pm.lm_head, "forward"),
    }


def kernel_profile(pm, size: int, rank: int, replays: int = 10) -> None:
    """torch.profiler over back-to-back replays of the decode graph: kernel time per replay by kernel
    (the graph's kernels are traced one by one) and the GPU's busy time vs the replay's span."""
    from profile_layer import idle_summary, kernel_table
    from torch.profiler import ProfilerActivity, profile

    g = pm.fusedpar_stack.graphs
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay_last(size)
        torch.cuda.synchronize()
    rows, total = kernel_table(prof, replays)
    idle = idle_summary(prof, replays)
    if rank == 0:
        layers = len(pm.fusedpar_stack.layers)
        print(f"\n== decode graph (size {size}) kernels per replay: {total:.0f} us kernel time "
              f"({total / layers:.1f} us per layer), span {idle['span_us']:.0f} us, busy {idle['busy_us']:.0f} us")
        for name, us, n in rows[:20]:
            print(f"  {us:8.1f} us  {100 * us / total:5.1f}%  x{n:<4d} {us / max(n, 1):6.2f} us each  {name}")
        for before, after, us, n, longest in idle["gaps"][:6]:
            print(f"   idle {us:7.1f} us  x{n:<5.1f} (max {longest:6.1f}) {before[:45]} -> {after[:45]}")
        sys.stdout.flush()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--batch", type=int, default=1, help="rows per generate")
    p.add_argument("--profile-steps", type=int, default=32, help="new tokens of the cProfiled generate")
    p.add_argument("--top", type=int, default=35, help="cProfile rows printed per table")
    args = p.parse_args()
    if not _bench.torchrun_available():
        print("probe_hf_decode: needs CUDA GPUs and a torchrun launch; nothing to do")
        return 0
    from fusedpar.integrations.hf import parallelize

    rank, world, device, lay = start(args)
    pm = parallelize(build_model(args, device), lay, shift_threshold=64)
    gen = torch.Generator().manual_seed(1)
    b = args.batch
    ids = torch.randint(1, 32000, (b, args.prompt), generator=gen).to(device)
    mask = torch.ones_like(ids)
    new = args.new_tokens

    timed_generate(pm, ids, mask, new)  # warm-up: capture, compiles
    samples = []
    for _ in range(3):
        t1, _ = timed_generate(pm, ids, mask, 1)
        tn, _ = timed_generate(pm, ids, mask, new)
        samples.append((tn - t1) / (new - 1) * 1e3)
    tpot = _bench.max_over_ranks(statistics.median(samples))
    direct_steps_ms(pm, ids, mask, 4)  # warm-up
    direct = _bench.max_over_ranks(statistics.median(direct_steps_ms(pm, ids, mask, new) for _ in range(3)))
    size = next(s for s in pm.fusedpar_stack.graphs.sizes if s >= b)
    replay = _bench.max_over_ranks(replay_ms(pm, size))
    if rank == 0:
        print(f"probe_hf_decode: {torch.cuda.get_device_name(device)} x{world}, {lay}, {args.layers} layers, batch {b}")
        print(f"  generate TPOT            {tpot:7.3f} ms")
        print(f"  direct forward per step  {direct:7.3f} ms   (generate's own host work ~{tpot - direct:.3f} ms)")
        print(f"  decode graph replay      {replay:7.3f} ms   (graph size {size}; the rest of a direct step: "
              f"{direct - replay:.3f} ms)", flush=True)

    kernel_profile(pm, size, rank)
    steps = 16
    timer = SplitTimer(split_parts(pm))
    direct_steps_ms(pm, ids, mask, steps, around=lambda: timer)
    if rank == 0:
        print(f"\n== one direct decode step, part by part (GPU synchronised around each part; per step, "
              f"mean of {steps})")
        for name, total in timer.total.items():
            print(f"  {name:28s} {total / steps * 1e3:8.3f} ms   ({timer.calls[name]} calls)")
        sys.stdout.flush()

    prof = cProfile.Profile()
    torch.cuda.synchronize()
    dist.barrier()
    prof.enable()
    pm.generate(ids, attention_mask=mask, max_new_tokens=args.profile_steps, min_new_tokens=args.profile_steps,
                do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    prof.disable()
    if rank == 0:
        for key in ("tottime", "cumulative"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).strip_dirs().sort_stats(key).print_stats(args.top)
            print(f"\n== cProfile of generate({args.profile_steps} new tokens), by {key} "
                  f"(divide by {args.profile_steps} for per step)")
            print(s.getvalue(), flush=True)
    _bench.exit_without_teardown(0)


if __name__ == "__main__":
    raise SystemExit(main())
