"""The q/k transforms of paged attention as @triton.jit helpers: RoPE angles, per-head RMSNorm, rotate-half.

    norm(x)  = x / sqrt(mean(x^2) + eps) * w                       (Qwen3's per-head q/k norm over hd)
    rope(x)  = x * cos(p f) + rotate_half(x) * sin(p f),  f_i = theta^(-2 (i mod hd/2) / hd)

all in fp32. The rope mode is a constexpr (ROPE): 0 none, 1 theta (libdevice cos/sin), 2 cos/sin
tables [tokens, hd], 3 theta with the GPU's cos.approx/sin.approx (fusedpar.kernels.attention.config
names them). Theta angles are reduced to about [-pi, pi] with a two-constant 2*pi that is exact for
angles below 2**16 turns, hence ROPE_THETA_MAX_KV_LEN. rotate_half's partner x[(d + hd/2) % hd] is
loaded a second time through permuted offsets (an L1 hit) rather than shuffled in registers.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
