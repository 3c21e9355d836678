"""`load_parallel(path, layout)`: load a big local safetensors checkpoint straight into shards.

The model is built on the meta device (no memory), checked like `parallelize` checks it, the
checkpoint's tensor names are checked against what the config builds (a missing tensor, or one
the config has no place for, fails naming it before any tensor data is read; only what
from_pretrained itself ignores, such as old per-layer rotary_emb.inv_freq, is skipped), and
then only what this rank keeps is read from disk:
- embeddings, the final norm and lm_head (replicated) are read whole;
- every decoder layer's q/k/v/o/gate/up/down weights are read through `safe_open(...).get_slice`
  one base-shard segment at a time (rows for column-parallel weights, columns for row-parallel
  ones), so a rank never holds a full layer weight; the layer norms (and q/k/v bias rows, with
  the same segments as the weight rows) are small and read whole / sliced.
The per-layer shards are handed to the same assembly as `parallelize`, which builds the
ShiftParallelStack and swaps the model's forward. Works with a single `model.safetensors` or a
sharded checkpoint with `model.safetensors.index.json`. A progress bar (tqdm if installed, else
one stderr line per layer) shows on global rank 0.

`model.fusedpar_load_stats` records the bytes read per kind (tests use it to prove that no
rank read more of a decoder layer than its base shard).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from fusedpar.layers import ShardedDecoderWeights, weight_shapes
from fusedpar.layers.fp8_weights import FP8Weight, cat_fp8, fp8_shift_view
from fusedpar.layers.weights import REPLICATED
from fusedpar.layouts import WEIGHT_NAMES, ParallelLayout

from .fp8 import FP8_WEIGHTS, fp8_segment, scale_key
from .model import assemble, check_arguments, fused_decision, graphs_decision
from .spec import LAYER_PARAMS, HFModelSpec, UnsupportedModelError, inspect_model, rotary_tables

__all__ = ["CheckpointReader", "load_parallel"]


class CheckpointReader:
    """Lazy tensor access to a local safetensors checkpoint (single file or index + shards).

    bytes_read counts what was materialised, by the `kind` the caller names.
    """

    def __init__(self, path: str | os.PathLike):
        from safetensors import safe_open

        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            self.weight_map = dict(json.loads(index.read_text())["weight_map"])
            absent = sorted(f for f in set(self.weight_map.values()) if not (self.path / f).is_file())
            if absent:  # now, not after the files before it were read
                raise FileNotFoundError(f"{self.path}: {index.name} names files that are not there: {absent}")
            # The index is a claim about the files: check it against their headers (a header read per
            # file, no tensor data), so a tensor the index misplaces fails here, not mid-load.
            by_file: dict[str, list[str]] = {}
            for name, file in self.weight_map.items():
                by_file.setdefault(file, []).append(name)
            misplaced = []
            for file, names in sorted(by_file.items()):
                with safe_open(self.path / file, framework="pt") as f:
                    held = set(f.keys())
                misplaced += [f"{n} (in {file})" for n in names if n not in held]
            if misplaced:
                raise ValueError(f"{self.path}: {index.name} places {len(misplaced)} tensor(s) in files that do not "
                                 f"hold them: {_few(sorted(misplaced))}")
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if len(files) != 1:
                raise FileNotFoundError(
                    f"{self.path}: expected model.safetensors.index.json or exactly one *.safetensors file, "
                    f"found {[f.name for f in files]}"
                )
            with safe_open(files[0], framework="pt") as f:
                self.weight_map = dict.fromkeys(f.keys(), files[0].name)
        self._safe_open = safe_open
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, object] = {}
        self.bytes_read: dict[str, int] = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _handle(self, name: str):
        if name not in self.weight_map:
            raise KeyError(f"{self.path}: tensor {name!r} is not in the checkpoint")
        file = self.weight_map[name]
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(
                self._safe_open(self.path / file, framework="pt", device="cpu"))
        return self._handles[file]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def _count(self, kind: str, t: torch.Tensor) -> torch.Tensor:
        self.bytes_read[kind] = self.bytes_read.get(kind, 0) + t.numel() * t.element_size()
        return t

    def full(self, name: str, kind: str = "other") -> torch.Tensor:
        return self._count(kind, self._handle(name).get_tensor(name))

    def narrow(self, name: str, dim: int, start: int, stop: int, kind: str = "layers") -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) [start, stop) of a tensor, reading only those."""
        sl = self._handle(name).get_slice(name)
        t = sl[start:stop] if dim == 0 else sl[:, start:stop]
        return self._count(kind, t)


