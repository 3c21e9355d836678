"""Decoder-layer configuration and seeded random weights (Llama/Qwen family, HF orientation)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedpar.layouts import ModelDims


@dataclass(frozen=True)
class DecoderConfig:
    """One Llama/Mistral/Qwen2/Qwen3-style decoder layer.

    qk_norm: Qwen3's per-head RMSNorm on q and k (weights of size head_dim), before RoPE.
    """

    hidden_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    qk_norm: bool = False

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
    """Global weight names and shapes; linear weights are [out_features, in_features]."""
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
    return shapes


def random_decoder_weights(
    cfg: DecoderConfig, *, seed: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """Seeded random weights scaled so activations stay O(1) through many layers.

    Norm weights are drawn around 1 (not exactly 1) so a wrong norm placement is visible.
    """
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in weight_shapes(cfg).items():
        if len(shape) == 1:
            w = 1.0 + 0.1 * torch.randn(shape, generator=gen, dtype=torch.float64)
        else:
            w = torch.randn(shape, generator=gen, dtype=torch.float64) / shape[1] ** 0.5
        out[name] = w.to(dtype=dtype, device=device)
    return out
