"""Single-process, unsharded oracle: the same decoder math with full weights and a plain cache.

Deliberately simple and independent of the sharded path (no layouts, no paging, no
collectives) so that tests comparing the two can fail.
"""

from __future__ import annotations

import torch

from fusedpar.kernels.reference import apply_rope, causal_gqa_attention, rms_norm, rope_cos_sin, swiglu
from fusedpar.layers.config import DecoderConfig
from fusedpar.layers.fp8_weights import linear  # F.linear, or the FP8 reference for FP8 weights
from fusedpar.layers.step_plan import StepBatch


class DenseDecoderStack:
    """forward(hidden [n, d], batch) -> [n, d]; keeps k/v per (layer, sequence) as plain tensors."""

    def __init__(self, cfg: DecoderConfig, layer_weights: list[dict[str, torch.Tensor]]):
        self.cfg, self.layers = cfg, layer_weights
        self.kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, hidden: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        cfg = self.cfg
        positions = batch.positions(hidden.device)
        kv_index = torch.arange(cfg.num_q_heads, device=hidden.device) // (cfg.num_q_heads // cfg.num_kv_heads)
        x = hidden
        for li, w in enumerate(self.layers):
            h = rms_norm(x, w["input_norm"], cfg.rms_norm_eps)
            n, hd = h.shape[0], cfg.head_dim
            bias = {p: w[f"{p}_bias"] if cfg.qkv_bias else None for p in "qkv"}
            q = linear(h, w["q"], bias["q"]).view(n, cfg.num_q_heads, hd)
            k = linear(h, w["k"], bias["k"]).view(n, cfg.num_kv_heads, hd)
            v = linear(h, w["v"], bias["v"]).view(n, cfg.num_kv_heads, hd)
            if cfg.qk_norm:
                q, k = rms_norm(q, w["q_norm"], cfg.rms_norm_eps), rms_norm(k, w["k_norm"], cfg.rms_norm_eps)
            cos, sin = rope_cos_sin(positions, hd, cfg.rope_theta, q.dtype, cfg.rope_inv_freq,
                                    cfg.rope_attention_scaling)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            outs, start = [], 0
            for sid, ql, cl in zip(batch.seq_ids, batch.query_lens, batch.context_lens, strict=True):
                pk, pv = self.kv.get((li, sid), (k[:0], v[:0]))
                if pk.shape[0] != cl:
                    raise ValueError(f"oracle: sequence {sid} has {pk.shape[0]} cached tokens, batch says {cl}")
                ck, cv = torch.cat([pk, k[start:start + ql]]), torch.cat([pv, v[start:start + ql]])
                self.kv[(li, sid)] = (ck, cv)
                outs.append(causal_gqa_attention(q[start:start + ql], ck, cv, kv_index, hd ** -0.5))
                start += ql
            x = x + linear(torch.cat(outs).reshape(n, -1), w["o"])
            h = rms_norm(x, w["post_norm"], cfg.rms_norm_eps)
            x = x + linear(swiglu(linear(h, w["gate"]), linear(h, w["up"])), w["down"])
        return x
