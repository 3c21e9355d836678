"""Shift-parallel Llama/Qwen decoder layer: both modes, on the reference ops or the Triton kernels.

Math (pre-norm, HF Llama/Qwen semantics):
    h   = x + O(attn(rope(qk_norm(Q(norm1(x)))), rope(qk_norm(K(...))), V(...)))
    out = h + Down(silu(Gate(norm2(h))) * Up(norm2(h)))

Tensor layout per rank (n real tokens, n_pad = n rounded up to a multiple of SP, m = n_pad/SP,
P = SP*TP, q/kv = local heads per rank, hd = head_dim):
  base  (Algorithm 2): x [m, d] = SP rank s's rows of the padded step; qkv GEMM with the base
        shard -> [m, SP*(q+2kv)*hd] -> Ulysses all-to-all in the SP group -> [n_pad, (q+2kv)*hd]
        -> attention on the n real rows -> [n_pad, q*hd] (pad rows zero) -> all-to-all back ->
        [m, SP*q*hd] -> O GEMM -> all-reduce over TP; MLP column/row parallel over TP.
  shift (TP = P): x [n, d] on every rank; the same GEMMs with the shift views; all-reduces
        over the shift group. No all-to-all, no padding.
Both modes compute exactly the heads HeadPlacement assigns to the rank, and read/write one
PagedKVCache. The GEMMs and their communication stages (qkv exchange, gate_up with its SwiGLU,
o-projection, row-parallel reduce) are a communicator's (fusedpar.layers.comm).

`torch_fwd` is the reference path (and the CPU path): reference ops on PlainComm(reference=True).
`fused_fwd` runs the same stages on the Triton norms and paged attention (whose stores may do the
return all-to-all) with the stack's communicator, normally FusedComm. forward() takes the fused
path when the layer has a communicator that takes the input (CUDA). Scaled RoPE reaches the Triton
attention as cos/sin tables [n, head_dim] built once per step (StepState.rope_tables); plain RoPE
passes rope_theta, except in steps beyond the kernel's fp32 angle range (needs_rope_tables).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fusedpar.collectives import ParallelContext
from fusedpar.kernels.reference import (
    apply_rope,
    blocked_swiglu,
    causal_gqa_attention,
    gqa_attention,
    rms_norm,
    rope_cos_sin,
)
from fusedpar.layers.comm import PlainComm
from fusedpar.layers.config import DecoderConfig
from fusedpar.layers.fp8_weights import linear
from fusedpar.layers.kv_cache import PagedKVCache
from fusedpar.layers.step_plan import StepBatch
from fusedpar.layers.weights import ShardedDecoderWeights
from fusedpar.layouts import StepMode, check_mode


def needs_rope_tables(cfg: DecoderConfig, max_kv_len: int) -> bool:
    """Whether the fused attention gets cos/sin tables for a step whose sequences reach max_kv_len
    tokens (context + new): always for a RoPE table or scaling, and for plain RoPE past the range
    where the kernel's own fp32 angles are accurate (attention.ROPE_THETA_MAX_KV_LEN)."""
    from fusedpar.kernels.attention import ROPE_THETA_MAX_KV_LEN

    return not cfg.rope_is_default or max_kv_len > ROPE_THETA_MAX_KV_LEN


def rope_tables(cfg: DecoderConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos, sin [n, head_dim] of the config's RoPE at `positions` (the fused attention's tables)."""
    return rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, torch.float32, cfg.rope_inv_freq,
                        cfg.rope_attention_scaling)


@dataclass(frozen=True)
class StepState:
    """Everything one forward step shares across layers (built once per step by the stack).

    positions, slots: [n] for the n real tokens, in packed order (slots index the paged cache).
    padded_tokens: n_pad in base mode, n in shift mode.
    attn_metadata: the Triton attention's per-step tensors (block tables, offsets), built once
    per step for the fused path; None on the reference path.
    rope_tables: (cos, sin) fp32 [n, head_dim] of the step's positions for the fused attention of a
    model with a RoPE table or scaling (DecoderConfig.rope_is_default False); None otherwise (the
    fused layer then builds them itself).
    """

    mode: StepMode
    batch: StepBatch
    padded_tokens: int
    positions: torch.Tensor
    slots: torch.Tensor
    attn_metadata: object | None = None
    rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_tokens(self) -> int:
        return self.batch.num_tokens


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm: the one-pass Triton kernel on CUDA, the reference elsewhere (same roundings)."""
    if x.is_cuda and x.dim() == 2 and x.stride(1) == 1 and x.dtype == weight.dtype:
        from fusedpar.kernels.rmsnorm import rms_norm as rms_norm_kernel

        return rms_norm_kernel(x, weight, eps)
    return rms_norm(x, weight, eps)


