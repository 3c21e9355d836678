"""`parallelize(model, layout)`: run a transformers causal LM on fusedpar's shift-parallel layers.

What happens to the model (in place; the same object is returned):
- embeddings, final norm and lm_head stay the model's own replicated modules;
- each decoder layer's weights are cut into this rank's base shard (ShardedDecoderWeights: one
  copy, the shift-mode weights are views into it) and the HF decoder layers are dropped, so the
  full per-layer weights are freed; a ShiftParallelStack runs the layers, and the emptied base
  model's own forward raises;
- the model's class is swapped for a subclass (`ShiftParallel<Name>`) whose forward has the HF
  causal-LM signature and runs one fusedpar step per call (runtime.py). generate is HF's own
  (search, stopping criteria, logits processors), so tokens match the unsharded model's whenever
  the logits do. output_hidden_states gives HF's L + 1 hidden states.
Refused with NotImplementedError: output_attentions, beam search and assisted decoding (cache.py),
generate(max_time=...) (each rank would stop by its own clock), a quantized cache,
save_pretrained (the checkpoint would lack the sharded decoder) and converting the model's dtype
or device (.to / .half / ...: only the replicated modules would follow).
generate(cache_implementation=...) and an empty user-made HF cache run on the paged cache.

Paths, decided from the model and the arguments so every rank agrees: on CUDA with bf16/fp16
weights the layers run on the fused kernels (fused_decision) and decode steps replay CUDA graphs
(graphs_decision); fp32 and CPU use the reference path. q/k/v bias and non-default RoPE tables
are DecoderConfig fields (spec.inspect_model).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers.cache_utils import Cache, QuantizedCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from fusedpar.collectives import ParallelContext, check_agreement, tensor_checksum
from fusedpar.layers import ShardedDecoderWeights, ShiftParallelDecoderLayer, ShiftParallelStack, ShiftPolicy
from fusedpar.layouts import ParallelLayout

from .cache import ShiftParallelCache
from .calls import check_call, fingerprint
from .runtime import _run_step, _Runtime
from .spec import HFModelSpec, UnsupportedModelError, inspect_model

__all__ = ["base_shard_bytes", "parallelize", "resident_decoder_bytes"]


def full_layer_weights(layer: nn.Module, spec: HFModelSpec) -> dict[str, torch.Tensor]:
    """One HF decoder layer's weights under the core names (fusedpar.layers.config.weight_shapes)."""
    attn, mlp = layer.self_attn, layer.mlp
    full = {
        "input_norm": layer.input_layernorm.weight, "post_norm": layer.post_attention_layernorm.weight,
        "q": attn.q_proj.weight, "k": attn.k_proj.weight, "v": attn.v_proj.weight, "o": attn.o_proj.weight,
        "gate": mlp.gate_proj.weight, "up": mlp.up_proj.weight, "down": mlp.down_proj.weight,
    }
    if spec.decoder.qk_norm:
        full["q_norm"], full["k_norm"] = attn.q_norm.weight, attn.k_norm.weight
    if spec.decoder.qkv_bias:
        full["q_bias"], full["k_bias"], full["v_bias"] = attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias
    return {k: v.detach() for k, v in full.items()}


# ---- the model ------------------------------------------------------------------------------
_IGNORED_KWARGS = ("cache_position", "return_dict")
_NO_CACHE = -1  # cached columns of a call without fusedpar's cache object


