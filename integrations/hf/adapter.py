"""`parallelize(model, layout)`: run a transformers causal LM on fusedpar's shift-parallel layers.

What happens to the model (in place; the same object is returned):
- embeddings, final norm and lm_head stay the model's own replicated modules;
- each decoder layer's weights are cut into this rank's base shard (ShardedDecoderWeights: one
  copy, the shift-mode weights are views into it) and the HF decoder layers are dropped, so the
  full per-layer weights are freed; a ShiftParallelStack runs the layers;
- the model's class is swapped for a subclass (`ShiftParallel<Name>`) whose `forward` has the
  HF causal-LM signature and maps each call onto one fusedpar step (below). `generate` is HF's
  own, unchanged: greedy/sampling search, stopping criteria, eos/pad handling and logits
  processors are the library's code, so tokens match the unsharded model's whenever the
  logits do (the robust choice over a hand-written greedy loop). Beam search and assisted
  decoding need cache reordering / cropping and raise NotImplementedError.

How an HF call becomes a step. Every batch row is one fusedpar sequence. Tokens whose
attention_mask is 0 (left padding from a tokenizer or generate, or any other padding) never
enter the step: the real tokens of all rows are packed in row order into a StepBatch (query
length = real tokens of the row in this call, context length = real tokens of the row already
cached) and the stack runs them in base mode when there are more than `shift_threshold` of them,
shift mode otherwise. Outputs are scattered back to [batch, seq]. Padded positions get HF's values
too (its default SDPA attention; their logits mean nothing, but they are there): after the step
each one runs as a side query through every layer, attending to its row's real tokens in earlier
columns without being a key itself (right padding); one that sees no real token (left padding) has
a zero attention output in HF's SDPA, so its embedding through the layers' MLPs alone, run once per
padding token id (_fill_padding). Within a sequence fusedpar numbers real
tokens 0, 1, 2, ...: exactly what generate passes (position_ids = cumsum(attention_mask) - 1).
A plain forward without position_ids gives a left-padded row positions p, p+1, ... in HF; RoPE
attention depends only on position differences, so a constant shift per row changes nothing.
Position ids that are not consecutive within a row, or that jump between calls (right padding
followed by more tokens), would change the result and raise NotImplementedError. A sliding-window
model's window counts attention_mask columns, not real tokens: a row whose real tokens span more
columns than the window (masked columns between them) raises ValueError.
output_hidden_states (keyword or config) gives HF's L + 1 hidden states (embeddings, every
layer's output but the last, the final norm's output; a base-mode layer's rows are all-gathered
over SP for it); output_attentions raises NotImplementedError (never formed).

Generation state. `past_key_values` returned by the model is a `ShiftParallelCache` (a
transformers `Cache` subclass holding only bookkeeping: row -> sequence id, cached real tokens,
columns seen). The k/v tensors live in one core PagedKVCache per parallelized model (this
rank's kv heads only, shared by both modes, grown by doubling with PagedKVCache.grow before a
step that does not fit). A call without past_key_values (or with an empty HF cache, as generate
passes first) starts new sequences and frees the previous live ones; a call with use_cache=False
uses temporary sequences freed before it returns. Only the most recent cache can be continued,
and copies of it: `copy.deepcopy(cache)` (HF's prompt-reuse recipe) forks its sequences (new
sequences holding a copy of its k/v), freed when the next call starts new sequences, or after the
copy is garbage-collected: its blocks return to the pool at the next step that would otherwise grow
the cache, once every rank of the replica has collected it (collection comes at different steps on
different ranks, and ranks whose pools differed would grow, and recapture decode graphs, at
different steps; this way the pools stay identical with no per-step collective). A continuing
call's attention_mask must repeat, over the cached columns, the mask they were cached under (the
paged cache holds only the real tokens, while an HF cache holds every column and lets each call
re-mask it): no mask or an all-ones one after a left-padded prompt, or a cached token masked
later, raises NotImplementedError naming the row and columns.
generate(cache_implementation=...), and generate(past_key_values=<an empty HF cache>) such as
StaticCache(...), run on the paged cache as well (a static HF cache would also make generate
build 4D masks); "quantized" and a QuantizedCache are refused (they change the numerics).
save_pretrained (the checkpoint would lack the sharded decoder) and converting the parallelized
model to another dtype or device (.to / .half / ...: only the replicated modules would follow)
raise NotImplementedError. The paged cache is created and grown outside inference mode, so a
model first run under torch.inference_mode() keeps working outside it.

Decode graphs (CUDA, fused path; `cuda_graphs=`). A decode step launches ~10 kernels per layer
from Python, which on a large model costs more host time than the step's GPU work. On the fused
path a pure decode step (one new token per row, at most 64 rows and the shift threshold) replays a
CUDA graph of the whole stack (fusedpar.layers.graphs.DecodeGraphs) on the paged cache. The
graphs are captured lazily, collectively (every rank sees the same calls): at the first decode
step of a batch size not captured yet, and again when the paged cache has grown (the graphs hold
its tensors) or a context outgrows the graphs' max_context (twice the longest context, rounded
up to a power of two, at least 1024 and at most the cache's capacity: the decode attention's
split-KV tiling is chosen for it). Their padding rows use one cache block of their own. A step
with output_hidden_states runs eagerly (its layer outputs are read by hooks). Since a grow forces
a (collective) recapture, the ranks of a replica agree on every grow: each step's free-block count
is the minimum over them (one int all-reduce), as a fork may be freed earlier on one rank.

Numerics. Every model runs on the core ShiftParallelDecoderLayer: q/k/v bias (Qwen2) and a
non-default RoPE table (llama3, linear, yarn: the HF rotary module's inv_freq and
attention_scaling) are DecoderConfig fields (spec.inspect_model). On CUDA with bf16/fp16
weights the layers run on the fused kernels (ShiftParallelStack.enable_fused; `fused=`
overrides the choice); fp32 and CPU use the reference path.
"""

