"""The per-model runtime of a parallelized HF model: one fusedpar step per forward call.

_Runtime holds the ShiftParallelStack, its PagedKVCache (created at the first step, grown by
doubling before a step that does not fit) and the live generation state (cache.py). _run_step maps
a call onto a step: every batch row is one fusedpar sequence; the real new tokens of all rows are
packed in row order into a StepBatch (query length = the row's real tokens in this call, context
length = its real tokens already cached), run in base mode above the shift threshold and in shift
mode otherwise, and scattered back to [batch, seq]; padded positions are filled after (padding.py).

Decode graphs (CUDA, fused path, cuda_graphs on): a pure decode step (one new token per row, at
most 64 rows and the shift threshold) replays a CUDA graph of the whole stack
(fusedpar.layers.graphs.DecodeGraphs) on the paged cache, and one of the final norm + lm_head
(_HeadGraph). Captures are lazy and collective: at the first decode step of a batch size not
captured yet, after the paged cache grew (the graphs hold its tensors), or when a context outgrows
the graphs' max_context (twice the longest context rounded up to a power of two, at least
GRAPH_MIN_CONTEXT, at most the cache's capacity). A grow forces a recapture, so the ranks of a
replica grow at the same step: their pools stay identical (the same steps, frees in call order,
collected forks freed together). Steps with output_hidden_states run eagerly.

Data parallelism (layout.dp > 1): every rank receives the whole batch, and replica d runs the
contiguous block row_blocks(b, dp)[d] of its rows (the first b % dp replicas take one row more; a
batch of fewer rows than replicas leaves the last replicas without rows, which skip the stack).
Every rank keeps the bookkeeping of every row (ShiftParallelCache) and checks every row's padding
and positions, so an invalid row raises on all ranks together; the paged cache of a replica holds
its own rows' sequences only. After the step each rank's output has its replica's rows and zeros
elsewhere, and one sum over the DP group (exact: every other term is zero) gives every rank the
whole batch, so norm, lm_head and the logits are the same on every rank.
"""

from __future__ import annotations

import queue
import weakref

import torch
from torch import nn

from fusedpar.collectives import CommGroup, ParallelContext, all_gather_rows, all_reduce_sum
from fusedpar.layers import PagedKVCache, ShiftParallelStack, StepBatch
from fusedpar.layers.graphs import DEFAULT_CAPTURE_SIZES, SCRATCH_SEQ_ID
from fusedpar.layouts import StepMode

from .cache import ShiftParallelCache
from .calls import CallChecker
from .padding import _check_limits, _check_positions, _fill_padding, _hf_positions, _real_columns
from .spec import HFModelSpec

# The smallest max_context of the decode graphs (tokens).
GRAPH_MIN_CONTEXT = 1024


def row_blocks(rows: int, dp: int) -> list[range]:
    """The batch rows of each of `dp` replicas: contiguous blocks in replica order, sizes differing by
    at most one (the first rows % dp replicas take one more); a replica may get none (rows < dp)."""
    q, r = divmod(rows, dp)
    starts = [d * q + min(d, r) for d in range(dp + 1)]
    return [range(starts[d], starts[d + 1]) for d in range(dp)]


def world_group() -> CommGroup:
    """Every rank of the default process group, as a CommGroup (the per-call check of DP layouts)."""
    dist = torch.distributed
    world = dist.get_world_size()
    return CommGroup(ranks=tuple(range(world)), rank=dist.get_rank(), pg=dist.group.WORLD if world > 1 else None)


class _Runtime:
    """Per parallelized model: the stack, its paged cache and the live generation state."""

    def __init__(self, spec: HFModelSpec, ctx: ParallelContext, stack: ShiftParallelStack, block_size: int,
                 cuda_graphs: bool = False, check_inputs: bool = True):
        self.spec, self.ctx, self.stack, self.block_size = spec, ctx, stack, block_size
        self.check_inputs = check_inputs  # forward's per-call agreement check (calls.py)
        self._checker: CallChecker | None = None
        self.stacks: dict = {}  # layout -> (ctx, stack): the layouts model.reshard switches among
        self.policy = None  # parallelize's layout policy: decide(facts, current) before every call
        self.reshards: list[dict] = []  # the results of the policy's switches
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
        self.staging = None  # KV migrations' symmetric staging (switching._staging), made at the first one

    def local_rows(self, rows: int) -> range:
        """The rows of a `rows`-row batch this rank's replica runs (all of them when dp = 1)."""
        layout = self.ctx.layout
        return row_blocks(rows, layout.dp)[self.ctx.coords.dp]

    @property
    def call_group(self) -> CommGroup:
        """The ranks that must make the same forward calls: the replica, or the world under DP."""
        return self.ctx.shift if self.ctx.layout.dp == 1 else world_group()

    @property
    def checker(self) -> CallChecker:
        """The per-call check of the current layout's call group (a switch first compares the calls
        still pending on the previous group's checker)."""
        group = self.call_group
        current = self._checker
        if current is None or current.group.ranks != group.ranks or current.group.pg is not group.pg:
            if current is not None:
                current.flush()
            current = self._checker = CallChecker(group, self.ctx.host(group), self.ctx.timeout)
        return current

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
        local = self.local_rows(len(state.seq_ids))
        rows = [i for i in local if state.cached[i]]
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
        the norm alone is ~7 eager launches per step, host time a replayed step would otherwise pay. The
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
        mine = g is not None and g.rebind(self.kv)  # a switch back to this layout's view of the pool: kept
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


