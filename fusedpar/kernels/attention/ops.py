"""torch.library custom ops of paged attention, with fake impls (what torch.compile traces).

    fusedpar::paged_attention_out       into a given out [rows, nq hd]
    fusedpar::paged_attention           into a new [rows, nq hd] tensor
    fusedpar::paged_attention_scatter   into the owner ranks' buffers (ScatterOut's fields)

Same arguments as the launcher (rope_theta <= 0 means no theta RoPE), pick_config's tiling. mutates_args
lists the cache layer views: the ops write the new k/v into them (declared even with write_kv=False,
which is harmless). Re-importing re-registers cleanly.
"""

from __future__ import annotations

import torch

from fusedpar.kernels.attention.launch import ScatterOut, _check_args, _check_scatter, _launch


@torch.library.custom_op("fusedpar::paged_attention_out", mutates_args=("out", "k_cache", "v_cache"))
def _paged_attention_out_op(
    qkv: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    slots: torch.Tensor | None,
    positions: torch.Tensor | None,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    rope_cos: torch.Tensor | None,
    rope_sin: torch.Tensor | None,
    num_tokens: int,
    num_q_heads: int,
    max_query_len: int,
    max_kv_len: int,
    scale: float,
    eps: float,
    rope_theta: float,
    write_kv: bool,
) -> None:
    """fusedpar.kernels.attention.paged_attention into `out`."""
    _launch(
        qkv, out, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, slots, positions, q_norm,
        k_norm, rope_cos, rope_sin, num_tokens=num_tokens, num_q_heads=num_q_heads,
        max_query_len=max_query_len, max_kv_len=max_kv_len, scale=scale, eps=eps, rope_theta=rope_theta,
        write_kv=write_kv,
    )


@_paged_attention_out_op.register_fake
def _paged_attention_out_fake(
    qkv, out, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, slots, positions, q_norm, k_norm,
    rope_cos, rope_sin, num_tokens, num_q_heads, max_query_len, max_kv_len, scale, eps, rope_theta, write_kv,
) -> None:
    _check_args(
        qkv, out, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, slots, positions, q_norm,
        k_norm, rope_cos, rope_sin, num_tokens, num_q_heads, rope_theta, write_kv,
    )


@torch.library.custom_op("fusedpar::paged_attention", mutates_args=("k_cache", "v_cache"))
def _paged_attention_op(
    qkv: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    slots: torch.Tensor | None,
    positions: torch.Tensor | None,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    rope_cos: torch.Tensor | None,
    rope_sin: torch.Tensor | None,
    num_tokens: int,
    num_q_heads: int,
    max_query_len: int,
    max_kv_len: int,
    scale: float,
    eps: float,
    rope_theta: float,
    write_kv: bool,
) -> torch.Tensor:
    """paged_attention into a new contiguous [rows, nq * hd] tensor of qkv's dtype."""
    out = torch.empty((qkv.shape[0], num_q_heads * k_cache.shape[3]), dtype=qkv.dtype, device=qkv.device)
    return _launch(
        qkv, out, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, slots, positions, q_norm,
        k_norm, rope_cos, rope_sin, num_tokens=num_tokens, num_q_heads=num_q_heads,
        max_query_len=max_query_len, max_kv_len=max_kv_len, scale=scale, eps=eps, rope_theta=rope_theta,
        write_kv=write_kv,
    )


@_paged_attention_op.register_fake
def _paged_attention_fake(
    qkv, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, slots, positions, q_norm, k_norm,
    rope_cos, rope_sin, num_tokens, num_q_heads, max_query_len, max_kv_len, scale, eps, rope_theta, write_kv,
) -> torch.Tensor:
    _check_args(
        qkv, None, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, slots, positions, q_norm,
        k_norm, rope_cos, rope_sin, num_tokens, num_q_heads, rope_theta, write_kv,
    )
    return qkv.new_empty((qkv.shape[0], num_q_heads * k_cache.shape[3]))


@torch.library.custom_op("fusedpar::paged_attention_scatter", mutates_args=("local", "k_cache", "v_cache"))
def _paged_attention_scatter_op(
    qkv: torch.Tensor,
    local: torch.Tensor,
    peer_ptrs: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    slots: torch.Tensor | None,
    positions: torch.Tensor | None,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    rope_cos: torch.Tensor | None,
    rope_sin: torch.Tensor | None,
    num_tokens: int,
    num_q_heads: int,
    max_query_len: int,
    max_kv_len: int,
    scale: float,
    eps: float,
    rope_theta: float,
    write_kv: bool,
    rows_per_rank: int,
    col_offset: int,
) -> None:
    """paged_attention storing into the owner ranks' buffers (ScatterOut); `local` is this rank's
    destination, declared mutated because the peers' launches store into it."""
    _launch(
        qkv, None, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, slots, positions, q_norm,
        k_norm, rope_cos, rope_sin, num_tokens=num_tokens, num_q_heads=num_q_heads,
        max_query_len=max_query_len, max_kv_len=max_kv_len, scale=scale, eps=eps, rope_theta=rope_theta,
        write_kv=write_kv, scatter=ScatterOut(peer_ptrs, local, rows_per_rank, col_offset),
    )


@_paged_attention_scatter_op.register_fake
def _paged_attention_scatter_fake(
    qkv, local, peer_ptrs, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, slots, positions, q_norm,
    k_norm, rope_cos, rope_sin, num_tokens, num_q_heads, max_query_len, max_kv_len, scale, eps, rope_theta,
    write_kv, rows_per_rank, col_offset,
) -> None:
    _check_args(
        qkv, None, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, slots, positions, q_norm,
        k_norm, rope_cos, rope_sin, num_tokens, num_q_heads, rope_theta, write_kv,
    )
    _check_scatter(qkv, ScatterOut(peer_ptrs, local, rows_per_rank, col_offset), num_tokens,
                   num_q_heads * k_cache.shape[3])
