"""State of the fused (Triton + symmetric memory) path of a shift-parallel stack, built once.

FusedKernels owns one SymmetricWorkspace per (group, protocol) the decoder layers need, sized
for steps of up to `max_tokens` tokens, and exposes the four stages the layer composes:

    base  (SP x TP)                                  shift (TP = P)
    qkv   qkv_all_to_all(h, W_qkv) -> recv [n_pad, blk]   F.linear(h, W_qkv view)
    attn  attention_step(recv, scatter=o_target(rows))    attention_step(...) -> [n, q*hd]
          stores each row in its owner's staging [m, SP*q*hd]
    o     scattered_o_proj(W_o) + TP all_reduce           gemm_all_reduce(attn, W_o view, shift) [+ x]
    down  gemm_all_reduce(gate_up, W_down, TP) + x        gemm_all_reduce(gate_up, W_down view, shift) + x

Base-mode return all-to-all (o_scatter=True, the default): the attention kernel stores its output
rows straight into the owner SP ranks' staging buffers (NVLink stores spread over the attention's
run, fusedpar.kernels.attention.ScatterOut), so the exchange costs one tiny arrival-barrier launch
and the o-projection is a plain cuBLAS GEMM on the staging. o_scatter=False keeps the previous
plan: attention into a local [n_pad, q*hd] buffer, then all_to_all_o_proj (fused push + GEMM up
to 128 rows per rank, NCCL all-to-all + cuBLAS above). Both use the o workspace, on one table.
qkv_copy_engine picks the base-mode qkv exchange (qkv_all_to_all's copy_engine: None by size,
True the per-owner cuBLAS GEMMs with copy-engine transfers, False the fused kernel).

The down projection takes the gate_up GEMM's output (SwiGLU by fusedpar.kernels.swiglu.silu_mul,
one pass) and the residual stream, which the fused reduce epilogue adds (one-shot in decode
graphs, two-shot at prefill sizes), so those steps launch no residual add; unfused paths add it
with torch. The o projection takes the residual only where a fused reduce adds it
(`fuses_residual`); elsewhere the layer keeps its one-pass residual-add + RMSNorm.

A q/k/v bias is the own block's bias rows: added to recv (out of place) in base mode, in the
GEMM in shift mode. Scaled RoPE reaches the attention as cos/sin tables instead of rope_theta.

Plain GEMMs with nothing to fuse (gate_up, shift-mode qkv) stay on cuBLAS: our Triton GEMM
would only match it. Two ways of fusing something into them in decode steps were built and
measured (commit 9aef8bd, reverted; one H200, CUDA graphs, weights streamed from HBM; logs
perf/results/gpu_run_h200_run76-80.log, records perf/results/norm_linear.json):
  - The RMSNorm folded into the GEMM (the per-row rsqrt scales the fp32 accumulator, x * g feeds
    the MMA, the sum of squares rides in the K loop) with split-K and a last-arriving reduce:
    at 1 / 8 rows the best swept tiling (up to 60 per shape) ties the Triton RMSNorm + cuBLAS pair on
    qkv (Llama-70B 17.3 vs 17.1 us, Qwen3-32B 13.1 vs 12.8) and loses on gate_up (69.4 vs 62.0,
    44.5 vs 37.7); the split-K Triton GEMM without the norm also only ties cuBLAS split-K + its
    reduce on qkv (17.1 vs 17.0, 13.0 vs 12.9). The x / g operand work in a weight-streaming loop
    costs what the saved launch gains.
  - The o-projection weight bulk-prefetched into L2 (cp.async.bulk.prefetch.L2) while decode
    attention runs: the GEMM reads a just-read weight only ~2 us faster (Qwen3-32B o, 1 row: 6.7
    vs 8.9 us cuBLAS), and the prefetch launch costs more than that on a side stream (+0.4 to
    +4.5 us per step) or the main stream (+3.1 to +5.5 us).
Every fused op routes itself to its plain fallback by size (and when a
step does not fit its workspace), deciding from shapes alone so every rank agrees.

Collective: every rank builds FusedKernels with the same arguments, in the same order.

fuse_comm=False builds no workspaces: every stage then takes its plain path (cuBLAS GEMMs,
stock torch.distributed NCCL all-to-all / all-reduce) around the same Triton attention, which is
the baseline the layer benchmark compares the fused communication against. (The fused stack's
own eager fallbacks skip dist.all_reduce's Python wrapper: fusedpar.kernels.allreduce.sum_over_group_.)
With plain_all_reduce="symm_mem" the shift-mode row-parallel GEMMs of up to `symm_mem_rows` rows
write into a torch symmetric-memory buffer and reduce with torch.ops.symm_mem.one_shot_all_reduce
(the best stock decode path inside a CUDA graph, DESIGN.md section 9); larger steps keep NCCL.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusedpar.collectives import ParallelContext, all_reduce_sum, head_to_seq_all_to_all, seq_to_head_all_to_all
from fusedpar.layers.config import DecoderConfig


class FusedKernels:
    def __init__(self, ctx: ParallelContext, cfg: DecoderConfig, *, max_tokens: int, dtype: torch.dtype,
                 fuse_comm: bool = True, plain_all_reduce: str = "nccl", symm_mem_rows: int = 64,
                 o_scatter: bool = True, qkv_copy_engine: bool | None = None):
        from fusedpar.collectives.symmetric import SymmetricWorkspace
        from fusedpar.kernels import allreduce, gemm_all_reduce, ulysses

        if ctx.device.type != "cuda":
            raise ValueError(f"FusedKernels needs CUDA (symmetric memory); the context is on {ctx.device}")
        self.ctx, self.cfg, self.dtype, self.max_tokens = ctx, cfg, dtype, max_tokens
        layout = ctx.layout
        place = layout.head_placement(cfg.num_q_heads, cfg.num_kv_heads)
        hd, sp, P = cfg.head_dim, layout.sp, layout.replica_size
        nq, nkv = place.q_heads_per_rank, place.kv_heads_per_rank
        self.blk = (nq + 2 * nkv) * hd
        self.attn_width = nq * hd  # C: this rank's attention output columns
        self.o_scatter = o_scatter
        self.qkv_copy_engine = qkv_copy_engine  # qkv_all_to_all's copy_engine: None = by size
        m_max = -(-max_tokens // sp)
        num_sms = torch.cuda.get_device_properties(ctx.device).multi_processor_count

        def reduce_bytes(group_size: int, k_o: int, k_down: int, rows: int) -> tuple[int, int]:
            sizes = [gemm_all_reduce.required_workspace(path, min(rows, cap), cfg.hidden_size, k, dtype,
                                                        group_size, num_sms=num_sms)
                     for path, cap in (("one_shot", gemm_all_reduce.ONE_SHOT_MAX_TOKENS),
                                       ("one_shot", gemm_all_reduce.SPLIT_K_MAX_ROWS), ("two_shot", 2048))
                     for k in (k_o, k_down)]
            return max(s[0] for s in sizes), max(s[1] for s in sizes)

        self.qkv_ws = self.o_ws = self.tp_allreduce_ws = None
        self.gemm_ar_ws: dict[str, object | None] = {"base": None, "shift": None}
        self.fuse_comm = fuse_comm
        # Diagnostic (perf/profile_layer.py --qkv-timeline): an int64 [#SMs, 4] tensor that the fused
        # qkv launch stamps with its phase times (fusedpar.kernels.ulysses.qkv_timeline_summary).
        self.qkv_timeline: torch.Tensor | None = None
        self._stock_one_shot = None  # (buffer [2, rows * d], group name): torch's one-shot baseline
        self._stock_calls = 0
        if plain_all_reduce not in ("nccl", "symm_mem"):
            raise ValueError(f"plain_all_reduce must be 'nccl' or 'symm_mem', got {plain_all_reduce!r}")
        if plain_all_reduce == "symm_mem":
            if fuse_comm:
                raise ValueError("plain_all_reduce='symm_mem' is a baseline of the plain path: use fuse_comm=False")
            if ctx.shift.size > 1:
                import torch.distributed._symmetric_memory as symm_mem

                # two buffers used alternately: a GEMM never overwrites what a slow peer may still read
                buf = symm_mem.empty((2, symm_mem_rows * cfg.hidden_size), dtype=dtype, device=ctx.device)
                symm_mem.rendezvous(buf, ctx.shift.pg)
                self._stock_one_shot = (buf, ctx.shift.pg.group_name)
        if not fuse_comm:
            return
        if sp > 1:
            self.qkv_ws = SymmetricWorkspace(ctx.sp, ulysses.qkv_workspace_bytes(m_max, self.blk, sp, dtype),
                                             ranks=ctx.sp.ranks)
            self.o_ws = SymmetricWorkspace(ctx.sp, ulysses.o_proj_workspace_bytes(m_max, nq * hd, sp, dtype),
                                           ranks=ctx.sp.ranks)
        tp = layout.tp
        if tp > 1:
            nbytes, blocks = reduce_bytes(tp, nq * sp * hd, cfg.intermediate_size // tp, m_max)
            self.gemm_ar_ws["base"] = SymmetricWorkspace(ctx.tp, nbytes, max_blocks=blocks, ranks=ctx.tp.ranks)
            # base mode with SP > 1 all-reduces the fused o-projection's output over TP
            self.tp_allreduce_ws = SymmetricWorkspace(
                ctx.tp, allreduce.DEFAULT_ONE_SHOT_MAX_BYTES, ranks=ctx.tp.ranks)
        if P > 1:
            nbytes, blocks = reduce_bytes(P, nq * hd, cfg.intermediate_size // P, max_tokens)
            self.gemm_ar_ws["shift"] = SymmetricWorkspace(ctx.shift, nbytes, max_blocks=blocks,
                                                          ranks=ctx.shift.ranks)
        torch.cuda.synchronize(ctx.device)

    def spin_timeouts(self) -> list[str]:
        """Names of the workspaces on which a bounded flag wait gave up (counters[STATUS] != 0: a peer
        never published, so that launch's output is wrong). Host sync: tests and debugging only."""
        named = {"qkv_all_to_all": self.qkv_ws, "all_to_all_o_proj": self.o_ws, "tp_all_reduce": self.tp_allreduce_ws,
                 **{f"gemm_all_reduce[{mode}]": ws for mode, ws in self.gemm_ar_ws.items()}}
        return [name for name, ws in named.items() if ws is not None and ws.table.status() != 0]

    # ---- the stages ------------------------------------------------------------------------
    def qkv(self, h: torch.Tensor, w: torch.Tensor, mode: str, bias: torch.Tensor | None = None) -> torch.Tensor:
        """[rows, d] -> qkv of this rank's heads for every token of the step: [n(_pad), blk].

        bias: optional [blk] q/k/v bias of this rank's own block (the shift view of the qkv bias):
        after the exchange every row holds exactly that block, so it is added to the received
        rows (out of place: they may be a view of the symmetric receive buffer); without an
        exchange (shift mode, SP = 1) w has exactly the block's rows and the GEMM adds it.
        """
        if mode == "base" and self.ctx.sp.size > 1:
            from fusedpar.kernels.ulysses import qkv_all_to_all

            if self.qkv_ws is not None:
                out = qkv_all_to_all(h, w, self.qkv_ws, self.ctx.sp, timeline=self.qkv_timeline,
                                     copy_engine=self.qkv_copy_engine)
            else:
                out = seq_to_head_all_to_all(F.linear(h, w), self.ctx.sp)
            return out if bias is None else out + bias
        return F.linear(h, w, bias)

    def o_target(self, mode: str, rows: int):
        """The ScatterOut the base-mode attention stores through (rows = m, per SP rank), or None when
        the step takes a local attention output (shift mode, SP = 1, no fused communication,
        o_scatter=False, or a step larger than the o workspace)."""
        from fusedpar.kernels.ulysses import o_proj_workspace_bytes, o_scatter_target

        if not (self.o_scatter and mode == "base" and self.o_ws is not None and rows >= 1):
            return None
        sp = self.ctx.sp.size
        if o_proj_workspace_bytes(rows, self.attn_width, sp, self.dtype) > self.o_ws.table.buffer_bytes:
            return None
        return o_scatter_target(self.o_ws, rows, self.attn_width, self.dtype)

    def o_proj_scattered(self, w: torch.Tensor, rows: int, num_tokens: int) -> torch.Tensor:
        """After attention stored through o_target(rows): the o-projection of the staged rows, summed
        over TP: [rows, d]."""
        from fusedpar.kernels.allreduce import all_reduce
        from fusedpar.kernels.ulysses import scattered_o_proj

        out = scattered_o_proj(w, self.o_ws, tokens=rows, num_tokens=num_tokens, c=self.attn_width)
        if self.ctx.tp.size > 1:
            out = all_reduce(out, self.ctx.tp, self.tp_allreduce_ws, inplace=True)
        return out

    def o_proj(self, attn: torch.Tensor, w: torch.Tensor, mode: str, *, residual: torch.Tensor | None = None
               ) -> torch.Tensor:
        """Attention output -> [residual +] o-projection summed over the mode's reduce group: [rows, d]."""
        if mode == "base" and self.ctx.sp.size > 1:
            if residual is not None:
                raise ValueError("o_proj: base mode with SP > 1 has no residual epilogue (see fuses_residual)")
            from fusedpar.kernels.allreduce import all_reduce
            from fusedpar.kernels.ulysses import all_to_all_o_proj

            if self.o_ws is not None:
                out = all_to_all_o_proj(attn, w, self.o_ws, self.ctx.sp)
            else:
                out = F.linear(head_to_seq_all_to_all(attn, self.ctx.sp), w)
            if self.ctx.tp.size > 1 and self.fuse_comm:
                out = all_reduce(out, self.ctx.tp, self.tp_allreduce_ws, inplace=True)
            elif self.ctx.tp.size > 1:  # the plain baseline: stock dist.all_reduce
                out = all_reduce_sum(out, self.ctx.tp)
            return out
        return self.row_parallel(attn, w, mode, residual=residual)

    def row_parallel(self, x: torch.Tensor, w: torch.Tensor, mode: str, *, residual: torch.Tensor | None = None,
                     swiglu_block: int = 0) -> torch.Tensor:
        """[residual +] act(x) @ w^T summed over the mode's reduce group (TP in base, shift group in shift).

        act(x) = x, or with swiglu_block > 0 the SwiGLU of the blocked gate_up output x [rows, 2 K]
        (fusedpar.kernels.swiglu). residual [rows, N]: the residual stream (same on every rank).
        """
        from fusedpar.kernels.gemm_all_reduce import gemm_all_reduce
        from fusedpar.kernels.swiglu import silu_mul

        # A separate pass, not a GEMM prologue: computing SwiGLU in the one-shot kernel's operand
        # load measured 2x slower than this + the kernel (fusedpar.kernels.gemm_all_reduce docstring).
        act = silu_mul(x, swiglu_block) if swiglu_block else x
        group = self.ctx.attention_group(mode)
        stock = self._stock_one_shot
        if stock is not None and group.size > 1 and mode == "shift" and x.shape[0] * w.shape[0] <= stock[0].shape[1]:
            buf, group_name = stock
            view = buf[self._stock_calls % 2, : x.shape[0] * w.shape[0]].view(x.shape[0], w.shape[0])
            self._stock_calls += 1
            torch.matmul(act, w.t(), out=view)
            y = torch.ops.symm_mem.one_shot_all_reduce(view, "sum", group_name)
            return y if residual is None else residual + y
        if not self.fuse_comm:  # the plain baseline: cuBLAS + stock dist.all_reduce, then the residual add
            y = all_reduce_sum(F.linear(act, w), group)
            return y if residual is None else residual + y
        # a group of one takes gemm_all_reduce's "local" path (cuBLAS, then the residual add)
        return gemm_all_reduce(act, w, group, self.gemm_ar_ws[mode], residual=residual)

    def fuses_residual(self, rows: int, w: torch.Tensor, mode: str) -> bool:
        """Whether o_proj/row_parallel of `rows` rows with this weight adds a residual inside a fused
        reduce (free) rather than with a torch add (then the layer's add + RMSNorm pass is cheaper)."""
        from fusedpar.kernels.gemm_all_reduce import auto_path

        if mode == "base" and self.ctx.sp.size > 1:
            return False  # all_to_all_o_proj + TP all-reduce: no residual epilogue there
        group = self.ctx.attention_group(mode)
        if group.size == 1 or (self._stock_one_shot is not None and mode == "shift"):
            return False
        ws = self.gemm_ar_ws[mode]
        table = ws.table if ws is not None else None
        return auto_path(rows, w.shape[0], w.shape[1], w.dtype, group.size, table, w.device) in ("one_shot", "two_shot")
