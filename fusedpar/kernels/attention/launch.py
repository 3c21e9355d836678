"""Host side of paged attention: argument checks, the output scatter target and the launcher.

_launch checks shapes/dtypes/devices (no device reads), zero-fills out's padding rows, picks the
tiling (pick_config or an explicit AttentionConfig), the RoPE mode and the split count, then launches
[_write_kv_kernel] -> _attention_kernel -> [_combine_kernel]:
    write kernel   when the launch writes k/v outside the attention kernel (prefill/mixed, decode
                   batches above FUSED_WRITE_MAX_SEQS) or pre-rotates q; grid (num_tokens,)
    attention      grid (num_tokens // block_q + num_seqs q tiles (one per sequence for pure decode),
                   nkv, splits); surplus tiles exit at once
    combine        when splits > 1; grid (num_tokens, nq)
Under TRITON_INTERPRET=1 (set before the first import) the kernels run on CPU tensors; the
interpreter cannot tl.dot bf16, so interpret fp16/fp32.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import triton.language as tl

from fusedpar.kernels._host import INTERPRETED, SUPPORTED_DTYPES, cdiv, device_num_sms, is_pow2, next_pow2
from fusedpar.kernels.attention.config import (
    ATTENTION_INTERPRETER_NUM_SMS,
    FUSED_WRITE_MAX_SEQS,
    ROPE_NONE,
    ROPE_TABLES,
    ROPE_THETA,
    ROPE_THETA_FAST,
    ROPE_THETA_MAX_KV_LEN,
    AttentionConfig,
    pick_config,
)
from fusedpar.kernels.attention.kernels import _attention_kernel, _combine_kernel, _write_kv_kernel

_INDEX_DTYPES = (torch.int32, torch.int64)
_LOG2E = 1.4426950408889634


@functools.cache
def _device_has_pdl(device: torch.device) -> bool:
    """Programmatic Dependent Launch (griddepcontrol) needs an NVIDIA sm_90+ GPU (ROCm reports
    device type "cuda" too) and a Triton with tl.extra.cuda.gdc_wait (the kernels only reference it
    under a PDL constexpr, so an older Triton still runs them without PDL)."""
    return (device.type == "cuda" and torch.version.hip is None and hasattr(tl.extra.cuda, "gdc_wait")
            and torch.cuda.get_device_capability(device)[0] >= 9)


@functools.lru_cache(maxsize=64)
def _rope_inv_freq(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """fp32 [hd/2] inverse frequencies theta^(-2i/hd), computed in float64 like rope_cos_sin.

    Cached per (hd, theta, device): the first call copies to the device, so make it before a
    CUDA-graph capture (any warm-up run does).
    """
    i = torch.arange(0, head_dim, 2, dtype=torch.float64)
    return (1.0 / theta ** (i / head_dim)).to(torch.float32).to(device)


def _is_index_vector(t: torch.Tensor | None, n: int) -> bool:
    return t is not None and t.dim() == 1 and t.shape[0] >= n and t.dtype in _INDEX_DTYPES


def _check_args(
    qkv: torch.Tensor,
    out: torch.Tensor | None,
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
    rope_theta: float,
    write_kv: bool,
) -> None:
    """Shape/dtype/device checks shared by the launch and the fake impl (no data access)."""
    fn = "fusedpar.paged_attention"
    if qkv.dim() != 2:
        raise ValueError(f"{fn}: qkv must be 2-D [rows, (nq + 2 nkv) * hd], got {tuple(qkv.shape)}")
    if qkv.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{fn}: qkv dtype must be one of {SUPPORTED_DTYPES}, got {qkv.dtype}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(
            f"{fn}: k_cache and v_cache must be one layer's [num_blocks, block_size, nkv, hd] with equal "
            f"shapes and strides, got {tuple(k_cache.shape)}/{k_cache.stride()} and "
            f"{tuple(v_cache.shape)}/{v_cache.stride()}"
        )
    if k_cache.dtype != qkv.dtype or v_cache.dtype != qkv.dtype:
        raise TypeError(f"{fn}: cache dtype {k_cache.dtype}/{v_cache.dtype} must equal qkv dtype {qkv.dtype}")
    _, _, nkv, hd = k_cache.shape
    if not is_pow2(hd) or hd < 16:
        raise ValueError(f"{fn}: head_dim must be a power of two >= 16 (tl.arange / tl.dot), got {hd}")
    if num_q_heads < 1 or num_q_heads % nkv:
        raise ValueError(f"{fn}: num_q_heads={num_q_heads} must be a positive multiple of the cache's {nkv} kv heads")
    width = (num_q_heads + 2 * nkv) * hd
    if qkv.shape[1] != width:
        raise ValueError(
            f"{fn}: qkv has {qkv.shape[1]} columns, expected (nq + 2 nkv) * hd = ({num_q_heads} + 2*{nkv}) * {hd} "
            f"= {width}"
        )
    if qkv.shape[1] > 1 and qkv.stride(1) != 1:
        raise ValueError(f"{fn}: qkv columns must be contiguous (stride(1) == 1), got strides {qkv.stride()}")
    if k_cache.stride(3) != 1:
        raise ValueError(f"{fn}: cache head_dim must be contiguous, got strides {k_cache.stride()}")
    if not 0 <= num_tokens <= qkv.shape[0]:
        raise ValueError(f"{fn}: num_tokens={num_tokens} must be in [0, rows={qkv.shape[0]}]")
    tensors: dict[str, torch.Tensor | None] = {
        "out": out, "k_cache": k_cache, "v_cache": v_cache, "cu_seqlens_q": cu_seqlens_q,
        "context_lens": context_lens, "block_tables": block_tables, "slots": slots, "positions": positions,
        "q_norm": q_norm, "k_norm": k_norm, "rope_cos": rope_cos, "rope_sin": rope_sin,
    }
    for name, t in tensors.items():
        if t is not None and t.device != qkv.device:
            raise ValueError(f"{fn}: {name} is on {t.device} but qkv is on {qkv.device}")
    for name in ("cu_seqlens_q", "context_lens", "block_tables"):
        t = tensors[name]
        if t.dtype != torch.int32 or not t.is_contiguous():
            raise TypeError(f"{fn}: {name} must be a contiguous int32 tensor, got {t.dtype} strides {t.stride()}")
    num_seqs = cu_seqlens_q.numel() - 1
    if cu_seqlens_q.dim() != 1 or num_seqs < 1:
        raise ValueError(
            f"{fn}: cu_seqlens_q must be [num_seqs + 1] with num_seqs >= 1, got {tuple(cu_seqlens_q.shape)}"
        )
    if context_lens.shape != (num_seqs,) or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"{fn}: context_lens must be [{num_seqs}] and block_tables [{num_seqs}, max_blocks], got "
            f"{tuple(context_lens.shape)} and {tuple(block_tables.shape)}"
        )
    if num_seqs > max(num_tokens, 1):
        raise ValueError(f"{fn}: {num_seqs} sequences but only {num_tokens} tokens (every sequence needs >= 1)")
    if write_kv and not _is_index_vector(slots, num_tokens):
        raise ValueError(
            f"{fn}: write_kv needs slots, an int32/int64 [>= num_tokens={num_tokens}] tensor, got "
            f"{None if slots is None else (tuple(slots.shape), slots.dtype)}"
        )
    if rope_theta > 0 and (rope_cos is not None or rope_sin is not None):
        raise ValueError(f"{fn}: pass rope_theta or rope_cos/rope_sin tables, not both")
    if rope_theta > 0 and not _is_index_vector(positions, num_tokens):
        raise ValueError(
            f"{fn}: RoPE with rope_theta needs positions, an int32/int64 [>= num_tokens={num_tokens}] tensor, got "
            f"{None if positions is None else (tuple(positions.shape), positions.dtype)}"
        )
    if (rope_cos is None) != (rope_sin is None):
        raise ValueError(f"{fn}: pass both rope_cos and rope_sin, or neither")
    if rope_cos is not None:
        for name, t in (("rope_cos", rope_cos), ("rope_sin", rope_sin)):
            if t.dim() != 2 or t.shape[0] < num_tokens or t.shape[1] != hd or t.stride(1) != 1:
                raise ValueError(
                    f"{fn}: {name} must be [>= num_tokens={num_tokens}, hd={hd}] with contiguous columns, got "
                    f"{tuple(t.shape)} strides {t.stride()}"
                )
        if rope_cos.stride(0) != rope_sin.stride(0):
            raise ValueError(f"{fn}: rope_cos and rope_sin must share a row stride")
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if w is not None and (w.shape != (hd,) or not w.is_contiguous()):
            raise ValueError(f"{fn}: {name} must be a contiguous [hd={hd}] weight, got {tuple(w.shape)}")
    if out is not None:
        want = (qkv.shape[0], num_q_heads * hd)
        if tuple(out.shape) != want or out.dtype != qkv.dtype:
            raise ValueError(
                f"{fn}: out must be [rows, nq * hd] = {want} of {qkv.dtype}, got {tuple(out.shape)} {out.dtype}"
            )
        if out.shape[1] > 1 and out.stride(1) != 1:
            raise ValueError(f"{fn}: out columns must be contiguous (stride(1) == 1), got strides {out.stride()}")


@dataclass(frozen=True)
class ScatterOut:
    """Where paged_attention stores its output instead of a local `out`: the Ulysses return
    all-to-all done by the attention's own stores (NVLink peer stores on a GPU).

    Output row t (token t of the step; base-mode rows are in source-rank order, as the receive
    buffer of the first all-to-all holds them) belongs to rank g = t // rows_per_rank and is stored
    in rank g's buffer, base address peer_ptrs[g], at row t - g * rows_per_rank, columns
    col_offset + [0, nq * hd), rows local.stride(0) elements apart. With rows_per_rank = m,
    local = [m, W * C] and col_offset = s * C on SP rank s (C = nq * hd), rank g's buffer receives
    exactly head_to_seq_all_to_all(out) of the whole SP group: the o-projection's A operand.
    Rows >= num_tokens are not stored: the receiver zero-fills its padding rows.
    peer_ptrs: contiguous int64 [W] on the kernel's device (a PeerTable's buffer_ptrs).
    local: THIS rank's destination [m, W * C] (the memory the peers store into), qkv's dtype; it
      names the destination for torch.compile and gives the row stride.
    The receiver reads `local` only after every peer's launch completed: fusedpar.kernels.ulysses
    (scattered_o_proj) publishes and waits for the arrival flags.
    """

    peer_ptrs: torch.Tensor
    local: torch.Tensor
    rows_per_rank: int
    col_offset: int


def _check_scatter(qkv: torch.Tensor, scatter: ScatterOut, num_tokens: int, width: int) -> None:
    fn = "fusedpar.paged_attention"
    ptrs, local, m = scatter.peer_ptrs, scatter.local, scatter.rows_per_rank
    if ptrs.dtype != torch.int64 or ptrs.dim() != 1 or not ptrs.is_contiguous() or ptrs.device != qkv.device:
        raise ValueError(
            f"{fn}: scatter.peer_ptrs must be a contiguous int64 [W] tensor on {qkv.device}, got "
            f"{ptrs.dtype} {tuple(ptrs.shape)} on {ptrs.device}"
        )
    if local.dim() != 2 or local.dtype != qkv.dtype or local.device != qkv.device or local.stride(1) != 1:
        raise ValueError(
            f"{fn}: scatter.local must be a [m, W * C] {qkv.dtype} tensor on {qkv.device} with contiguous "
            f"columns, got {local.dtype} {tuple(local.shape)} strides {local.stride()} on {local.device}"
        )
    W = ptrs.numel()
    if m < 1 or local.shape[0] != m or num_tokens > W * m:
        raise ValueError(
            f"{fn}: scatter needs rows_per_rank m >= 1 with num_tokens <= W * m and local [m, ...]: got m={m}, "
            f"W={W}, num_tokens={num_tokens}, local {tuple(local.shape)}"
        )
    if not 0 <= scatter.col_offset <= local.shape[1] - width:
        raise ValueError(
            f"{fn}: scatter columns [{scatter.col_offset}, {scatter.col_offset + width}) do not fit the "
            f"destination's {local.shape[1]} columns"
        )


def _launch(
    qkv: torch.Tensor,
    out: torch.Tensor | None,
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
    *,
    num_tokens: int,
    num_q_heads: int,
    max_query_len: int,
    max_kv_len: int,
    scale: float,
    eps: float,
    rope_theta: float,
    write_kv: bool,
    config: AttentionConfig | None = None,
    scatter: ScatterOut | None = None,
) -> torch.Tensor | None:
    """Check, write the new k/v into the cache (and, with cfg.prerotate_q and RoPE or a q norm, the
    transformed q into a scratch), run attention into `out`, zero `out`'s padding rows; or, with
    `scatter` (out None), store the real rows into the owner ranks' buffers and return None."""
    _check_args(
        qkv, out, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, slots, positions,
        q_norm, k_norm, rope_cos, rope_sin, num_tokens, num_q_heads, rope_theta, write_kv,
    )
    if (out is None) == (scatter is None):
        raise ValueError("fusedpar.paged_attention: pass exactly one of out and scatter")
    if scatter is not None:
        _check_scatter(qkv, scatter, num_tokens, num_q_heads * k_cache.shape[3])
    if qkv.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError(
            "fusedpar.paged_attention got CPU tensors but its Triton kernels were compiled for a GPU: set "
            "TRITON_INTERPRET=1 before fusedpar.kernels is first imported to use the CPU interpreter"
        )
    if qkv.device.type not in ("cpu", "cuda"):
        raise ValueError(f"fusedpar.paged_attention supports CUDA (and CPU under TRITON_INTERPRET=1), got {qkv.device}")
    if out is not None and num_tokens < qkv.shape[0]:
        out[num_tokens:].zero_()  # padding rows: zeros, as the reference sends them
    if num_tokens == 0:
        return out
    if scatter is not None:
        # The kernels store through out_ptr's element type and row stride: local carries both.
        out_arg, out_peers = scatter.local, scatter.peer_ptrs
        rows_per_rank, col0 = scatter.rows_per_rank, scatter.col_offset
    else:
        out_arg, out_peers, rows_per_rank, col0 = out, cu_seqlens_q, 1, 0  # out_peers unused

    _, page, nkv, hd = k_cache.shape
    group = num_q_heads // nkv
    num_seqs = cu_seqlens_q.numel() - 1
    if INTERPRETED:
        num_sms = ATTENTION_INTERPRETER_NUM_SMS
    else:
        index = qkv.device.index if qkv.device.index is not None else torch.cuda.current_device()
        num_sms = device_num_sms(index)
    cfg = config or pick_config(
        head_dim=hd, group=group, num_seqs=num_seqs, num_kv_heads=nkv, max_query_len=max_query_len,
        max_kv_len=max_kv_len, dtype=qkv.dtype, num_sms=num_sms, interpret=INTERPRETED,
    )
    if not (is_pow2(cfg.block_m) and is_pow2(cfg.block_n) and cfg.block_m >= 16 and cfg.block_n >= 16):
        raise ValueError(f"fusedpar.paged_attention: block_m/block_n must be powers of two >= 16, got {cfg}")
    if not 1 <= cfg.block_q * group <= cfg.block_m or not 1 <= cfg.num_splits <= 1024:
        raise ValueError(
            f"fusedpar.paged_attention: need 1 <= block_q * G ({group}) <= block_m and 1 <= splits, got {cfg}"
        )

    if rope_theta > 0:
        if max_kv_len > ROPE_THETA_MAX_KV_LEN:
            raise ValueError(f"fusedpar.paged_attention: rope_theta mode is accurate for positions below "
                             f"{ROPE_THETA_MAX_KV_LEN} (fp32 angle reduction), this step reaches "
                             f"max_kv_len={max_kv_len}: pass rope_cos/rope_sin tables instead")
        # (inline PTX: NVIDIA only)
        fast = not INTERPRETED and torch.version.hip is None and qkv.dtype in (torch.bfloat16, torch.float16)
        rope_mode = ROPE_THETA_FAST if fast else ROPE_THETA
        inv_freq = _rope_inv_freq(hd, float(rope_theta), qkv.device)
    elif rope_cos is not None:
        rope_mode, inv_freq = ROPE_TABLES, qkv
    else:
        rope_mode, inv_freq = ROPE_NONE, qkv
    # Unused pointer arguments get a harmless tensor: their constexpr flags keep them unread.
    positions_arg = positions if positions is not None else cu_seqlens_q
    cos_arg = rope_cos if rope_cos is not None else qkv
    sin_arg = rope_sin if rope_sin is not None else qkv
    stride_rope = rope_cos.stride(0) if rope_cos is not None else 0
    blk_stride, tok_stride, head_stride = k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)

    one_token_per_seq = num_tokens == num_seqs  # every sequence has >= 1 token, so all have exactly 1
    block_q = 1 if one_token_per_seq else cfg.block_q
    num_tiles = num_seqs if one_token_per_seq else num_tokens // block_q + num_seqs
    splits = cfg.num_splits
    split_len = 0
    if splits > 1:
        split_len = cdiv(cdiv(max(max_kv_len, 1), splits), cfg.block_n) * cfg.block_n
        splits = cdiv(max(max_kv_len, 1), split_len)  # no split that is empty for every sequence
    if splits > 1:
        part_acc = torch.empty((splits, num_tokens, num_q_heads, hd), dtype=torch.float32, device=qkv.device)
        part_m = torch.empty((splits, num_tokens, num_q_heads), dtype=torch.float32, device=qkv.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = qkv  # unused

    q_norm_arg = q_norm if q_norm is not None else qkv
    transforms_q = rope_mode != ROPE_NONE or q_norm is not None
    prerotate = cfg.prerotate_q and transforms_q
    # Small decode batches: the attention programs write the new k/v themselves (one launch fewer).
    fused_write = write_kv and one_token_per_seq and not prerotate and num_seqs <= FUSED_WRITE_MAX_SEQS
    if prerotate:
        # The attention kernel addresses q as q_src + token * stride + head * hd: a contiguous
        # [num_tokens, nq hd] scratch fits that as the qkv layout's q columns do.
        q_src = torch.empty((num_tokens, num_q_heads * hd), dtype=k_cache.dtype, device=qkv.device)
        attn_rope, attn_q_norm = ROPE_NONE, False
    else:
        q_src, attn_rope, attn_q_norm = qkv, rope_mode, q_norm is not None
    # The write kernel holds one [heads_p2, hd] fp32 tile (plus its rotated copy, cos and sin):
    # one warp for a few heads, more so that a wide q tile (16 x 128) does not spill.
    tile = max(next_pow2(nkv) if write_kv else 0, next_pow2(num_q_heads) if prerotate else 0) * hd
    write_warps = 1 if tile <= 256 else 4 if tile <= 4096 else 8

    write_kernel = (write_kv and not fused_write) or prerotate
    pdl_ok = cfg.pdl and not INTERPRETED and _device_has_pdl(qkv.device)  # Hopper+ NVIDIA GPUs only
    # PDL: 1 = the attention waits before reading q (the write kernel's scratch), 2 = after its q
    # prologue (only the cache's new k/v are the write kernel's).
    pdl = (1 if prerotate else 2) if write_kernel and pdl_ok else 0
    pdl_kw = {"launch_pdl": True} if pdl else {}
    # The split path's combine kernel is the attention grid's programmatic dependent in turn.
    combine_pdl = splits > 1 and pdl_ok

    guard = torch.cuda.device(qkv.device) if qkv.device.type == "cuda" else contextlib.nullcontext()
    with guard:
        if write_kernel:
            _write_kv_kernel[(num_tokens,)](
                qkv, slots if write_kv else cu_seqlens_q, positions_arg, inv_freq, cos_arg, sin_arg,
                q_norm_arg, k_norm if k_norm is not None else qkv, k_cache, v_cache, q_src,
                qkv.stride(0), q_src.stride(0), blk_stride, tok_stride, head_stride, stride_rope, eps,
                NQ=num_q_heads, NQ_P2=next_pow2(num_q_heads), NKV=nkv, NKV_P2=next_pow2(nkv), HD=hd, PAGE=page,
                HAS_Q_NORM=q_norm is not None, HAS_K_NORM=k_norm is not None, ROPE=rope_mode,
                WRITE_KV=write_kv and not fused_write, WRITE_Q=prerotate, LAUNCH_DEPENDENTS=pdl > 0,
                num_warps=write_warps,
            )
        _attention_kernel[(num_tiles, nkv, splits)](
            q_src, out_arg, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
            positions_arg, inv_freq, cos_arg, sin_arg, q_norm_arg,
            part_acc, part_m, part_l,
            slots if fused_write else cu_seqlens_q, k_norm if k_norm is not None else qkv, out_peers,
            q_src.stride(0), out_arg.stride(0), blk_stride, tok_stride, head_stride, block_tables.stride(0),
            stride_rope, num_seqs, num_tokens, num_tiles, split_len, block_tables.shape[1] * page, rows_per_rank,
            col0, scale * _LOG2E, eps,
            NQ=num_q_heads, G=group, HD=hd, PAGE=page, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_Q=block_q, ONE_TOKEN_PER_SEQ=one_token_per_seq, HAS_Q_NORM=attn_q_norm,
            ROPE=attn_rope, SPLIT=splits > 1,
            DOT_PRECISION="ieee" if qkv.dtype == torch.float32 else "tf32",
            WRITE_NEW_KV=fused_write, HAS_K_NORM=k_norm is not None,
            PAGE_PREFETCH=cfg.page_prefetch, SCATTER=scatter is not None,
            Q_BY_TOKEN=transforms_q and not prerotate and is_pow2(group), PDL=pdl, LAUNCH_DEPENDENTS=combine_pdl,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_kw,
        )
        if splits > 1:
            _combine_kernel[(num_tokens, num_q_heads)](
                part_acc, part_m, part_l, out_arg, out_peers, out_arg.stride(0), num_tokens, splits, rows_per_rank,
                col0, NQ=num_q_heads, HD=hd, SPLITS_P2=next_pow2(splits), SCATTER=scatter is not None,
                PDL=combine_pdl, num_warps=1 if hd <= 64 else 2, **({"launch_pdl": True} if combine_pdl else {}),
            )
    return out
