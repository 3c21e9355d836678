"""Paged flash attention in Triton that reads q/k/v straight from the all-to-all receive layout.

Math (per rank; nq local q heads, nkv local kv heads, G = nq / nkv, hd = head_dim)
    For every real token t of the step (packed order, sequence s, position p_t = ctx_s + i):
        q_t,h  = rope(norm_q(Q[t, h]), p_t)           h = 0..nq-1
        k_t,j  = rope(norm_k(K[t, j]), p_t)           j = 0..nkv-1   (written to the cache)
        v_t,j  = V[t, j]                                             (written to the cache)
        out[t, h] = sum_{u <= p_t} softmax_u(scale * q_t,h . k_{s,u,j}) v_{s,u,j},   j = h // G
    where k_{s,u}, v_{s,u} are sequence s's cached keys/values at position u (the ctx_s tokens
    cached by earlier steps followed by this step's new tokens). norm is Qwen3's per-head RMSNorm
    over hd, x / sqrt(mean(x^2) + eps) * w (optional), and rope is HF rotate-half RoPE,
    x * cos(p f) + rotate_half(x) * sin(p f), f_i = theta^(-2 (i mod hd/2) / hd) (optional; or cos/sin
    tables). This is exactly `ShiftParallelDecoderLayer._attention` (norm, then RoPE; post-RoPE k and
    raw v are cached), with fp32 transforms, fp32 softmax state and fp32 accumulation.

Layouts
    qkv  [rows, (nq + 2 nkv) hd]: row t = packed token t of the step; columns = q heads, then k
         heads, then v heads (what the base-mode Ulysses all-to-all delivers and what the shift-mode
         qkv GEMM produces). Only rows < num_tokens are real; padding rows are never read. Any row
         stride (a view into a larger receive buffer is fine); columns must be contiguous.
    out  [rows, nq hd]: row t = token t, heads in rank order (what the return all-to-all sends).
         Rows < num_tokens hold the attention output; rows >= num_tokens are zero-filled (the
         reference pads the output with zeros before the return exchange).
    scatter  (ScatterOut, base mode) instead of out: output row t is stored in its owner SP rank's
         o staging buffer, [m, W * nq hd] per rank, at row t % m and this rank's column block: the
         return all-to-all done by the output stores (NVLink peer stores on a GPU). The receiver
         zero-fills its padding rows and waits for every peer's arrival flag before reading
         (fusedpar.kernels.ulysses.scattered_o_proj).
    k_cache, v_cache  [num_blocks, block_size, nkv, hd] (one layer of PagedKVCache; any strides
         with a contiguous hd). Token t is stored at slot = block * block_size + offset.
    block_tables [num_seqs, max_blocks] int32: block_tables[s, i] = physical block holding
         positions [i bs, (i+1) bs) of sequence s (entries past the sequence are never read).
    cu_seqlens_q [num_seqs + 1] int32: tokens of sequence s are rows cu[s] .. cu[s+1]-1.
    context_lens [num_seqs] int32: tokens of each sequence cached before this step.
    GQA: q head h reads local kv head h // G; the G q heads of one kv head are contiguous (that is
         HeadPlacement.q_to_kv_index for every layout, kv replication included: nkv = 1, G = nq).

Kernels (three layers, DESIGN.md section 1: @triton.jit kernel -> launcher -> registered torch op)
    _write_kv_kernel     one program per real token: k -> norm -> RoPE -> cache; v -> cache;
                         for prefill/mixed launches (AttentionConfig.prerotate_q) also every q
                         head -> norm -> RoPE -> a [num_tokens, nq hd] scratch in the cache dtype,
                         which the attention kernel then reads as its q (no norm/RoPE there).
                         On sm_90+ the attention launch after it is its programmatic dependent
                         (PDL, AttentionConfig.pdl): the attention grid starts while the write
                         grid runs and waits (griddepcontrol) before reading what it writes
                         (q scratch, or the new keys when q is transformed in the prologue).
                         Why: on an H200 (1 x 4096 tokens, 16 q / 2 kv heads, hd 128, bf16, tile
                         128x64, 8 warps) attention alone took 0.23 ms but the full path with
                         q/k RoPE and the cache write 0.37 ms while the write kernel itself takes
                         ~8 us: the q prologue inside the attention kernel (register pressure
                         that slows the whole main loop; 0.51 vs 0.20 ms with 4 warps) cost
                         ~0.13 ms, far more than a q round trip through memory. Decode keeps the
                         in-kernel prologue (one token per program: tiny, and a round trip would
                         only add traffic and work to a memory-bound step), and a pure decode
                         launch of up to FUSED_WRITE_MAX_SEQS sequences has no write kernel at
                         all (see WRITE_NEW_KV below).
    _attention_kernel    one program per (q tile, kv head, kv split). A q tile packs BLOCK_Q
                         tokens x G q heads of one kv head into its BLOCK_M rows (row r = token
                         r // G, head r % G), so one K/V tile load serves the whole GQA group:
                         decode reads each cached K/V byte once per step, prefill G times less
                         than a per-head kernel. q is normed/roped in registers after the load
                         (for a power-of-two G as a [tokens, G, hd] tile, so each token's cos/sin
                         are evaluated once, not once per head: _q_tile_by_token)
                         unless the write kernel pre-rotated it (both paths round the fp32
                         transform to the cache dtype before the dot, so they agree bit for bit
                         in the interpreter; on a GPU the q RMSNorm sum may reduce in another
                         order in the two tile shapes, a rare one-unit difference in a q element).
                         Decode (one token per sequence, write_kv, <= FUSED_WRITE_MAX_SEQS
                         sequences): the program whose key range
                         holds the new position stores the step's k (normed, roped) and v in
                         the cache and attends to them from registers; the cached keys before
                         it come from the cache as usual (one launch fewer per decode step).
                         K/V are gathered from the paged cache through the block table, in
                         BLOCK_N-key tiles: an unmasked loop over tiles wholly below the causal
                         diagonal, then a masked loop over the rest (a pure decode launch: one
                         masked loop, _attend_decode_tiles). With AttentionConfig.page_prefetch
                         (pick_config's choice) each tile's block-table entries are loaded a tile
                         ahead, so the pipeliner can keep K/V tiles in flight. Online softmax in
                         base 2.
                         Split-KV (flash decoding): with few (tile, kv head) programs the key
                         range is cut into `num_splits` chunks whose partial (max, sum, acc) go to
                         fp32 scratch and are merged by
    _combine_kernel      one program per (token, q head).
    paged_attention(...)         launcher (asserts, heuristics, grid, padding-row zero fill)
    torch.ops.fusedpar.paged_attention[_out]   custom ops with fake impls (what torch.compile traces)
    AttentionMetadata.from_step / attention_step(...)   glue for the decoder layer's contract.

Known limits (see pick_config for the tilings): head_dim must be a power of two >= 16; the cache
dtype equals the model dtype (no fp8 KV); a mixed batch uses prefill-sized q tiles for its decode
sequences too (one token in a 128-row tile: wasted MMA work, but each K/V byte is still read once
per kv head); a future split into a decode launch + a prefill launch would remove that.

RoPE angles (rope_theta mode) are reduced to about [-pi, pi] in fp32; on an NVIDIA GPU with bf16/fp16 their
cos/sin are the SFU's cos/sin.approx.f32 (ROPE_THETA_FAST, absolute error ~2**-20.5 there),
elsewhere libdevice's (ROPE_THETA). The libdevice calls were most of the RoPE cost: on an H200
(GPU run 171 vs 170, CUDA graphs) a 4 x 128-token prefill with q/k RoPE and the cache write went
from 0.0117 to 0.0104 ms and a 1 x 4096 decode from 0.0089 to 0.0075 ms.

CPU: under TRITON_INTERPRET=1 (set before this module is first imported) the kernels run on CPU
tensors; the interpreter cannot tl.dot bf16, so interpret fp16/fp32 and test bf16 on a GPU.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from fusedpar.kernels._host import cdiv, next_pow2

if TYPE_CHECKING:  # annotations only: kernels must not import fusedpar.layers at runtime
    from fusedpar.layers.decoder import StepState
    from fusedpar.layers.kv_cache import PagedKVCache
    from fusedpar.layers.policy import StepBatch

__all__ = [
    "AttentionConfig",
    "AttentionMetadata",
    "ScatterOut",
    "attention_step",
    "check_kv_index",
    "paged_attention",
    "pick_config",
]

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
_LOG2E = 1.4426950408889634
# Interpreter: the SM count the split-KV heuristic assumes, sized so that it splits the keys of
# CPU-test decode batches (a handful of sequences) and the combine path is exercised.
_INTERPRETER_NUM_SMS = 16
_MAX_SPLITS = 64
# Decode batches of up to this many sequences write their new k/v inside the attention launch
# (WRITE_NEW_KV). Measured on H200 (perf/bench_attention.py, 4096-token contexts, CUDA graphs; GPU
# runs 24 -> 29): 1 seq 0.0171 -> 0.0147 ms, 8 seqs 0.0259 -> 0.0224 ms (one launch fewer), but
# 16 seqs 0.0361 -> 0.0410 and 64 seqs 0.082 -> 0.099 ms: there the extra prologue in every program
# costs more than the launch it saves. With this limit (run 36): 0.0145 / 0.0224 / 0.0367 / 0.0820.
FUSED_WRITE_MAX_SEQS = 8
# Score masks use -inf; the running max starts at this finite value instead, so a row that has
# seen only masked keys keeps exp2(-inf - m) = 0 and alpha = exp2(m - m) = 1 (never inf - inf).
_M_INIT = tl.constexpr(-1.0e38)

ROPE_NONE, ROPE_THETA, ROPE_TABLES, ROPE_THETA_FAST = 0, 1, 2, 3
# ROPE_THETA_FAST is ROPE_THETA with the GPU's approximate cos/sin instructions: the launcher's
# choice for bf16/fp16 on a GPU (see _rope_cos_sin). fp32 and the interpreter keep ROPE_THETA.
# rope_theta mode computes each angle in fp32 and reduces it by a two-constant 2*pi that is exact
# only for angles below 2**16 turns (~411k rad; the angle of position p is up to p): beyond that the
# cached keys drift (measured 7e-2 abs at position 1M). Steps that reach further pass cos/sin tables
# (DecoderConfig-level callers do so automatically: fusedpar.layers.decoder.needs_rope_tables).
ROPE_THETA_MAX_KV_LEN = 6 * 2**16


# ---- Triton kernels -----------------------------------------------------------------------------


@triton.jit
def _rope_cos_sin(rope_rows, row_mask, positions_ptr, inv_freq_ptr, cos_ptr, sin_ptr, stride_rope, HD: tl.constexpr,
                  ROPE: tl.constexpr):
    """fp32 cos, sin [R, HD] of the packed tokens rope_rows [R] (index into positions or the
    cos/sin tables); column d holds the angle of frequency d % (HD / 2), as rotate-half pairs
    them. Masked rows are zeros. R = 1 gives one token's row, which broadcasts over its heads.
    """
    HALF: tl.constexpr = HD // 2
    offs_d = tl.arange(0, HD)
    if ROPE == 1 or ROPE == 3:
        pos = tl.load(positions_ptr + rope_rows, mask=row_mask, other=0).to(tl.float32)
        inv_freq = tl.load(inv_freq_ptr + (offs_d % HALF))
        ang = pos[:, None] * inv_freq[None, :]
        # Reduce to [-pi, pi] with a two-constant 2*pi (6.28125 has 8 significant bits, so
        # k * 6.28125 is exact for k < 2**16): accurate cos/sin whether they lower to libdevice
        # or to the hardware approximations, which lose accuracy for large arguments.
        k = tl.floor(ang * 0.15915494309189535 + 0.5)
        ang = (ang - k * 6.28125) - k * 0.0019353071795864769
        if ROPE == 3:
            # ROPE_THETA_FAST: the SFU's cos/sin.approx.f32, one instruction each (tl.cos/tl.sin
            # lower to libdevice's __nv_cosf/__nv_sinf: dozens of instructions plus a
            # Payne-Hanek branch). On the reduced angle (|ang| <= pi + 4e-3 for every position below
            # ROPE_THETA_MAX_KV_LEN) their absolute error is ~2**-20.5, far below the relative
            # rounding of the bf16 (2**-8) or fp16 (2**-11) values they feed (GPU, 16-bit only).
            c = tl.inline_asm_elementwise("cos.approx.f32 $0, $1;", "=r,r", [ang], dtype=tl.float32,
                                          is_pure=True, pack=1)
            s = tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=r,r", [ang], dtype=tl.float32,
                                          is_pure=True, pack=1)
        else:
            c = tl.cos(ang)
            s = tl.sin(ang)
    elif ROPE == 2:
        t_off = rope_rows.to(tl.int64)[:, None] * stride_rope + offs_d[None, :]
        c = tl.load(cos_ptr + t_off, mask=row_mask[:, None], other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + t_off, mask=row_mask[:, None], other=0.0).to(tl.float32)
    else:  # no RoPE: nothing to read (callers ignore c and s)
        c = tl.zeros((rope_rows.shape[0], HD), dtype=tl.float32)
        s = c
    return c, s


@triton.jit
def _load_rot(row_ptrs, row_mask, HD: tl.constexpr, ROPE: tl.constexpr):
    """R head vectors (row_ptrs[r] -> element 0 of a contiguous [HD] vector) as fp32 [R, HD], and,
    for RoPE, the same vectors with their halves swapped (x[(d + HD/2) % HD]: rotate-half's partner,
    loaded a second time through permuted offsets, an L1 hit, instead of shuffling registers);
    without RoPE the second is the first. Masked rows are zeros."""
    HALF: tl.constexpr = HD // 2
    offs_d = tl.arange(0, HD)
    x = tl.load(row_ptrs[:, None] + offs_d[None, :], mask=row_mask[:, None], other=0.0).to(tl.float32)
    if ROPE != 0:
        offs_rot = (offs_d + HALF) % HD
        xr = tl.load(row_ptrs[:, None] + offs_rot[None, :], mask=row_mask[:, None], other=0.0).to(tl.float32)
    else:
        xr = x
    return x, xr


@triton.jit
def _norm_rope_values(x, xr, c, s, w_ptr, eps, HD: tl.constexpr, HAS_NORM: tl.constexpr, ROPE: tl.constexpr):
    """rope(norm(x)) as fp32 [R, HD] from _load_rot's (x, xr).

    c, s: _rope_cos_sin of the rows' tokens, [R, HD] or [1, HD] (one token's angles shared by
    all its heads: the write kernel evaluates them once per token, not once per head; the
    values are the same, so are the results). Unused without ROPE. RMSNorm's row scale is
    shared by x and xr; the weight is applied per column.
    """
    HALF: tl.constexpr = HD // 2
    offs_d = tl.arange(0, HD)
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / HD + eps)
        w = tl.load(w_ptr + offs_d).to(tl.float32)
        x = x * rstd[:, None] * w[None, :]
    if ROPE != 0:
        offs_rot = (offs_d + HALF) % HD
        if HAS_NORM:
            wr = tl.load(w_ptr + offs_rot).to(tl.float32)
            xr = xr * rstd[:, None] * wr[None, :]
        sign = tl.where(offs_d < HALF, -1.0, 1.0)
        x = x * c + sign[None, :] * xr * s
    return x


@triton.jit
def _norm_rope(
    row_ptrs,
    row_mask,
    c,
    s,
    w_ptr,
    eps,
    HD: tl.constexpr,
    HAS_NORM: tl.constexpr,
    ROPE: tl.constexpr,
):
    """Load R head vectors (row_ptrs[r] -> element 0 of a contiguous [HD] vector) and return
    rope(norm(x)) as fp32 [R, HD]; masked rows are zeros (_load_rot, then _norm_rope_values)."""
    x, xr = _load_rot(row_ptrs, row_mask, HD, ROPE)
    return _norm_rope_values(x, xr, c, s, w_ptr, eps, HD, HAS_NORM, ROPE)


@triton.jit
def _q_tile_by_token(
    qkv_ptr, stride_qkv, q_start, q_local, q_len, kvh, positions_ptr, inv_freq_ptr, cos_ptr, sin_ptr, stride_rope,
    w_ptr, eps, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, G: tl.constexpr, HD: tl.constexpr,
    HAS_NORM: tl.constexpr, ROPE: tl.constexpr,
):
    """The attention kernel's q tile rope(norm(q)) as fp32 [BLOCK_M, HD], for a power-of-two G.

    Row r = token r // G, head r % G, the kernel's row map, so the tile is loaded as [BLOCK_M / G
    tokens, G heads, HD] and reshaped. Why 3-D: each token's cos/sin row is evaluated once and
    broadcast over its G heads (the row-wise _rope_cos_sin evaluates it once per head: G times the
    transcendentals, which made the in-kernel prologue of a 16-token x 8-head prefill tile cost
    more than the attention it feeds). Same values and roundings as _norm_rope per row.
    """
    BT: tl.constexpr = BLOCK_M // G
    HALF: tl.constexpr = HD // 2
    offs_t = tl.arange(0, BT)
    offs_g = tl.arange(0, G)
    offs_d = tl.arange(0, HD)
    tok_local = q_local + offs_t
    t_ok = (offs_t < BLOCK_Q) & (tok_local < q_len)
    token = q_start + tok_local
    c, s = _rope_cos_sin(token, t_ok, positions_ptr, inv_freq_ptr, cos_ptr, sin_ptr, stride_rope, HD, ROPE)
    heads = (token.to(tl.int64) * stride_qkv)[:, None] + ((kvh * G + offs_g) * HD)[None, :]  # [BT, G]
    mask = t_ok[:, None, None] & (offs_g < G)[None, :, None] & (offs_d < HD)[None, None, :]
    x = tl.load(qkv_ptr + heads[:, :, None] + offs_d[None, None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(x * x, axis=2) / HD + eps)
        w = tl.load(w_ptr + offs_d).to(tl.float32)
        xn = x * rstd[:, :, None] * w[None, None, :]
    else:
        xn = x
    if ROPE != 0:
        offs_rot = (offs_d + HALF) % HD
        xr = tl.load(qkv_ptr + heads[:, :, None] + offs_rot[None, None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_NORM:
            wr = tl.load(w_ptr + offs_rot).to(tl.float32)
            xr = xr * rstd[:, :, None] * wr[None, None, :]
        sign = tl.where(offs_d < HALF, -1.0, 1.0)
        xn = xn * c[:, None, :] + sign[None, None, :] * xr * s[:, None, :]
    return tl.reshape(xn, (BLOCK_M, HD))


@triton.jit
def _write_kv_kernel(
    qkv_ptr,
    slots_ptr,
    positions_ptr,
    inv_freq_ptr,
    cos_ptr,
    sin_ptr,
    q_norm_ptr,
    k_norm_ptr,
    k_cache_ptr,
    v_cache_ptr,
    q_out_ptr,
    stride_qkv,
    stride_qout,
    stride_blk,
    stride_tok,
    stride_head,
    stride_rope,
    eps,
    NQ: tl.constexpr,
    NQ_P2: tl.constexpr,
    NKV: tl.constexpr,
    NKV_P2: tl.constexpr,
    HD: tl.constexpr,
    PAGE: tl.constexpr,
    HAS_Q_NORM: tl.constexpr,
    HAS_K_NORM: tl.constexpr,
    ROPE: tl.constexpr,
    WRITE_KV: tl.constexpr,
    WRITE_Q: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr,  # the attention launch after this one is programmatic (PDL)
):
    """Program t (one per real token):
        WRITE_KV: k_cache[slot_t] = rope(norm_k(K[t])), v_cache[slot_t] = V[t]   (NKV heads)
        WRITE_Q:  q_out[t, h hd : (h+1) hd] = rope(norm_q(Q[t, h]))              (NQ heads)
    q_out [num_tokens, NQ hd] (row stride stride_qout) is stored in the cache dtype: the same
    rounding the attention kernel applies to a q it transforms itself, so reading q_out back with
    no norm/RoPE gives that kernel the q it would have computed (see the module docstring).

    Each head group is one [N_P2, HD] tile. A negative slot means "not a real token" (a CUDA-graph
    padding row): its k/v are not written (q still is: a cheap, harmless row of scratch). Padding
    rows >= num_tokens have no program.
    Every load is issued before any of it is used and the slot test is a store mask, not a branch:
    a program is a few independent loads, arithmetic and stores, one memory round trip instead of
    a chain (slot -> k/v, then q), which is what a short prefill's launch of a few hundred
    programs waits for.
    """
    if LAUNCH_DEPENDENTS:
        # Let the attention grid start now: its programs find their sequence and, when they transform
        # q themselves, load and transform it while this grid runs; they wait (gdc_wait) for this
        # grid's completion before reading anything it writes (the q scratch, the new k/v).
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0)
    offs_d = tl.arange(0, HD)
    row = qkv_ptr + t.to(tl.int64) * stride_qkv
    one = tl.arange(0, 1)
    if WRITE_KV:
        slot = tl.load(slots_ptr + t).to(tl.int64)
        offs_h = tl.arange(0, NKV_P2)
        h_mask = offs_h < NKV
        k, kr = _load_rot(row + (NQ + offs_h) * HD, h_mask, HD, ROPE)
        v = tl.load(row + (NQ + NKV + offs_h)[:, None] * HD + offs_d[None, :], mask=h_mask[:, None])
    if WRITE_Q:
        offs_q = tl.arange(0, NQ_P2)
        q_mask = offs_q < NQ
        q, qr = _load_rot(row + offs_q * HD, q_mask, HD, ROPE)
    # One token per program: its cos/sin row once, shared by the k and q heads (evaluating them
    # per head element was most of this kernel's time: 2 x (NQ + NKV) x HD transcendentals).
    c, s = _rope_cos_sin(one + t, one < 1, positions_ptr, inv_freq_ptr, cos_ptr, sin_ptr, stride_rope, HD, ROPE)
    if WRITE_KV:
        k = _norm_rope_values(k, kr, c, s, k_norm_ptr, eps, HD, HAS_K_NORM, ROPE)
        # the slot test as a [NKV_P2] tensor: Triton 3.9's interpreter rejects a store mask made
        # from a vector & a scalar comparison ("mask has unsupported dtype")
        kv_mask = (h_mask & (offs_h * 0 + slot >= 0))[:, None]
        dst = (slot // PAGE) * stride_blk + (slot % PAGE) * stride_tok
        dst_ptrs = dst + offs_h[:, None] * stride_head + offs_d[None, :]
        tl.store(k_cache_ptr + dst_ptrs, k.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(v_cache_ptr + dst_ptrs, v.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)
    if WRITE_Q:
        q = _norm_rope_values(q, qr, c, s, q_norm_ptr, eps, HD, HAS_Q_NORM, ROPE)
        q_ptrs = q_out_ptr + t.to(tl.int64) * stride_qout + offs_q[:, None] * HD + offs_d[None, :]
        tl.store(q_ptrs, q.to(k_cache_ptr.dtype.element_ty), mask=q_mask[:, None])


@triton.jit
def _find_seq(cu_seqlens_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """The sequence that owns virtual q tile `tile`.

    Sequence s owns virtual tiles [cu[s] // BLOCK_Q + s, cu[s+1] // BLOCK_Q + s + 1): at least
    cdiv(len_s, BLOCK_Q) of them, so num_tokens // BLOCK_Q + num_seqs tiles cover every batch
    without a per-step tile map (the surplus tiles exit at once). Binary search for the last s
    whose first tile is <= tile.
    """
    lo: tl.int32 = 0  # a tensor from the start: it is loop-carried
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(cu_seqlens_ptr + mid) // BLOCK_Q + mid
        if first <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _softmax_step(s, l_i, m_i, qk_scale):
    """Online softmax in base 2 over one tile of fp32 scores s [M, N] (masked entries -inf):
    returns (p, alpha, l, m): probabilities against the new running max m, the factor alpha that
    rescales what was accumulated under the old max, and the new running sum l."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    return p, alpha, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def _attend_tiles(
    acc,
    l_i,
    m_i,
    q,
    k_cache_ptr,
    v_cache_ptr,
    bt_row_ptr,
    head_off,
    start,
    end,
    p_row,
    kv_len,
    bt_keys,
    stride_blk,
    stride_tok,
    qk_scale,
    HD: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """Online-softmax update over key tiles [start, end) (multiples of BLOCK_N) of one sequence.

    Keys are gathered from the paged cache: key u lives in block bt_row[u // PAGE], offset
    u % PAGE. MASKED=False is only used for tiles wholly inside every valid row's causal window
    (no load or score masks); MASKED=True masks keys u > p_row (causal) and u >= kv_len (never
    load past the sequence: those slots may hold anything, NaN included).
    Scores stay in fp32 and in base 2 (qk_scale = softmax scale * log2(e)).
    PREFETCH: each tile's block-table entries are loaded one iteration ahead (the first before the
    loop, bounded by the table width bt_keys), so the K/V addresses of a tile do not wait on a
    load of the same iteration and the pipeliner can keep num_stages - 1 tiles in flight (without
    it, Triton 3.6 overlaps such indirect loads about (num_stages - 2) // 2 tiles ahead).
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HD)
    if PREFETCH:
        first = start + offs_n
        page_next = tl.load(bt_row_ptr + first // PAGE, mask=first < bt_keys, other=0)
    for start_n in range(start, end, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k_pos = start_n + offs_n
        if MASKED:
            k_ok = k_pos < kv_len
        if PREFETCH:
            page = page_next
            nxt = k_pos + BLOCK_N
            # Bound by kv_len like the K/V load mask, not by `end`: a masked tile can run past
            # `end` (keys causally hidden from every row, but still loaded: they need real pages,
            # or a V row of NaN garbage would poison p * v even where p = 0).
            page_next = tl.load(bt_row_ptr + nxt // PAGE, mask=nxt < kv_len, other=0)
        elif MASKED:
            page = tl.load(bt_row_ptr + k_pos // PAGE, mask=k_ok, other=0)
        else:
            page = tl.load(bt_row_ptr + k_pos // PAGE)
        # int64: a layer of a large cache can exceed 2**31 elements.
        key_off = page.to(tl.int64) * stride_blk + (k_pos % PAGE) * stride_tok + head_off
        kv_ptrs = key_off[:, None] + offs_d[None, :]
        # (constexpr conditional expressions: Triton compiles only the taken branch)
        k = tl.load(k_cache_ptr + kv_ptrs, mask=k_ok[:, None], other=0.0) if MASKED else tl.load(k_cache_ptr + kv_ptrs)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASKED:
            s = tl.where((k_pos[None, :] <= p_row[:, None]) & k_ok[None, :], s, float("-inf"))
        p, alpha, l_i, m_i = _softmax_step(s, l_i, m_i, qk_scale)
        acc = acc * alpha[:, None]
        # Masked V loads use other=0, not garbage: p = 0 there, but 0 * NaN would poison the row.
        v = tl.load(v_cache_ptr + kv_ptrs, mask=k_ok[:, None], other=0.0) if MASKED else tl.load(v_cache_ptr + kv_ptrs)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _attend_decode_tiles(
    acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row_ptr, head_off, start, end, bt_keys, stride_blk, stride_tok,
    qk_scale, HD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """_attend_tiles for a one-token query: keys [start, end) of one sequence, all visible (the
    causal bound of the single row is the key count), so one masked loop (mask: key < end).

    Shaped for latency, not throughput: a decode program owns a few key tiles, and with
    _attend_tiles' order each tile is a chain of three dependent memory round trips (block-table
    entries -> K -> V after the score dot) that nothing else hides. Here the first tile's
    block-table entries are loaded before the loop (bounded by the table width bt_keys, not by the
    sequence length, so the load does not wait for context_lens either), the next tile's entries
    are loaded while the current tile computes, and V is loaded together with K: one round trip
    per tile. Entries past the sequence are read but only feed masked (never issued) K/V loads.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HD)
    k_pos = start + offs_n
    page = tl.load(bt_row_ptr + k_pos // PAGE, mask=k_pos < bt_keys, other=0)
    for start_n in range(start, end, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k_pos = start_n + offs_n
        k_ok = k_pos < end
        key_off = page.to(tl.int64) * stride_blk + (k_pos % PAGE) * stride_tok + head_off
        kv_ptrs = key_off[:, None] + offs_d[None, :]
        k = tl.load(k_cache_ptr + kv_ptrs, mask=k_ok[:, None], other=0.0)
        v = tl.load(v_cache_ptr + kv_ptrs, mask=k_ok[:, None], other=0.0)  # other=0: p * NaN would poison
        nxt = k_pos + BLOCK_N
        page = tl.load(bt_row_ptr + nxt // PAGE, mask=nxt < end, other=0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        s = tl.where(k_ok[None, :], s, float("-inf"))
        p, alpha, l_i, m_i = _softmax_step(s, l_i, m_i, qk_scale)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _write_and_attend_new_key(
    acc, l_i, m_i, q, row_ptr, token, kvh, slots_ptr, positions_ptr, inv_freq_ptr, cos_ptr, sin_ptr,
    stride_rope, k_norm_ptr, eps, k_cache_ptr, v_cache_ptr, stride_blk, stride_tok, stride_head, qk_scale,
    NQ: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, PAGE: tl.constexpr, HAS_K_NORM: tl.constexpr,
    ROPE: tl.constexpr,
):
    """Decode with WRITE_NEW_KV: the step's own key and value for kv head `kvh` of packed token `token`
    (row_ptr = its qkv row): k = rope(norm_k(K)) in the cache dtype and raw V are stored at the
    token's slot (skipped for a negative slot) and attended from registers, one online-softmax
    step with the roundings of _attend_tiles (score from the stored-dtype k; p rounded to V's
    dtype for the PV product). No read-back of what was just stored, so no ordering question.
    """
    one = tl.arange(0, 1)
    offs_d = tl.arange(0, HD)
    c, s = _rope_cos_sin(one + token, one < 1, positions_ptr, inv_freq_ptr, cos_ptr, sin_ptr, stride_rope, HD, ROPE)
    k = _norm_rope(row_ptr + (NQ + kvh + one) * HD, one < 1, c, s, k_norm_ptr, eps, HD, HAS_K_NORM, ROPE)
    k = k.to(k_cache_ptr.dtype.element_ty)  # [1, HD]
    v = tl.load(row_ptr + (NQ + NKV + kvh + one)[:, None] * HD + offs_d[None, :]).to(v_cache_ptr.dtype.element_ty)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot >= 0:
        dst = (slot // PAGE) * stride_blk + (slot % PAGE) * stride_tok + kvh * stride_head + offs_d[None, :]
        tl.store(k_cache_ptr + dst + one[:, None] * 0, k)
        tl.store(v_cache_ptr + dst + one[:, None] * 0, v)
    score = tl.sum(q.to(tl.float32) * k.to(tl.float32), axis=1)
    m_new = tl.maximum(m_i, score * qk_scale)
    p = tl.exp2(score * qk_scale - m_new)
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + p
    acc = acc * alpha[:, None] + p.to(v.dtype).to(tl.float32)[:, None] * v.to(tl.float32)
    return acc, l_i, m_new


@triton.jit
def _out_rows(out_ptr, out_peers_ptr, token, row_ok, stride_out, rows_per_rank, out_col0, SCATTER: tl.constexpr):
    """Address of output row `token` (a scalar or a vector of rows; rows with row_ok False are
    never stored, so their address may be anything).

    Local: out + token * stride_out. SCATTER (ScatterOut): row t belongs to rank g = t // rows_per_rank
    and lands in g's buffer (base address out_peers[g], in out_ptr's dtype) at row t - g * rows_per_rank,
    columns from out_col0: the layout the o-projection reads after the return all-to-all.
    """
    if SCATTER:
        dst = token // rows_per_rank
        base = tl.load(out_peers_ptr + dst, mask=row_ok, other=0).to(tl.pointer_type(out_ptr.dtype.element_ty))
        return base + ((token - dst * rows_per_rank).to(tl.int64) * stride_out + out_col0)
    else:
        return out_ptr + token.to(tl.int64) * stride_out


@triton.jit
def _attention_kernel(
    qkv_ptr,
    out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    cu_seqlens_ptr,
    context_lens_ptr,
    positions_ptr,
    inv_freq_ptr,
    cos_ptr,
    sin_ptr,
    q_norm_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    slots_ptr,  # WRITE_NEW_KV: the new tokens' cache slots
    k_norm_ptr,  # WRITE_NEW_KV with HAS_K_NORM
    out_peers_ptr,  # SCATTER: int64 [W] base addresses of the destination ranks' buffers
    stride_qkv,
    stride_out,
    stride_blk,
    stride_tok,
    stride_head,
    stride_bt,
    stride_rope,
    num_seqs,
    num_tokens,
    num_tiles,
    split_len,
    bt_keys,  # block_tables.shape[1] * PAGE: the keys the table can address
    rows_per_rank,  # SCATTER: output row t goes to rank t // rows_per_rank
    out_col0,  # SCATTER: first destination column of this rank's heads
    qk_scale,
    eps,
    NQ: tl.constexpr,
    G: tl.constexpr,
    HD: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    ONE_TOKEN_PER_SEQ: tl.constexpr,
    HAS_Q_NORM: tl.constexpr,
    ROPE: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WRITE_NEW_KV: tl.constexpr,  # ONE_TOKEN_PER_SEQ only: the launch's cache write happens here
    HAS_K_NORM: tl.constexpr,
    PAGE_PREFETCH: tl.constexpr,  # block-table entries a tile ahead; ONE_TOKEN_PER_SEQ: _attend_decode_tiles
    SCATTER: tl.constexpr,  # store output rows into the owner ranks' buffers (_out_rows)
    Q_BY_TOKEN: tl.constexpr,  # in-kernel q transform with per-token cos/sin (_q_tile_by_token; G a power of 2)
    PDL: tl.constexpr,  # launched as a programmatic dependent of the write kernel: 0 no, 1 wait before q, 2 after
    LAUNCH_DEPENDENTS: tl.constexpr,  # SPLIT: the combine launch after this one is programmatic (PDL)
):
    """Program (tile, kv head j, split): BLOCK_Q tokens x the G q heads of kv head j.

    Tiles run longest-first (reversed program order): under a causal mask the last tiles of a
    sequence see the most keys, and starting them first shortens the tail of the grid.
    ONE_TOKEN_PER_SEQ (pure decode, num_tokens == num_seqs): tile = sequence, no search.
    SPLIT: this program covers keys [split * split_len, (split + 1) * split_len) (the last split
    runs to the end whatever split_len says, so an underestimated bound stays correct) and writes
    unnormalised partials; otherwise it covers every key and writes the output rows.
    WRITE_NEW_KV (decode, no write kernel): keys [0, ctx) come from the cache and the step's own key
    (position ctx) from the qkv row: the program whose key range holds position ctx (one per
    sequence and kv head) normalises/ropes it, stores it into the cache and attends to it from
    registers (_write_and_attend_new_key). Saves the write kernel's launch in every decode step.
    """
    if LAUNCH_DEPENDENTS:
        # The combine grid may start now: it waits (gdc_wait) for this grid's partials before reading.
        tl.extra.cuda.gdc_launch_dependents()
    tile = num_tiles - 1 - tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if ONE_TOKEN_PER_SEQ:
        # num_tokens == num_seqs and every sequence has >= 1 token: cu_seqlens is 0, 1, .., so
        # sequence s is token s. Not loading it takes a dependent round trip off the q load.
        seq = tile
        q_start = tile
        q_len = 1
        q_local = 0
    else:
        seq = _find_seq(cu_seqlens_ptr, num_seqs, tile, BLOCK_Q)
        first_tile = tl.load(cu_seqlens_ptr + seq) // BLOCK_Q + seq
        q_start = tl.load(cu_seqlens_ptr + seq)
        q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
        q_local = (tile - first_tile) * BLOCK_Q
        if q_local >= q_len:
            return
    ctx = tl.load(context_lens_ptr + seq)
    kv_len = ctx + q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HD)
    tok_local = q_local + offs_m // G
    row_ok = (offs_m < BLOCK_Q * G) & (tok_local < q_len)
    token = q_start + tok_local
    head = kvh * G + offs_m % G
    p_row = ctx + tok_local  # key positions row r may see: 0 .. p_row

    if PDL == 1:
        tl.extra.cuda.gdc_wait()  # q is the write kernel's pre-rotated scratch
    if Q_BY_TOKEN:
        q = _q_tile_by_token(
            qkv_ptr, stride_qkv, q_start, q_local, q_len, kvh, positions_ptr, inv_freq_ptr, cos_ptr, sin_ptr,
            stride_rope, q_norm_ptr, eps, BLOCK_M, BLOCK_Q, G, HD, HAS_Q_NORM, ROPE,
        )
    else:
        q_rows = qkv_ptr + token.to(tl.int64) * stride_qkv + head * HD
        c, s = _rope_cos_sin(token, row_ok, positions_ptr, inv_freq_ptr, cos_ptr, sin_ptr, stride_rope, HD, ROPE)
        q = _norm_rope(q_rows, row_ok, c, s, q_norm_ptr, eps, HD, HAS_Q_NORM, ROPE)
    if PDL == 2:
        # q came from qkv (complete before the write kernel started); the keys this step wrote into
        # the cache are the write kernel's: wait for it before the first K/V load.
        tl.extra.cuda.gdc_wait()
    # Round q to the cache dtype like the reference (which attends with q in the model dtype). A q
    # pre-rotated by _write_kv_kernel was stored already rounded, so this is exact there: both
    # paths feed tl.dot the same bits.
    q = q.to(k_cache_ptr.dtype.element_ty)

    kv_hi = ctx + tl.minimum(q_local + BLOCK_Q, q_len)  # 1 + the tile's last position
    if SPLIT:
        lo = split * split_len
        hi = tl.where(split == tl.num_programs(2) - 1, kv_hi, tl.minimum(lo + split_len, kv_hi))
    else:
        lo = 0
        hi = kv_hi
    if WRITE_NEW_KV:
        # Cached keys stop before the new one (position ctx, attended from registers below).
        hi_cache = tl.minimum(hi, ctx)
        kv_cached = ctx
        diag = ctx // BLOCK_N * BLOCK_N
    else:
        hi_cache = hi
        kv_cached = kv_len
        # Key tiles ending at or before the tile's first position + 1 are visible to every row.
        diag = (ctx + q_local + 1) // BLOCK_N * BLOCK_N
    mid = tl.maximum(lo, tl.minimum(hi_cache, diag))

    m_i = tl.full([BLOCK_M], _M_INIT, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HD], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_off = kvh * stride_head
    if PAGE_PREFETCH and ONE_TOKEN_PER_SEQ:
        # One query token at position ctx (or kv_len - 1): every key below hi_cache is visible.
        acc, l_i, m_i = _attend_decode_tiles(
            acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row, head_off, lo, hi_cache, bt_keys,
            stride_blk, stride_tok, qk_scale, HD, PAGE, BLOCK_N, DOT_PRECISION,
        )
    else:
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row, head_off, lo, mid, p_row, kv_cached, bt_keys,
            stride_blk, stride_tok, qk_scale, HD, PAGE, BLOCK_N, False, DOT_PRECISION, PAGE_PREFETCH,
        )
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row, head_off, mid, hi_cache, p_row, kv_cached, bt_keys,
            stride_blk, stride_tok, qk_scale, HD, PAGE, BLOCK_N, True, DOT_PRECISION, PAGE_PREFETCH,
        )
    if WRITE_NEW_KV:  # noqa: SIM102 (a compile-time branch around a runtime one: Triton cannot `and` them)
        if (lo <= ctx) & (ctx < hi):
            acc, l_i, m_i = _write_and_attend_new_key(
                acc, l_i, m_i, q, qkv_ptr + q_start.to(tl.int64) * stride_qkv, q_start, kvh, slots_ptr,
                positions_ptr, inv_freq_ptr, cos_ptr, sin_ptr, stride_rope, k_norm_ptr, eps, k_cache_ptr,
                v_cache_ptr, stride_blk, stride_tok, stride_head, qk_scale, NQ, NQ // G, HD, PAGE, HAS_K_NORM,
                ROPE,
            )

    if SPLIT:
        part = (split * num_tokens + token).to(tl.int64) * NQ + head
        tl.store(part_acc_ptr + part[:, None] * HD + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
    else:
        # Every valid row sees key 0, so l_i > 0 there; the guard only keeps dead rows finite.
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        rows = _out_rows(out_ptr, out_peers_ptr, token, row_ok, stride_out, rows_per_rank, out_col0, SCATTER)
        out_ptrs = rows[:, None] + (head * HD)[:, None] + offs_d[None, :]
        tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _combine_kernel(
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    out_ptr,
    out_peers_ptr,
    stride_out,
    num_tokens,
    num_splits,
    rows_per_rank,
    out_col0,
    NQ: tl.constexpr,
    HD: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    SCATTER: tl.constexpr,
    PDL: tl.constexpr,  # launched as the attention grid's programmatic dependent: wait for its partials
):
    """Program (token t, q head h): out[t, h] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s,
    M = max_s m_s (splits that saw no key carry m = -1e38, l = 0, acc = 0: weight 0)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, HD)
    s_ok = offs_s < num_splits
    part = (offs_s * num_tokens + t).to(tl.int64) * NQ + h
    m = tl.load(part_m_ptr + part, mask=s_ok, other=float("-inf"))
    l = tl.load(part_l_ptr + part, mask=s_ok, other=0.0)
    w = tl.exp2(m - tl.max(m, 0))
    acc = tl.load(part_acc_ptr + part[:, None] * HD + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    o = tl.sum(w[:, None] * acc, 0) / tl.sum(w * l, 0)
    row = _out_rows(out_ptr, out_peers_ptr, t, t < num_tokens, stride_out, rows_per_rank, out_col0, SCATTER)
    tl.store(row + h * HD + offs_d, o.to(out_ptr.dtype.element_ty))


# Triton decides interpreter vs compiler when @triton.jit runs (see gemm.py).
_INTERPRETED = not isinstance(_attention_kernel, JITFunction)


# ---- launcher -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionConfig:
    """Compile-time tiling of one attention launch.

    block_m: q-tile rows (= block_q tokens x G heads, padded to a power of two >= 16);
    block_n: keys per K/V tile; num_splits: key-range splits (1 = no split, no combine kernel).
    prerotate_q: when the launch has RoPE and/or a q norm, _write_kv_kernel computes
    rope(norm_q(q)) once per token into a [num_tokens, nq hd] scratch (cache dtype) and the
    attention kernel reads that instead of transforming q itself (the same rounding: see the
    module docstring); ignored without RoPE and q norm.
    page_prefetch: load each K/V tile's block-table entries one tile ahead, which lets Triton's
    pipeliner keep num_stages - 1 K/V tiles in flight per program; a pure decode launch then also
    runs one masked loop (_attend_decode_tiles) instead of the unmasked + masked pair. On by default
    (an explicit tiling gets the fast loops too); False keeps the plain loops, for A/B measurements.
    pdl: when a write kernel runs before the attention kernel (prefill/mixed launches, decode
    batches above FUSED_WRITE_MAX_SEQS or with prerotate_q), launch the attention as its
    programmatic dependent (sm_90+ CUDA GPUs with a Triton that has gdc_wait): attention programs
    start while the write grid runs, find their sequence and (q not pre-rotated) load and transform
    their q, and wait for the write grid before any other load (block table, K/V, q scratch).
    Likewise a split launch's combine kernel is launched as the attention grid's dependent.
    False launches the two kernels back to back, for A/B measurements. Measured on one H200 (GPU run
    171, perf/bench_attention.py --short-prefill-sweep, CUDA graphs, pre-rotated q): 4 x 128 tokens
    0.0113 -> 0.0104 ms, 4 x 256 0.0158 -> 0.0146, 1 x 512 0.0185 -> 0.0177, 4 x 1024 0.0808 -> 0.0795.
    """

    block_m: int
    block_n: int
    block_q: int
    num_warps: int = 4
    num_stages: int = 2
    num_splits: int = 1
    prerotate_q: bool = False
    page_prefetch: bool = True
    pdl: bool = True


def pick_config(
    *,
    head_dim: int,
    group: int,
    num_seqs: int,
    num_kv_heads: int,
    max_query_len: int,
    max_kv_len: int,
    dtype: torch.dtype,
    num_sms: int,
    interpret: bool,
) -> AttentionConfig:
    """Tiling for one launch. GPU choices: measured on one H200 with perf/bench_attention.py's sweep
    (hd 128, 16 q / 2 kv heads, bf16, 16-token pages, full path = q/k RoPE + cache write +
    attention, SDPA flash without RoPE or cache write as the reference) where marked, else reasoned.

    page_prefetch is on everywhere: each K/V tile's block-table entries are loaded one tile ahead,
    which is what lets Triton's pipeliner prefetch K/V at all. Without it the K/V addresses come
    from a block-table load in the same iteration and Triton 3.6 gives them about
    (num_stages - 2) // 2 tiles of lookahead (sm_90 builds: none at 3-4 stages; deeper stages were
    measured in GPU run 61 and were not faster). Same run, same GPU, old pick vs this one (GPU
    runs 69 on nvidia-h200 and 70 on nvidia-h200-x4, perf/results/attention.json): prefill
    1 x 4096 0.210 -> 0.197 ms, 4 x 1024 0.107 -> 0.095, 1 x 16384 2.854 -> 2.511, 4 x 4096
    0.836 -> 0.764, 4 x 256 and 4 x 128 ties; decode in CUDA graphs 1 / 8 / 16 / 64 x 4096
    0.0145 / 0.0219 / 0.0359 / 0.0817 -> 0.0108 / 0.0202 / 0.0332 / 0.0790 ms.

    Decode (max_query_len == 1): block_q = 1, block_m = max(16, next_pow2(G)): one token's G
      heads (tl.dot needs M >= 16, so G < 16 wastes rows, but decode is bound by the K/V bytes,
      which are read once per kv head). block_n 64, 4 warps, 2 stages (one K/V tile in flight
      beyond the current one; 39 KiB of shared memory, so several programs per SM; run 69 at
      8 x 4096: 5 stages 0.0298 ms, 3 stages 0.0200, 2 stages 0.0194).
    Prefill/mixed: block_m 128 (hd <= 128) with block_q = 128 // G tokens, block_n 64, 8 warps,
      3 stages, prerotate_q on (with the page prefetch it beats the 32-key / 4-warp tile that was
      the choice for sequences over 1024 tokens: 1 x 16384 2.511 vs 2.854 ms, run 70). hd 256 or
      fp32 inputs: block_m 64, block_n 32, 4 warps, 2 stages to stay inside 227 KiB of shared
      memory.
      prerotate_q: the in-kernel q prologue cost 0.12-0.13 ms at 4096 tokens although the write
      kernel is ~8 us: its extra live registers slow the whole main loop. Pre-rotating q in the
      write kernel costs one [T, nq hd] write + read (2 x 16 MiB at 4096 tokens, ~7 us at H200
      bandwidth) and leaves the attention kernel as lean as the attention-only one.
    Decode (max_query_len == 1): prerotate_q off: the prologue transforms one token's G heads
      per program (tiny), so an extra q round trip through memory and its launch work would be
      pure cost.
    Split-KV when every sequence fits in one q tile (decode-like) and the (sequence, kv head)
      programs cannot fill the GPU: enough splits for ~4 programs per SM, at most one per key tile
      and at most 64. With the K/V prefetch a split of a single tile is fine (run 70, 1 x 4096:
      64 one-tile splits 0.0108 ms vs 17 four-tile splits without prefetch 0.0145 ms; 8 x 4096:
      33 two-tile splits 0.0202, 16 four-tile splits 0.0222); before it splits were >= 4 tiles.
    Interpreter: small tiles (16/32 rows, 16 keys) so CPU tests cover many tiles and splits.
    """
    big = head_dim > 128 or dtype == torch.float32
    if interpret:
        block_m, block_n, warps, stages = (16 if max_query_len == 1 else 32), 16, 4, 1
        block_m = max(block_m, next_pow2(group))
    elif max_query_len == 1:
        block_m, block_n, warps, stages = max(16, next_pow2(group)), (32 if big else 64), 4, (3 if big else 2)
    else:
        block_m = max(64 if big else 128, next_pow2(group))
        block_n, warps, stages = (32, 4, 2) if big else (64, 8, 3)
    block_q = 1 if max_query_len == 1 else max(1, block_m // group)

    splits = 1
    if max_query_len <= block_q:
        programs = num_seqs * num_kv_heads
        # Nearest whole number of waves of ~4 CTAs per SM (a rounded-up count can leave a
        # mostly idle last wave: 128 programs x 3 splits on 132 SMs is 1.45 waves).
        want = max(1, round(4 * num_sms / programs))
        splits = max(1, min(want, cdiv(max(max_kv_len, 1), block_n), _MAX_SPLITS))
    # Interpreter too: CPU tests of prefill batches then run the pre-rotated path the GPU runs.
    return AttentionConfig(block_m, block_n, block_q, warps, stages, splits, prerotate_q=max_query_len > 1)


@functools.cache
def _device_num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


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


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


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
    if qkv.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"{fn}: qkv dtype must be one of {_SUPPORTED_DTYPES}, got {qkv.dtype}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(
            f"{fn}: k_cache and v_cache must be one layer's [num_blocks, block_size, nkv, hd] with equal "
            f"shapes and strides, got {tuple(k_cache.shape)}/{k_cache.stride()} and "
            f"{tuple(v_cache.shape)}/{v_cache.stride()}"
        )
    if k_cache.dtype != qkv.dtype or v_cache.dtype != qkv.dtype:
        raise TypeError(f"{fn}: cache dtype {k_cache.dtype}/{v_cache.dtype} must equal qkv dtype {qkv.dtype}")
    _, _, nkv, hd = k_cache.shape
    if not _is_pow2(hd) or hd < 16:
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
    if qkv.device.type == "cpu" and not _INTERPRETED:
        raise RuntimeError(
            "fusedpar.paged_attention got CPU tensors but its Triton kernels were compiled for a GPU: set "
            "TRITON_INTERPRET=1 before fusedpar.kernels.attention is first imported to use the CPU interpreter"
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
    if _INTERPRETED:
        num_sms = _INTERPRETER_NUM_SMS
    else:
        index = qkv.device.index if qkv.device.index is not None else torch.cuda.current_device()
        num_sms = _device_num_sms(index)
    cfg = config or pick_config(
        head_dim=hd, group=group, num_seqs=num_seqs, num_kv_heads=nkv, max_query_len=max_query_len,
        max_kv_len=max_kv_len, dtype=qkv.dtype, num_sms=num_sms, interpret=_INTERPRETED,
    )
    if not (_is_pow2(cfg.block_m) and _is_pow2(cfg.block_n) and cfg.block_m >= 16 and cfg.block_n >= 16):
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
        fast = not _INTERPRETED and torch.version.hip is None and qkv.dtype in (torch.bfloat16, torch.float16)
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
    pdl_ok = cfg.pdl and not _INTERPRETED and _device_has_pdl(qkv.device)  # Hopper+ NVIDIA GPUs only
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
            Q_BY_TOKEN=transforms_q and not prerotate and _is_pow2(group), PDL=pdl, LAUNCH_DEPENDENTS=combine_pdl,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_kw,
        )
        if splits > 1:
            _combine_kernel[(num_tokens, num_q_heads)](
                part_acc, part_m, part_l, out_arg, out_peers, out_arg.stride(0), num_tokens, splits, rows_per_rank,
                col0, NQ=num_q_heads, HD=hd, SPLITS_P2=next_pow2(splits), SCATTER=scatter is not None,
                PDL=combine_pdl, num_warps=1 if hd <= 64 else 2, **({"launch_pdl": True} if combine_pdl else {}),
            )
    return out


# ---- torch custom ops ---------------------------------------------------------------------------
# mutates_args lists the cache layer views: the op writes the new k/v into them (declared even when
# write_kv=False, which is harmless). Re-importing re-registers cleanly (as in gemm.py).


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
    """paged_attention into `out` (see the module docstring); rope_theta <= 0 means no theta RoPE."""
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


# ---- public API ---------------------------------------------------------------------------------


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
    config: AttentionConfig | None = None,
    scatter: ScatterOut | None = None,
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
      num_seqs); block tables and slots index inside the cache. AttentionMetadata.from_step and
      fusedpar.layers.graphs build them so.
    RoPE: rope_theta (with positions [>= num_tokens], absolute position of each token), or
      rope_cos/rope_sin tables [>= num_tokens, hd] (row t for token t), or neither (no RoPE).
      rope_theta computes fp32 angles, accurate while max_kv_len <= ROPE_THETA_MAX_KV_LEN (positions
      below it); larger steps are refused: pass tables.
    q_norm / k_norm: optional [hd] RMSNorm weights (Qwen3), applied before RoPE with eps.
    max_query_len / max_kv_len: host-side upper bounds used only for tiling and split-KV choices
      (results are correct for any values); None derives them from the tensors (a device sync).
      In a CUDA graph pass bounds valid for every replay (e.g. the model's max length).
    scale: softmax scale, default hd ** -0.5. out: optional [rows, nq hd] destination (any row
      stride, contiguous columns). config: explicit tiling (tests/tuning).
    Returns out: rows < num_tokens = attention output, rows >= num_tokens = 0.
    scatter: a ScatterOut instead of out: every real row is stored straight into its owner rank's
      buffer (the return all-to-all); returns None. Its readers wait for the peers' arrival flags
      (fusedpar.kernels.ulysses.scattered_o_proj).
    Under torch.compile it goes through torch.ops.fusedpar.paged_attention[_out] (one opaque node
    with a fake impl; not with an explicit config); eager calls launch the kernels directly.
    """
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
        # custom-op dispatcher costs ~20 us of host time per call, as much as a decode step's
        # attention on the GPU (the other fused ops do the same; see gemm_all_reduce._call_fused).
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

    @classmethod
    def from_step(
        cls, batch: StepBatch, cache: PagedKVCache, device: torch.device | str | None = None
    ) -> AttentionMetadata:
        """Build from a StepBatch and a PagedKVCache AFTER cache.begin_step(batch) (which allocates the
        blocks of the new tokens). Python touches each sequence once (to read its block list),
        never each token. Raises if a block table is too short for its context + new tokens.
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
        return cls(
            cu_seqlens_q=dev_buf[: num_seqs + 1],
            context_lens=dev_buf[num_seqs + 1 : 2 * num_seqs + 1],
            block_tables=dev_buf[2 * num_seqs + 1 :].view(num_seqs, max_blocks),
            num_tokens=int(q_lens.sum()),
            max_query_len=int(q_lens.max()),
            max_kv_len=int((q_lens + ctx).max()),
        )


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
    metadata: AttentionMetadata.from_step(step.batch, cache), ideally built once per step and shared
    by all layers; built here when None (host work + one small host->device copy per call).
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
    md = metadata if metadata is not None else AttentionMetadata.from_step(step.batch, cache, qkv.device)
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