def decode_graph_size(batch: StepBatch, cap: int) -> int | None:
    """The decode graph size (DEFAULT_CAPTURE_SIZES) that runs `batch`, or None when it runs eagerly:
    not every sequence adds exactly one token, or more sequences than the largest size <= cap."""
    n = len(batch.seq_ids)
    if batch.num_tokens != n:
        return None
    return next((s for s in DEFAULT_CAPTURE_SIZES if n <= s <= cap), None)


def _run_step(rt: _Runtime, state: ShiftParallelCache, embeds: torch.Tensor, attention_mask, position_ids,
              capture: bool = False, input_ids: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Pack the real new tokens of every row, run the stack, scatter back to [b, s, d]; then the
    padded positions get HF's SDPA values (_fill_padding).

    capture: also return the output of every decoder layer but the last, scattered the same way,
    for output_hidden_states; else that list is empty."""
    b, s, _ = embeds.shape
    past = state.width
    new = _real_columns(state, attention_mask, b, s)
    all_real = bool(new.all())
    q_lens = [s] * b if all_real else new.sum(1).tolist()
    pos = _hf_positions(position_ids, b, s, past)
    offsets = _check_positions(state, pos, new, q_lens)
    first_col = _check_limits(rt.spec, state, new, q_lens, all_real)

    local = rt.local_rows(b)
    lo, hi = local.start, local.stop
    rows = [i for i in local if q_lens[i]]
    n_layers = len(rt.stack.layers)
    # every new column real (generate's decode steps): the packed rows are embeds' rows
    dense = bool(all_real and s and hi > lo)
    if dense and hi - lo == b:
        batch = StepBatch(tuple(state.seq_ids), tuple(q_lens), tuple(state.cached))
        with _LayerOutputs(rt, enabled=capture) as captured:
            hidden = rt.run(embeds.reshape(b * s, -1), batch, eager=capture)
        out = hidden.to(embeds.dtype).view(b, s, -1)
        layer_outputs = [x.to(embeds.dtype).view(b, s, -1) for x in captured.outputs]
        _check_layer_outputs(capture, layer_outputs, n_layers)
    else:
        out = torch.zeros_like(embeds)
        layer_outputs = [torch.zeros_like(embeds) for _ in range(n_layers - 1)] if capture else []
    if dense and hi - lo < b:  # this replica's block of an all-real call
        batch = StepBatch(tuple(state.seq_ids[lo:hi]), tuple(q_lens[lo:hi]), tuple(state.cached[lo:hi]))
        with _LayerOutputs(rt, enabled=capture) as captured:
            hidden = rt.run(embeds[lo:hi].reshape((hi - lo) * s, -1), batch, eager=capture)
        out[lo:hi] = hidden.to(out.dtype).view(hi - lo, s, -1)
        _check_layer_outputs(capture, captured.outputs, n_layers)
        for dst, src in zip(layer_outputs, captured.outputs, strict=True):
            dst[lo:hi] = src.to(dst.dtype).view(hi - lo, s, -1)
    elif rows and not dense:
        batch = StepBatch(tuple(state.seq_ids[i] for i in rows), tuple(q_lens[i] for i in rows),
                          tuple(state.cached[i] for i in rows))
        mask = new.clone()
        mask[:lo], mask[hi:] = False, False
        mask = mask.to(embeds.device)
        with _LayerOutputs(rt, enabled=capture) as captured:
            hidden = rt.run(embeds[mask].contiguous(), batch, eager=capture)  # hooks see eager layers only
        out[mask] = hidden.to(out.dtype)
        _check_layer_outputs(capture, captured.outputs, n_layers)
        for dst, src in zip(layer_outputs, captured.outputs, strict=True):
            dst[mask] = src.to(dst.dtype)
    if not all_real and hi > lo:
        _fill_padding(rt, state, embeds, new, pos, offsets, input_ids, out, layer_outputs, local)
    if rt.ctx.layout.dp > 1:  # every replica's rows to every rank (the other terms are zeros)
        for t in (out, *layer_outputs):
            all_reduce_sum(t, rt.ctx.dp)
    for i in range(b):  # every row's bookkeeping, the other replicas' rows included
        state.cached[i] += q_lens[i]
    state.offsets, state.first_col = offsets, first_col
    state.width = past + s
    state._append_columns(new)
    return out, layer_outputs


def _check_layer_outputs(capture: bool, outputs: list, n_layers: int) -> None:
    if capture and len(outputs) != n_layers - 1:
        raise RuntimeError(f"fusedpar.integrations.hf: output_hidden_states: {len(outputs)} layer outputs seen, "
                           f"expected {n_layers - 1} (a step replayed as a CUDA graph?)")


class _LayerOutputs:
    """Forward hooks on the stack's layers (all but the last) recording each one's full output [n, d]
    for the step: in base mode a layer's output is this SP rank's rows of the padded step, gathered
    here over the SP group (every rank runs the same hooks, so the collective matches)."""

    def __init__(self, rt: _Runtime, enabled: bool):
        self.rt, self.enabled, self.outputs, self.handles = rt, enabled, [], []

    def _hook(self, module, args, output):
        step = args[1]
        if step.mode == StepMode.BASE:
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
