"""The plain-PyTorch reference of the kernels' math, shared by the layers' reference paths and the tests.

rms_norm (fusedpar.kernels.rmsnorm), swiglu / blocked_swiglu (fusedpar.kernels.swiglu),
rope_cos_sin / apply_rope and causal_gqa_attention / gqa_attention (the q/k transforms and the
attention of fusedpar.kernels.attention). Half-precision inputs compute in fp32 like the kernels;
float64 inputs stay float64 (the tests' oracles).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, computed in fp32 (HF Llama semantics)."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def rope_cos_sin(
    positions: torch.Tensor,
    head_dim: int,
    theta: float,
    dtype: torch.dtype,
    inv_freq: Sequence[float] | torch.Tensor | None = None,
    scale: float = 1.0,
):
    """cos, sin of shape [n, head_dim] for rotate-half RoPE (HF layout: halves, not interleaved).

    Angles position * f_i in float64 with f_i = theta ** (-2i / head_dim), or inv_freq [head_dim/2]
    when given (scaled RoPE tables; theta is then unused); cos and sin are multiplied by `scale`
    (HF's attention_scaling) before the cast to dtype.
    """
    if inv_freq is None:
        freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim))
    else:
        freqs = torch.as_tensor(inv_freq, dtype=torch.float64).to(positions.device)
        if freqs.shape != (head_dim // 2,):
            raise ValueError(f"rope_cos_sin: inv_freq must have head_dim/2 = {head_dim // 2} entries, "
                             f"got shape {tuple(freqs.shape)}")
    ang = positions.to(torch.float64)[:, None] * freqs[None, :]
    emb = torch.cat((ang, ang), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, head_dim]; cos/sin [n, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, with torch's roundings (silu rounded to the dtype, then the product)."""
    return F.silu(gate) * up


def blocked_swiglu(gate_up: torch.Tensor, block: int) -> torch.Tensor:
    """SwiGLU of a gate_up GEMM output laid out as per-block [gate | up] chunks of `block` columns:
    [rows, blocks * 2 * block] -> [rows, blocks * block] (fusedpar.kernels.swiglu is its Triton pass)."""
    rows, width = gate_up.shape
    v = gate_up.reshape(rows, width // (2 * block), 2, block)
    return swiglu(v[:, :, 0], v[:, :, 1]).reshape(rows, width // 2)


def causal_gqa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_index: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of one sequence's new tokens against its whole cached context.

    q [L_new, Hq, d]; k, v [L_ctx, Hkv, d] with the new tokens last (L_ctx >= L_new);
    kv_index [Hq]: which kv head each q head reads. Query i sits at position L_ctx - L_new + i
    and sees keys 0..that position. Returns [L_new, Hq, d].
    """
    return gqa_attention(q, k, v, kv_index, scale, causal=True)


def gqa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_index: torch.Tensor, scale: float, *, causal: bool
) -> torch.Tensor:
    """causal_gqa_attention, or with causal=False every query attending to every key (queries that
    are not keys themselves, e.g. HF's padding positions: ShiftParallelDecoderLayer.side_queries)."""
    L_new, L_ctx = q.shape[0], k.shape[0]
    kh, vh = k[:, kv_index], v[:, kv_index]  # [L_ctx, Hq, d]
    if q.dtype in (torch.float16, torch.bfloat16):
        # fp32 scores and softmax state for half inputs (as SDPA's kernels keep them; rounding the
        # scores to half first is a visible extra error); fp64 oracles stay fp64
        q, kh = q.float(), kh.float()
    scores = torch.einsum("qhd,khd->hqk", q, kh)
    scores = scores * scale
    if causal:
        q_pos = torch.arange(L_ctx - L_new, L_ctx, device=q.device)[:, None]
        k_pos = torch.arange(L_ctx, device=q.device)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.einsum("hqk,khd->qhd", probs, vh)
