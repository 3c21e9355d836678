"""Shared parts of the perf/bench_*.py scripts: setup, timing, records.

The scripts import it as a sibling module (each puts its own directory on sys.path first):
    init_distributed / finish_distributed   torchrun + NCCL with NVLink multicast off
    max_over_ranks                          a collective is as slow as its slowest rank
    BarrierTimer                            eager call sequences (alone or interleaved) and CUDA-graph replays
    SpinTimer                               one call per sample after a GPU spin
    measure_link_ceilings                   cuBLAS peak, HBM and NCCL all-to-all bandwidth
    run_info                                the torch / triton / commit / date / command record fields
    write_records                           the JSON list of records, relative to the repo root
    sp_common, print_sp_header, sp_row, run_sp_cases, token_ranges, print_fused_wins
                                            records, table, (model, tokens) loop and summary of the
                                            two Ulysses benches (qkv_all_to_all, all_to_all_o_proj)
Nothing here imports fusedpar at module level, so `--help` works without a GPU or the package.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
SLEEP_CYCLES = 100_000  # SpinTimer: ~50 us GPU spin ahead of each timed call
LINK_BYTES = 256 << 20  # measure_link_ceilings: all-to-all message


def add_repo_to_path() -> None:
    """Make `import fusedpar` work when a script runs from a checkout without `pip install -e .`."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


def torchrun_available() -> bool:
    return torch.cuda.is_available() and "LOCAL_RANK" in os.environ


def init_distributed() -> tuple[int, int, int]:
    """(local rank, rank, world size) of an NCCL WORLD group made from torchrun's environment.

    Sets NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 (unless
    already set) before torch.distributed initialises anything: NVLink multicast stays off on our
    machines and no path here may depend on it.
    """
    from fusedpar.testing.gpu import init_torchrun_nccl

    rank, world = init_torchrun_nccl()
    return int(os.environ["LOCAL_RANK"]), rank, world


def finish_distributed() -> None:
    dist.barrier()
    dist.destroy_process_group()


def exit_without_teardown(code: int = 0) -> None:
    """End a benchmark that captured CUDA graphs containing NCCL / symmetric-memory work: after a
    barrier, leave with os._exit. Tearing the process group down while such graphs exist can hang
    after the records are written; the OS reclaims all."""
    dist.barrier()
    torch.cuda.synchronize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def interleaved_order(names: list[str], i: int) -> list[str]:
    """Round i of an interleaved timing: a permutation of the names seeded by i alone (so every rank
    runs the same order), which over the rounds puts each name in every position and after every
    other name, where a fixed cycle always runs B after A."""
    return random.Random(i).sample(names, len(names))


class BarrierTimer:
    """Per-call medians (ms) of eager call sequences and graph replays, aligned by a device barrier."""

    def __init__(self, barrier: Callable[[], None], iters: int, warmup: int):
        self.barrier, self.iters, self.warmup = barrier, iters, warmup
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def _sample(self, run: Callable[[], None], calls: int) -> float:
        self.barrier()  # stream-ordered: every rank starts the sample together
        self.start.record()
        run()
        self.end.record()
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / calls

    def eager(self, calls: list[Callable[[], object]]) -> float:
        def run():
            for c in calls:
                c()

        for _ in range(self.warmup):
            run()
        torch.cuda.synchronize()
        return statistics.median(self._sample(run, len(calls)) for _ in range(self.iters))

    def eager_interleaved(self, variants: dict[str, list[Callable[[], object]]]) -> dict[str, float]:
        """eager() of several call sequences whose samples alternate: an eager call of a small op is
        host-bound, and on a shared host the launch speed drifts over seconds, so timing one variant
        after the other lets the drift decide the ratio. interleaved_order() varies each variant's
        predecessor as well as its position, and runs each variant once, untimed and synchronized,
        right before each of its timed samples. The predecessor matters: an eager F.linear + NCCL
        all-reduce sample runs slower right after a sample of the Triton one-shot than after any
        other variant, so a fixed cycle (A B C, B C A, ...) that always runs the router's fallback
        right after the fused path times it below a plain path it is identical to on the GPU. The
        priming run helps but does not remove the effect, so its cause is not only the host's
        caches; the random order spreads what is left over all variants alike."""
        names = list(variants)
        runs = {name: (lambda calls=calls: [c() for c in calls]) for name, calls in variants.items()}
        for _ in range(self.warmup):
            for name in names:
                runs[name]()
        torch.cuda.synchronize()
        samples: dict[str, list[float]] = {name: [] for name in names}
        for i in range(self.iters):
            for name in interleaved_order(names, i):
                runs[name]()  # the priming run: the timed sample follows its own variant
                torch.cuda.synchronize()
                samples[name].append(self._sample(runs[name], len(variants[name])))
        return {name: statistics.median(v) for name, v in samples.items()}

    def graph(self, calls: list[Callable[[], object]]) -> float:
        for c in calls:  # warm-up outside capture (compilation, NCCL graph registration)
            c()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for c in calls:
                c()
        for _ in range(self.warmup):
            g.replay()
        torch.cuda.synchronize()
        ms = statistics.median(self._sample(g.replay, len(calls)) for _ in range(self.iters))
        del g
        return ms