class ShiftParallelCausalLMMixin:
    """forward() of a parallelized causal LM (put before the HF class in the MRO)."""

    _fusedpar: _Runtime

    @property
    def fusedpar_stack(self) -> ShiftParallelStack:
        """The ShiftParallelStack running the decoder (its `.steps` counts steps per mode)."""
        return self._fusedpar.stack

    @property
    def fusedpar_spec(self) -> HFModelSpec:
        return self._fusedpar.spec

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ):
        rt: _Runtime = self._fusedpar
        return_dict = kwargs.get("return_dict")
        loss_kwargs = {k: kwargs.pop(k) for k in ("num_items_in_batch", "ignore_index") if k in kwargs}
        # as HF: an absent (or None) flag takes the config's value
        flags = {f: kwargs.pop(f, None) for f in ("output_attentions", "output_hidden_states")}
        flags = {f: getattr(self.config, f, False) if v is None else v for f, v in flags.items()}
        if flags["output_attentions"]:
            raise NotImplementedError("fusedpar.integrations.hf: output_attentions=True is not supported (the "
                                      "attention probabilities are never formed, and live sharded over the ranks)")
        output_hidden_states = flags["output_hidden_states"]
        if not isinstance(output_hidden_states, bool):
            raise NotImplementedError(f"fusedpar.integrations.hf: output_hidden_states={output_hidden_states!r} is "
                                      "not supported (True or False: a list of layers is not)")
        extra = sorted(k for k, v in kwargs.items() if k not in _IGNORED_KWARGS and v is not None and v is not False)
        if extra:
            raise NotImplementedError(f"fusedpar.integrations.hf: forward arguments {extra} are not supported")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if use_cache is None:
            use_cache = bool(getattr(self.config, "use_cache", True))

        with torch.no_grad():
            embeds = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
            if embeds.dim() != 3:
                raise ValueError(f"expected input_ids [batch, seq] / inputs_embeds [batch, seq, hidden], got "
                                 f"{tuple(embeds.shape)}")
            b = embeds.shape[0]
            if rt.check_inputs:  # before any collective: ranks that differ raise here, together
                cached = past_key_values.width if isinstance(past_key_values, ShiftParallelCache) else _NO_CACHE
                check_call(fingerprint(batch=b, new=embeds.shape[1], cached=cached,
                                       inputs=input_ids if inputs_embeds is None else inputs_embeds,
                                       attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache,
                                       output_hidden_states=output_hidden_states, logits_to_keep=logits_to_keep,
                                       device=embeds.device), rt.ctx.shift)
            state = _resolve_state(rt, past_key_values, b, keep=use_cache)
            temporary = not use_cache and not isinstance(past_key_values, ShiftParallelCache)
            rt.replayed = None
            try:
                hidden, layer_outputs = _run_step(rt, state, embeds, attention_mask, position_ids,
                                                  capture=output_hidden_states, input_ids=input_ids)
            except BaseException:
                if temporary:
                    state.release()
                raise
            if temporary:
                state.release()
            # a decode step that replayed a graph: norm + lm_head replay one too (one column: any int
            # logits_to_keep keeps it)
            logits = rt.head_logits(self, hidden) if isinstance(logits_to_keep, int) else None
            if logits is None:
                hidden = self.model.norm(hidden)
                keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
                logits = self.lm_head(hidden[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **loss_kwargs)
        # HF's hidden_states: the embeddings, the output of every layer but the last, the final norm's output
        hidden_states = (embeds, *layer_outputs, hidden) if output_hidden_states else None
        out = CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=None if temporary else state,
                                     hidden_states=hidden_states)
        return out.to_tuple() if return_dict is False else out

    def reshard(self, layout: ParallelLayout) -> dict:
        """Switch the decoder to `layout`, one of parallelize's reshard_layouts (collective: every rank,
        same layout). The weights of every declared layout are views of what each rank holds, and
        layouts that split one replica size differently into SP x TP cache the same kv heads on the
        same ranks, so the live past_key_values stay valid and nothing moves. Returns
        {"weight_bytes_moved", "kv_bytes_moved", "seconds", "layout"}."""
        import time

        t0 = time.perf_counter()
        rt: _Runtime = self._fusedpar
        if not isinstance(layout, ParallelLayout):
            raise ValueError(f"reshard needs a ParallelLayout, got {type(layout).__name__}")
        current = rt.ctx.layout
        if layout.world_size != current.world_size:
            raise ValueError(f"reshard stays within the world of {current.world_size} ranks; {layout!r} has "
                             f"{layout.world_size} ranks")
        if layout not in rt.stacks:
            raise ValueError(f"{layout!r} was not declared: parallelize(..., reshard_layouts=...) names the layouts "
                             f"a model can switch among, here {sorted(map(repr, rt.stacks))}")
        check_agreement("fusedpar.integrations.hf: reshard", {"layout": repr(layout)})
        ctx, stack = rt.stacks[layout]
        if rt.kv is not None and tuple(stack.layers[0].kv_heads) != tuple(rt.kv.kv_heads):
            raise RuntimeError(f"rank {ctx.global_rank}: {layout!r} caches kv heads {stack.layers[0].kv_heads}, the "
                               f"live cache holds {rt.kv.kv_heads}")
        rt.ctx, rt.stack = ctx, stack
        rt.heads.clear()
        rt.replayed = None
        return {"weight_bytes_moved": 0, "kv_bytes_moved": 0, "seconds": time.perf_counter() - t0,
                "layout": repr(layout)}

    def save_pretrained(self, *args, **kwargs):
        """Refused: HF would write the embeddings, final norm and lm_head only (the decoder layers live
        in fusedpar's stack, each rank holding its shard), a checkpoint that loads with random layers."""
        raise NotImplementedError(
            "fusedpar.integrations.hf: save_pretrained of a parallelized model is not supported: its decoder "
            f"layers ({self._fusedpar.spec.num_layers}) are sharded over the ranks in fusedpar's layout and "
            "the checkpoint would hold none of them; save the model before parallelize"
        )

    def _apply(self, fn, *args, **kwargs):
        """.to() / .half() / .bfloat16() / .float() / .cuda() ...: refused when they would change the
        dtype or device. They would convert only the replicated modules (embeddings, final norm,
        lm_head), not the decoder shards (plain tensors in fusedpar's stack), leaving a model of mixed
        precision or devices. A no-op (same dtype and device) is fine."""
        rt = getattr(self, "_fusedpar", None)
        if isinstance(rt, _Runtime):
            probe = fn(torch.empty(0, dtype=rt.spec.dtype, device=rt.ctx.device))
            if probe.dtype != rt.spec.dtype or probe.device != rt.ctx.device:
                raise NotImplementedError(
                    f"fusedpar.integrations.hf: cannot convert a parallelized model from {rt.spec.dtype} on "
                    f"{rt.ctx.device} to {probe.dtype} on {probe.device} (its decoder shards are not module "
                    "parameters and would stay as they are); convert the model before parallelize"
                )
        return super()._apply(fn, *args, **kwargs)

    def _get_stopping_criteria(self, generation_config, stopping_criteria=None, *args, **kwargs):
        """max_time (generate's argument or a MaxTimeCriteria) stops each rank by its own clock, so the
        ranks of a replica could stop at different steps: one would wait forever in the next step's
        collective, or (synced_gpus) feed other tokens into the shared sums. Refused before any step."""
        from transformers.generation.stopping_criteria import MaxTimeCriteria

        if getattr(generation_config, "max_time", None) is not None or any(
                isinstance(c, MaxTimeCriteria) for c in (stopping_criteria or ())):
            raise NotImplementedError(
                "fusedpar.integrations.hf: generate(max_time=...) / MaxTimeCriteria is not supported: each rank "
                "would stop by its own clock, possibly at a different step than the other ranks of its replica, "
                "whose layers share every step's collectives; bound the length with max_new_tokens / max_length")
        return super()._get_stopping_criteria(generation_config, stopping_criteria, *args, **kwargs)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """generate(cache_implementation=...): the paged cache replaces any HF cache (a static one would
        also make generate turn the 2D mask into 4D masks, which this forward cannot read padding from),
        so generate runs as with the default cache; a quantized cache changes the logits, which the
        paged cache does not reproduce. generation_config is generate's per-call copy."""
        impl = getattr(generation_config, "cache_implementation", None)
        if impl == "quantized":
            raise NotImplementedError("fusedpar.integrations.hf: cache_implementation='quantized' is not supported "
                                      "(the sharded paged cache keeps k/v in the model's dtype)")
        if impl is not None:
            generation_config.cache_implementation = None
        past = model_kwargs.get("past_key_values")
        if isinstance(past, Cache) and not isinstance(past, ShiftParallelCache):
            _check_foreign_cache(past)
            if past.get_seq_length() == 0:
                # an empty HF cache the caller made (StaticCache(...), DynamicCache()): the paged cache
                # replaces it, as above (a static one would make generate build 4D masks)
                model_kwargs["past_key_values"] = None
        return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)