class _Progress:
    def __init__(self, total: int, enabled: bool, desc: str):
        self.enabled, self.total, self.desc, self.n, self.bar = enabled, total, desc, 0, None
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=total, desc=desc, unit="layer", file=sys.stderr)

    def update(self, what: str) -> None:
        self.n += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(what, refresh=False)
            self.bar.update(1)
        else:
            print(f"{self.desc}: {self.n}/{self.total} {what}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    if attr in mod._parameters:
        mod._parameters[attr] = nn.Parameter(value, requires_grad=False)
    else:
        mod._buffers[attr] = value


def _load_replicated(model, reader: CheckpointReader, spec: HFModelSpec, dtype, device) -> None:
    """Everything outside the decoder layers, read whole; tied lm_head shares the embedding."""
    loaded: dict[str, torch.Tensor] = {}
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, p in params.items():
        if name.startswith("model.layers.") or (name == "lm_head.weight" and spec.tied_embeddings):
            continue  # tied: lm_head shares the embedding (as from_pretrained ties it), whatever the file holds
        if name in reader:
            t = reader.full(name, kind="replicated")
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"{reader.path}: {name} has shape {tuple(t.shape)}, "
                                 f"the config expects {tuple(p.shape)}")
            loaded[name] = t
        else:
            raise KeyError(f"{reader.path}: tensor {name!r} is not in the checkpoint")
    for name, t in loaded.items():
        _set_tensor(model, name, t.to(device=device, dtype=dtype))
    if spec.tied_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    rotary_tables(model)  # rebuilds the rotary module's (non-persistent) tables on CPU
    model.model.rotary_emb.to(device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()]
            if t.device.type == "meta" and not n.startswith("model.layers.")]
    if left:
        raise UnsupportedModelError(f"fusedpar.integrations.hf loader: do not know how to materialise {left}")


# Checkpoint tensors from_pretrained drops without a word, as it does (modeling_utils
# _adjust_missing_and_unexpected_keys): per-layer RoPE tables of old checkpoints, once-persistent
# position ids; plus the model class's own _keys_to_ignore_on_load_unexpected.
_IGNORED_UNEXPECTED = (r"rotary_emb\.inv_freq", r"(^|\.)position_ids$")


def _few(names: list[str], n: int = 8) -> str:
    return ", ".join(names[:n]) + (f", ... ({len(names) - n} more)" if len(names) > n else "")


