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
from fusedpar.kernels.fp8 import E4M3
from fusedpar.layers import (
    ShardedDecoderWeights,
    ShiftParallelDecoderLayer,
    ShiftParallelStack,
    StepModeRule,
    weight_shapes,
)
from fusedpar.layers.fp8_weights import FP8Weight
from fusedpar.layers.kernel_choice import choose_cuda_graphs, choose_fused_kernels
from fusedpar.layouts import ParallelLayout, holdings

from .cache import ShiftParallelCache
from .fp8 import FP8_WEIGHTS, to_fp8_weight
from .runtime import _run_step, _Runtime
from .spec import LAYER_PARAMS, HFModelSpec, UnsupportedModelError, inspect_model
from .switching import check_reshard_layouts, follow_policy, held_layouts_for, reshard_runtime, share_row_parallel

__all__ = ["base_shard_bytes", "parallelize", "resident_decoder_bytes"]


def full_layer_weights(layer: nn.Module, spec: HFModelSpec) -> dict[str, torch.Tensor | FP8Weight]:
    """One HF decoder layer's weights under the core names (fusedpar.layers.config.weight_shapes); the
    projections of an FP8 model (transformers' FP8Linear: an e4m3 weight beside its scales) as FP8Weight."""
    out = {}
    for n in weight_shapes(spec.decoder):
        w = layer.get_parameter(LAYER_PARAMS[n]).detach()
        if spec.fp8 is not None and n in FP8_WEIGHTS:
            module = LAYER_PARAMS[n].removesuffix(".weight")
            scale = getattr(layer.get_submodule(module), spec.fp8.scale_name, None)
            if scale is None or w.dtype != E4M3:
                raise UnsupportedModelError(
                    f"fusedpar.integrations.hf: the config declares FP8 weights, but {module} holds a {w.dtype} "
                    f"weight{'' if scale is not None else ' and no ' + spec.fp8.scale_name} (load FP8 checkpoints "
                    "with load_parallel, or the model with transformers' FP8 quantizer on a GPU)")
            w = to_fp8_weight(w, scale.detach(), spec.fp8, tuple(w.shape), module)
        out[n] = w
    return out


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
    def fusedpar_steps(self) -> dict[str, int]:
        """Steps run per mode ("base", "shift"), summed over the stacks of every declared layout."""
        stacks = [stack for _, stack in self._fusedpar.stacks.values()] or [self._fusedpar.stack]
        return {m: sum(stack.steps[m] for stack in stacks) for m in stacks[0].steps}

    @property
    def fusedpar_reshards(self) -> list[dict]:
        """The results of the switches parallelize's `policy` made, in order (model.reshard's dicts)."""
        return self._fusedpar.reshards

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
                live = isinstance(past_key_values, ShiftParallelCache)
                cached = past_key_values.width if live else _NO_CACHE
                rt.checker.check(batch=b, new=embeds.shape[1], cached=cached,
                                 inputs=input_ids if inputs_embeds is None else inputs_embeds,
                                 attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache,
                                 output_hidden_states=output_hidden_states, logits_to_keep=logits_to_keep,
                                 decode=live and cached > 0 and embeds.shape[1] == 1, device=embeds.device)
            state = _resolve_state(rt, past_key_values, b, keep=use_cache)
            if rt.policy is not None:
                follow_policy(self, rt, state, embeds.shape[1], attention_mask)
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
        same layout), keeping the live past_key_values (and its live copies) valid.

        Weights: every declared layout runs on views of what each rank holds, so none move. KV: layouts
        of one replica size (SP x TP splits of the same P) cache the same kv heads on the same ranks,
        and nothing moves; otherwise every cached sequence goes to the replica that runs its row in
        `layout` (row_blocks) and each rank of that replica receives the kv heads it caches there
        that it did not cache before (fusedpar.layouts.kv_plan, carried out in one all_to_all_single by
        fusedpar.layers.kv_reshard.migrate_kv on the same pool memory, grown to one agreed size when a
        rank now caches more).

        Returns {"weight_bytes_moved": 0, "kv_bytes_moved": KV bytes sent over the world (the same on
        every rank), "kv_bytes_received": this rank's, "seconds", "layout"}. ValueError, before any
        collective, for a non-layout, a layout of another world size, one the model cannot be
        sharded over (naming each constraint), or one not declared."""
        return reshard_runtime(self._fusedpar, layout)

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

    def generate(self, *args, **kwargs):
        """HF's generate; before it returns, the decode calls' inputs still pending in the per-call
        check are compared (calls.py), so every generate ends checked."""
        out = super().generate(*args, **kwargs)
        rt = self._fusedpar
        if rt.check_inputs:
            rt.checker.flush()
        return out

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
    """Whether the stack runs on the fused kernels (Triton + symmetric memory): the shared rule
    (fusedpar.layers.kernel_choice) with the attention kernel's head_dim as this adapter's blocker.

    None (auto): yes on CUDA for bf16/fp16 models with a power-of-two head_dim >= 16 (q/k/v bias
    and RoPE tables included); fp32 stays on the exact reference path
    (tl.dot would use TF32). True: required, else UnsupportedModelError naming why. Decided from
    the model alone, so every rank agrees (enable_fused is collective).
    """
    hd = spec.decoder.head_dim
    blockers = [f"head_dim={hd} (the attention kernel needs a power of two >= 16)"] if hd < 16 or hd & (hd - 1) else []
    if spec.fp8 is not None:
        blockers.append(f"FP8 weights ({spec.fp8.scheme.weight} scales: the fused kernels take bf16 / fp16 weights, "
                        "FP8 layers run on the plain path)")
    return choose_fused_kernels(
        fused, device=device, dtype=spec.dtype, blockers=blockers,
        refuse=lambda why: UnsupportedModelError("fusedpar.integrations.hf: fused=True is not possible: "
                                                 + "; ".join(why)))


def graphs_decision(use_fused: bool, device: torch.device, cuda_graphs: bool | None) -> bool:
    """Whether decode steps replay CUDA graphs of the stack (_Runtime._ready_graphs): the shared rule
    (fusedpar.layers.kernel_choice).

    None (auto): on the fused path (which is CUDA only). True: required, else UnsupportedModelError
    naming why; False: every step eager. Decided from the model and the arguments, so every rank agrees.
    """
    return choose_cuda_graphs(cuda_graphs, use_fused=use_fused, refuse=lambda why: UnsupportedModelError(
        f"fusedpar.integrations.hf: cuda_graphs=True needs the fused kernels (the graphs capture them), and "
        f"this model runs on the reference path (on {device}; see fused=): pass fused=True or cuda_graphs=None"))


def check_arguments(*, shift_threshold, block_size, fused, fused_max_tokens, cuda_graphs, check_inputs=True) -> None:
    """The options parallelize and load_parallel share, checked before any work (no collective, no
    read): ValueError naming the value passed. The shift threshold is StepModeRule's check (None or an
    int >= 0) with bools excluded: True would quietly mean threshold 1."""
    if isinstance(shift_threshold, bool):
        raise ValueError(f"shift threshold must be an int >= 0 or None, got {shift_threshold!r}")
    StepModeRule(shift_threshold)
    if not _is_int(block_size) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1 (tokens per KV-cache page), got {block_size!r}")
    for name, value in (("fused", fused), ("cuda_graphs", cuda_graphs)):
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{name} must be None, True or False, got {value!r}")
    if not _is_int(fused_max_tokens) or fused_max_tokens < 1:
        raise ValueError(f"fused_max_tokens must be an int >= 1, got {fused_max_tokens!r}")
    if not isinstance(check_inputs, bool):
        raise ValueError(f"check_inputs must be True or False, got {check_inputs!r}")


def _policy_fingerprint(policy) -> str:
    """What every rank's layout policy must agree on: its class, and its repr when the class defines one
    (the policies of fusedpar.layers.layout_policy name their settings there; object's own repr would
    hold a per-process address)."""
    if policy is None:
        return "None"
    cls = type(policy)
    own = cls.__repr__ is not object.__repr__
    return f"{cls.__module__}.{cls.__qualname__}" + (f": {policy!r}" if own else "")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def assemble(model, spec: HFModelSpec, layout: ParallelLayout, layer_shards: Iterable, *, device: torch.device,
             shift_threshold: int | None, block_size: int, fused: bool | None = False, fused_max_tokens: int = 4096,
             cuda_graphs: bool | None = None, check_inputs: bool = True,
             reshard_layouts: tuple[ParallelLayout, ...] = (),
             held_layouts: dict[int, ParallelLayout] | None = None, layout_policy=None):
    """Build the stack from per-layer ShardedDecoderWeights, attach it, swap classes.

    `layer_shards` is consumed lazily, one layer at a time (parallelize frees each HF layer as
    it goes; the loader reads each layer's shards from disk). Shared by parallelize and the loader.
    With reshard_layouts, each item of `layer_shards` maps a replica size P to the weights of
    held_layouts[P] (held_layouts_for), and every layout (`layout` first) gets its own context and
    stack on views of the weights of its replica size.
    """
    policy = StepModeRule(shift_threshold)  # validates the threshold before any collective
    use_fused = fused_decision(spec, device, fused)
    use_graphs = graphs_decision(use_fused, device, cuda_graphs)
    embeddings = model.get_input_embeddings().weight
    check_agreement("fusedpar.integrations.hf", {
        "layout": repr(layout), "shift_threshold": policy.threshold, "block_size": block_size,
        "max_seq_len": spec.max_seq_len, "fused": use_fused, "fused_max_tokens": fused_max_tokens,
        "cuda_graphs": use_graphs, "model": repr((type(model).__name__, spec.decoder, spec.num_layers)),
        "embedding checksum": None if embeddings.device.type == "meta" else tensor_checksum(embeddings),
        "reshard layouts": repr(list(reshard_layouts)), "layout policy": _policy_fingerprint(layout_policy),
    })
    layouts = [layout, *(lay for lay in reshard_layouts if lay != layout)]
    held = list(layer_shards)
    if len(held) != spec.num_layers:
        raise RuntimeError(f"built {len(held)} layers, the model has {spec.num_layers}")
    stacks = {}
    rank = torch.distributed.get_rank()
    for lay in layouts:  # the same order on every rank: each context creates its groups collectively
        ctx = ParallelContext(lay, device=device, host_groups=check_inputs)
        P = lay.replica_size
        weights = held if not reshard_layouts else [
            ShardedDecoderWeights.viewing(w[P], spec.decoder, held_layouts[P], lay, rank) for w in held]
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
    model._fusedpar.policy = layout_policy
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
                reshard_layouts: Iterable[ParallelLayout] = (), policy=None):
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
        inputs and settings (shapes over a host exchange before any collective, input hashes over a
        device all-gather, compared two calls later in decode steps; calls.py) and raises ValueError
        on every rank, naming what differs, instead of hanging or mixing results. False skips the
        check (ranks known to agree, e.g. fed by one scheduler).
    reshard_layouts: more layouts of the same world to switch among with `model.reshard(layout)`,
        live, mid-generation (TP, SP, DP and their mixes). Each rank keeps, per replica size P among
        the declared layouts, the weights of the one with the largest SP (held_layouts_for), and
        every declared layout runs on views of them: switching moves no weight bytes. One replica
        size costs one shard (SP x TP splits of P share it); a pure DP layout (P = 1) costs the full
        weights; several replica sizes cost one qkv and gate_up shard per size and the union of
        their o and down columns once (switching.share_row_parallel).

    policy: switches layouts by itself, per forward call (so per generate step): an object with
        `layouts` (the ParallelLayouts it may choose, declared here with reshard_layouts) and
        `decide(facts, current) -> layout` (fusedpar.layers.layout_policy: LoadPolicy for DP <-> TP,
        ShiftThresholdPolicy, AutoPolicy, or any object with these two). Before each call's step the
        model builds the call's StepFacts (step_facts: its real new tokens, rows running and
        starting, no host KV tier, so PrefillDecodePolicy, which needs one, raises its ValueError),
        asks the policy, and calls model.reshard when the answer differs from the current layout;
        the results collect in model.fusedpar_reshards.

    Data parallelism (layout.dp > 1): every rank passes the whole batch; replica d runs the
    contiguous block of rows runtime.row_blocks(batch, dp)[d] (sizes differ by at most one, the
    first replicas taking the extra rows; with fewer rows than replicas the last replicas idle), and
    every rank returns the whole batch's logits (the rows are summed over the DP group). The
    per-call check then spans every rank of the world.

    Raises ValueError naming any argument of the wrong kind, and UnsupportedModelError (a
    ValueError) naming every unsupported feature of the model or layout, before any collective runs.
    """
    if isinstance(getattr(model, "_fusedpar", None), _Runtime):
        raise UnsupportedModelError(f"fusedpar.integrations.hf: this model ({type(model).__name__}) is already "
                                    "parallelized")
    check_arguments(shift_threshold=shift_threshold, block_size=block_size, fused=fused,
                    fused_max_tokens=fused_max_tokens, cuda_graphs=cuda_graphs, check_inputs=check_inputs)
    reshard_layouts = check_reshard_layouts(layout, reshard_layouts)
    if policy is not None:
        if not callable(getattr(policy, "decide", None)) or not hasattr(policy, "layouts"):
            raise ValueError(f"policy must have decide(facts, current) and layouts (fusedpar.layers.layout_policy), "
                             f"got {policy!r}")
        reshard_layouts = check_reshard_layouts(layout, (*reshard_layouts, *policy.layouts))
        if layout not in tuple(policy.layouts):
            raise ValueError(f"the policy chooses among {list(policy.layouts)}; the model starts in {layout!r}, "
                             "which is not one of them")
    spec = inspect_model(model, layout, max_seq_len=max_seq_len)
    if spec.fp8 is not None and reshard_layouts:
        raise UnsupportedModelError("fusedpar.integrations.hf: live re-sharding (reshard_layouts / policy) of FP8 "
                                    f"weights ({spec.fp8.scheme.weight} scales); parallelize FP8 models in one layout")
    for lay in reshard_layouts:
        inspect_model(model, lay, max_seq_len=max_seq_len)  # every declared layout must fit the model
    held_layouts = held_layouts_for((layout, *reshard_layouts))
    if any(p.device.type == "meta" for p in model.parameters()):
        raise UnsupportedModelError("fusedpar.integrations.hf: the model has meta-device weights; "
                                    "use fusedpar.integrations.hf.load_parallel for checkpoints")
    device = model_device(model)
    graphs_decision(fused_decision(spec, device, fused), device, cuda_graphs)
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        raise RuntimeError("parallelize needs torch.distributed initialised (init_process_group) on every rank")
    rank = torch.distributed.get_rank()
    layers = model.model.layers

    union = holdings(list(held_layouts.values()), spec.decoder.dims)[rank] if len(held_layouts) > 1 else None

    def shards():
        for i in range(len(layers)):
            full = full_layer_weights(layers[i], spec)
            # base shards (+ shift views, q/k/v bias rows): copies, never views of `full`
            if not reshard_layouts:
                yield ShardedDecoderWeights.from_full(spec.decoder, layout, rank, full)
            else:
                per = {P: ShardedDecoderWeights.from_full(spec.decoder, lay, rank, full)
                       for P, lay in held_layouts.items()}
                if union is not None:
                    share_row_parallel(per, held_layouts, union, spec, rank, full)
                yield per
            del full
            layers[i] = nn.Identity()  # free this layer's full weights before the next one

    model = assemble(model, spec, layout, shards(), device=device, shift_threshold=shift_threshold,
                     block_size=block_size, fused=fused, fused_max_tokens=fused_max_tokens, cuda_graphs=cuda_graphs,
                     check_inputs=check_inputs, reshard_layouts=reshard_layouts, held_layouts=held_layouts,
                     layout_policy=policy)
    return model


def resident_decoder_bytes(model) -> int:
    """Bytes of distinct storages behind this rank's decoder weights (base shards and q/k/v bias rows,
    their views, norms), over the stacks of every declared layout."""
    seen: dict[int, int] = {}
    stacks = [stack for _, stack in model._fusedpar.stacks.values()] or [model._fusedpar.stack]
    for layer in (layer for stack in stacks for layer in stack.layers):
        for w in (*layer.w.base.values(), *layer.w.shift.values(), *layer.w.replicated.values()):
            for t in ((w.q, w.scale) if isinstance(w, FP8Weight) else (w,)):
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