def _resolve_state(rt: _Runtime, past, rows: int, keep: bool) -> ShiftParallelCache:
    if isinstance(past, ShiftParallelCache):
        if past._runtime is not rt:
            raise ValueError("past_key_values belongs to a different parallelized model")
        if past.released:
            raise ValueError(
                "past_key_values was released: a later call without past_key_values started new sequences "
                "(a parallelized model keeps one live cache)"
            )
        if past.batch_size != rows:
            raise ValueError(f"past_key_values holds {past.batch_size} rows, this call has {rows}: rows cannot be "
                             "added, dropped or reordered")
        return past
    if isinstance(past, Cache):
        _check_foreign_cache(past)
    if past is None or (isinstance(past, Cache) and past.get_seq_length() == 0):
        return rt.new_state(rows, keep=keep)
    raise ValueError(
        f"past_key_values is a {type(past).__name__} with {past.get_seq_length() if isinstance(past, Cache) else '?'} "
        "tokens that was not produced by this parallelized model; pass None to start new sequences"
    )


def _check_foreign_cache(past: Cache) -> None:
    """An HF cache passed in (empty: it only asks for a cache) must not ask for other numerics."""
    if isinstance(past, QuantizedCache):
        raise NotImplementedError("fusedpar.integrations.hf: past_key_values=QuantizedCache(...) is not supported "
                                  "(the sharded paged cache keeps k/v in the model's dtype)")


