"""`fusedpar demo`: the reference shift-parallel layers under static TP, static SP, shift and a
mixed (SP, TP) layout on local CPU processes, each step checked against an unsharded model.

Embedded default: a small Llama-architecture decoder stack (seeded random fp32 weights), a
workload of a few long prompts followed by short decode steps, 4 gloo processes. No download,
no GPU. Exits 1 if any step of any configuration differs from the unsharded reference.
"""

from __future__ import annotations

import argparse
import sys
import time

from fusedpar.layers import DecoderConfig
from fusedpar.layouts import ParallelLayout
from fusedpar.testing.dist import run_distributed
from fusedpar.testing.scenarios import Step, run_layer_scenario

DEMO_MODEL = DecoderConfig(hidden_size=256, num_q_heads=16, num_kv_heads=4, head_dim=16,
                           intermediate_size=512, rope_theta=10000.0)
REL_TOL = 1e-5  # fp32 sharded vs fp64 unsharded


def demo_workload() -> list[Step]:
    """Three prompts (71 tokens, not a multiple of 4), decode steps, a late prompt, more decode."""
    steps = [Step(((0, 37), (1, 23), (2, 11)))]
    steps += [Step(((0, 1), (1, 1), (2, 1)))] * 5
    steps += [Step(((3, 29), (0, 1), (1, 1), (2, 1)))]
    steps += [Step(((0, 1), (1, 1), (2, 1), (3, 1)))] * 5
    return steps


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fusedpar", description="fusedpar: shift-parallel transformer layers.")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser(
        "demo",
        help="run the reference layers in TP, SP, shift and mixed layouts on CPU processes and check them",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d.add_argument("--world-size", type=int, default=4,
                   help="number of local processes (GPUs in a real deployment); default 4")
    d.add_argument("--sp", type=int, default=None,
                   help="SP degree of the shift configuration's base mode (default: world size); "
                        "the shift mode is always TP = world size")
    d.add_argument("--tp", type=int, default=1, help="TP degree of the shift configuration's base mode (default 1)")
    d.add_argument("--threshold", type=int, default=16,
                   help="steps with at most this many tokens run in shift mode (TP), larger ones in base mode "
                        "(SP x TP); default 16 for this small workload")
    d.add_argument("--layers", type=int, default=4, help="decoder layers in the demo model (default 4)")
    d.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs")
    return p


def _configs(args) -> list[tuple[str, int, int, int]]:
    """(label, sp, tp, threshold) for static TP, static SP, shift and (if it fits) a mixed layout."""
    W = args.world_size
    sp = args.sp or W // args.tp
    if sp * args.tp != W:
        raise SystemExit(f"error: --sp {sp} x --tp {args.tp} must equal --world-size {W}")
    always_base, always_shift = 0, 2**62
    configs = [
        (f"static TP={W}", 1, W, always_shift),
        (f"static SP={W}", W, 1, always_base),
        (f"shift (SP={sp},TP={args.tp}) <-> TP={W}", sp, args.tp, args.threshold),
    ]
    if W % 2 == 0 and W >= 4 and (sp, args.tp) != (2, W // 2):
        configs.append((f"shift (SP=2,TP={W // 2}) <-> TP={W}", 2, W // 2, args.threshold))
    return configs


def run_demo(args) -> int:
    if args.world_size < 1 or args.layers < 1 or args.threshold < 0:
        raise SystemExit("error: --world-size and --layers must be >= 1, --threshold >= 0")
    cfg = DEMO_MODEL
    steps = demo_workload()
    configs = _configs(args)
    for label, sp, tp, _ in configs:  # fail here, with the constraint, not inside a worker process
        try:
            ParallelLayout(args.world_size, sp=sp, tp=tp).weight_shards(cfg.dims)
        except ValueError as e:
            raise SystemExit(f"error: {label} cannot hold the demo model "
                             f"({cfg.num_q_heads} q / {cfg.num_kv_heads} kv heads, MLP {cfg.intermediate_size}): {e}"
                             ) from None
    print(f"fusedpar demo: {args.layers}-layer Llama-style stack (hidden {cfg.hidden_size}, "
          f"{cfg.num_q_heads} q / {cfg.num_kv_heads} kv heads), {len(steps)} steps, "
          f"{args.world_size} CPU processes, gloo", flush=True)
    rows, ok = [], True
    for i, (label, sp, tp, threshold) in enumerate(configs, 1):
        print(f"[{i}/{len(configs)}] {label} ...", end=" ", flush=True)
        t0 = time.perf_counter()
        per_rank = run_distributed(run_layer_scenario, args.world_size, cfg, sp, tp, steps,
                                   num_layers=args.layers, threshold=threshold, seed=args.seed)
        wall = time.perf_counter() - t0
        recs = per_rank[0].steps
        err = max(max(s.rel_error for s in r.steps) for r in per_rank)
        cache_err = max(r.cache_rel_error for r in per_rank)
        passed = err < REL_TOL and cache_err < REL_TOL
        ok &= passed
        print(f"{'ok' if passed else 'MISMATCH'} ({wall:.1f}s)", flush=True)
        rows.append((label, sum(s.mode == "base" for s in recs), sum(s.mode == "shift" for s in recs),
                     sum(s.padded_tokens - s.tokens for s in recs), err, cache_err, passed))
    header = ("configuration", "base steps", "shift steps", "pad tokens", "max rel err", "cache rel err", "check")
    widths = [max(len(header[0]), *(len(r[0]) for r in rows)), 10, 11, 10, 11, 13, 8]
    print()
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    for r in rows:
        cells = (r[0], str(r[1]), str(r[2]), str(r[3]), f"{r[4]:.2e}", f"{r[5]:.2e}", "ok" if r[6] else "FAIL")
        print("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)))
    print(f"\nreference: unsharded fp64 model; tolerance {REL_TOL:g} relative. "
          + ("All configurations match." if ok else "MISMATCH: see FAIL rows."))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        return run_demo(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
