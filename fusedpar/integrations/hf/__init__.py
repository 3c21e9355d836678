"""Hugging Face transformers adapter (the `hf` extra): shift-parallel Llama / Mistral / Qwen2 / Qwen3.

    import torch.distributed as dist
    from fusedpar import ParallelLayout
    from fusedpar.integrations.hf import parallelize, load_parallel

    dist.init_process_group("nccl")                       # or "gloo" for CPU models
    layout = ParallelLayout(dist.get_world_size(), sp=2, tp=2)
    model = parallelize(model, layout, shift_threshold=256)         # a model with full weights, or
    model = load_parallel("/ckpt/dir", layout, dtype=torch.bfloat16)  # read only this rank's shards
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=64, do_sample=False)
    # parallelize(..., reshard_layouts=[...]) then model.reshard(layout): switch live among TP, SP, DP
    # and their mixes, or parallelize(..., policy=...) to switch per step (docs/hf.md)

Modules: spec (what is supported, checks), model (parallelize: sharding, the model's forward),
switching (declared layouts: the weights kept, model.reshard, the layout policy),
calls (the per-call agreement check),
runtime (one fusedpar step per call, decode graphs), padding (padded columns, positions), cache
(the past_key_values bookkeeping), loader (meta-device build + sliced safetensors reads).
The core never imports this package.
"""

try:
    import transformers  # noqa: F401
except ModuleNotFoundError as e:
    if e.name != "transformers":
        raise
    raise ImportError('fusedpar.integrations.hf needs transformers: pip install "fusedpar[hf]"') from e

from .cache import ShiftParallelCache
from .loader import CheckpointReader, load_parallel
from .model import base_shard_bytes, parallelize, resident_decoder_bytes
from .spec import SUPPORTED_MODEL_TYPES, SUPPORTED_ROPE_TYPES, HFModelSpec, UnsupportedModelError, inspect_model

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "SUPPORTED_ROPE_TYPES",
    "CheckpointReader",
    "HFModelSpec",
    "ShiftParallelCache",
    "UnsupportedModelError",
    "base_shard_bytes",
    "inspect_model",
    "load_parallel",
    "parallelize",
    "resident_decoder_bytes",
]
