"""Model shapes the benchmarks time, declared once.

Each shape: hidden size, q heads, kv heads, head dim, MLP intermediate size, layers, vocabulary,
RoPE theta and whether q/k are RMS-normed per head (Qwen3). The benchmarks take per-rank slices
of these (e.g. a TP=4 column block); `decoder_config_kwargs` gives the keywords of
fusedpar.layers.DecoderConfig. Plain data: importing this module loads nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    name: str  # the model the shape is taken from
    hidden: int
    heads: int  # q heads
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    vocab: int
    rope_theta: float
    qk_norm: bool = False

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim


SHAPES: dict[str, ModelShape] = {
    "llama70b": ModelShape("Llama-3-70B", hidden=8192, heads=64, kv_heads=8, head_dim=128, intermediate=28672,
                           layers=80, vocab=128256, rope_theta=500000.0),
    "qwen32b": ModelShape("Qwen3-32B", hidden=5120, heads=64, kv_heads=8, head_dim=128, intermediate=25600,
                          layers=64, vocab=151936, rope_theta=1000000.0, qk_norm=True),
    "llama8b": ModelShape("Llama-3-8B", hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336,
                          layers=32, vocab=128256, rope_theta=500000.0),
    # Qwen3-30B-A3B's attention (32 q / 4 kv heads of 128, hidden 2048) with a dense MLP as wide as
    # its 8 active experts (8 x 768): kv heads are replicated at SP=8.
    "qwen30b_a3b_attn": ModelShape("Qwen3-30B-A3B attention", hidden=2048, heads=32, kv_heads=4, head_dim=128,
                                   intermediate=6144, layers=48, vocab=151936, rope_theta=1000000.0, qk_norm=True),
}


def shape(key: str) -> ModelShape:
    try:
        return SHAPES[key]
    except KeyError:
        raise ValueError(f"unknown model shape {key!r}; known: {sorted(SHAPES)}") from None


def rank_shape(key: str, tp: int) -> ModelShape:
    """One rank's shard of the shape at tensor parallelism `tp`, as a model of its own: q heads, MLP and
    vocabulary split tp ways, kv heads too (one per rank, replicated, where tp exceeds them). A TP=tp
    rank's decode step is this model's step on one GPU plus the all-reduces."""
    s = shape(key)
    if tp < 1 or s.heads % tp or s.intermediate % tp or (s.kv_heads % tp and tp % s.kv_heads):
        raise ValueError(f"{s.name} does not split {tp} ways: need {tp} to divide the {s.heads} q heads and the "
                         f"{s.intermediate} MLP columns, and to divide or be a multiple of the {s.kv_heads} kv heads")
    return ModelShape(f"{s.name} TP={tp} rank", hidden=s.hidden, heads=s.heads // tp,
                      kv_heads=max(1, s.kv_heads // tp), head_dim=s.head_dim, intermediate=s.intermediate // tp,
                      layers=s.layers, vocab=-(-s.vocab // tp), rope_theta=s.rope_theta, qk_norm=s.qk_norm)


def decoder_config_kwargs(key: str | ModelShape) -> dict:
    """Keywords of fusedpar.layers.DecoderConfig for one decoder layer of the shape (a key of SHAPES or a shape)."""
    s = key if isinstance(key, ModelShape) else shape(key)
    kw = dict(hidden_size=s.hidden, num_q_heads=s.heads, num_kv_heads=s.kv_heads, head_dim=s.head_dim,
              intermediate_size=s.intermediate, rope_theta=s.rope_theta)
    if s.qk_norm:
        kw["qk_norm"] = True
    return kw