def _add_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm(x + delta)): one Triton pass on CUDA, the reference elsewhere."""
    if x.is_cuda and x.dim() == 2 and x.stride(1) == 1 and x.dtype == weight.dtype == delta.dtype:
        from fusedpar.kernels.rmsnorm import add_rms_norm

        return add_rms_norm(x, delta.contiguous(), weight, eps)
    s = x + delta
    return s, rms_norm(s, weight, eps)


class ShiftParallelDecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, ctx: ParallelContext, weights: ShardedDecoderWeights, layer_idx: int):
        super().__init__()
        self.cfg, self.ctx, self.w, self.layer_idx = cfg, ctx, weights, layer_idx
        placement = ctx.layout.head_placement(cfg.num_q_heads, cfg.num_kv_heads)
        rank = ctx.global_rank
        for attr in ("q_heads", "kv_heads"):
            base, shift = getattr(placement, attr)(rank, StepMode.BASE), getattr(placement, attr)(rank, StepMode.SHIFT)
            if base != shift:  # the whole design rests on this; never run with a broken placement
                raise AssertionError(f"rank {rank}: base {attr} {base} != shift {shift}")
        self.q_heads = placement.q_heads(rank, StepMode.SHIFT)
        self.kv_heads = placement.kv_heads(rank, StepMode.SHIFT)
        self.register_buffer("kv_index", torch.tensor(placement.q_to_kv_index(rank), device=ctx.device),
                             persistent=False)
        self.nq, self.nkv = len(self.q_heads), len(self.kv_heads)
        # width of one [gate | up] block of the gate_up output (SP blocks in base mode, one in shift)
        self.act_block = cfg.intermediate_size // ctx.layout.replica_size
        self.comm = PlainComm(ctx, reference=True)  # the reference path's stages
        self.fused = None  # the fused path's communicator, shared by the stack's layers (ShiftParallelStack)

    @classmethod
    def from_full_weights(
        cls, cfg: DecoderConfig, ctx: ParallelContext, full: dict[str, torch.Tensor], layer_idx: int
    ) -> ShiftParallelDecoderLayer:
        w = ShardedDecoderWeights.from_full(cfg, ctx.layout, ctx.global_rank, full)
        return cls(cfg, ctx, w, layer_idx)

    def forward(self, x: torch.Tensor, step: StepState, cache: PagedKVCache) -> torch.Tensor:
        if self.fused is not None and x.is_cuda and self.fused.should_use(x):  # Triton kernels: CUDA inputs
            return self.fused_fwd(x, step, cache)
        return self.torch_fwd(x, step, cache)

    def _check(self, x: torch.Tensor, step: StepState, cache: PagedKVCache) -> tuple[StepMode, int]:
        mode = check_mode(step.mode)
        sp = self.ctx.sp.size if mode is StepMode.BASE else 1
        rows = step.padded_tokens // sp
        if x.dim() != 2 or x.shape != (rows, self.cfg.hidden_size):
            raise ValueError(
                f"{mode} mode expects hidden [{rows}, {self.cfg.hidden_size}] on this rank "
                f"({step.num_tokens} tokens, padded to {step.padded_tokens}, SP={sp}), got {tuple(x.shape)}"
            )
        if cache.kv_heads != self.kv_heads:
            raise ValueError(f"cache holds kv heads {cache.kv_heads}, this rank computes {self.kv_heads}")
        return mode, rows

    # ---- fused path -------------------------------------------------------------------------
    def fused_fwd(self, x: torch.Tensor, step: StepState, cache: PagedKVCache) -> torch.Tensor:
        mode, rows = self._check(x, step, cache)
        w, rep, cfg, comm = self.w.weights(mode), self.w.replicated, self.cfg, self.fused
        h = _norm(x, rep["input_norm"], cfg.rms_norm_eps)
        # [n_pad, blk] in base (may be a view of the receive buffer), [n, blk] in shift
        qkv = comm.qkv(h, w["qkv"], mode, w.get("qkv_bias"))
        target = comm.o_target(mode, rows)
        if target is not None:  # base mode: the attention's stores are the return all-to-all
            self._fused_attention(qkv, step, cache, scatter=target)
            o = comm.o_proj_scattered(w["o"], rows, step.num_tokens)
            x, h = _add_norm(x, o, rep["post_norm"], cfg.rms_norm_eps)
        else:
            attn = self._fused_attention(qkv, step, cache)
            if comm.fuses_residual(rows, w["o"], mode):  # the o-projection's reduce epilogue adds x
                x = comm.o_proj(attn, w["o"], mode, residual=x)
                h = _norm(x, rep["post_norm"], cfg.rms_norm_eps)
            else:  # residual add + post-attention norm in one pass (attention zero-fills padding rows)
                x, h = _add_norm(x, comm.o_proj(attn, w["o"], mode), rep["post_norm"], cfg.rms_norm_eps)
        # SwiGLU of the [gate | up] blocks rides on the gate_up GEMM, the residual add on the down projection
        act = comm.column_parallel(h, w["gate_up"], swiglu_block=self.act_block)
        return comm.row_parallel(act, w["down"], mode, residual=x)

    def _fused_attention(self, qkv: torch.Tensor, step: StepState, cache: PagedKVCache, scatter=None
                         ) -> torch.Tensor | None:
        """Triton paged attention of qkv [rows >= n, blk] -> [rows, q*hd] (padding rows zero); with
        scatter (a ScatterOut) the rows go to their owner ranks' staging instead (returns None)."""
        from fusedpar.kernels.attention import paged_attention
        from fusedpar.layers.attention import attention_step, step_metadata

        cfg, rep = self.cfg, self.w.replicated
        if step.rope_tables is None and cfg.rope_is_default:
            return attention_step(qkv, step, cache, self.layer_idx, q_norm=rep.get("q_norm"),
                                  k_norm=rep.get("k_norm"), eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
                                  metadata=step.attn_metadata, scatter=scatter)
        # attention_step takes only rope_theta: the same call with the step's cos/sin tables
        cos, sin = step.rope_tables if step.rope_tables is not None else rope_tables(cfg, step.positions)
        md = step.attn_metadata
        if md is None:
            md = step_metadata(step.batch, cache, qkv.device)
        return paged_attention(
            qkv, num_tokens=step.num_tokens, num_q_heads=self.nq, cu_seqlens_q=md.cu_seqlens_q,
            context_lens=md.context_lens, block_tables=md.block_tables, k_cache=cache.k[self.layer_idx],
            v_cache=cache.v[self.layer_idx], slots=step.slots, max_query_len=md.max_query_len,
            max_kv_len=md.max_kv_len, q_norm=rep.get("q_norm"), k_norm=rep.get("k_norm"), eps=cfg.rms_norm_eps,
            rope_cos=cos, rope_sin=sin, scatter=scatter,
        )

    # ---- reference path -----------------------------------------------------------------------
    def torch_fwd(self, x: torch.Tensor, step: StepState, cache: PagedKVCache) -> torch.Tensor:
        mode, _ = self._check(x, step, cache)
        w, comm = self.w.weights(mode), self.comm

        h = rms_norm(x, self.w.replicated["input_norm"], self.cfg.rms_norm_eps)
        qkv = comm.qkv(h, w["qkv"], mode, w.get("qkv_bias"))  # [n_pad, (q+2kv)*hd] in base mode
        attn = self._attention(qkv[: step.num_tokens], step, cache)  # [n, q*hd]
        if mode is StepMode.BASE:
            attn = F.pad(attn, (0, 0, 0, step.padded_tokens - step.num_tokens))  # pad rows stay zero
        x = comm.o_proj(attn, w["o"], mode, residual=x)
        return self._mlp_reference(x, w, mode)

    def _mlp_reference(self, x: torch.Tensor, w: dict, mode: str) -> torch.Tensor:
        """x + down(SwiGLU(gate_up(RMSNorm(x)))), the down projection reduced over the mode's group."""
        h = rms_norm(x, self.w.replicated["post_norm"], self.cfg.rms_norm_eps)
        act = blocked_swiglu(linear(h, w["gate_up"]), self.act_block)
        return self.comm.row_parallel(act, w["down"], mode, residual=x)

    def side_queries(self, x: torch.Tensor, positions: torch.Tensor, visible: list[tuple[int, int, int]],
                     cache: PagedKVCache) -> torch.Tensor:
        """The layer for k extra queries that attend to cached tokens but are not keys themselves:
        nothing is written to the cache and no other token sees them (HF's padding positions, whose
        own mask column is 0). x [k, d] and everything else the same on every rank; shift-mode
        weights, reference ops, all-reduces over the shift group (collective).

        Query i sits at RoPE position positions[i] and attends to the tokens lo..hi-1 of sequence
        seq_id, (seq_id, lo, hi) = visible[i], already in `cache`; with hi == lo it attends to
        nothing and its attention output is zero (what HF's SDPA gives a fully masked query), so the
        layer is x + MLP(x) for it. Returns x + O(attn) + MLP, as forward() does for a real token.
        """
        cfg, hd = self.cfg, self.cfg.head_dim
        k = x.shape[0]
        if x.dim() != 2 or x.shape[1] != cfg.hidden_size or positions.shape != (k,) or len(visible) != k:
            raise ValueError(f"side_queries expects hidden [k, {cfg.hidden_size}], positions [k] and k visible "
                             f"ranges, got {tuple(x.shape)}, {tuple(positions.shape)}, {len(visible)}")
        w, rep = self.w.weights(StepMode.SHIFT), self.w.replicated
        rows = [i for i, (_, lo, hi) in enumerate(visible) if hi > lo]
        if rows:  # the same on every rank, so the o all-reduce below is called by all or by none
            idx = torch.tensor(rows, device=x.device)
            bias = w.get("qkv_bias")
            q = linear(rms_norm(x[idx], rep["input_norm"], cfg.rms_norm_eps), w["qkv"].narrow(0, 0, self.nq * hd),
                         None if bias is None else bias[: self.nq * hd]).reshape(len(rows), self.nq, hd)
            if cfg.qk_norm:
                q = rms_norm(q, rep["q_norm"], cfg.rms_norm_eps)
            cos, sin = rope_cos_sin(positions[idx], hd, cfg.rope_theta, q.dtype, cfg.rope_inv_freq,
                                    cfg.rope_attention_scaling)
            q = apply_rope(q, cos, sin)
            attn = torch.zeros((k, self.nq * hd), dtype=x.dtype, device=x.device)
            # queries that see the same keys (e.g. a right-padded row's padding) attend in one call
            groups: dict[tuple[int, int, int], list[int]] = {}
            for r, i in enumerate(rows):
                groups.setdefault(visible[i], []).append(r)
            gathered: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            for (sid, lo, hi), members in groups.items():
                if sid not in gathered:
                    gathered[sid] = cache.gather(self.layer_idx, sid)
                kc, vc = gathered[sid]
                if hi > kc.shape[0]:
                    raise ValueError(f"side queries: sequence {sid} holds {kc.shape[0]} tokens, asked for {lo}..{hi}")
                sel = torch.tensor(members, device=x.device)
                out = gqa_attention(q[sel], kc[lo:hi], vc[lo:hi], self.kv_index, hd ** -0.5, causal=False)
                attn[idx[sel]] = out.reshape(len(members), -1)
            x = self.comm.row_parallel(attn, w["o"], StepMode.SHIFT, residual=x)
        return self._mlp_reference(x, w, StepMode.SHIFT)

    def _attention(self, qkv: torch.Tensor, step: StepState, cache: PagedKVCache) -> torch.Tensor:
        """qkv [n, (q+2kv)*hd] of the rank's heads for the n real tokens -> [n, q*hd].

        Writes the new k/v to the cache first, then attends each sequence to its cached context.
        """
        cfg, n = self.cfg, qkv.shape[0]
        hd = cfg.head_dim
        q, k, v = qkv.split([self.nq * hd, self.nkv * hd, self.nkv * hd], dim=1)
        q, k, v = q.reshape(n, self.nq, hd), k.reshape(n, self.nkv, hd), v.reshape(n, self.nkv, hd)
        if cfg.qk_norm:
            q = rms_norm(q, self.w.replicated["q_norm"], cfg.rms_norm_eps)
            k = rms_norm(k, self.w.replicated["k_norm"], cfg.rms_norm_eps)
        cos, sin = rope_cos_sin(step.positions, hd, cfg.rope_theta, q.dtype, cfg.rope_inv_freq,
                                cfg.rope_attention_scaling)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache.write(self.layer_idx, step.slots, k, v)

        out = torch.empty((n, self.nq, hd), dtype=qkv.dtype, device=qkv.device)
        start = 0
        for sid, ql in zip(step.batch.seq_ids, step.batch.query_lens, strict=True):
            kc, vc = cache.gather(self.layer_idx, sid)
            out[start:start + ql] = causal_gqa_attention(q[start:start + ql], kc, vc, self.kv_index, hd ** -0.5)
            start += ql
        return out.reshape(n, self.nq * hd)