def _check_keys(reader: CheckpointReader, model, spec: HFModelSpec) -> None:
    """The checkpoint's tensor names against what the config builds, before any tensor is read.

    Missing tensors fail here rather than after the layers before them were read. Unexpected ones
    fail too (from_pretrained would only warn): a tensor the config has no place for, such as a
    bias the config does not enable or a layer beyond num_hidden_layers, means the checkpoint is
    another model than the config describes, and loading without it would run that other model.
    """
    required = {n for n, _ in model.named_parameters(remove_duplicate=False) if not n.startswith("model.layers.")}
    optional = set()
    if spec.tied_embeddings:  # lm_head is the embedding, whether or not the file holds a copy
        required.discard("lm_head.weight")
        optional.add("lm_head.weight")
    shapes = weight_shapes(spec.decoder)
    required |= {f"model.layers.{i}.{LAYER_PARAMS[n]}" for i in range(spec.num_layers) for n in shapes}
    if spec.fp8 is not None:  # every projection weight's scales
        required |= {f"model.layers.{i}.{scale_key(LAYER_PARAMS[n], spec.fp8)}" for i in range(spec.num_layers)
                     for n in FP8_WEIGHTS}
    patterns = [*_IGNORED_UNEXPECTED, *(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())]
    ignored = re.compile("|".join(f"({p})" for p in patterns))
    present = set(reader.weight_map)
    missing = sorted(required - present)
    unexpected = sorted(k for k in present - required - optional if not ignored.search(k))
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensor(s) the config needs are missing: {_few(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} tensor(s) the config has no place for: {_few(unexpected)} (a bias "
                        f"the config does not enable, layers beyond num_hidden_layers={spec.num_layers}, another "
                        "architecture's names?); loading without them would run a different model")
    if problems:
        raise ValueError(f"{reader.path} does not match its config.json ({spec.architecture}, {spec.num_layers} "
                         "layers): " + "; ".join(problems))


def _resolve_dtype(dtype, config) -> torch.dtype:
    """dtype as from_pretrained takes it: a torch.dtype, its name ("bfloat16", "torch.float16"), or
    None / "auto" for the config's dtype (float32 when the config names none)."""
    if dtype is None or dtype == "auto":
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        named = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(named, torch.dtype):
            raise ValueError(f"dtype={dtype!r} names no torch dtype (pass e.g. torch.bfloat16, 'bfloat16' or 'auto')")
        dtype = named
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, its name or 'auto', got {type(dtype).__name__} {dtype!r}")
    return dtype


def _layer_shards(reader: CheckpointReader, spec: HFModelSpec, layout: ParallelLayout, rank: int, dtype, device,
                  progress: _Progress):
    """Yield ShardedDecoderWeights per layer (q/k/v bias rows included), reading only this rank's segments."""
    cfg = spec.decoder
    shard_map = layout.weight_shards(cfg.dims)
    shapes = weight_shapes(cfg)
    for i in range(spec.num_layers):
        prefix = f"model.layers.{i}."
        for n, shape in shapes.items():
            got = reader.shape(prefix + LAYER_PARAMS[n])
            if got != shape:
                raise ValueError(f"{reader.path}: {prefix + LAYER_PARAMS[n]} has shape {got}, config expects {shape}")
        base, shift = {}, {}
        for wname in WEIGHT_NAMES:
            shard = shard_map.shard(rank, wname)
            dim = shard.torch_dim
            if spec.fp8 is not None:
                base[wname] = _fp8_shard(reader, prefix, shard, spec, shapes, device)
                shift[wname] = fp8_shift_view(base[wname], shard)
                continue
            pieces = [reader.narrow(prefix + LAYER_PARAMS[seg.source], dim, seg.start, seg.stop)
                      for seg in shard.base]
            base[wname] = torch.cat(pieces, dim=dim).to(device=device, dtype=dtype).contiguous()
            del pieces
            lo, hi = shard.shift
            shift[wname] = base[wname].narrow(dim, lo, hi - lo)
        replicated = {n: reader.full(prefix + LAYER_PARAMS[n], kind="layers").to(device=device, dtype=dtype)
                      for n in REPLICATED if n in shapes}
        if cfg.qkv_bias:  # the bias entries of the qkv shard's rows, as ShardedDecoderWeights.from_full
            shard = shard_map.shard(rank, "qkv")
            pieces = [reader.narrow(prefix + LAYER_PARAMS[seg.source + "_bias"], 0, seg.start, seg.stop)
                      for seg in shard.base]
            base["qkv_bias"] = torch.cat(pieces).to(device=device, dtype=dtype).contiguous()
            lo, hi = shard.shift
            shift["qkv_bias"] = base["qkv_bias"].narrow(0, lo, hi - lo)
        yield ShardedDecoderWeights(base, shift, replicated)
        progress.update(f"layer {i}")


def _fp8_shard(reader: CheckpointReader, prefix: str, shard, spec: HFModelSpec, shapes: dict, device) -> FP8Weight:
    """A base shard of FP8 weights: each segment's e4m3 rows / columns and the scales of the tiles they
    cover, read from the checkpoint (the scales whole: a few per thousand of the weight's bytes)."""
    pieces = []
    for seg in shard.base:
        key = prefix + LAYER_PARAMS[seg.source]
        q = reader.narrow(key, shard.torch_dim, seg.start, seg.stop)
        scale = reader.full(scale_key(key, spec.fp8), kind="layers")
        pieces.append(fp8_segment(q, scale, spec.fp8, shapes[seg.source], shard.torch_dim, seg.start, key))
    joined = cat_fp8(pieces, shard.torch_dim)
    return FP8Weight(joined.q.to(device).contiguous(), joined.scale.to(device).contiguous(), joined.tile)


def _resolve_device(device) -> torch.device:
    """device as passed to load_parallel, checked against this machine before any work; None: the
    CUDA current device under NCCL, else CPU."""
    if device is None:
        if dist.is_initialized() and dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"load_parallel: device={device!r} is not a torch device ({e})") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"load_parallel: device={device!r}, but CUDA is not available on this machine "
                             "(torch.cuda.is_available() is False); pass device='cpu' (gloo process group)")
        count = torch.cuda.device_count()
        if resolved.index is not None and resolved.index >= count:
            raise ValueError(f"load_parallel: device={device!r}, but this machine has {count} CUDA device(s)")
    return resolved


