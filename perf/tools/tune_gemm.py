"""Sweep tile configs of the persistent Triton GEMM on the benchmark shapes (one GPU).

For every (shape, tokens) of perf/bench_gemm.py it times cuBLAS, the current pick_config()
choice and each candidate GemmConfig, and writes the table to --out (JSON). The winners feed the
heuristic in fusedpar/kernels/gemm/config.py:pick_config; this script changes nothing by itself.

    python3 perf/tools/tune_gemm.py --out perf/tools/out/gemm_tune.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # perf/: the shared bench modules
import bench_gemm  # the bench's shapes and timing helpers

from fusedpar.kernels import gemm
from fusedpar.kernels.gemm.config import SMEM_BYTES
from fusedpar.kernels.gemm.launch import _launch


def candidates(m: int) -> list[gemm.GemmConfig]:
    """Tile configs that fit Hopper shared memory: stages*(BM+BN)*BK*2 + BM*BN*2 bytes."""
    out = []
    if m <= 64:
        bm = max(16, 1 << (m - 1).bit_length())
        grid = itertools.product((32, 64, 128), (128, 256), (3, 4, 5), (4,))
        out = [gemm.GemmConfig(bm, bn, bk, 8, w, s) for bn, bk, s, w in grid]
    else:
        grid = itertools.product((64, 128), (64, 128, 256), (64, 128), (3, 4, 5), (4, 8))
        out = [gemm.GemmConfig(bm, bn, bk, 8, w, s) for bm, bn, bk, s, w in grid
               if not (bm == 64 and w == 8 and bn < 128)]
    return [c for c in out if c.num_stages * (c.block_m + c.block_n) * c.block_k * 2
            + c.block_m * c.block_n * 2 <= SMEM_BYTES]


def tma_candidates() -> list[gemm.GemmConfig]:
    """TMA-fed tilings (gemm/kernels.py's TMA mainloop), with the flattened and the nested tile loop."""
    base = [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 4, 5), (128, 128, 64, 8, 4),
            (128, 128, 128, 8, 3), (64, 256, 64, 4, 4), (64, 128, 128, 4, 4)]
    return [gemm.GemmConfig(bm, bn, bk, 8, w, s, tma=True, flatten=flat)
            for bm, bn, bk, w, s in base for flat in (True, False)]