# ---- parallelize ----------------------------------------------------------------------------
_CLASSES: dict[type, type] = {}


def _parallel_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"ShiftParallel{cls.__name__}", (ShiftParallelCausalLMMixin, cls),
                             {"__module__": __name__, "__doc__": f"{cls.__name__} on fusedpar shift-parallel layers."})
    return _CLASSES[cls]


def _detached_forward(self, *args, **kwargs):
    raise RuntimeError("this base model's decoder layers were moved into fusedpar's ShiftParallelStack by "
                       "fusedpar.integrations.hf.parallelize: call the causal LM (or its generate) instead")


_BASE_CLASSES: dict[type, type] = {}


def _detach_base_model(inner: nn.Module) -> None:
    cls = type(inner)
    if cls not in _BASE_CLASSES:
        _BASE_CLASSES[cls] = type(f"Detached{cls.__name__}", (cls,), {"forward": _detached_forward,
                                                                     "__module__": __name__})
    inner.__class__ = _BASE_CLASSES[cls]


def model_device(model: nn.Module) -> torch.device:
    devices = {p.device for p in model.parameters() if p.device.type != "meta"}
    if not devices:
        return torch.device("cpu")
    return next(iter(devices))


def fused_decision(spec: HFModelSpec, device: torch.device, fused: bool | None) -> bool:
    """Whether the stack runs on the fused kernels (Triton + symmetric memory).

    None (auto): yes on CUDA for bf16/fp16 models with a power-of-two head_dim >= 16 (q/k/v bias
    and RoPE tables included); fp32 stays on the exact reference path
    (tl.dot would use TF32). True: required, else UnsupportedModelError naming why. Decided from
    the model alone, so every rank agrees (enable_fused is collective).
    """
    if fused is not None and not isinstance(fused, bool):
        raise ValueError(f"fused must be None, True or False, got {fused!r}")
    if fused is False:
        return False
    hd = spec.decoder.head_dim
    why = []
    if device.type != "cuda":
        why.append(f"the model is on {device} (fused kernels need CUDA)")
    if hd < 16 or hd & (hd - 1):
        why.append(f"head_dim={hd} (the attention kernel needs a power of two >= 16)")
    if fused is None:
        return not why and spec.dtype in (torch.bfloat16, torch.float16)
    if why:
        raise UnsupportedModelError("fusedpar.integrations.hf: fused=True is not possible: " + "; ".join(why))
    return True


