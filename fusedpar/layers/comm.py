"""The decoder layer's communication stages: PlainComm (cuBLAS + torch.distributed) and FusedComm.

Stages (rows = this rank's rows: m = n_pad / SP in base mode, n in shift mode; blk = (q+2kv)*hd):
  qkv(h, w, mode, bias)      [rows, d] -> [n(_pad), blk]: the qkv GEMM (bias = the mode's qkv bias,
                             w's rows), in base mode followed by the seq->head all-to-all over SP.
  o_target(mode, rows)       a ScatterOut the base-mode attention stores its rows through (the return
                             all-to-all done by the attention's stores), or None: a local output.
  o_proj_scattered(w, rows, num_tokens)  after o_target: o GEMM of the staged rows + TP reduce.
  o_proj(attn, w, mode, residual)  [n(_pad), q*hd] -> [residual +] o-projection [rows, d]: in base mode
                             head->seq all-to-all, GEMM, all-reduce over TP; in shift mode row_parallel.
  column_parallel(x, w, swiglu_block)  [rows, K] -> act(x @ w^T): a GEMM on this rank's output
                             columns, nothing exchanged; act = SwiGLU of the blocked gate_up output
                             when swiglu_block > 0 (fusedpar.kernels.swiglu), else the identity.
  row_parallel(x, w, mode, residual, swiglu_block)  [residual +] act(x) @ w^T summed over the mode's
                             group (TP in base, the shift group in shift); act as in column_parallel.
  fuses_residual(rows, w, mode)  whether o_proj adds the residual inside a fused reduce (free).

PlainComm: F.linear (FP8Weight.linear for FP8 weights) + fusedpar.collectives; any device and backend (gloo on
CPU, NCCL on CUDA).
FusedComm: symmetric-memory workspaces (CUDA) + the fused Triton kernels, on bf16 / fp16 weights and on
FP8Weight ones (the kernels' e4m3 variants). Each stage checks
whether it can take the step (a workspace, a group of more than one rank) and otherwise runs its
PlainComm's; the kernels route by size themselves. The GEMMs with nothing to exchange
(column_parallel, qkv without the all-to-all, row_parallel over a group of one) run on the
weight-streaming decode GEMM (fusedpar.kernels.gemv, SwiGLU in its epilogue) where it takes the
shapes (gemv.takes: at most MAX_M rows, half-precision plain weights) and the routing table's entry
for the GPU routes that many rows there (fusedpar.kernels.routing: decode_gemm_max_rows, measured per
GPU), on PlainComm's GEMM elsewhere. `should_use(x)` says whether a communicator can take hidden
states x at all; `select` returns the first of several that can (callers list them fused first).
Every choice depends on shapes and the routing table only, so all ranks agree. Collective: every
rank builds a FusedComm with the same arguments, in the same order.

One class per backend: a caller picks the communicator (ShiftParallelStack.enable_fused(comm=...));
the layer benchmarks' cuBLAS + NCCL baseline is a PlainComm on the fused layer path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fusedpar.collectives import ParallelContext, all_reduce_sum, head_to_seq_all_to_all, seq_to_head_all_to_all
from fusedpar.layers.config import DecoderConfig
from fusedpar.layers.fp8_weights import FP8Weight, linear
from fusedpar.layouts import StepMode

if TYPE_CHECKING:
    from fusedpar.kernels.ulysses.config import UlyssesOptions

_HALF = (torch.float16, torch.bfloat16)


def _fp8_args(w, **extra) -> tuple[torch.Tensor, dict]:
    """A weight as the fused kernels take it: (w, {}) for a plain one; for an FP8Weight its e4m3 tensor and
    the keywords w_scale / w_tile (with `extra`)."""
    if isinstance(w, FP8Weight):
        return w.q, {"w_scale": w.scale, "w_tile": w.tile, **extra}
    return w, {}


def _skinny_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ w^T + bias on the decode GEMM (fusedpar.kernels.gemv; the caller checked gemv.takes). The bias
    is added to the fp32 result before its one rounding, as F.linear's GEMM epilogue adds it."""
    from fusedpar.kernels.gemv import skinny_matmul

    if bias is None:
        return skinny_matmul(x, w)
    acc = skinny_matmul(x, w, out=x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32))
    return acc.add_(bias).to(x.dtype)