def load_parallel(path: str | os.PathLike, layout: ParallelLayout, *, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None, shift_threshold: int | None = None,
                  max_seq_len: int | None = None, block_size: int = 16, progress: bool = True,
                  fused: bool | None = None, fused_max_tokens: int = 4096, cuda_graphs: bool | None = None,
                  check_inputs: bool = True):
    """Build a parallelized causal LM from a local HF checkpoint directory, reading only this rank's shards.

    Call on every rank of an initialised process group (world size = layout.world_size).
    dtype: weights' dtype, a torch.dtype or its name (default / "auto": the config's dtype, else
    float32); checkpoint tensors are converted to it. device: default CUDA current device under
    NCCL, else CPU; a device this machine lacks is refused before any work. shift_threshold /
    max_seq_len / block_size / fused / fused_max_tokens / cuda_graphs / check_inputs: as for `parallelize`
    (checked before anything is read). progress: show a progress bar on global rank 0. No network:
    `path` must be a local directory with config.json and safetensors files.
    Returns the same kind of model as `parallelize` (forward / generate as the unsharded model).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    check_arguments(shift_threshold=shift_threshold, block_size=block_size, fused=fused,
                    fused_max_tokens=fused_max_tokens, cuda_graphs=cuda_graphs,
                    check_inputs=check_inputs)  # before reading anything
    device = _resolve_device(device)
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a local checkpoint directory")
    if not (path / "config.json").is_file():  # AutoConfig would say "should have a model_type key"
        raise FileNotFoundError(f"{path} has no config.json (a transformers checkpoint directory holds config.json "
                                "and safetensors files)")
    if not dist.is_initialized():
        raise RuntimeError("load_parallel needs torch.distributed initialised (init_process_group) on every rank")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    dtype = _resolve_dtype(dtype, config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if (path / "generation_config.json").is_file():  # eos / pad ids etc., as from_pretrained would load them
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
    spec = inspect_model(model, layout, max_seq_len=max_seq_len)
    graphs_decision(fused_decision(spec, device, fused), device, cuda_graphs)
    world = dist.get_world_size()
    if world != layout.world_size:  # ParallelContext checks it too, but only after the embeddings were read
        raise ValueError(f"layout.world_size={layout.world_size} but torch.distributed world size is {world}")
    rank = dist.get_rank()
    bar = _Progress(spec.num_layers, progress and rank == 0, f"fusedpar: loading {path.name} shards (rank 0)")
    try:
        with CheckpointReader(path) as reader:
            _check_keys(reader, model, spec)
            _load_replicated(model, reader, spec, dtype, device)
            model = assemble(model, spec, layout, _layer_shards(reader, spec, layout, rank, dtype, device, bar),
                             device=device, shift_threshold=shift_threshold, block_size=block_size,
                             fused=fused, fused_max_tokens=fused_max_tokens, cuda_graphs=cuda_graphs,
                             check_inputs=check_inputs)
            model.fusedpar_load_stats = dict(reader.bytes_read)
    finally:
        bar.close()
    return model
