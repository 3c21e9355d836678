"""What a transformers causal LM is, in fusedpar terms, and everything about it we cannot run.

`inspect_model(model, layout)` reads the model's config and its decoder-layer modules (shapes
only, so it works on a meta-device model) and returns an `HFModelSpec`: the core
`DecoderConfig` (q/k/v bias and a non-default RoPE frequency table included) plus what only the
adapter needs (dtype, layer count, a sequence-length limit). It collects every unsupported
feature it finds and raises one `UnsupportedModelError` (a ValueError) naming all of them,
before any process group is touched, so every rank fails the same way at `parallelize` time.

Supported: model_type llama, mistral, qwen2, qwen3 (the families whose decoder layer is
pre-norm RMSNorm -> GQA attention with rotate-half RoPE -> RMSNorm -> SwiGLU MLP), fp32 / bf16 /
fp16, q/k/v bias (Qwen2), Qwen3's per-head q/k RMSNorm, tied embeddings, RoPE types "default",
"linear", "llama3" and "yarn" (static frequency tables; the HF module's own table is used), FP8
projection weights in the formats of fp8.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from fusedpar.layers import DecoderConfig
from fusedpar.layouts import ParallelLayout, scale_block_problems, shard_problems

from .fp8 import FP8Format, fp8_format

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CONFIG_FIELDS = ("hidden_size", "num_attention_heads", "intermediate_size", "rms_norm_eps")
_MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")

# core weight name (fusedpar.layers.config.weight_shapes) -> parameter path inside an HF decoder layer
# of the supported families: the checkpoint key below model.layers.<i>., and the module path in a model
LAYER_PARAMS = {
    "input_norm": "input_layernorm.weight", "post_norm": "post_attention_layernorm.weight",
    "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight", "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight", "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
    "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias", "v_bias": "self_attn.v_proj.bias",
}


class UnsupportedModelError(ValueError):
    """The model or its config uses something fusedpar.integrations.hf cannot run exactly."""


@dataclass(frozen=True)
class HFModelSpec:
    """The decoder of an HF causal LM as fusedpar runs it.

    decoder: the core layer config (eps, rope_theta, head_dim, qk_norm from the HF config;
        qkv_bias when the q/k/v projections carry a bias (Qwen2; sharded like the weight rows);
        for any rope_type but "default", rope_inv_freq and rope_attention_scaling are the HF
        rotary module's own values).
    rope_type: HF rope type.
    sliding_window: smallest window of any layer (None: full attention everywhere).
    max_seq_len: per-sequence token limit enforced at run time (None: no limit). Set when a
        sliding window exists: up to the window, windowed attention equals full attention.
    """

    model_type: str
    architecture: str
    decoder: DecoderConfig
    num_layers: int
    dtype: torch.dtype
    rope_type: str
    sliding_window: int | None
    max_seq_len: int | None
    tied_embeddings: bool
    fp8: FP8Format | None = None  # FP8 projection weights (fp8.py); dtype is then that of the other weights

    @property
    def qkv_bias(self) -> bool:
        return self.decoder.qkv_bias

    @property
    def rope_inv_freq(self) -> torch.Tensor | None:
        """float32 [head_dim/2] RoPE table of a non-default rope_type (None: from rope_theta)."""
        freqs = self.decoder.rope_inv_freq
        return None if freqs is None else torch.tensor(freqs, dtype=torch.float32)

    @property
    def rope_attention_scaling(self) -> float:
        return self.decoder.rope_attention_scaling


def _rope_params(config) -> dict:
    params = getattr(config, "rope_parameters", None)
    if params is None:  # transformers < 5 naming
        scaling = getattr(config, "rope_scaling", None) or {}
        params = {"rope_type": scaling.get("rope_type", scaling.get("type", "default")),
                  "rope_theta": getattr(config, "rope_theta", 10000.0)}
    return dict(params)


def _decoder_parts(model):
    """(inner model, decoder layers) of a *ForCausalLM, or None if it does not look like one."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if inner is None or layers is None or getattr(model, "lm_head", None) is None:
        return None
    if getattr(inner, "embed_tokens", None) is None or getattr(inner, "norm", None) is None:
        return None
    return inner, layers


def _has_bias(linear) -> bool:
    return getattr(linear, "bias", None) is not None


def rotary_tables(model) -> tuple[torch.Tensor, float]:
    """inv_freq (float32, CPU) and attention scaling of the model's rotary module.

    A model built on the meta device has a meta inv_freq: rebuild the module on CPU from the
    config (the same HF code computes it) and put it back, so the HF model stays consistent.
    """
    inner = model.model
    rot = inner.rotary_emb
    if rot.inv_freq.device.type == "meta":
        with torch.device("cpu"):
            rot = type(rot)(config=model.config)
        inner.rotary_emb = rot
    return rot.inv_freq.detach().float().cpu().clone(), float(rot.attention_scaling)


def inspect_model(model, layout: ParallelLayout, *, max_seq_len: int | None = None) -> HFModelSpec:
    """Check that `model` can run sharded on `layout` and describe it; raise UnsupportedModelError.

    max_seq_len: optional per-sequence token limit. A model with sliding-window attention runs
    sequences of up to its (smallest) window, where windowed attention equals full attention:
    max_seq_len defaults to the window there, and a larger max_seq_len is rejected. The forward
    raises (naming the window) before a sequence would grow past the limit, so nothing is
    silently wrong; MistralConfig's default window (4096) thus needs no argument.
    """
    if not isinstance(layout, ParallelLayout):
        raise TypeError(f"fusedpar.integrations.hf: layout must be a fusedpar.ParallelLayout, got "
                        f"{type(layout).__name__} {layout!r}")
    problems: list[str] = []
    config = getattr(model, "config", None)
    name = type(model).__name__
    if config is None:
        raise UnsupportedModelError(f"fusedpar.integrations.hf: {name} has no .config; pass a transformers causal LM")
    model_type = getattr(config, "model_type", "?")
    if getattr(config, "is_encoder_decoder", False):
        problems.append("encoder-decoder models")
    moe = [f for f in _MOE_FIELDS if getattr(config, f, None)]
    if moe:
        fields = ", ".join(f"{f}={getattr(config, f)}" for f in moe)
        problems.append(f"mixture-of-experts (MoE) layers (config {fields})")
    if model_type not in SUPPORTED_MODEL_TYPES:
        problems.append(f"model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    fp8, fp8_problems = fp8_format(getattr(config, "quantization_config", None))
    problems += fp8_problems
    parts = _decoder_parts(model)
    if parts is None:
        problems.append(f"{name} does not have the *ForCausalLM layout (model.embed_tokens, model.layers, "
                        "model.norm, lm_head)")
        _raise(name, problems)
    inner, layers = parts
    if len(layers) == 0:
        problems.append("a model with no decoder layers (already parallelized?)")
        _raise(name, problems)

    act = getattr(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        problems.append(f"hidden_act={act!r} (only SwiGLU with silu)")

    # Llama-style config fields; other families (LayerNorm models such as OLMo, Cohere, StarCoder2)
    # lack some, which must not end in an AttributeError before the problems found so far are named
    absent = [f for f in _CONFIG_FIELDS if getattr(config, f, None) is None]
    if absent:
        problems.append(f"a config without {', '.join(absent)} (not a Llama-style RMSNorm decoder)")
        _raise(name, problems)
    hidden = config.hidden_size
    h = config.num_attention_heads
    h_kv = getattr(config, "num_key_value_heads", None) or h
    attn0 = getattr(layers[0], "self_attn", None)  # absent on e.g. Qwen3-Next's linear-attention layers
    head_dim = getattr(attn0, "head_dim", None) or getattr(config, "head_dim", None) or hidden // h
    intermediate = config.intermediate_size

    qkv_bias_layers, windows = set(), []
    qk_norm = None
    for i, layer in enumerate(layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
            problems.append(f"layer {i} is not a q/k/v/o attention layer")
            continue
        if not all(hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj")):
            problems.append(f"layer {i}: MLP {type(mlp).__name__} is not a gate/up/down SwiGLU (MoE?)")
            continue
        shapes = {
            "q_proj": (attn.q_proj, (h * head_dim, hidden)),
            "k_proj": (attn.k_proj, (h_kv * head_dim, hidden)),
            "v_proj": (attn.v_proj, (h_kv * head_dim, hidden)),
            "o_proj": (attn.o_proj, (hidden, h * head_dim)),
            "gate_proj": (mlp.gate_proj, (intermediate, hidden)),
            "up_proj": (mlp.up_proj, (intermediate, hidden)),
            "down_proj": (mlp.down_proj, (hidden, intermediate)),
        }
        for pname, (mod, shape) in shapes.items():
            if tuple(mod.weight.shape) != shape:
                problems.append(f"layer {i} {pname}.weight has shape {tuple(mod.weight.shape)}, expected {shape}")
        biases = [_has_bias(attn.q_proj), _has_bias(attn.k_proj), _has_bias(attn.v_proj)]
        if any(biases):
            if not all(biases):
                problems.append(f"layer {i}: bias on only some of q/k/v projections")
            qkv_bias_layers.add(i)
        if _has_bias(attn.o_proj):
            problems.append("attention output projection bias (o_proj.bias; e.g. attention_bias=True on Llama)")
        if any(_has_bias(getattr(mlp, p)) for p in ("gate_proj", "up_proj", "down_proj")):
            problems.append("MLP bias (mlp_bias=True)")
        has_qn, has_kn = getattr(attn, "q_norm", None) is not None, getattr(attn, "k_norm", None) is not None
        if has_qn != has_kn:
            problems.append(f"layer {i}: q_norm without k_norm (or the reverse)")
        elif has_qn:
            for nname in ("q_norm", "k_norm"):
                w = getattr(attn, nname).weight
                if tuple(w.shape) != (head_dim,):
                    problems.append(f"layer {i} {nname} over {tuple(w.shape)} "
                                    "(only per-head q/k norm of size head_dim)")
        if qk_norm is not None and qk_norm != has_qn:
            problems.append("q/k norm on some layers only")
        qk_norm = has_qn
        scaling = getattr(attn, "scaling", head_dim ** -0.5)
        if abs(scaling - head_dim ** -0.5) > 1e-12 * max(1.0, scaling):
            problems.append(f"attention scaling {scaling} (only 1/sqrt(head_dim))")
        # Qwen2/3 set it per layer (None on full-attention layers); Mistral reads the config. Llama's
        # attention ignores a sliding_window its config may carry (always full causal): no limit there.
        if hasattr(attn, "sliding_window"):
            window = attn.sliding_window
        else:
            window = getattr(config, "sliding_window", None) if model_type == "mistral" else None
        if window is not None:
            windows.append(int(window))
        for nname in ("input_layernorm", "post_attention_layernorm"):
            norm = getattr(layer, nname, None)
            if norm is None or "RMSNorm" not in type(norm).__name__:
                problems.append(f"layer {i} {nname} is not an RMSNorm")
    if qkv_bias_layers and len(qkv_bias_layers) != len(layers):
        problems.append("q/k/v bias on some layers only")

    sliding_window = min(windows) if windows else None
    if sliding_window is not None:
        if max_seq_len is None:
            max_seq_len = sliding_window  # inside the window, windowed attention is full attention
        elif max_seq_len > sliding_window:
            problems.append(
                f"sliding window attention (sliding_window={sliding_window}) with max_seq_len={max_seq_len}: "
                f"fusedpar computes full attention, equal to the model's only up to {sliding_window} tokens "
                f"per sequence; pass max_seq_len <= {sliding_window} (the default for this model) or use a "
                "config with sliding_window=None"
            )

    rope = _rope_params(config)
    rope_type = rope.get("rope_type", "default")
    if isinstance(rope_type, dict) or rope_type not in SUPPORTED_ROPE_TYPES:
        problems.append(f"rope type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)}; dynamic / longrope "
                        "rescale with the sequence length)")
    if rope.get("partial_rotary_factor", 1.0) not in (None, 1.0):
        problems.append(f"partial rotary embeddings (partial_rotary_factor={rope['partial_rotary_factor']})")

    # FP8 projection weights and their fp32 scales do not set the model's dtype
    dtypes = {p.dtype for n, p in model.named_parameters()
              if fp8 is None or not (p.dtype == torch.float8_e4m3fn or n.endswith(fp8.scale_name))}
    bad = sorted(str(d) for d in dtypes if d not in SUPPORTED_DTYPES)
    if bad:
        problems.append(f"parameter dtypes {bad} (supported: float32, bfloat16, float16)")
    if len(dtypes) > 1:
        problems.append(f"mixed parameter dtypes {sorted(str(d) for d in dtypes)}")
    devices = {p.device for p in model.parameters() if p.device.type != "meta"}
    if len(devices) > 1:
        problems.append(f"a model spread over several devices {sorted(map(str, devices))} (device_map); "
                        "put the whole model on this rank's device first")

    # The layout must fit the model: heads and MLP columns split evenly (same checks the core uses).
    decoder = None
    try:
        decoder = DecoderConfig(
            hidden_size=hidden, num_q_heads=h, num_kv_heads=h_kv, head_dim=head_dim,
            intermediate_size=intermediate, rms_norm_eps=float(config.rms_norm_eps),
            rope_theta=float(rope.get("rope_theta", 10000.0)), qk_norm=bool(qk_norm),
            # q/k/v bias from the modules: Llama's attention_bias (rejected above when o_proj has one
            # too), Qwen2's always-on q/k/v bias (its config has no attention_bias field)
            qkv_bias=bool(qkv_bias_layers),
        )
        problems += [f"layout {layout!r} does not fit the model: {p}" for p in shard_problems(layout, decoder.dims)]
        if fp8 is not None and fp8.scheme.weight == "block":
            problems += [f"layout {layout!r} cuts FP8 weights inside their {fp8.scheme.block[0]}x{fp8.scheme.block[1]} "
                         f"scale blocks: {p}" for p in scale_block_problems(layout, decoder.dims, fp8.scheme.block)]
    except ValueError as e:  # DecoderConfig's own checks (sizes, odd head_dim, rope_theta, eps)
        problems.append(f"decoder sizes: {e}")
    _raise(name, problems)

    if rope_type != "default":
        inv_freq, attn_scale = rotary_tables(model)
        if inv_freq.numel() * 2 != head_dim:
            _raise(name, [f"rotary table of {inv_freq.numel()} frequencies for head_dim {head_dim} (partial rotary)"])
        # the float32 table HF computes, exactly (RoPE angles are then taken in float64 by the core)
        decoder = dataclasses.replace(decoder, rope_inv_freq=tuple(inv_freq.tolist()),
                                      rope_attention_scaling=attn_scale)
    dtype = next(iter(dtypes))
    tied = model.lm_head.weight is inner.embed_tokens.weight or bool(getattr(config, "tie_word_embeddings", False))
    return HFModelSpec(
        model_type=model_type, architecture=name, decoder=decoder, num_layers=len(layers), dtype=dtype,
        rope_type=rope_type, sliding_window=sliding_window, max_seq_len=max_seq_len, tied_embeddings=tied, fp8=fp8,
    )


def _raise(name: str, problems: list[str]) -> None:
    if problems:
        unique = list(dict.fromkeys(problems))
        raise UnsupportedModelError(
            f"fusedpar.integrations.hf cannot parallelize {name}: unsupported "
            + "; ".join(unique)
        )