class SpinTimer:
    """Median per-call ms of fn(i) over samples, each: device barrier, GPU spin, event, call, event.

    The figure is the max over ranks of the per-rank medians.
    """

    def __init__(self, barrier: Callable[[], None], iters: int, warmup: int):
        self.barrier, self.iters, self.warmup = barrier, iters, warmup
        self.sleep = getattr(torch.cuda, "_sleep", None)

    def __call__(self, fn: Callable[[int], object]) -> float:
        for i in range(self.warmup):
            fn(i)
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.iters)]
        for i in range(self.iters):
            self.barrier()
            if self.sleep is not None:
                self.sleep(SLEEP_CYCLES)
            starts[i].record()
            fn(self.warmup + i)
            ends[i].record()
        torch.cuda.synchronize()
        return max_over_ranks(statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)))


def measure_link_ceilings(timer: SpinTimer, group) -> dict[str, float]:
    """peak FLOP/s (cuBLAS bf16 8192^3), HBM B/s (1 GiB copy), link B/s (NCCL all-to-all bus bw, 256 MiB)."""
    n = 8192
    a = torch.randn((n, n), device="cuda", dtype=torch.bfloat16)
    t = timer(lambda i, a=a: torch.matmul(a, a))
    peak = 2 * n**3 / (t * 1e-3)
    del a
    nel = (1 << 30) // 4
    src, dst = torch.rand(nel, device="cuda"), torch.empty(nel, device="cuda")
    t = timer(lambda i, dst=dst, src=src: dst.copy_(src))
    hbm = 2 * (1 << 30) / (t * 1e-3)
    del src, dst
    W = group.size
    send = torch.randn(LINK_BYTES // 2, device="cuda", dtype=torch.bfloat16)
    recv = torch.empty_like(send)
    t = timer(lambda i, r=recv, s=send: dist.all_to_all_single(r, s, group=group.pg))
    link = (W - 1) / W * LINK_BYTES / (t * 1e-3)
    del send, recv
    torch.cuda.empty_cache()
    return {"peak_flops": peak, "hbm_bps": hbm, "link_bps": link}


def git_commit() -> str | None:
    """The commit the benchmark runs: $FUSEDPAR_COMMIT if set (a checkout without .git, e.g. a copy of
    the tree on a GPU machine), else `git rev-parse` of the repo, "+dirty" when tracked files differ
    from it; None when neither is available."""
    env = os.environ.get("FUSEDPAR_COMMIT", "").strip()
    if env:
        return env
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=REPO, timeout=30).returncode != 0
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}+dirty" if dirty else head