from __future__ import annotations

import queue
import weakref
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache, QuantizedCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from fusedpar.collectives import ParallelContext, all_gather_rows
from fusedpar.layers import (
    PagedKVCache,
    ShardedDecoderWeights,
    ShiftParallelDecoderLayer,
    ShiftParallelStack,
    ShiftPolicy,
    StepBatch,
)
from fusedpar.layers.graphs import DEFAULT_CAPTURE_SIZES, SCRATCH_SEQ_ID
from fusedpar.layouts import ParallelLayout

from .spec import HFModelSpec, UnsupportedModelError, inspect_model

__all__ = ["ShiftParallelCache", "parallelize"]


# ---- weights --------------------------------------------------------------------------------
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


# ---- generation state -----------------------------------------------------------------------
class ShiftParallelCache(Cache):
    """past_key_values of a parallelized model: bookkeeping only, the k/v live in the paged cache.

    seq_ids[i]: fusedpar sequence of batch row i; cached[i]: its real tokens in the cache;
    width: columns seen so far (what HF calls the cache's sequence length: attention masks of
    later calls are this wide plus the new tokens); offsets[i]: HF position minus fusedpar
    position of row i (constant for a valid row, see the module docstring); first_col[i]: the
    column of row i's first real token (sliding-window models only: their window counts columns);
    columns: bool [rows, width] CPU, which columns were real tokens when they were cached (a later
    call's attention_mask must repeat it over those columns: the cache holds only real tokens, so
    it can neither mask a cached token nor attend to a padding one, as an HF cache could).
    """

    def __init__(self, runtime: _Runtime, seq_ids: list[int]):
        super().__init__(layers=[])
        self._runtime = runtime
        self.seq_ids = list(seq_ids)
        self.cached = [0] * len(seq_ids)
        self.offsets: list[int | None] = [None] * len(seq_ids)
        self.first_col: list[int | None] = [None] * len(seq_ids)
        self.columns = torch.zeros((len(seq_ids), 0), dtype=torch.bool)
        self._columns_dev: torch.Tensor | None = None  # `columns` where the masks live (columns_on)
        self.width = 0
        self.released = False

    def columns_on(self, device: torch.device) -> torch.Tensor:
        """`columns` on `device`, kept there and extended with it, so that checking a decode step's
        mask copies only its new columns to the host, not the whole [rows, width] mask."""
        dev = self._columns_dev
        if dev is None or dev.device != device or dev.shape != self.columns.shape:
            dev = self._columns_dev = self.columns.to(device)
        return dev

    def _append_columns(self, new: torch.Tensor) -> None:
        self.columns = torch.cat([self.columns, new], dim=1)
        if self._columns_dev is not None:
            self._columns_dev = torch.cat([self._columns_dev, new.to(self._columns_dev.device)], dim=1)

    def __deepcopy__(self, memo):
        """copy.deepcopy(past_key_values), as HF's prompt-reuse recipe does: a fork (new sequences
        holding a copy of this cache's k/v); this cache stays as it is and can be continued too."""
        return self._runtime.fork(self)

    def __repr__(self) -> str:
        return (f"ShiftParallelCache(rows={len(self.seq_ids)}, width={self.width}, cached={self.cached}, "
                f"released={self.released})")

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.width

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return True

    @property
    def batch_size(self) -> int:
        return len(self.seq_ids)

    def release(self) -> None:
        """Free this cache's sequences in the paged cache (idempotent)."""
        if not self.released:
            self._runtime.release(self)

    def reset(self) -> None:
        self.release()

    def _unsupported(self, what: str):
        raise NotImplementedError(
            f"fusedpar.integrations.hf: {what} is not supported by the sharded KV cache "
            "(greedy and sampling generate work; beam search and assisted decoding do not)"
        )

    def update(self, *args, **kwargs):
        self._unsupported("Cache.update (running HF attention layers on this cache)")

    def reorder_cache(self, beam_idx):
        self._unsupported("reordering the cache (beam search)")

    def crop(self, tokens_to_remove):
        self._unsupported("cropping the cache (assisted decoding)")

    def batch_repeat_interleave(self, repeats):
        self._unsupported("batch_repeat_interleave")

    def batch_select_indices(self, indices):
        self._unsupported("batch_select_indices")


