"""Decoder-layer configuration and seeded random weights (Llama/Qwen family, HF orientation)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fusedpar.layouts import ModelDims
from fusedpar.layouts._checks import positive_int


@dataclass(frozen=True)
class DecoderConfig:
    """One Llama/Mistral/Qwen2/Qwen3-style decoder layer.

    qk_norm: Qwen3's per-head RMSNorm on q and k (weights of size head_dim), before RoPE.
    qkv_bias: the q, k and v projections add a bias (Qwen2): weights "q_bias" [q_size],
        "k_bias" [kv_size], "v_bias" [kv_size], sharded like the rows of the qkv weight.
    rope_inv_freq: the RoPE inverse frequencies f_i, i < head_dim/2, when they are not
        rope_theta ** (-2i / head_dim) (scaled RoPE: HF "linear", "llama3", "yarn" tables);
        None: computed from rope_theta, which is then the only RoPE parameter used.
    rope_attention_scaling: multiplies cos and sin (HF's rotary `attention_scaling`, e.g.
        yarn's); 1.0 for plain RoPE.
    RoPE rotates (rotate-half, HF layout) by angle position * f_i:
        x * cos(p f) * s + rotate_half(x) * sin(p f) * s, s = rope_attention_scaling.
    """

    hidden_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    qk_norm: bool = False
    qkv_bias: bool = False
    rope_inv_freq: tuple[float, ...] | None = None
    rope_attention_scaling: float = 1.0

    def __post_init__(self):
        for name in ("hidden_size", "num_q_heads", "num_kv_heads", "head_dim", "intermediate_size"):
            positive_int(name, getattr(self, name))
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even: RoPE rotates pairs of dimensions "
                             "(rotate-half, first half with second half)")
        for name in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v < math.inf):
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        if self.rope_inv_freq is not None:
            # accept any sequence (list, float tensor); keep a tuple so the config stays hashable
            freqs = self.rope_inv_freq
            if isinstance(freqs, torch.Tensor):
                freqs = freqs.detach().cpu().double().flatten().tolist()
            freqs = tuple(float(f) for f in freqs)
            if self.head_dim % 2 or len(freqs) != self.head_dim // 2:
                raise ValueError(
                    f"rope_inv_freq has {len(freqs)} frequencies; head_dim={self.head_dim} needs head_dim/2 "
                    "(partial rotary embeddings are not supported)"
                )
            if not all(math.isfinite(f) for f in freqs):
                raise ValueError("rope_inv_freq must be finite")
            object.__setattr__(self, "rope_inv_freq", freqs)
        scaling = float(self.rope_attention_scaling)
        if not math.isfinite(scaling):
            raise ValueError(f"rope_attention_scaling must be finite, got {scaling}")
        object.__setattr__(self, "rope_attention_scaling", scaling)

    @property
    def rope_is_default(self) -> bool:
        """True when RoPE is theta ** (-2i/d) with no scaling (what a kernel can compute from rope_theta)."""
        return self.rope_inv_freq is None and self.rope_attention_scaling == 1.0

    @property
    def dims(self) -> ModelDims:
        return ModelDims(self.num_q_heads, self.num_kv_heads, self.head_dim, self.intermediate_size)

    @property
    def q_size(self) -> int:
        return self.num_q_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def weight_shapes(cfg: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Global weight names and shapes; linear weights are [out_features, in_features], biases 1-D."""
    d = cfg.hidden_size
    shapes = {
        "input_norm": (d,),
        "q": (cfg.q_size, d),
        "k": (cfg.kv_size, d),
        "v": (cfg.kv_size, d),
        "o": (d, cfg.q_size),
        "post_norm": (d,),
        "gate": (cfg.intermediate_size, d),
        "up": (cfg.intermediate_size, d),
        "down": (d, cfg.intermediate_size),
    }
    if cfg.qk_norm:
        shapes["q_norm"] = (cfg.head_dim,)
        shapes["k_norm"] = (cfg.head_dim,)
    if cfg.qkv_bias:
        shapes["q_bias"] = (cfg.q_size,)
        shapes["k_bias"] = (cfg.kv_size,)
        shapes["v_bias"] = (cfg.kv_size,)
    return shapes


def random_decoder_weights(
    cfg: DecoderConfig, *, seed: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """Seeded random weights scaled so activations stay O(1) through many layers.

    Norm weights are drawn around 1 (not exactly 1) so a wrong norm placement is visible; biases
    around 0 with std 0.5 (as large as the projections' outputs, so a misplaced bias is visible).
    Biases are drawn last: a config without them gets the same weights as before they existed.
    """
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in weight_shapes(cfg).items():
        if name.endswith("_bias"):
            w = 0.5 * torch.randn(shape, generator=gen, dtype=torch.float64)
        elif len(shape) == 1:
            w = 1.0 + 0.1 * torch.randn(shape, generator=gen, dtype=torch.float64)
        else:
            w = torch.randn(shape, generator=gen, dtype=torch.float64) / shape[1] ** 0.5
        out[name] = w.to(dtype=dtype, device=device)
    return out