def run_info(torchrun_world: int | None = None, *, python: bool = False) -> dict:
    """Record fields torch, triton[, python], commit, date, command (torchrun_world: the torchrun command line).

    commit is left out, with a warning, where git_commit() finds none: set FUSEDPAR_COMMIT."""
    import triton

    info = {"torch": torch.__version__, "triton": triton.__version__}
    if python:
        info["python"] = platform.python_version()
    commit = git_commit()
    if commit is None:
        print("warning: no git commit found for the records (set FUSEDPAR_COMMIT)", file=sys.stderr)
    else:
        info["commit"] = commit
    info["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    argv = sys.argv if torchrun_world is None else ["torchrun", f"--nproc-per-node {torchrun_world}", *sys.argv]
    out = os.environ.get("OUT", "").rstrip("/")
    if out:  # the machine's output folder (perf/run_gpu.sh's $OUT) is no part of the command's meaning
        argv = ["$OUT" + a[len(out):] if a == out or a.startswith(out + "/") else a for a in argv]
    info["command"] = " ".join(argv)
    return info


def write_records(records: list[dict], out: str) -> None:
    """Write the records as a JSON list to `out` (relative paths: from the repo root)."""
    path = Path(out)
    if not path.is_absolute():
        path = REPO / path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records, indent=1) + "\n")
    print(f"wrote {len(records)} records to {path}")


def sp_common(bench: str, world: int, baseline: str, ceil: dict[str, float]) -> dict:
    """The fields every record of a Ulysses bench shares (ceil: measure_link_ceilings)."""
    return {
        "bench": bench,
        "world": world,
        "gpu": torch.cuda.get_device_name(),
        "baseline": baseline,
        **run_info(world),
        "peak_tflops": ceil["peak_flops"] / 1e12,
        "hbm_gbps": ceil["hbm_bps"] / 1e9,
        "link_gbps": ceil["link_bps"] / 1e9,
    }


def print_sp_header(common: dict, extra: str = "") -> None:
    """The machine line and the table header of a Ulysses bench; extra: more column names before "routed"."""
    print(
        f"{common['gpu']} x{common['world']}: cuBLAS bf16 {common['peak_tflops']:.0f} TFLOP/s, "
        f"HBM {common['hbm_gbps']:.0f} GB/s, NCCL all-to-all bus {common['link_gbps']:.0f} GB/s; "
        f"torch {common['torch']}, triton {common['triton']}"
    )
    print(f"{'case':<14}{'tokens':>7}{'base ms':>10}{'fused ms':>10}{'speedup':>9}{'cuBLAS ms':>11}"
          f"{'fused/gemm':>11}{'triton ms':>11}{'%roof':>7}  bound   {extra}routed")


def sp_row(r: dict, extra: str = "") -> str:
    """One table row of a Ulysses bench (print_sp_header's columns; extra: the extra cells)."""
    return (f"{r['case']:<14}{r['tokens']:>7}{r['baseline_ms']:>10.4f}{r['fused_ms']:>10.4f}{r['speedup']:>9.2f}"
            f"{r['gemm_cublas_ms']:>11.4f}{r['fused_over_gemm']:>11.2f}{r['gemm_triton_ms']:>11.4f}"
            f"{r['roofline_pct']:>6.0f}%  {r['bound']:<7} {extra}{r['routed']}")