def graphs_decision(use_fused: bool, device: torch.device, cuda_graphs: bool | None) -> bool:
    """Whether decode steps replay CUDA graphs of the stack (_Runtime._ready_graphs).

    None (auto): on the fused path (which is CUDA only). True: required, else UnsupportedModelError
    naming why; False: every step eager. Decided from the model and the arguments, so every rank agrees.
    """
    if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
        raise ValueError(f"cuda_graphs must be None, True or False, got {cuda_graphs!r}")
    if cuda_graphs is None:
        return use_fused
    if cuda_graphs and not use_fused:
        raise UnsupportedModelError(
            f"fusedpar.integrations.hf: cuda_graphs=True needs the fused kernels (the graphs capture them), and "
            f"this model runs on the reference path (on {device}; see fused=): pass fused=True or cuda_graphs=None")
    return cuda_graphs


def check_arguments(*, shift_threshold, block_size, fused, fused_max_tokens, cuda_graphs, check_inputs=True) -> None:
    """The options parallelize and load_parallel share, checked before any work (no collective, no
    read): ValueError naming the value passed. The shift threshold is ShiftPolicy's check (None or an
    int >= 0) with bools excluded: True would quietly mean threshold 1."""
    if isinstance(shift_threshold, bool):
        raise ValueError(f"shift threshold must be an int >= 0 or None, got {shift_threshold!r}")
    ShiftPolicy(shift_threshold)
    if not _is_int(block_size) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1 (tokens per KV-cache page), got {block_size!r}")
    for name, value in (("fused", fused), ("cuda_graphs", cuda_graphs)):
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{name} must be None, True or False, got {value!r}")
    if not _is_int(fused_max_tokens) or fused_max_tokens < 1:
        raise ValueError(f"fused_max_tokens must be an int >= 1, got {fused_max_tokens!r}")
    if not isinstance(check_inputs, bool):
        raise ValueError(f"check_inputs must be True or False, got {check_inputs!r}")