def _on_decode_gemm(x: torch.Tensor, w, swiglu_block: int = 0) -> bool:
    """Whether FusedComm runs x @ w^T (SwiGLU epilogue when swiglu_block > 0) on the decode GEMM: the kernel
    takes the shapes (gemv.takes) and the routing table's entry for this GPU routes that many rows there
    (routing.Thresholds.decode_gemm_max_rows). Shapes and the table only, so every rank decides alike."""
    from fusedpar.kernels import gemv, routing

    return x.shape[0] <= routing.thresholds(x.device, 1).decode_gemm_max_rows and gemv.takes(x, w, swiglu_block)


def select(x: torch.Tensor, *comms):
    """The first of `comms` (None entries skipped) whose should_use(x) holds."""
    for comm in comms:
        if comm is not None and comm.should_use(x):
            return comm
    raise ValueError(f"no communicator takes a {x.dtype} tensor on {x.device}")


class PlainComm:
    """The stages on cuBLAS (F.linear) and torch.distributed (fusedpar.collectives).

    reference=True gives the reference path's numerics: half-precision row-parallel partials are
    computed and summed in fp32 and rounded once, as the unsharded GEMM rounds its fp32 accumulator
    once (P + 1 half roundings flip near-tied greedy tokens against the unsharded model); the fused
    reduces do the same. reference=False is the stock path: GEMM and reduce in the input dtype.
    SwiGLU: the Triton pass on CUDA, the plain-PyTorch definition elsewhere (same roundings).
    """

    def __init__(self, ctx: ParallelContext, *, reference: bool = False):
        self.ctx, self.reference = ctx, reference

    def spin_timeouts(self) -> list[str]:
        """No flag waits here: nothing can have timed out (FusedComm names its workspaces that did)."""
        return []

    def should_use(self, x: torch.Tensor) -> bool:
        return True

    def qkv(self, h: torch.Tensor, w: torch.Tensor, mode: str, bias: torch.Tensor | None = None) -> torch.Tensor:
        qkv = linear(h, w, bias)  # the base bias rows follow the base block order
        return seq_to_head_all_to_all(qkv, self.ctx.sp) if mode == StepMode.BASE else qkv

    def column_parallel(self, x: torch.Tensor, w: torch.Tensor, *, swiglu_block: int = 0) -> torch.Tensor:
        y = linear(x, w)
        return self.swiglu(y, swiglu_block) if swiglu_block else y

    def o_target(self, mode: str, rows: int):
        return None

    def o_proj_scattered(self, w: torch.Tensor, rows: int, num_tokens: int) -> torch.Tensor:
        raise RuntimeError("PlainComm has no o_target: the attention output is local")

    def o_proj(self, attn: torch.Tensor, w: torch.Tensor, mode: str, *, residual: torch.Tensor | None = None
               ) -> torch.Tensor:
        if mode == StepMode.BASE:
            attn = head_to_seq_all_to_all(attn, self.ctx.sp)  # [m, SP*q*hd]
        return self.row_parallel(attn, w, mode, residual=residual)

    def row_parallel(self, x: torch.Tensor, w: torch.Tensor, mode: str, *, residual: torch.Tensor | None = None,
                     swiglu_block: int = 0) -> torch.Tensor:
        group = self.ctx.attention_group(mode)
        act = self.swiglu(x, swiglu_block) if swiglu_block else x
        if self.reference and group.size > 1 and act.dtype in _HALF:
            y = all_reduce_sum(linear(act.float(), w if isinstance(w, FP8Weight) else w.float()), group).to(act.dtype)
        else:
            y = all_reduce_sum(linear(act, w), group)
        return y if residual is None else residual + y

    @staticmethod
    def swiglu(gate_up: torch.Tensor, block: int) -> torch.Tensor:
        from fusedpar.kernels.swiglu import silu_mul, silu_mul_reference

        return silu_mul(gate_up, block) if gate_up.is_cuda else silu_mul_reference(gate_up, block)

    def fuses_residual(self, rows: int, w: torch.Tensor, mode: str) -> bool:
        return False


