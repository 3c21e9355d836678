"""The paged-attention Triton kernels (launched by fusedpar.kernels.attention.launch).

_write_kv_kernel    one program per real token: k -> norm -> RoPE -> cache, v -> cache; with
                    AttentionConfig.prerotate_q (prefill/mixed launches) also every q head ->
                    norm -> RoPE -> a [num_tokens, nq hd] scratch in the cache dtype, which the
                    attention kernel reads as its q. On sm_90+ the attention launch after it is its
                    programmatic dependent (PDL) and waits (griddepcontrol) before reading what it wrote.
_attention_kernel   one program per (q tile, kv head, kv split). A q tile packs BLOCK_Q tokens x the G q
                    heads of one kv head into BLOCK_M rows (row r = token r // G, head r % G), so one
                    K/V tile load serves the whole GQA group. K/V are gathered through the block table
                    in BLOCK_N-key tiles: an unmasked loop below the causal diagonal, then a masked
                    one (a pure decode launch: one masked loop, _attend_decode_tiles). Online softmax
                    in base 2, fp32 state and accumulation. q is normed/roped in registers unless the
                    write kernel pre-rotated it; both round the transform to the cache dtype before
                    the dot, so they agree bit for bit in the interpreter.
                    Decode with WRITE_NEW_KV (<= FUSED_WRITE_MAX_SEQS sequences, no write kernel): the
                    program whose key range holds the new position stores the step's k/v and attends
                    to them from registers (one launch fewer per decode step).
                    SPLIT (flash decoding): the key range is cut into chunks whose unnormalised
                    partials (max, sum, acc) go to fp32 scratch and are merged by
_combine_kernel     one program per (token, q head).
Outputs go to a local out [rows, nq hd] or, SCATTER, to their owner ranks' buffers (_out_rows).
"""

from __future__ import annotations

import triton
import triton.language as tl

from fusedpar.kernels.attention.rope_norm import (
    _load_rot,
    _norm_rope,
    _norm_rope_values,
    _q_tile_by_token,
    _rope_cos_sin,
)

# Score masks use -inf; the running max starts at this finite value instead, so a row that has
# seen only masked keys keeps exp2(-inf - m) = 0 and alpha = exp2(m - m) = 1 (never inf - inf).
_M_INIT = tl.constexpr(-1.0e38)


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
    no norm/RoPE gives that kernel the q it would have computed (bit-identical paths).

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


# Batch counts vary step to step: specialising on them (== 1, % 16) would compile a new variant
# mid-serving for a batch mix not seen at warm-up (seconds of host time in a request's TTFT).
@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "num_tiles"])
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


@triton.jit(do_not_specialize=["num_tokens", "num_splits"])
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
