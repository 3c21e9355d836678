"""The decoder layer's attention on the Triton kernels: a StepBatch + PagedKVCache -> paged_attention.

step_metadata builds a step's AttentionMetadata (the device tensors shared by every layer of the
step) from the batch and the cache's block tables; attention_step is the drop-in for
ShiftParallelDecoderLayer._attention (norm, RoPE, cache write, causal GQA attention) on one layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from fusedpar.kernels.attention import AttentionMetadata, ScatterOut, check_kv_index, paged_attention

if TYPE_CHECKING:  # annotations only (decoder imports this module)
    from fusedpar.layers.decoder import StepState
    from fusedpar.layers.kv_cache import PagedKVCache
    from fusedpar.layers.step_plan import StepBatch

__all__ = ["attention_step", "step_metadata"]


def step_metadata(
    batch: StepBatch, cache: PagedKVCache, device: torch.device | str | None = None
) -> AttentionMetadata:
    """AttentionMetadata of a step, built AFTER cache.begin_step(batch) (which allocates the blocks of
    the new tokens), on `device` (default: the cache's).

    cu_seqlens_q, context_lens and the [S, max_blocks] block table are views of one int32 buffer,
    filled on the host and copied in one transfer. Python touches each sequence once (to read its
    block list), never each token. Raises if a block table is too short for its context + new tokens.
    """
    bs = cache.block_size
    q_lens = torch.tensor(batch.query_lens, dtype=torch.int64)
    ctx = torch.tensor(batch.context_lens, dtype=torch.int64)
    need = (ctx + q_lens + bs - 1) // bs
    tables = [cache.block_tables.get(sid, []) for sid in batch.seq_ids]
    have = torch.tensor([len(t) for t in tables], dtype=torch.int64)
    short = (have < need).nonzero().flatten().tolist()
    if short:
        i = short[0]
        raise ValueError(
            f"AttentionMetadata: sequence {batch.seq_ids[i]} has {int(have[i])} cache blocks but needs "
            f"{int(need[i])} for {batch.context_lens[i]} + {batch.query_lens[i]} tokens: call "
            f"cache.begin_step(batch) first"
        )
    num_seqs, max_blocks = len(tables), max(1, int(need.max()))
    buf = torch.zeros(2 * num_seqs + 1 + num_seqs * max_blocks, dtype=torch.int32)
    buf[1 : num_seqs + 1] = torch.cumsum(q_lens, 0).to(torch.int32)
    buf[num_seqs + 1 : 2 * num_seqs + 1] = ctx.to(torch.int32)
    # Pad the sequences' block-id tensors into the [S, max_blocks] table in one call; the
    # cache keeps those tensors between steps, so no Python loop runs over blocks.
    rows = [cache.block_table(sid)[:c] for sid, c in zip(batch.seq_ids, need.tolist(), strict=True)]
    padded = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    buf[2 * num_seqs + 1 :].view(num_seqs, max_blocks)[:, : padded.shape[1]] = padded
    dev_buf = buf.to(device if device is not None else cache.k.device)
    return AttentionMetadata(
        cu_seqlens_q=dev_buf[: num_seqs + 1],
        context_lens=dev_buf[num_seqs + 1 : 2 * num_seqs + 1],
        block_tables=dev_buf[2 * num_seqs + 1 :].view(num_seqs, max_blocks),
        num_tokens=int(q_lens.sum()),
        max_query_len=int(q_lens.max()),
        max_kv_len=int((q_lens + ctx).max()),
    )


def attention_step(
    qkv: torch.Tensor,
    step: StepState,
    cache: PagedKVCache,
    layer_idx: int,
    *,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    rope_theta: float | None = 10000.0,
    scale: float | None = None,
    kv_index: torch.Tensor | Sequence[int] | None = None,
    metadata: AttentionMetadata | None = None,
    out: torch.Tensor | None = None,
    scatter: ScatterOut | None = None,
) -> torch.Tensor | None:
    """Drop-in for ShiftParallelDecoderLayer._attention on the Triton kernels.

    qkv [rows, (nq + 2 nkv) hd] with rows = step.num_tokens (or the padded count: rows past
    num_tokens are ignored, so the all-to-all receive buffer can be passed whole). Writes the new
    tokens' post-RoPE k and raw v at step.slots of layer `layer_idx`, attends each sequence to its
    cached context + new tokens, returns [rows, nq hd] with zero padding rows.
    rope_theta: the model's RoPE base (None: no RoPE); q_norm/k_norm: Qwen3 weights or None;
    kv_index: optional, validated once per buffer (must be the contiguous GQA map).
    metadata: step_metadata(step.batch, cache), ideally built once per step and shared by all
    layers; built here when None (host work + one small host->device copy per call).
    Works identically for base-mode and shift-mode inputs: nothing here depends on the mode.
    scatter: store the rows into their owner ranks' buffers instead (see paged_attention); returns None.
    """
    nkv, hd = cache.k.shape[3], cache.k.shape[4]
    if qkv.dim() != 2 or qkv.shape[1] % hd or qkv.shape[1] // hd <= 2 * nkv:
        raise ValueError(
            f"attention_step: qkv must be [rows, (nq + 2*{nkv}) * {hd}] for this cache, got {tuple(qkv.shape)}"
        )
    nq = qkv.shape[1] // hd - 2 * nkv
    if kv_index is not None:
        check_kv_index(kv_index, nq, nkv)
    md = metadata if metadata is not None else step_metadata(step.batch, cache, qkv.device)
    if md.num_tokens != step.num_tokens:
        raise ValueError(f"attention_step: metadata has {md.num_tokens} tokens, the step {step.num_tokens}")
    return paged_attention(
        qkv,
        num_tokens=step.num_tokens,
        num_q_heads=nq,
        cu_seqlens_q=md.cu_seqlens_q,
        context_lens=md.context_lens,
        block_tables=md.block_tables,
        k_cache=cache.k[layer_idx],
        v_cache=cache.v[layer_idx],
        slots=step.slots,
        positions=step.positions,
        max_query_len=md.max_query_len,
        max_kv_len=md.max_kv_len,
        scale=scale,
        q_norm=q_norm,
        k_norm=k_norm,
        eps=eps,
        rope_theta=rope_theta,
        out=out,
        scatter=scatter,
    )
