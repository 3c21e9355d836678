"""The fused GEMM + all-reduce (fusedpar.kernels.gemm_all_reduce) on every rank of an EmulatedWorld.

The interpreter runs a launch's programs one after another, so a launch that waits for a peer's
later phase would spin forever. The driver therefore runs every rank phase by phase (the
kernel's constexprs DO_GEMM / DO_REDUCE / DO_COPY): every rank's GEMM launch, then every rank's
reduce, then (two-shot) every rank's copy. The flag code still runs (USE_FLAGS): the flags are
simply set when the waits start; use_flags=False skips it.
"""

from __future__ import annotations

import torch

from fusedpar.collectives.symmetric import EmulatedWorld
from fusedpar.kernels._host import require_same_on_ranks
from fusedpar.kernels._sync import check_emulated_rank
from fusedpar.kernels.fp8 import FP8Operands
from fusedpar.kernels.gemm_all_reduce.launch import check_operands, chunk_fp8, launch_chunk, plan_or_raise
from fusedpar.kernels.gemm_all_reduce.plan import FusedConfig

__all__ = ["gemm_all_reduce_emulated"]


def gemm_all_reduce_emulated(
    world: EmulatedWorld,
    xs: list[torch.Tensor],
    ws: list[torch.Tensor],
    *,
    path: str = "two_shot",
    outs: list[torch.Tensor] | None = None,
    partial_dtype: torch.dtype | None = None,
    use_flags: bool = True,
    schedule: str = "phased",
    config: FusedConfig | None = None,
    residuals: list[torch.Tensor] | None = None,
    fp8: list[FP8Operands] | None = None,
) -> list[torch.Tensor]:
    """One fused call on every rank of an EmulatedWorld (CPU, interpreter); rank r's output at [r].

    residuals: as gemm_all_reduce's residual, one per rank (the reduce epilogues of both paths).
    fp8: e4m3 xs and ws with these scales, one per rank (outputs of each one's out_dtype).

    schedule "phased": per chunk, each phase for every rank before the next phase.
    schedule "staggered": a legal interleaving with multi-phase launches and live flags.
      one_shot: GEMM for ranks 0..W-2; rank W-1 runs the registered op (both phases, one
      launch: the GPU code path); then the reduce for ranks 0..W-2.
      two_shot: GEMM for every rank; reduce for ranks 0..W-2; rank W-1 runs reduce + copy in
      ONE launch; then copy for ranks 0..W-2. (All three phases in one launch need peers that
      run concurrently; with one rank they are covered by the registered-op tests.)
    Raises RuntimeError if a bounded flag wait timed out (a protocol bug).
    """
    W = world.world_size
    if len(xs) != W or len(ws) != W:
        raise ValueError(f"gemm_all_reduce_emulated: {len(xs)} inputs and {len(ws)} weights for {W} ranks")
    if schedule not in ("phased", "staggered"):
        raise ValueError(f"gemm_all_reduce_emulated: unknown schedule {schedule!r}")
    require_same_on_ranks("gemm_all_reduce_emulated", "x", xs)
    require_same_on_ranks("gemm_all_reduce_emulated", "w", ws)
    f8 = fp8 if fp8 is not None else [None] * W
    if outs is None:
        outs = [torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype if f is None else f.out_dtype)
                for x, w, f in zip(xs, ws, f8, strict=True)]
    res = residuals if residuals is not None else [None] * W
    for r in range(W):
        check_operands(xs[r], ws[r], outs[r], world[r].device, res[r], f8[r])
    plan = plan_or_raise(path, xs[0], ws[0], world[0], partial_dtype, config, outs[0].dtype)

    def run(r: int, m0: int, rows: int, **phases) -> None:
        t = world[r]
        launch_chunk(xs[r].narrow(0, m0, rows), ws[r], outs[r].narrow(0, m0, rows), t.buffer_ptrs, t.signal_ptrs,
                      t.counters, r, W, plan, use_flags=use_flags, spin_limit=None,
                      residual=None if res[r] is None else res[r].narrow(0, m0, rows), fp8=chunk_fp8(f8[r], m0, rows),
                      **{"gemm": False, "reduce": False, "copy": False, **phases})

    def checked(r: int) -> None:
        check_emulated_rank(world[r], r, "gemm_all_reduce")

    rest = range(W - 1)
    for m0, rows in plan.chunks:
        if path == "one_shot":
            if schedule == "phased":
                for r in range(W):
                    run(r, m0, rows, gemm=True)
                for r in range(W):
                    run(r, m0, rows, reduce=True)
                    checked(r)
            else:
                for r in rest:
                    run(r, m0, rows, gemm=True)
                t = world[W - 1]
                torch.ops.fusedpar.gemm_all_reduce_out(
                    xs[W - 1].narrow(0, m0, rows), ws[W - 1], t.buffer_ptrs, t.signal_ptrs, t.counters,
                    outs[W - 1].narrow(0, m0, rows), W - 1, W, t.buffer_bytes, t.max_blocks, path,
                    plan.partial_dtype == torch.float32 and outs[0].dtype != torch.float32, plan.config.as_list(),
                    use_flags, None if res[W - 1] is None else res[W - 1].narrow(0, m0, rows),
                    *FP8Operands.op_args(chunk_fp8(f8[W - 1], m0, rows)),
                )
                checked(W - 1)
                for r in rest:
                    run(r, m0, rows, reduce=True)
                    checked(r)
        else:
            for r in range(W):
                run(r, m0, rows, gemm=True)
            if schedule == "phased":
                for r in range(W):
                    run(r, m0, rows, reduce=True)
                    checked(r)
                for r in range(W):
                    run(r, m0, rows, copy=True)
                    checked(r)
            else:
                for r in rest:
                    run(r, m0, rows, reduce=True)
                    checked(r)
                run(W - 1, m0, rows, reduce=True, copy=True)
                checked(W - 1)
                for r in rest:
                    run(r, m0, rows, copy=True)
                    checked(r)
    return outs