def check_reshard_layouts(layout: ParallelLayout, reshard_layouts) -> tuple[ParallelLayout, ...]:
    """The declared layouts as a tuple; ValueError naming every one that cannot join `layout`."""
    try:
        declared = tuple(reshard_layouts)
    except TypeError:
        raise ValueError(f"reshard_layouts must be an iterable of ParallelLayout, got {reshard_layouts!r}") from None
    problems = []
    for lay in declared:
        if not isinstance(lay, ParallelLayout):
            problems.append(f"{lay!r} is not a ParallelLayout")
        elif lay.world_size != layout.world_size:
            problems.append(f"{lay!r} has {lay.world_size} ranks, the model's layout {layout.world_size}")
        elif lay.dp != 1 or layout.dp != 1:
            problems.append(f"{lay!r} with {layout!r}: data-parallel layouts (dp > 1) cannot be resharded yet")
    if problems:
        raise ValueError("reshard_layouts: " + "; ".join(problems))
    return tuple(dict.fromkeys(declared))


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def assemble(model, spec: HFModelSpec, layout: ParallelLayout, layer_shards: Iterable, *, device: torch.device,
             shift_threshold: int | None, block_size: int, fused: bool | None = False, fused_max_tokens: int = 4096,
             cuda_graphs: bool | None = None, check_inputs: bool = True,
             reshard_layouts: tuple[ParallelLayout, ...] = (), held_layout: ParallelLayout | None = None):
    """Build the stack from per-layer ShardedDecoderWeights, attach it, swap classes.

    `layer_shards` is consumed lazily, one layer at a time (parallelize frees each HF layer as
    it goes; the loader reads each layer's shards from disk). Shared by parallelize and the loader.
    With reshard_layouts, `layer_shards` are `held_layout`'s, and every layout (`layout` first)
    gets its own context and stack on views of them.
    """
    policy = ShiftPolicy(shift_threshold)  # validates the threshold before any collective
    use_fused = fused_decision(spec, device, fused)
    use_graphs = graphs_decision(use_fused, device, cuda_graphs)
    embeddings = model.get_input_embeddings().weight
    check_agreement("fusedpar.integrations.hf", {
        "layout": repr(layout), "shift_threshold": policy.threshold, "block_size": block_size,
        "max_seq_len": spec.max_seq_len, "fused": use_fused, "fused_max_tokens": fused_max_tokens,
        "cuda_graphs": use_graphs, "model": repr((type(model).__name__, spec.decoder, spec.num_layers)),
        "embedding checksum": None if embeddings.device.type == "meta" else tensor_checksum(embeddings),
        "reshard layouts": repr(list(reshard_layouts)),
    })
    layouts = [layout, *(lay for lay in reshard_layouts if lay != layout)]
    held = list(layer_shards)
    if len(held) != spec.num_layers:
        raise RuntimeError(f"built {len(held)} layers, the model has {spec.num_layers}")
    stacks = {}
    rank = torch.distributed.get_rank()
    for lay in layouts:  # the same order on every rank: each context creates its groups collectively
        ctx = ParallelContext(lay, device=device)
        weights = held if not reshard_layouts else [
            ShardedDecoderWeights.viewing(w, spec.decoder, held_layout, lay, rank) for w in held]
        stack = ShiftParallelStack(spec.decoder, ctx, [ShiftParallelDecoderLayer(spec.decoder, ctx, w, i)
                                                       for i, w in enumerate(weights)], policy)
        if use_fused:
            stack.enable_fused(max_tokens=fused_max_tokens)  # collective; larger steps fall back per op
        stacks[lay] = (ctx, stack)
    ctx, stack = stacks[layout]
    inner = model.model
    inner.layers = nn.ModuleList()  # the HF layers (and any weights they still hold) are gone
    _detach_base_model(inner)
    model.__class__ = _parallel_class(type(model))
    model._fusedpar = _Runtime(spec, ctx, stack, block_size, cuda_graphs=use_graphs, check_inputs=check_inputs)
    model._fusedpar.stacks = stacks
    gen_cfg = getattr(model, "generation_config", None)
    if gen_cfg is not None and getattr(gen_cfg, "cache_implementation", None) is not None:
        # a static/quantized HF cache would make generate build 4D masks for the first step;
        # the sharded paged cache replaces any HF cache anyway
        gen_cfg.cache_implementation = None
    model.eval()
    return model