class _Runtime:
    """Per parallelized model: the stack, its paged cache and the live generation state."""

    def __init__(self, spec: HFModelSpec, ctx: ParallelContext, stack: ShiftParallelStack, block_size: int,
                 cuda_graphs: bool = False):
        self.spec, self.ctx, self.stack, self.block_size = spec, ctx, stack, block_size
        self.cuda_graphs = cuda_graphs  # decode steps replay CUDA graphs of the stack (_ready_graphs)
        self.graph_captures = 0
        self.kv: PagedKVCache | None = None
        self.active: ShiftParallelCache | None = None
        self.forks: weakref.WeakSet[ShiftParallelCache] = weakref.WeakSet()  # deepcopies still alive
        # sequence ids of forks garbage-collected on this rank: a finalizer may run at any allocation,
        # and SimpleQueue.put is safe there (reentrant); drained into _gone, freed by _free_collected
        self._collected: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._gone: set[int] = set()
        self._next_seq = 0
        self.replayed: int | None = None  # the decode graph size the last run() replayed, None if eager
        self.heads: dict[int, _HeadGraph] = {}  # final norm + lm_head graphs per decode graph size

    def _take_ids(self, rows: int) -> list[int]:
        ids = list(range(self._next_seq, self._next_seq + rows))
        self._next_seq += rows
        return ids

    def new_state(self, rows: int, keep: bool) -> ShiftParallelCache:
        if keep:
            # the live cache and every fork, alive or collected: the same set on every rank, freed in
            # one order, so the pools stay identical
            # strong references first: a fork collected after this snapshot would be missed by both
            # (neither live here nor drained below), and another rank would still free it
            live = [state for state in (self.active, *self.forks) if state is not None]
            ids = self._drain_collected()
            for state in live:
                if not state.released:
                    ids.update(state.seq_ids)
                    state.released = True
            self.active = None
            self._gone.clear()
            self._free(sorted(ids))
        state = ShiftParallelCache(self, self._take_ids(rows))
        if keep:
            self.active = state
        return state

    def release(self, state: ShiftParallelCache) -> None:
        self._free(state.seq_ids)
        state.released = True
        if self.active is state:
            self.active = None

    def _free(self, seq_ids: list[int]) -> None:
        if self.kv is not None:
            for sid in seq_ids:
                self.kv.free(sid)  # idempotent; ids are never reused

    def _drain_collected(self) -> set[int]:
        """_gone, with the ids of forks collected since the last call added, less the ids that hold no
        blocks any more (a fork released before it was collected): the same filter on every rank, as
        the pools are the same, and _gone stays bounded by what the cache holds."""
        while True:
            try:
                self._gone.add(self._collected.get_nowait())
            except queue.Empty:
                break
        held = self.kv.block_tables if self.kv is not None else {}
        self._gone = {sid for sid in self._gone if sid in held}
        return set(self._gone)

    def _free_collected(self) -> None:
        """Free the forks that every rank of the replica has garbage-collected (collective: called by
        every rank at the same step, when the pools, identical on all ranks, fall short)."""
        mine = sorted(self._drain_collected())
        group = self.ctx.shift
        if group.size == 1:
            common = set(mine)
        else:
            seen: list = [None] * group.size
            torch.distributed.all_gather_object(seen, mine, group=group.pg)
            common = set.intersection(*(set(x) for x in seen))
        self._gone -= common
        self._free(sorted(common))

    def fork(self, state: ShiftParallelCache) -> ShiftParallelCache:
        """A new cache with new sequences holding a copy of `state`'s k/v and bookkeeping.

        Freed like a live cache (by the next call that starts new sequences) or when the copy
        is garbage-collected (HF's recipe deep-copies a prompt cache per request)."""
        if state.released:
            raise ValueError("cannot copy a released past_key_values (a later call without past_key_values "
                             "started new sequences)")
        forked = ShiftParallelCache(self, self._take_ids(len(state.seq_ids)))
        forked.cached, forked.offsets, forked.first_col = list(state.cached), list(state.offsets), list(state.first_col)
        forked.width, forked.columns = state.width, state.columns.clone()
        rows = [i for i, n in enumerate(state.cached) if n]
        if rows:
            # the copies' slots for positions 0..n-1 (reserved like a prefill), filled from the originals'
            batch = StepBatch(tuple(forked.seq_ids[i] for i in rows), tuple(state.cached[i] for i in rows),
                              (0,) * len(rows))
            self._reserve(batch)
            kv, bs = self.kv, self.block_size
            src = []
            for i in rows:
                pos = torch.arange(state.cached[i])
                src.append(kv.block_table(state.seq_ids[i]).long()[pos // bs] * bs + pos % bs)
            src = torch.cat(src).to(kv.k.device)
            dst = kv.begin_step(batch)
            for t in (kv.k, kv.v):
                flat = t.view(t.shape[0], -1, *t.shape[3:])  # [layers, blocks * block_size, kv heads, hd]
                flat[:, dst] = flat[:, src]
        self.forks.add(forked)
        weakref.finalize(forked, _put_all, self._collected, list(forked.seq_ids))
        return forked

    def _reserve(self, batch: StepBatch, extra_blocks: int = 0) -> None:
        """Create / grow the paged cache so that `batch` (and extra_blocks more) fits. Outside inference
        mode: a cache created under torch.inference_mode() would hold inference tensors, which later
        calls outside it could not write (in-place writes to normal tensors are fine inside inference mode)."""
        with torch.inference_mode(False):
            if self.kv is None:
                tokens = sum(q + c for q, c in zip(batch.query_lens, batch.context_lens, strict=True))
                # room for the first step twice over; doubled below when a step does not fit
                blocks = max(16, 2 * (-(-tokens // self.block_size) + len(batch.seq_ids)))
                self.kv = self.stack.make_cache(block_size=self.block_size, num_blocks=blocks)
            need, kv = self.kv.blocks_needed(batch) + extra_blocks, self.kv
            # Every rank's pool is the same (the same steps, frees in call order, collected forks freed
            # together below), so all take this branch at the same step: a grow makes decode graphs
            # stale, and their recapture is collective.
            if need > kv.free_blocks:
                self._free_collected()
            if need > kv.free_blocks:  # HF calls come unplanned: grow
                kv.grow(max(2 * kv.num_blocks, kv.num_blocks - kv.free_blocks + need))

    def run(self, hidden: torch.Tensor, batch: StepBatch, *, eager: bool = False) -> torch.Tensor:
        """One stack step on the paged cache. A pure decode step of at most the largest capture size
        (and the stack's graph_token_cap) replays a CUDA graph when cuda_graphs is on, unless eager."""
        size = None if eager or not self.cuda_graphs else decode_graph_size(batch, self.stack.graph_token_cap)
        # the graphs' padding rows take one cache block (the scratch sequence), reserved with the step's
        scratch = size is not None and (self.kv is None or SCRATCH_SEQ_ID not in self.kv.block_tables)
        self._reserve(batch, extra_blocks=1 if scratch else 0)
        if size is not None:
            self._ready_graphs(batch, size)
        replays = self.stack.graph_steps
        out = self.stack(hidden, batch, self.kv, use_graphs=not eager)
        self.replayed = size if self.stack.graph_steps != replays else None
        return out

    def head_logits(self, model: nn.Module, hidden: torch.Tensor) -> torch.Tensor | None:
        """The final norm + lm_head of a step that replayed a decode graph, [b, 1, vocab], from a CUDA
        graph of those two modules for its size (None for any other step: the caller runs them). Why:
        the norm alone is ~7 eager launches per step, ~0.1 ms of host time (probe_hf_decode.py). The
        modules are replicated and collective-free, so each rank captures on its own, lazily; a graph
        is recaptured when a parameter of the two modules is no longer the tensor it captured."""
        size = self.replayed
        if size is None or hidden.dim() != 3 or hidden.shape[1] != 1 or hidden.shape[0] > size:
            return None
        norm, head = model.model.norm, model.lm_head
        if _observed(norm) or _observed(head) or torch.is_autocast_enabled(hidden.device.type):
            return None  # a replay would skip the hooks, or compute without autocast: run the modules
        params = tuple(p for m in (norm, head) for p in m.parameters())
        g = self.heads.get(size)
        if g is None or not g.holds(params) or g.inp.dtype != hidden.dtype or g.inp.shape[1] != hidden.shape[-1]:
            g = self.heads[size] = _HeadGraph(norm, head, params, size, hidden.shape[-1], hidden.dtype, hidden.device)
        return g.run(hidden)

    def _ready_graphs(self, batch: StepBatch, size: int) -> None:
        """Make the stack's decode graphs cover this step: (re)capture them when there are none, they
        lack this batch size, a context outgrew their max_context, or the cache was grown since (the
        graphs hold its tensors). Every rank sees the same calls and cache, so all capture together
        (capture is collective). max_context grows by doubling from twice the longest context: the
        decode attention's split-KV tiling is chosen for it, and a bound far above the real contexts
        would leave most of its splits empty."""
        g, need = self.stack.graphs, max(batch.context_lens) + 1
        mine = g is not None and g.cache is self.kv
        if mine and g.stale_reason() is None and size in g.sizes and need <= g.max_context:
            return
        sizes = {size} | (set(g.sizes) if mine else set())
        capacity = self.kv.num_blocks * self.block_size  # no sequence can hold more tokens than the cache
        max_context = min(capacity, max(GRAPH_MIN_CONTEXT, 1 << (2 * need - 1).bit_length(),
                                        g.max_context if mine else 0))
        # drop the old graphs (their pool and static buffers) before capturing the new ones
        del g
        self.stack.graphs = None
        self.heads.clear()
        with torch.inference_mode(False), torch.no_grad():  # static buffers: normal tensors (see _reserve)
            self.stack.capture_decode_graphs(self.kv, max_context=max_context, sizes=tuple(sorted(sizes)))
        self.graph_captures += 1


def _put_all(q: queue.SimpleQueue, items: list) -> None:
    for x in items:
        q.put(x)


def _observed(module: nn.Module) -> bool:
    """Whether forward hooks (the module's own or global ones) would see this module's calls."""
    from torch.nn.modules import module as module_mod

    return bool(module._forward_hooks or module._forward_pre_hooks or module_mod._global_forward_hooks
                or module_mod._global_forward_pre_hooks)


class _HeadGraph:
    """A CUDA graph of norm -> lm_head on static hidden states [size, d] -> logits [size, vocab]."""

    def __init__(self, norm: nn.Module, head: nn.Module, params: tuple, size: int, d: int, dtype, device):
        self.params = params  # kept alive: holds() compares identities
        self.ptrs = tuple(p.data_ptr() for p in params)
        # outside inference mode: a first decode under torch.inference_mode() must not leave an
        # inference tensor that later calls outside it cannot write (see _Runtime._reserve)
        with torch.inference_mode(False), torch.no_grad():
            self.inp = torch.zeros((size, d), dtype=dtype, device=device)
            side = torch.cuda.Stream(device=device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                head(norm(self.inp))  # warm-up outside the capture (cuBLAS handles, workspaces)
            torch.cuda.current_stream(device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = head(norm(self.inp))

    def holds(self, params: tuple) -> bool:
        return (len(params) == len(self.params) and all(a is b for a, b in zip(params, self.params, strict=True))
                and self.ptrs == tuple(p.data_ptr() for p in params))

    def run(self, hidden: torch.Tensor) -> torch.Tensor:
        b = hidden.shape[0]
        self.inp[:b].copy_(hidden.view(b, -1))
        self.graph.replay()
        return self.out[:b].clone().view(b, 1, -1)  # the static output is rewritten by the next replay


# The smallest max_context of the HF adapter's decode graphs (tokens).
GRAPH_MIN_CONTEXT = 1024


def decode_graph_size(batch: StepBatch, cap: int) -> int | None:
    """The decode graph size (DEFAULT_CAPTURE_SIZES) that runs `batch`, or None when it runs eagerly:
    not every sequence adds exactly one token, or more sequences than the largest size <= cap."""
    n = len(batch.seq_ids)
    if batch.num_tokens != n:
        return None
    return next((s for s in DEFAULT_CAPTURE_SIZES if n <= s <= cap), None)


# ---- the model ------------------------------------------------------------------------------
_IGNORED_KWARGS = ("cache_position", "return_dict")


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


def _check_positions(state: ShiftParallelCache, pos: torch.Tensor, new: torch.Tensor, q_lens: list[int]):
    """Per-row offset HF position - fusedpar position of the new real tokens; raise unless constant.

    fusedpar position of the j-th new real token of row i = state.cached[i] + j. The offset must
    be the same for all of a row's new tokens (consecutive positions) and equal to the offset its
    earlier tokens had; then RoPE attention is identical to HF's.
    """
    if new.shape[1] == 1:  # one column per row (a decode step): its offset, without tensor work
        lo = hi = [p - c for p, c in zip(pos[:, 0].tolist(), state.cached, strict=True)]
    else:
        ours = torch.tensor(state.cached, dtype=torch.long)[:, None] + new.long().cumsum(1) - 1
        off = torch.where(new, pos.long() - ours, 0)
        big = torch.iinfo(torch.long).max
        lo = torch.where(new, off, big).min(1).values.tolist()
        hi = torch.where(new, off, -big).max(1).values.tolist()
    offsets = list(state.offsets)
    for i, q in enumerate(q_lens):
        if not q:
            continue
        if lo[i] != hi[i]:
            raise NotImplementedError(
                f"row {i}: position_ids of its real tokens are not consecutive ({pos[i][new[i]].tolist()[:16]}); "
                "fusedpar numbers each sequence's tokens 0, 1, 2, ... (equal to HF up to a constant shift per row)"
            )
        if offsets[i] is not None and offsets[i] != lo[i]:
            raise NotImplementedError(
                f"row {i}: its positions shift by {lo[i] - offsets[i]} against its cached tokens (padding between "
                "real tokens, e.g. right padding followed by more tokens, or a left-padded prompt cached without "
                "position_ids and continued by generate, which numbers real tokens from 0); such a row cannot be "
                "matched"
            )
        offsets[i] = lo[i]
    return offsets


def _run_step(rt: _Runtime, state: ShiftParallelCache, embeds: torch.Tensor, attention_mask, position_ids,
              capture: bool = False, input_ids: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Pack the real new tokens of every row, run the stack, scatter back to [b, s, d]; then the
    padded positions get HF's SDPA values (_fill_padding).

    capture: also return the output of every decoder layer but the last, scattered the same way,
    for output_hidden_states; else that list is empty."""
    b, s, _ = embeds.shape
    past = state.width
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise NotImplementedError("fusedpar.integrations.hf: only 2D attention masks [batch, past + seq] "
                                      f"are supported, got shape {tuple(attention_mask.shape)}")
        if tuple(attention_mask.shape) != (b, past + s):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; expected ({b}, {past + s}) "
                             f"= (batch, {past} cached columns + {s} new)")
        # the cached columns are compared where the mask lives (one bool comes back to the host)
        if past and not torch.equal(attention_mask[:, :past].bool(), state.columns_on(attention_mask.device)):
            _check_cached_columns(state, attention_mask[:, :past].to("cpu").bool(), given=True)
        new = attention_mask[:, past:].to("cpu").bool()
    else:  # HF: every column real, the cached ones included
        if past and not bool(state.columns.all()):
            _check_cached_columns(state, torch.ones((b, past), dtype=torch.bool), given=False)
        new = torch.ones((b, s), dtype=torch.bool)
    all_real = bool(new.all())
    q_lens = [s] * b if all_real else new.sum(1).tolist()

    # HF positions of the new tokens (explicit, or what the HF model would compute).
    if position_ids is None:
        pos = (torch.arange(s) + past).expand(b, s)
    else:
        pos = position_ids.to("cpu")
        if pos.dim() == 1:
            pos = pos[None]
        if pos.dim() != 2 or pos.shape[1] != s or pos.shape[0] not in (1, b):
            raise NotImplementedError(f"position_ids of shape {tuple(position_ids.shape)} (expected [batch, {s}])")
        pos = pos.expand(b, s)
    offsets = _check_positions(state, pos, new, q_lens)
    limit, window = rt.spec.max_seq_len, rt.spec.sliding_window
    if limit is not None:
        for i in range(b):
            if state.cached[i] + q_lens[i] > limit:
                raise ValueError(
                    f"row {i} would hold {state.cached[i] + q_lens[i]} tokens, over max_seq_len={limit}"
                    + (f" (sliding_window={window}: longer sequences would leave the window)"
                       if window is not None else "")
                )
    # HF's sliding window counts attention_mask columns (key column > query column - window), not
    # real tokens: a row with masked columns between its real tokens leaves the window sooner.
    first_col = list(state.first_col)
    for i in range(b) if window is not None else ():
        if not q_lens[i]:
            continue
        real_cols = range(s) if all_real else new[i].nonzero().flatten().tolist()
        if first_col[i] is None:
            first_col[i] = past + real_cols[0]
        span = past + real_cols[-1] - first_col[i] + 1
        if span > window:
            raise ValueError(
                f"row {i}: its {state.cached[i] + q_lens[i]} real tokens span {span} attention_mask columns "
                f"(masked columns between them), over sliding_window={window}: the model's window counts "
                f"columns, and fusedpar's full attention equals it only while a row spans at most {window}"
            )

    rows = [i for i in range(b) if q_lens[i]]
    n_layers = len(rt.stack.layers)
    if all_real and s and b:  # every new column real (generate's decode steps): packed rows = embeds' rows
        batch = StepBatch(tuple(state.seq_ids), tuple(q_lens), tuple(state.cached))
        with _LayerOutputs(rt, enabled=capture) as captured:
            hidden = rt.run(embeds.reshape(b * s, -1), batch, eager=capture)
        out = hidden.to(embeds.dtype).view(b, s, -1)
        layer_outputs = [x.to(embeds.dtype).view(b, s, -1) for x in captured.outputs]
        _check_layer_outputs(capture, layer_outputs, n_layers)
    else:
        out = torch.zeros_like(embeds)
        layer_outputs = [torch.zeros_like(embeds) for _ in range(n_layers - 1)] if capture else []
    if rows and not (all_real and s and b):
        batch = StepBatch(tuple(state.seq_ids[i] for i in rows), tuple(q_lens[i] for i in rows),
                          tuple(state.cached[i] for i in rows))
        mask = new.to(embeds.device)
        with _LayerOutputs(rt, enabled=capture) as captured:
            hidden = rt.run(embeds[mask].contiguous(), batch, eager=capture)  # hooks see eager layers only
        out[mask] = hidden.to(out.dtype)
        _check_layer_outputs(capture, captured.outputs, n_layers)
        for dst, src in zip(layer_outputs, captured.outputs, strict=True):
            dst[mask] = src.to(dst.dtype)
    if not all_real:
        _fill_padding(rt, state, embeds, new, pos, offsets, input_ids, out, layer_outputs)
    for i in rows:
        state.cached[i] += q_lens[i]
    state.offsets, state.first_col = offsets, first_col
    state.width = past + s
    state._append_columns(new)
    return out, layer_outputs


def _check_layer_outputs(capture: bool, outputs: list, n_layers: int) -> None:
    if capture and len(outputs) != n_layers - 1:
        raise RuntimeError(f"fusedpar.integrations.hf: output_hidden_states: {len(outputs)} layer outputs seen, "
                           f"expected {n_layers - 1} (a step replayed as a CUDA graph?)")


def _fill_padding(rt: _Runtime, state: ShiftParallelCache, embeds: torch.Tensor, new: torch.Tensor, pos: torch.Tensor,
                  offsets: list, input_ids: torch.Tensor | None, out: torch.Tensor,
                  layer_outputs: list[torch.Tensor]) -> None:
    """Write HF's (SDPA) output at this call's padded positions into out (and layer_outputs).

    After the step every real token's k/v is cached, so each padded position runs as a side query
    (ShiftParallelDecoderLayer.side_queries): it attends to the real tokens of its row in columns
    before its own (within the sliding window, if any) and is no key itself, as in HF's SDPA, where
    its mask column is 0. A padding query that sees no real token (left padding: what generate and
    tokenizers use for decoder-only models) gets a zero attention output there, so its state is its
    embedding through the layers' MLPs alone, whatever its position: run once per token id. Runs
    after the stack, so no real position depends on it. Cost: one reference-path pass over the
    layers for the call's distinct blind ids plus every padding query that sees a real token (those
    that see the same tokens - a right-padded row's - attend in one call per layer; generate's left
    padding costs one row).
    new: [b, s] CPU bool, the call's real columns; pos: [b, s] CPU, HF position ids; offsets: HF -
    fusedpar position per row."""
    past = state.width
    real = torch.cat([state.columns, new], dim=1)
    before = F.pad(real.long().cumsum(1), (1, 0))  # before[i, c]: real columns of row i in [0, c)
    rows, cols = (~new).nonzero(as_tuple=True)
    col = past + cols
    hi = before[rows, col]
    window = rt.spec.sliding_window
    # HF's window: key column > query column - window
    lo = before[rows, (col - window + 1).clamp_min(0)] if window is not None else torch.zeros_like(hi)
    blind = hi == lo
    # queries that see a real token, one each; the blind ones, one per token id
    seeing = (~blind).nonzero().flatten()
    blind_at = blind.nonzero().flatten()
    if input_ids is not None and blind_at.numel():
        _, blind_group = torch.unique(input_ids.cpu()[rows[blind_at], cols[blind_at]], return_inverse=True)
    else:
        blind_group = torch.arange(blind_at.numel())
    n_blind = int(blind_group.max()) + 1 if blind_at.numel() else 0
    source = torch.empty(rows.numel(), dtype=torch.long)  # padded position -> row of x
    source[blind_at] = blind_group
    source[seeing] = n_blind + torch.arange(seeing.numel())
    picked = torch.empty(n_blind + seeing.numel(), dtype=torch.long)  # row of x -> a padded position
    picked[source] = torch.arange(rows.numel())  # blind duplicates hold one embedding: any may land
    visible = [(-1, 0, 0)] * n_blind
    positions = torch.zeros(n_blind + seeing.numel(), dtype=torch.long)
    for r, p in enumerate(seeing.tolist(), n_blind):
        i = int(rows[p])
        visible.append((state.seq_ids[i], int(lo[p]), int(hi[p])))
        positions[r] = int(pos[i, cols[p]]) - offsets[i]  # a row that sees a real token has an offset
    dev = embeds.device
    rows_d, cols_d = rows.to(dev), cols.to(dev)
    x = embeds[rows_d[picked.to(dev)], cols_d[picked.to(dev)]]
    source = source.to(dev)
    positions = positions.to(dev)
    for li, layer in enumerate(rt.stack.layers):
        x = layer.side_queries(x, positions, visible, rt.kv)
        if li < len(layer_outputs):
            layer_outputs[li][rows_d, cols_d] = x[source].to(layer_outputs[li].dtype)
    out[rows_d, cols_d] = x[source].to(out.dtype)


class _LayerOutputs:
    """Forward hooks on the stack's layers (all but the last) recording each one's full output [n, d]
    for the step: in base mode a layer's output is this SP rank's rows of the padded step, gathered
    here over the SP group (every rank runs the same hooks, so the collective matches)."""

    def __init__(self, rt: _Runtime, enabled: bool):
        self.rt, self.enabled, self.outputs, self.handles = rt, enabled, [], []

    def _hook(self, module, args, output):
        step = args[1]
        if step.mode == "base":
            output = all_gather_rows(output, self.rt.ctx.sp)[:step.num_tokens]
        self.outputs.append(output.clone())  # the fused path may reuse its buffers in the next layer

    def __enter__(self):
        if self.enabled:
            self.handles = [layer.register_forward_hook(self._hook) for layer in self.rt.stack.layers[:-1]]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles = []


def _check_cached_columns(state: ShiftParallelCache, seen: torch.Tensor, given: bool) -> None:
    """The attention_mask over the cached columns must be the one they were cached under.

    An HF cache keeps every column's k/v (padding included) and the mask of each call decides
    which of them attend; the paged cache keeps only the real tokens. A call that re-masks a
    cached token, or unmasks a cached padding column (e.g. no attention_mask, or an all-ones one,
    after a left-padded prompt), would attend differently in HF: refuse it rather than differ."""
    if torch.equal(seen, state.columns):
        return
    row = int((seen != state.columns).any(1).nonzero()[0])
    diff = (seen[row] != state.columns[row]).nonzero().flatten().tolist()
    now_real = [c for c in diff if seen[row, c]]
    now_pad = [c for c in diff if not seen[row, c]]
    what = []
    if now_real:
        what.append(f"marks cached padding column(s) {now_real[:8]} as real")
    if now_pad:
        what.append(f"masks cached real token column(s) {now_pad[:8]}")
    how = "" if given else " (no attention_mask: HF would take every cached column as real)"
    raise NotImplementedError(
        f"fusedpar.integrations.hf: row {row}: this call's attention_mask {' and '.join(what)}{how}; "
        f"the sharded cache holds only the tokens that were real when cached ({int(state.columns[row].sum())} of "
        f"{state.width} columns in this row) and cannot change which cached tokens attend: pass the earlier "
        "calls' attention_mask extended by the new columns"
    )


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


def check_shift_threshold(shift_threshold) -> None:
    """ShiftPolicy's check (None or an int >= 0), bools excluded: True would quietly mean threshold 1."""
    if isinstance(shift_threshold, bool):
        raise ValueError(f"shift threshold must be an int >= 0 or None, got {shift_threshold!r}")
    ShiftPolicy(shift_threshold)


def assemble(model, spec: HFModelSpec, layout: ParallelLayout, layer_shards: Iterable, *, device: torch.device,
             shift_threshold: int | None, block_size: int, fused: bool | None = False, fused_max_tokens: int = 4096,
             cuda_graphs: bool | None = None):
    """Build the stack from per-layer ShardedDecoderWeights, attach it, swap classes.

    `layer_shards` is consumed lazily, one layer at a time (parallelize frees each HF layer as
    it goes; the loader reads each layer's shards from disk). Shared by parallelize and the loader.
    """
    policy = ShiftPolicy(shift_threshold)  # validates the threshold before any collective
    use_fused = fused_decision(spec, device, fused)
    use_graphs = graphs_decision(use_fused, device, cuda_graphs)
    ctx = ParallelContext(layout, device=device)
    layers = []
    for i, weights in enumerate(layer_shards):
        layers.append(ShiftParallelDecoderLayer(spec.decoder, ctx, weights, i))
    if len(layers) != spec.num_layers:
        raise RuntimeError(f"built {len(layers)} layers, the model has {spec.num_layers}")
    stack = ShiftParallelStack(spec.decoder, ctx, layers, policy)
    if use_fused:
        stack.enable_fused(max_tokens=fused_max_tokens)  # collective; larger steps fall back per op
    inner = model.model
    inner.layers = nn.ModuleList()  # the HF layers (and any weights they still hold) are gone
    _detach_base_model(inner)
    model.__class__ = _parallel_class(type(model))
    model._fusedpar = _Runtime(spec, ctx, stack, block_size, cuda_graphs=use_graphs)
    gen_cfg = getattr(model, "generation_config", None)
    if gen_cfg is not None and getattr(gen_cfg, "cache_implementation", None) is not None:
        # a static/quantized HF cache would make generate build 4D masks for the first step;
        # the sharded paged cache replaces any HF cache anyway
        gen_cfg.cache_implementation = None
    model.eval()
    return model


def parallelize(model, layout: ParallelLayout, shift_threshold: int | None = None, *,
                max_seq_len: int | None = None, block_size: int = 16, fused: bool | None = None,
                fused_max_tokens: int = 4096, cuda_graphs: bool | None = None):
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
    block_size: page size of the KV cache.
    fused: run the decoder on the fused kernels (see fused_decision; None = auto: CUDA + bf16/fp16
        + a model the core layer computes as is). fused_max_tokens sizes their symmetric
        workspaces (steps with more tokens fall back to the plain ops per op).
    cuda_graphs: decode steps (one new token per row, at most 64 rows and the shift threshold) replay
        CUDA graphs of the decoder stack (None = auto: on the fused path; True: required). A graph is
        captured at the first decode step of a batch size (and again after the paged cache grows, or
        a context outgrows the graphs' max_context), so that step takes longer; later ones skip
        Python's per-kernel launch cost. Steps with output_hidden_states run eagerly.

    Raises UnsupportedModelError (a ValueError) naming every unsupported feature of the model or
    layout before any collective runs.
    """
    if isinstance(getattr(model, "_fusedpar", None), _Runtime):
        raise UnsupportedModelError("fusedpar.integrations.hf: this model is already parallelized")
    spec = inspect_model(model, layout, max_seq_len=max_seq_len)
    check_shift_threshold(shift_threshold)  # before any collective
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
            yield ShardedDecoderWeights.from_full(spec.decoder, layout, rank, full)
            del full
            layers[i] = nn.Identity()  # free this layer's full weights before the next one

    return assemble(model, spec, layout, shards(), device=device, shift_threshold=shift_threshold,
                    block_size=block_size, fused=fused, fused_max_tokens=fused_max_tokens, cuda_graphs=cuda_graphs)


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
