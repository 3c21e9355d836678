"""Paged flash attention in Triton reading q/k/v straight from the all-to-all receive layout.

Math (per rank; nq q heads, nkv kv heads, G = nq / nkv, hd = head_dim), for every real token t of
sequence s at position p_t = ctx_s + i:
    q_t,h = rope(norm_q(Q[t, h]), p_t),  k_t,j = rope(norm_k(K[t, j]), p_t) and v_t,j = V[t, j]
    (both written to the cache),  out[t, h] = sum_{u <= p_t} softmax_u(scale q_t,h . k_{s,u,j}) v_{s,u,j}
    with j = h // G over sequence s's cached keys followed by this step's. norm (Qwen3's per-head
    RMSNorm) and rope (HF rotate-half) are optional; fp32 transforms, softmax state and accumulation.
Layouts
    qkv [rows, (nq + 2 nkv) hd]: row t = packed token t; q heads, then k heads, then v heads; rows >=
        num_tokens are padding, never read; any row stride, contiguous columns.
    out [rows, nq hd]: rows < num_tokens the output, the rest zero-filled. Or scatter (ScatterOut):
        row t goes to its owner SP rank's o staging buffer (the return all-to-all by the stores).
    k_cache, v_cache [num_blocks, block_size, nkv, hd]: one layer of the paged cache; token slot =
        block * block_size + offset. block_tables [S, max_blocks] int32 (block i holds positions
        [i bs, (i+1) bs)), cu_seqlens_q [S + 1] int32, context_lens [S] int32 (tokens cached before
        this step): AttentionMetadata.
    GQA: q head h reads kv head h // G (the q heads of one kv head adjacent: check_kv_index).
Limits: head_dim a power of two >= 16; the cache dtype is the model dtype; a mixed batch tiles its
decode sequences like prefill ones.

Modules: rope_norm / kernels (@triton.jit), config (tilings), launch (checks, launcher), ops
(torch.library ops).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fusedpar.kernels.attention import ops as _ops  # noqa: F401  (registers torch.ops.fusedpar.paged_attention*)
from fusedpar.kernels.attention.config import (
    FUSED_WRITE_MAX_SEQS,
    ROPE_THETA_MAX_KV_LEN,
    AttentionConfig,
    AttentionOptions,
    pick_config,
)
from fusedpar.kernels.attention.launch import ScatterOut, _check_args, _launch

__all__ = [
    "FUSED_WRITE_MAX_SEQS",
    "ROPE_THETA_MAX_KV_LEN",
    "AttentionConfig",
    "AttentionMetadata",
    "AttentionOptions",
    "ScatterOut",
    "check_kv_index",
    "paged_attention",
    "pick_config",
]


def paged_attention(
    qkv: torch.Tensor,
    *,
    num_tokens: int,
    num_q_heads: int,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    max_query_len: int | None = None,
    max_kv_len: int | None = None,
    scale: float | None = None,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    rope_theta: float | None = None,
    rope_cos: torch.Tensor | None = None,
    rope_sin: torch.Tensor | None = None,
    write_kv: bool = True,
    out: torch.Tensor | None = None,
    scatter: ScatterOut | None = None,
    options: AttentionOptions | None = None,
) -> torch.Tensor | None:
    """Causal varlen/paged GQA attention of one step, reading the all-to-all layout in place.

    qkv [rows, (nq + 2 nkv) hd] (fp16/bf16/fp32; rows >= num_tokens, padding rows never read).
    k_cache, v_cache: this layer's [num_blocks, block_size, nkv, hd] cache views (same dtype).
    cu_seqlens_q [S+1], context_lens [S], block_tables [S, max_blocks]: contiguous int32, on the
      device (AttentionMetadata builds them). num_q_heads = nq; G = nq / nkv; q head h reads kv
      head h // G.
    slots [>= num_tokens] (int32/64): cache slot of each new token; negative = skip. Needed when
      write_kv (default): the new k (normed, roped) and raw v are written there before attending.
      With write_kv=False the new tokens' k/v must already be in the cache. A negative slot marks
      a padding row whose output is dropped: it is not meaningful (small decode batches attend its
      own key from registers, other launches read whatever the skipped slot holds).
    The metadata tensors are trusted, as in FlashAttention's varlen API (checking device values
      would cost a sync per call): cu_seqlens_q starts at 0, rises by >= 1 per sequence and ends at
      num_tokens (a CUDA graph's padded metadata may hold empty sequences when num_tokens >
      num_seqs); block tables and slots index inside the cache.
    RoPE: rope_theta (with positions [>= num_tokens], absolute position of each token), or
      rope_cos/rope_sin tables [>= num_tokens, hd] (row t for token t), or neither (no RoPE).
      rope_theta computes fp32 angles, accurate while max_kv_len <= ROPE_THETA_MAX_KV_LEN (positions
      below it); larger steps are refused: pass tables.
    q_norm / k_norm: optional [hd] RMSNorm weights (Qwen3), applied before RoPE with eps.
    max_query_len / max_kv_len: host-side upper bounds used only for tiling and split-KV choices
      (results are correct for any values); None derives them from the tensors (a device sync).
      In a CUDA graph pass bounds valid for every replay (e.g. the model's max length).
    scale: softmax scale, default hd ** -0.5. out: optional [rows, nq hd] destination (any row
      stride, contiguous columns).
    Returns out: rows < num_tokens = attention output, rows >= num_tokens = 0.
    scatter: a ScatterOut instead of out: every real row is stored straight into its owner rank's
      buffer (the return all-to-all); returns None. Its readers wait for the peers' arrival flags
      (fusedpar.kernels.ulysses.scattered_o_proj).
    options: tuning overrides (AttentionOptions: an explicit tiling), for tests and measurements.
    Under torch.compile it goes through torch.ops.fusedpar.paged_attention[_out|_scatter] (one opaque
    node with a fake impl; not with an explicit tiling); eager calls launch the kernels directly.
    """
    config = options.config if options is not None else None
    hd = k_cache.shape[-1]
    if scale is None:
        scale = hd**-0.5
    if max_query_len is None or max_kv_len is None:
        # Validate before reading the metadata, so a malformed call fails with the shape message.
        _check_args(
            qkv, out, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, slots, positions, q_norm,
            k_norm, rope_cos, rope_sin, num_tokens, num_q_heads, float(rope_theta or 0.0), write_kv,
        )
        lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(torch.int64)
        if max_query_len is None:
            max_query_len = int(lens.max()) if lens.numel() else 1
        if max_kv_len is None:
            max_kv_len = int((lens + context_lens).max()) if lens.numel() else 1
    theta = float(rope_theta) if rope_theta is not None else 0.0
    args = (cu_seqlens_q, context_lens, block_tables, slots, positions, q_norm, k_norm, rope_cos, rope_sin)
    kwargs: dict[str, Any] = dict(
        num_tokens=num_tokens, num_q_heads=num_q_heads, max_query_len=max_query_len, max_kv_len=max_kv_len,
        scale=float(scale), eps=float(eps), rope_theta=theta, write_kv=write_kv,
    )
    if config is not None or not torch.compiler.is_compiling():
        # Eager (and CUDA-graph capture, which records kernels, not ops): launch directly. The
        # custom-op dispatcher's host time per call is of the order of a decode step's attention on
        # the GPU.
        if out is None and scatter is None:
            out = torch.empty((qkv.shape[0], num_q_heads * hd), dtype=qkv.dtype, device=qkv.device)
        return _launch(qkv, out, k_cache, v_cache, *args, **kwargs, config=config, scatter=scatter)
    if scatter is not None:
        if out is not None:
            raise ValueError("fusedpar.paged_attention: pass exactly one of out and scatter")
        torch.ops.fusedpar.paged_attention_scatter(
            qkv, scatter.local, scatter.peer_ptrs, k_cache, v_cache, *args, **kwargs,
            rows_per_rank=scatter.rows_per_rank, col_offset=scatter.col_offset,
        )
        return None
    if out is None:
        return torch.ops.fusedpar.paged_attention(qkv, k_cache, v_cache, *args, **kwargs)
    torch.ops.fusedpar.paged_attention_out(qkv, out, k_cache, v_cache, *args, **kwargs)
    return out


@dataclass(frozen=True)
class AttentionMetadata:
    """Device-side batch description of one step, shared by every layer of the step.

    cu_seqlens_q [S+1], context_lens [S], block_tables [S, max_blocks]: int32 on the cache's device
    (views of one buffer, copied in one host->device transfer). num_tokens, max_query_len,
    max_kv_len: host ints (tiling choices; no device sync at launch).
    """

    cu_seqlens_q: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    num_tokens: int
    max_query_len: int
    max_kv_len: int


_VALIDATED_KV_INDEX: set[tuple] = set()


def check_kv_index(kv_index: torch.Tensor | Sequence[int], num_q_heads: int, num_kv_heads: int) -> None:
    """Raise unless kv_index == arange(nq) // (nq / nkv), the only GQA map the kernel implements
    (HeadPlacement.q_to_kv_index always has this form). Remembered per tensor (pointer, version),
    so the device->host read happens once per buffer, not once per layer call."""
    key = None
    if isinstance(kv_index, torch.Tensor):
        key = (kv_index.device, kv_index.data_ptr(), kv_index._version, kv_index.numel(), num_q_heads, num_kv_heads)
        if key in _VALIDATED_KV_INDEX:
            return
        values = [int(x) for x in kv_index.tolist()]
    else:
        values = [int(x) for x in kv_index]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"kv_index: {num_q_heads} q heads are not a multiple of {num_kv_heads} kv heads")
    want = [h // (num_q_heads // num_kv_heads) for h in range(num_q_heads)]
    if values != want:
        raise ValueError(
            f"kv_index {values} is not the contiguous GQA map {want} (q heads of one kv head must be adjacent)"
        )
    if key is not None:
        _VALIDATED_KV_INDEX.add(key)
