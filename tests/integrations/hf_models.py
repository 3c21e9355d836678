"""Tiny seeded transformers models and left-padded batches for the HF adapter tests (no downloads)."""

from __future__ import annotations

import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)


def make_config(family: str, **overrides):
    import transformers

    kw = dict(BASE)
    if family == "llama":
        cls = transformers.LlamaConfig
        kw.update(rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    elif family == "mistral":
        cls = transformers.MistralConfig
        # transformers' default sliding_window (4096), as a user's MistralConfig() has it: runs with a
        # per-sequence limit of 4096 tokens (spec.inspect_model)
        kw.update(rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    elif family == "qwen2":
        cls = transformers.Qwen2Config
        kw.update(rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    elif family == "qwen3":
        cls = transformers.Qwen3Config
        kw.update(head_dim=16, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    else:
        raise ValueError(family)
    kw.update(overrides)
    return cls(**kw)


def randomize_(model, seed: int) -> None:
    """O(1) activations and well-separated logits (HF's std=0.02 init gives near-ties in argmax).

    Linear weights ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norm weights ~ 1 + 0.1 N(0, 1), biases 0.2 N(0, 1).
    With tied embeddings the input token's own embedding dominates the logits (greedy repeats
    it), so o_proj / down_proj get gain 4 there.
    """
    gen = torch.Generator().manual_seed(seed)
    gain = 4.0 if model.config.tie_word_embeddings else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                w = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
            elif name.endswith("bias"):
                w = 0.2 * torch.randn(p.shape, generator=gen)
            elif "embed_tokens" in name:
                w = torch.randn(p.shape, generator=gen)
            else:
                w = torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5
                if "o_proj" in name or "down_proj" in name:
                    w = w * gain
            p.copy_(w.to(p.dtype))


def make_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    import transformers

    config = make_config(family, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config)
    randomize_(model, seed)
    return model.to(dtype).eval()


def left_padded(lengths: list[int], vocab: int, seed: int, pad_id: int = 0):
    """input_ids [b, max(lengths)] with random real tokens right-aligned, and the attention mask."""
    gen = torch.Generator().manual_seed(seed)
    b, s = len(lengths), max(lengths)
    ids = torch.full((b, s), pad_id, dtype=torch.long)
    mask = torch.zeros((b, s), dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, s - n:] = torch.randint(1, vocab, (n,), generator=gen)
        mask[i, s - n:] = 1
    return ids, mask


def right_padded(ids, mask):
    """The same rows with their real tokens moved to the front (padding after them)."""
    order = torch.argsort(mask, dim=1, descending=True, stable=True)
    return ids.gather(1, order), mask.gather(1, order)