def parallelize(model, layout: ParallelLayout, shift_threshold: int | None = None, *,
                max_seq_len: int | None = None, block_size: int = 16, fused: bool | None = None,
                fused_max_tokens: int = 4096, cuda_graphs: bool | None = None, check_inputs: bool = True,
                reshard_layouts: Iterable[ParallelLayout] = ()):
    """Shard a transformers causal LM's decoder over `layout` and run it with shift parallelism.

    Call on every rank of an initialised torch.distributed process group (world size =
    layout.world_size), each holding the same full model (same weights) on its device: CPU
    tensors run over gloo, CUDA tensors over NCCL (call torch.cuda.set_device first). Returns the
    same model object, modified in place (see the module docstring): forward and generate keep
    their signatures and give the unsharded model's logits / greedy tokens, identical on every
    rank. Afterwards do not move or cast the model (the shards are plain tensors on `device`).

    shift_threshold: steps with at most this many real tokens run in shift mode (TP over all
        sp*tp ranks of a replica), larger ones in base mode (SP x TP). None: the core default
        (fusedpar.layers.DEFAULT_SHIFT_THRESHOLD); 0: always base; a huge number: always shift.
    max_seq_len: optional per-sequence token limit; a sliding-window model defaults to (and
        accepts at most) its window, inside which windowed attention equals full attention.
    block_size: page size of the KV cache (tokens, an int >= 1).
    fused: run the decoder on the fused kernels (see fused_decision; None = auto: CUDA + bf16/fp16
        + a model the core layer computes as is). fused_max_tokens sizes their symmetric
        workspaces (steps with more tokens fall back to the plain ops per op).
    cuda_graphs: decode steps (one new token per row, at most 64 rows and the shift threshold) replay
        CUDA graphs of the decoder stack (None = auto: on the fused path; True: required). A graph is
        captured at the first decode step of a batch size (and again after the paged cache grows, or
        a context outgrows the graphs' max_context), so that step takes longer; later ones skip
        Python's per-kernel launch cost. Steps with output_hidden_states run eagerly.
    check_inputs: each forward call first checks that every rank of the replica passed the same
        inputs and settings (one small all-gather and a device-to-host copy; calls.py) and raises
        ValueError on every rank, naming what differs, instead of hanging or mixing results. False
        skips the check (ranks known to agree, e.g. fed by one scheduler).
    reshard_layouts: more layouts of the same world to switch among with `model.reshard(layout)`,
        live, mid-generation. Each rank keeps the weights of the layout with the largest SP, and
        every declared layout runs on views of them (0 bytes moved). Supported: layouts of one
        replica (dp = 1), whose SP x TP splits cache the same kv heads on the same ranks (the KV
        stays where it is); data-parallel layouts are not supported yet.

    Raises ValueError naming any argument of the wrong kind, and UnsupportedModelError (a
    ValueError) naming every unsupported feature of the model or layout, before any collective runs.
    """
    if isinstance(getattr(model, "_fusedpar", None), _Runtime):
        raise UnsupportedModelError(f"fusedpar.integrations.hf: this model ({type(model).__name__}) is already "
                                    "parallelized")
    check_arguments(shift_threshold=shift_threshold, block_size=block_size, fused=fused,
                    fused_max_tokens=fused_max_tokens, cuda_graphs=cuda_graphs, check_inputs=check_inputs)
    reshard_layouts = check_reshard_layouts(layout, reshard_layouts)
    spec = inspect_model(model, layout, max_seq_len=max_seq_len)
    for lay in reshard_layouts:
        inspect_model(model, lay, max_seq_len=max_seq_len)  # every declared layout must fit the model
    held_layout = max((layout, *reshard_layouts), key=lambda lay: lay.sp)
    if any(p.device.type == "meta" for p in model.parameters()):
        raise UnsupportedModelError("fusedpar.integrations.hf: the model has meta-device weights; "
                                    "use fusedpar.integrations.hf.load_parallel for checkpoints")
    device = model_device(model)
    graphs_decision(fused_decision(spec, device, fused), device, cuda_graphs)
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        raise RuntimeError("parallelize needs torch.distributed initialised (init_process_group) on every rank")
    rank = torch.distributed.get_rank()
    layers = model.model.layers

    def shards():
        for i in range(len(layers)):
            full = full_layer_weights(layers[i], spec)
            # base shards (+ shift views, q/k/v bias rows): copies, never views of `full`
            yield ShardedDecoderWeights.from_full(spec.decoder, held_layout, rank, full)
            del full
            layers[i] = nn.Identity()  # free this layer's full weights before the next one

    return assemble(model, spec, layout, shards(), device=device, shift_threshold=shift_threshold,
                    block_size=block_size, fused=fused, fused_max_tokens=fused_max_tokens, cuda_graphs=cuda_graphs,
                    check_inputs=check_inputs, reshard_layouts=reshard_layouts, held_layout=held_layout)


def resident_decoder_bytes(model) -> int:
    """Bytes of distinct storages behind this rank's decoder weights (base shards and q/k/v bias rows,
    their views, norms)."""
    seen: dict[int, int] = {}
    for layer in model._fusedpar.stack.layers:
        for t in (*layer.w.base.values(), *layer.w.shift.values(), *layer.w.replicated.values()):
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def base_shard_bytes(spec: HFModelSpec, layout: ParallelLayout, rank: int, element_size: int) -> int:
    """What resident_decoder_bytes must be: base shards + replicated norms (+ qkv bias rows), per layer."""
    cfg = spec.decoder
    shard_map = layout.weight_shards(cfg.dims)
    per_layer = shard_map.base_bytes(rank, cfg.hidden_size, element_size)
    per_layer += 2 * cfg.hidden_size * element_size
    if cfg.qk_norm:
        per_layer += 2 * cfg.head_dim * element_size
    if spec.qkv_bias:
        per_layer += shard_map.shard(rank, "qkv").size * element_size
    return per_layer * spec.num_layers