def run_sp_cases(
    models: list[str],
    tokens: list[int],
    world: int,
    rank: int,
    common: dict,
    measure: Callable[[str, int], dict],
    row: Callable[[dict], str],
) -> list[dict]:
    """One record per (model, tokens): common | measure(model, m), or the error it raised; rank 0 prints row(record)."""
    records = []
    for model in models:
        for m in tokens:
            record = {**common, "case": f"{model}.sp{world}", "tokens": m}
            try:
                record |= measure(model, m)
            except Exception as exc:
                # Unattended run: record the failure (compile error, OOM, a timed-out flag wait)
                # and go on; every rank runs the same code, so they fail alike.
                record["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                torch.cuda.synchronize()
                dist.barrier()
            records.append(record)
            if rank == 0:
                if "error" in record:
                    print(f"{record['case']:<14}{m:>7}  ERROR {record['error'][:200]}")
                else:
                    print(row(record))
            torch.cuda.empty_cache()
    return records


def token_ranges(wins: dict[int, bool]) -> tuple[tuple[int, int | None], ...]:
    """Inclusive ranges of the measured token counts where the fused path won (last one open-ended)."""
    ms = sorted(wins)
    ranges, lo = [], None
    for i, m in enumerate(ms):
        if wins[m] and lo is None:
            lo = m
        if lo is not None and (not wins[m] or i == len(ms) - 1):
            hi = None if wins[m] else ms[i - 1]
            ranges.append((lo if lo != ms[0] else 1, hi))
            lo = None
    return tuple(ranges)


def print_fused_wins(records: list[dict], ranges_name: str) -> None:
    """The token counts where the fused path won on every model, as the library's `ranges_name` setting."""
    wins: dict[int, bool] = {}
    for r in records:
        if "error" not in r:
            wins[r["tokens"]] = wins.get(r["tokens"], True) and r["speedup"] >= 1.0
    print(f"fused wins (every model) at tokens {sorted(m for m, w in wins.items() if w)}; "
          f"{ranges_name} = {token_ranges(wins)}")


def enable_stack(stack, *, max_tokens: int, fused: bool, o_scatter: bool = True, symm_mem_rows: int = 64):
    """stack.enable_fused for a benchmark, with the communicator the benchmark picks: a FusedComm
    (fused=True), or the plain baseline, a PlainComm (cuBLAS + NCCL around the same attention and norms)
    whose shift-mode row-parallel GEMMs of up to symm_mem_rows rows reduce with torch's symm_mem one-shot
    instead of NCCL: the fastest stock decode path inside a CUDA graph, so the baseline is the best a user
    could assemble from stock parts. o_scatter=False (fused only): base mode's attention output stays local
    and all_to_all_o_proj returns it, instead of the attention storing its rows into the owners' o staging
    (the A/B of the return all-to-all's two plans)."""
    from fusedpar.layers.comm import FusedComm, PlainComm

    ctx, dtype = stack.ctx, stack.weight_dtype
    if fused:
        comm = (FusedComm if o_scatter else _local_out_fused_comm())(ctx, stack.cfg, max_tokens=max_tokens,
                                                                       dtype=dtype)
    elif ctx.shift.size > 1 and hasattr(torch.ops, "symm_mem"):
        comm = _symm_mem_plain_comm()(ctx, stack.cfg.hidden_size, symm_mem_rows, dtype)
    else:
        comm = PlainComm(ctx)
    return stack.enable_fused(max_tokens=max_tokens, comm=comm)


def _local_out_fused_comm() -> type:
    """The FusedComm subclass whose base mode never scatters the attention's rows (defined on first use,
    as _symm_mem_plain_comm): no o_target, so the attention writes a local output for o_proj."""
    from fusedpar.layers.comm import FusedComm

    class _LocalOutFusedComm(FusedComm):
        def o_target(self, mode, rows):
            return None

    return _LocalOutFusedComm


def _symm_mem_plain_comm() -> type:
    """The PlainComm subclass (defined on first use: fusedpar is importable only after add_repo_to_path)."""
    from fusedpar.layers.comm import PlainComm

    class _SymmMemPlainComm(PlainComm):
        """PlainComm whose shift-mode row-parallel reduce of at most `rows` rows is cuBLAS into a torch
        symmetric-memory buffer + torch.ops.symm_mem.one_shot_all_reduce (two buffers used alternately,
        so a GEMM never overwrites what a slow peer may still read); larger steps keep NCCL."""

        def __init__(self, ctx, hidden: int, rows: int, dtype: torch.dtype):
            import torch.distributed._symmetric_memory as symm_mem

            super().__init__(ctx)
            self.buf = symm_mem.empty((2, rows * hidden), dtype=dtype, device=ctx.device)
            symm_mem.rendezvous(self.buf, ctx.shift.pg)
            self.group_name, self.calls = ctx.shift.pg.group_name, 0

        def row_parallel(self, x, w, mode, *, residual=None, swiglu_block=0):
            n = x.shape[0] * w.shape[0]
            if mode != "shift" or n > self.buf.shape[1]:
                return super().row_parallel(x, w, mode, residual=residual, swiglu_block=swiglu_block)
            act = self.swiglu(x, swiglu_block) if swiglu_block else x
            view = self.buf[self.calls % 2, :n].view(x.shape[0], w.shape[0])
            self.calls += 1
            torch.matmul(act, w.t(), out=view)
            y = torch.ops.symm_mem.one_shot_all_reduce(view, "sum", self.group_name)
            return y if residual is None else residual + y

    return _SymmMemPlainComm