@dataclass(frozen=True)
class FusedOptions:
    """Options of FusedComm.

    ulysses: the options of the qkv / o routers (None: their defaults, routed by the routing table's
        GPU times; a caller whose eager steps are bound by host time can route more rows fused).
    """

    ulysses: UlyssesOptions | None = None


class FusedComm:
    """The stages on symmetric-memory workspaces sized for steps of up to max_tokens tokens (CUDA).

    Workspaces: qkv_ws / o_ws over SP (qkv_all_to_all, all_to_all_o_proj and the scattered o), one
    gemm_all_reduce workspace per mode's reduce group (gemm_ar_ws), tp_allreduce_ws for the base
    o-projection's TP all-reduce. A group of one gets none. The fused reduces add the residual in
    their epilogue (one-shot in CUDA graphs, two-shot at prefill sizes); elsewhere it is a torch add.
    A q/k/v bias is added after the exchange (the rank's own block of it; the kernel has no bias input).
    In base mode with SP > 1 the attention stores its rows into the owners' staging (o_target) for
    steps that fit the o workspace: its stores are the return all-to-all.
    """

    def __init__(self, ctx: ParallelContext, cfg: DecoderConfig, *, max_tokens: int, dtype: torch.dtype,
                 options: FusedOptions | None = None):
        self.ctx, self.cfg, self.dtype, self.max_tokens = ctx, cfg, dtype, max_tokens
        self.options = options or FusedOptions()
        self.plain = PlainComm(ctx)
        place = ctx.layout.head_placement(cfg.num_q_heads, cfg.num_kv_heads)
        self.blk = (place.q_heads_per_rank + 2 * place.kv_heads_per_rank) * cfg.head_dim
        self.attn_width = place.q_heads_per_rank * cfg.head_dim  # C: this rank's attention output columns
        self.qkv_ws = self.o_ws = self.tp_allreduce_ws = None
        self.gemm_ar_ws: dict[StepMode, object | None] = {StepMode.BASE: None, StepMode.SHIFT: None}
        self._build_workspaces()

    def _build_workspaces(self) -> None:
        from fusedpar.collectives.symmetric import SymmetricWorkspace
        from fusedpar.kernels import gemm_all_reduce, routing, ulysses
        from fusedpar.kernels._host import device_num_sms

        ctx, cfg, dtype = self.ctx, self.cfg, self.dtype
        if ctx.device.type != "cuda":
            raise ValueError(f"FusedComm needs CUDA (symmetric memory); the context is on {ctx.device}")
        sp, tp, P = ctx.layout.sp, ctx.layout.tp, ctx.layout.replica_size
        m_max = -(-self.max_tokens // sp)
        num_sms = device_num_sms(ctx.device.index if ctx.device.index is not None else torch.cuda.current_device())

        def reduce_bytes(group_size: int, k_o: int, k_down: int, rows: int) -> tuple[int, int]:
            one_shot_rows = routing.thresholds(ctx.device, group_size).one_shot_max_rows
            sizes = [gemm_all_reduce.required_workspace(path, min(rows, cap), cfg.hidden_size, k, dtype,
                                                        group_size, num_sms=num_sms)
                     for path, cap in (("one_shot", one_shot_rows), ("one_shot", gemm_all_reduce.SPLIT_K_MAX_ROWS),
                                       ("two_shot", 2048))
                     for k in (k_o, k_down)]
            return max(s[0] for s in sizes), max(s[1] for s in sizes)

        if sp > 1:
            self.qkv_ws = SymmetricWorkspace(ctx.sp, ulysses.qkv_workspace_bytes(m_max, self.blk, sp, dtype),
                                             ranks=ctx.sp.ranks)
            self.o_ws = SymmetricWorkspace(ctx.sp, ulysses.o_proj_workspace_bytes(m_max, self.attn_width, sp, dtype),
                                           ranks=ctx.sp.ranks)
        if tp > 1:
            nbytes, blocks = reduce_bytes(tp, sp * self.attn_width, cfg.intermediate_size // tp, m_max)
            self.gemm_ar_ws[StepMode.BASE] = SymmetricWorkspace(ctx.tp, nbytes, max_blocks=blocks, ranks=ctx.tp.ranks)
            # base mode with SP > 1 all-reduces the fused o-projection's output over TP
            self.tp_allreduce_ws = SymmetricWorkspace(
                ctx.tp, routing.thresholds(ctx.device, tp).all_reduce_one_shot_max_bytes, ranks=ctx.tp.ranks)
        if P > 1:
            nbytes, blocks = reduce_bytes(P, self.attn_width, cfg.intermediate_size // P, self.max_tokens)
            self.gemm_ar_ws[StepMode.SHIFT] = SymmetricWorkspace(ctx.shift, nbytes, max_blocks=blocks,
                                                          ranks=ctx.shift.ranks)
        torch.cuda.synchronize(ctx.device)

    def should_use(self, x: torch.Tensor) -> bool:
        return x.is_cuda and x.dtype == self.dtype

    def spin_timeouts(self) -> list[str]:
        """Names of the workspaces on which a bounded flag wait gave up (counters[STATUS] != 0: a peer
        never published, so that launch's output is wrong). Host sync: tests and debugging only."""
        named = {"qkv_all_to_all": self.qkv_ws, "all_to_all_o_proj": self.o_ws, "tp_all_reduce": self.tp_allreduce_ws,
                 **{f"gemm_all_reduce[{mode}]": ws for mode, ws in self.gemm_ar_ws.items()}}
        return [name for name, ws in named.items() if ws is not None and ws.table.status() != 0]

    def _exchanges(self, mode: str) -> bool:
        return mode == StepMode.BASE and self.ctx.sp.size > 1

    def _tp_sum(self, out: torch.Tensor) -> torch.Tensor:
        from fusedpar.kernels.allreduce import all_reduce

        if self.ctx.tp.size == 1:
            return out
        return all_reduce(out, self.ctx.tp, self.tp_allreduce_ws, inplace=True)

    # ---- the stages ------------------------------------------------------------------------
    def column_parallel(self, x: torch.Tensor, w: torch.Tensor, *, swiglu_block: int = 0) -> torch.Tensor:
        """As PlainComm.column_parallel; on the decode GEMM (SwiGLU in its epilogue) where it takes x and w."""
        from fusedpar.kernels import gemv

        if not _on_decode_gemm(x, w, swiglu_block):
            return self.plain.column_parallel(x, w, swiglu_block=swiglu_block)
        return gemv.skinny_matmul(x, w, swiglu_block=swiglu_block)

    def qkv(self, h: torch.Tensor, w: torch.Tensor, mode: str, bias: torch.Tensor | None = None) -> torch.Tensor:
        """As PlainComm.qkv. Without the exchange, the GEMM of column_parallel (and the bias). After
        the exchange every row holds this rank's own block, so the bias added is that block of
        `bias` (out of place: the rows may be a view of the receive buffer)."""
        if not self._exchanges(mode) and _on_decode_gemm(h, w):
            return _skinny_linear(h, w, bias)
        if self.qkv_ws is None or not self._exchanges(mode):
            return self.plain.qkv(h, w, mode, bias)
        from fusedpar.kernels.ulysses import qkv_all_to_all

        q, fp8 = _fp8_args(w)
        out = qkv_all_to_all(h, q, self.qkv_ws, self.ctx.sp, options=self.options.ulysses, **fp8)
        if bias is None:
            return out
        return out + bias.narrow(0, self.ctx.sp.rank * self.blk, self.blk)

    def o_target(self, mode: str, rows: int):
        """None for a step larger than the o workspace (and outside base mode with SP > 1)."""
        from fusedpar.kernels.ulysses import o_proj_workspace_bytes, o_scatter_target

        if not (self.o_ws is not None and self._exchanges(mode) and rows >= 1):
            return None
        if o_proj_workspace_bytes(rows, self.attn_width, self.ctx.sp.size, self.dtype) > self.o_ws.table.buffer_bytes:
            return None
        return o_scatter_target(self.o_ws, rows, self.attn_width, self.dtype)

    def o_proj_scattered(self, w: torch.Tensor, rows: int, num_tokens: int) -> torch.Tensor:
        from fusedpar.kernels.ulysses import scattered_o_proj

        q, fp8 = _fp8_args(w, dtype=self.dtype)
        return self._tp_sum(scattered_o_proj(q, self.o_ws, tokens=rows, num_tokens=num_tokens, c=self.attn_width,
                                             **fp8))

    def o_proj(self, attn: torch.Tensor, w: torch.Tensor, mode: str, *, residual: torch.Tensor | None = None
               ) -> torch.Tensor:
        if not self._exchanges(mode):
            return self.row_parallel(attn, w, mode, residual=residual)
        if self.o_ws is None:
            return self.plain.o_proj(attn, w, mode, residual=residual)
        from fusedpar.kernels.ulysses import all_to_all_o_proj

        q, fp8 = _fp8_args(w)
        out = self._tp_sum(all_to_all_o_proj(attn, q, self.o_ws, self.ctx.sp, options=self.options.ulysses, **fp8))
        return out if residual is None else residual + out

    def row_parallel(self, x: torch.Tensor, w: torch.Tensor, mode: str, *, residual: torch.Tensor | None = None,
                     swiglu_block: int = 0) -> torch.Tensor:
        """As PlainComm.row_parallel; over a group of one, the decode GEMM where it takes act(x) and w
        (the residual added after, as PlainComm adds it)."""
        # A separate pass, not a GEMM prologue: SwiGLU in the one-shot kernel's operand load was
        # slower than this + the kernel (fusedpar.kernels.gemm_all_reduce docstring).
        act = self.plain.swiglu(x, swiglu_block) if swiglu_block else x
        if self.ctx.attention_group(mode).size == 1 and _on_decode_gemm(act, w):  # nothing to reduce
            y = _skinny_linear(act, w, None)
            return y if residual is None else residual + y
        ws = self.gemm_ar_ws[mode]
        if ws is None:  # a group of one, or no workspace
            return self.plain.row_parallel(act, w, mode, residual=residual)
        from fusedpar.kernels.gemm_all_reduce import gemm_all_reduce

        q, fp8 = _fp8_args(w)
        return gemm_all_reduce(act, q, self.ctx.attention_group(mode), ws, residual=residual, **fp8)

    def fuses_residual(self, rows: int, w: torch.Tensor, mode: str) -> bool:
        """Whether row_parallel (o_proj outside base mode) adds the residual inside a fused reduce
        rather than with a torch add (then the layer's one-pass add + RMSNorm is cheaper)."""
        ws = None if self._exchanges(mode) else self.gemm_ar_ws[mode]
        if ws is None:
            return False
        from fusedpar.kernels.gemm_all_reduce import auto_path

        group = self.ctx.attention_group(mode)
        q = w.q if isinstance(w, FP8Weight) else w
        dtype = self.dtype if isinstance(w, FP8Weight) else w.dtype
        return auto_path(rows, w.shape[0], w.shape[1], dtype, group.size, ws.table, q.device) in ("one_shot",
                                                                                                "two_shot")