def split_candidates() -> list[gemm.GemmConfig]:
    """TMA tilings whose tiles are two column blocks (gemm/kernels.py's BLOCK_N2): 160 = 128 + 32 and 320 = 256 + 64
    columns divide N = 2560 and 5120 into nearly full waves of 132 SMs at 512-2048 rows (192 = 128 + 64
    and 288 = 256 + 32 for comparison). Only the operand ring is checked against shared memory here:
    TMA builds reuse it for the epilogue; a tiling that still does not fit fails to launch and is
    recorded with its error."""
    out = []
    tiles = ((128, 128, 32), (128, 128, 64), (128, 256, 64), (128, 256, 32), (64, 256, 64))
    for (bm, bn, n2), s, flat in itertools.product(tiles, (2, 3, 4, 5), (True, False)):
        for w in ((4, 8) if bn == 128 else (8,) if bm == 128 else (4,)):
            cfg = gemm.GemmConfig(bm, bn, 64, 8, w, s, tma=True, flatten=flat, block_n2=n2)
            if s * (bm + bn + n2) * 64 * 2 <= SMEM_BYTES:
                out.append(cfg)
    # around pick_config's split tile: swizzle group, 8 warps (two warpgroups side by side in N)
    for g, w, s in itertools.product((1, 4, 16), (4, 8), (3, 4)):
        out.append(gemm.GemmConfig(64, 256, 64, g, w, s, tma=True, flatten=False, block_n2=64))
    out += [gemm.GemmConfig(64, 256, 64, 8, 8, s, tma=True, flatten=False, block_n2=64) for s in (3, 4)]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="llama70b,qwen32b")
    p.add_argument("--tokens", default="8,32,64,128,256,512,1024,2048,4096,8192,16384")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--budget-s", type=float, default=240.0, help="stop sweeping after this many seconds")
    p.add_argument("--tma-only", action="store_true",
                   help="sweep only the TMA tilings (tma_candidates) against the default and cuBLAS")
    p.add_argument("--split-only", action="store_true",
                   help="sweep only the two-column-block TMA tilings (split_candidates)")
    p.add_argument("--out", default="perf/tools/out/gemm_tune.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("tune_gemm: no CUDA device; nothing to tune")
        return 0
    dev = torch.device("cuda", 0)
    dtype = torch.bfloat16
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    t_start = time.time()
    rows = []
    for model in args.shapes.split(","):
        for case in bench_gemm.layer_cases(model):
            for m in map(int, args.tokens.split(",")):
                if time.time() - t_start > args.budget_s:
                    print("budget reached; stopping", flush=True)
                    break
                n, k = case.n, case.k
                w = bench_gemm.make_weight(case, dtype, "view", dev)
                sets = [(torch.randn((m, k), device=dev, dtype=dtype), w) for _ in range(4)]
                outs = [torch.empty((m, n), device=dev, dtype=dtype) for _ in range(4)]
                ref = torch.nn.functional.linear(*sets[0]).float()
                cublas = bench_gemm.time_ms(torch.nn.functional.linear, sets, args.iters, 3)
                # what matmul's launcher picks for these operands (TMA where the descriptors can work)
                default = gemm.pick_config(m, n, k, dtype=dtype, num_sms=sms, interpret=False,
                                           tma=gemm.tma_compatible(sets[0][0], w))
                results = []
                if args.split_only:
                    pool = split_candidates()
                elif args.tma_only:
                    pool = tma_candidates()
                else:
                    pool = [*candidates(m), *tma_candidates(), *split_candidates()]
                for cfg in [default, *pool]:
                    try:
                        _launch(sets[0][0], w, outs[0], config=cfg)
                        err = (outs[0].float() - ref).abs().max().item() / ref.abs().max().item()
                        if not math.isfinite(err) or err > 2e-2:
                            results.append((cfg, float("inf"), f"wrong: rel err {err:.3g}"))
                            continue
                        arg_sets = [(a, w_, o) for (a, w_), o in zip(sets, outs, strict=True)]
                        ms = bench_gemm.time_ms(lambda a, w_, o, c=cfg: _launch(a, w_, o, config=c),
                                                arg_sets, args.iters, 3)
                        results.append((cfg, ms, ""))
                    except Exception as e:  # a config that fails to compile is skipped, not fatal
                        results.append((cfg, float("inf"), f"{type(e).__name__}: {str(e)[:80]}"))
                best = min(results, key=lambda r: r[1])
                row = {"case": case.name, "m": m, "n": n, "k": k, "cublas_ms": cublas,
                       "default": vars(default), "default_ms": results[0][1],
                       "best": vars(best[0]), "best_ms": best[1],
                       "best_vs_cublas": cublas / best[1], "default_vs_cublas": cublas / results[0][1],
                       "top5": [[vars(c), ms] for c, ms, _ in sorted(results, key=lambda r: r[1])[:5]]}
                rows.append(row)
                b = best[0]
                print(f"{case.name:16s} m={m:6d} cublas {cublas:.4f}  default {results[0][1]:.4f} "
                      f"({row['default_vs_cublas']:.2f}x)  best {best[1]:.4f} ({row['best_vs_cublas']:.2f}x) "
                      f"{b.block_m}x{b.block_n}{f'+{b.block_n2}' if b.block_n2 else ''}x{b.block_k} "
                      f"g{b.group_m} w{b.num_warps} s{b.num_stages}"
                      f"{' tma' if b.tma else ''}{'' if b.flatten else ' nested'}", flush=True)
                del sets, outs, w
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                                          "command": " ".join(sys.argv), "rows": rows}, indent=1))
    print(f"wrote {len(rows)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
