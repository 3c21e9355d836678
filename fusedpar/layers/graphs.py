"""CUDA graphs of a ShiftParallelStack's steps on the fused path: DecodeGraphs (shift mode, one token
per sequence, per batch size), PrefillGraphs (shift mode, varlen steps, per token count) and
BaseGraphs (base mode, varlen steps, per token count; see their docstrings). What follows describes
the decode graphs; the varlen graphs differ in their static inputs and padding (fill_prefill_inputs),
and base graphs also in what runs inside (each SP rank's rows in, all rows gathered out).

A decode step (every sequence adds one token) at low traffic is short enough that launching
~10 kernels per layer from Python costs as much host time as the step's GPU work (eager against
replayed steps: perf/bench_layer.py, perf/results/layer.json). DecodeGraphs captures the whole
stack once per batch size and replays it.

What is captured, per batch size B (sizes <= the policy's shift threshold, so every captured
step is a shift-mode step, and every rank captures the same graphs in the same order):
    static inputs   hidden [B, d]; int64 [2, B] = positions, cache slots; int32 = cu_seqlens_q
                    [B+1] (0..B), context_lens [B], block_tables [B, max_blocks]
    graph           for each layer: the shift-mode fused layer (the decode GEMM for qkv and
                    gate_up + SwiGLU where the routing table routes them, Triton attention with RoPE/q-k-norm/cache
                    write, one-shot GEMM + all-reduce for o and down);
                    cos/sin tables of a scaled RoPE are computed from the static positions inside
    static output   hidden [B, d]
A step of n <= B sequences uses the smallest captured B >= n. Rows n..B-1 are padding: they
point at a scratch cache block reserved at capture (position 0, context 0), so they write and
read only that block; every op is row-independent, so they never touch real rows, and their
outputs are dropped. The split-KV tiling is chosen for `max_context` (the longest context a
graph serves); shorter sequences leave trailing splits empty, which the combine step weighs 0.

Host work per replay: cache.begin_step (slots), one block-table fill, two host->device copies
from pinned staging buffers (an event guards their reuse), one device copy of the hidden states.

Limits (checked, never silent): every sequence has query length 1; contexts + 1 <= max_context;
the cache must not have been grown since capture (the graph holds its tensors); larger batches
or other steps run eagerly (ShiftParallelStack.forward routes). A new cache object over the same
memory, seen the same way (the pool reinterpreted back to these heads after a layout switch), takes
the graphs over with rebind(): no capture.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fusedpar.layers.step_plan import StepBatch
from fusedpar.layouts import StepMode

# The scratch sequence holding the padding rows' cache block. Negative: StepBatch accepts any
# int id, callers use their own non-negative request ids.
SCRATCH_SEQ_ID = -(2**62)
DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)
# token counts of PrefillGraphs (those <= the shift threshold and max_tokens are captured)
DEFAULT_PREFILL_SIZES = (128, 256, 512, 1024)


@dataclass
class _StaticStep:
    """One captured batch size: its static input/output tensors, host staging and graph."""

    size: int
    hidden: torch.Tensor  # [B, d]
    index64: torch.Tensor  # [2, B]: positions, slots
    index32: torch.Tensor  # [B+1 + B + B*max_blocks]: cu_seqlens_q, context_lens, block tables
    host64: torch.Tensor  # pinned staging of index64
    host32: torch.Tensor  # pinned staging of index32
    out: torch.Tensor | None = None
    graph: torch.cuda.CUDAGraph | None = None
    copied: torch.cuda.Event | None = None  # the staging buffers' last copy; wait before refilling
    written: list = field(default_factory=list)  # fill_decode_inputs' record of host32's table rows


def fill_decode_inputs(batch: StepBatch | None, slots: torch.Tensor | None, cache, size: int, max_blocks: int,
                       scratch_block: int, host64: torch.Tensor, host32: torch.Tensor,
                       written: list | None = None) -> None:
    """Write one decode step's graph inputs into the host staging buffers (CPU only, no device work).

    batch: n <= size sequences of one new token each; slots: their cache slots (cache.begin_step
    already ran); batch None: every row a padding row (the capture input). host64 [2, size] <-
    positions, slots; host32 <- cu_seqlens_q = 0..size, context_lens, block tables [size,
    max_blocks]. Rows n..size-1 are padding rows: position 0, the scratch block's first slot,
    context 0, block table row [scratch_block, 0, ...].

    written: what the block-table rows of these buffers hold from their previous fill (this function
    keeps it: one entry per row), or None to write every row. Consecutive decode steps mostly run
    the same sequences, whose tables change once per block_size tokens, so only changed rows are
    rewritten: a row is skipped when its sequence's cache.block_table() is the same tensor object as
    last time (the cache builds a new one whenever a table changes) and covers the same blocks.
    The host work per step stays a handful of tensor ops whatever the batch and context.
    """
    seq_ids, context_lens = (batch.seq_ids, batch.context_lens) if batch is not None else ((), ())
    n, bs = len(seq_ids), cache.block_size
    if n > size:
        raise ValueError(f"decode graph of {size} rows cannot take {n} sequences")
    if batch is not None and batch.num_tokens != n:
        raise ValueError(f"a decode graph step adds one token per sequence, got query lengths {batch.query_lens}")
    need = [(c + bs) // bs for c in context_lens]  # blocks holding context + the new token
    if n and max(need) > max_blocks:
        i = max(range(n), key=need.__getitem__)
        raise ValueError(f"sequence {seq_ids[i]} needs {need[i]} cache blocks, the decode graphs were "
                         f"captured for at most {max_blocks} ({max_blocks * bs} tokens of context)")
    pad = size - n
    # one new token per sequence: its position is its context length
    slot_list = slots.tolist() if n else []
    host64.copy_(torch.tensor([[*context_lens, *[0] * pad], [*slot_list, *[scratch_block * bs] * pad]],
                              dtype=torch.int64))
    host32[: 2 * size + 1].copy_(torch.tensor([*range(size + 1), *context_lens, *[0] * pad], dtype=torch.int32))
    tables = host32[2 * size + 1 :].view(size, max_blocks)
    if written is not None and len(written) != size:
        written[:] = [_UNKNOWN_ROW] * size
    for row in range(size):
        table, k = (cache.block_table(seq_ids[row]), need[row]) if row < n else (None, 1)
        if written is not None:
            last = written[row]
            if last is not _UNKNOWN_ROW and last[0] is table and last[1] == k:
                continue
            written[row] = (table, k)
        tables[row].zero_()
        if table is None:
            tables[row, 0] = scratch_block
        else:
            tables[row, :k] = table[:k]


# fill_decode_inputs' `written` entry of a row whose content is not known
_UNKNOWN_ROW = (object(), -1)


def _view_of(cache) -> tuple:
    """What a captured graph reads of a cache's memory: kv heads, block size, and per k / v the data
    pointer, shape, strides and dtype."""
    return (tuple(cache.kv_heads), cache.block_size,
            *((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in (cache.k, cache.v)))


def fill_prefill_inputs(batch: StepBatch | None, slots: torch.Tensor | None, cache, size: int, max_seqs: int,
                        max_blocks: int, scratch_block: int, host64: torch.Tensor, host32: torch.Tensor) -> None:
    """Write one varlen step's graph inputs into the host staging buffers (CPU only, no device work).

    batch: m <= max_seqs sequences of n <= size tokens in all; slots: their cache slots (cache.begin_step
    already ran); batch None: every row a padding row (the capture input). Layout (S = max_seqs):
    host64 [2, size] <- positions, slots; host32 <- cu_seqlens_q [S + 2], context_lens [S + 1], block
    tables [S + 1, max_blocks]. Sequences m..S-1 are empty (cu_seqlens repeats n; the attention's
    programs for them exit at once). Rows n..size-1 are the padding sequence S (context 0): position
    0, slot -1 (the cache write skips negative slots, so padding never writes the cache), a block-table
    row of nothing but the scratch block, so its attention reads only that block; its outputs are
    dropped, and every other op is row-independent, so it never touches a real row.
    """
    seq_ids = batch.seq_ids if batch is not None else ()
    m, n, bs = len(seq_ids), (batch.num_tokens if batch is not None else 0), cache.block_size
    if m > max_seqs or n > size:
        raise ValueError(f"a prefill graph of {size} tokens / {max_seqs} sequences cannot take {n} tokens of "
                         f"{m} sequences")
    if n:
        host64[0, :n] = batch.positions()
        host64[1, :n] = slots
    host64[0, n:] = 0
    host64[1, n:] = -1
    cu = host32[: max_seqs + 2]
    cu.fill_(n)
    cu[0] = 0
    cu[max_seqs + 1] = size
    ctx = host32[max_seqs + 2 : 2 * max_seqs + 3]
    ctx.zero_()
    tables = host32[2 * max_seqs + 3 :].view(max_seqs + 1, max_blocks)
    tables.zero_()
    tables[max_seqs] = scratch_block
    if not m:
        return
    q = torch.tensor(batch.query_lens, dtype=torch.int64)
    c = torch.tensor(batch.context_lens, dtype=torch.int64)
    cu[1 : m + 1] = torch.cumsum(q, 0).to(torch.int32)
    ctx[:m] = c.to(torch.int32)
    need = ((c + q + bs - 1) // bs).tolist()
    if max(need) > max_blocks:
        i = max(range(m), key=need.__getitem__)
        raise ValueError(f"sequence {seq_ids[i]} needs {need[i]} cache blocks, the prefill graphs were "
                         f"captured for at most {max_blocks} ({max_blocks * bs} tokens of context)")
    for row, (sid, k) in enumerate(zip(seq_ids, need, strict=True)):
        tables[row, :k] = cache.block_table(sid)[:k]


class _StackGraphs:
    """What decode and prefill graphs share: the checks and state of a capture (scratch block, RoPE
    frequencies, graph pool, the cache and workspaces the graphs point at), the capture itself and the
    replay/staging protocol. Subclasses say what one captured size holds (_new_step), how a step's
    inputs are staged (_fill), the metadata the captured layers read (_metadata) and which size runs a
    step (size_for). Collective: every rank constructs it with the same arguments, at the same point
    of its step sequence."""

    kind = "decode"
    mode = StepMode.SHIFT  # the mode of the steps these graphs run (BaseGraphs: StepMode.BASE)

    def _setup(self, stack, cache, *, max_context: int, sizes, max_blocks: int) -> None:
        from fusedpar.kernels.attention import AttentionMetadata
        from fusedpar.layers.decoder import needs_rope_tables

        if stack.fused is None or stack.ctx.device.type != "cuda":
            raise ValueError(f"{type(self).__name__} needs a CUDA stack on the fused path (stack.enable_fused(...) "
                             f"first)")
        sizes = tuple(sorted(set(int(s) for s in sizes)))
        if not sizes or sizes[0] < 1:
            raise ValueError(f"capture sizes must be >= 1, got {sizes}")
        if sizes[-1] > stack.fused_max_tokens:
            raise ValueError(f"{self.kind} graph size {sizes[-1]} > the fused kernels' max_tokens "
                             f"{stack.fused_max_tokens} (enable_fused(max_tokens=...))")
        sp, threshold = stack.ctx.sp.size, stack.policy.threshold
        if self.mode == StepMode.SHIFT and sp > 1 and sizes[-1] > threshold:
            raise ValueError(f"capture size {sizes[-1]} > shift threshold {threshold}: a {self.kind} step of "
                             f"{sizes[-1]} tokens runs in base mode (BaseGraphs captures those); {self.kind} "
                             f"capture sizes must be <= the threshold")
        if self.mode == StepMode.BASE:
            problems = []
            if sp < 2:
                problems.append(f"SP = {sp}: base mode is shift mode without SP (capture PrefillGraphs)")
            if sizes[0] <= threshold:
                problems.append(f"sizes {[x for x in sizes if x <= threshold]} <= shift threshold {threshold} (steps "
                                f"that small run in shift mode)")
            if any(x % sp for x in sizes):
                problems.append(f"sizes {[x for x in sizes if x % sp]} are not multiples of SP = {sp} (base mode "
                                f"splits a step's tokens evenly over SP)")
            if problems:
                raise ValueError("BaseGraphs: " + "; ".join(problems))
        if max_context < 1:
            raise ValueError(f"max_context must be >= 1, got {max_context}")
        self.stack, self.cache, self.sizes = stack, cache, sizes
        self.max_context = max_context
        self.max_blocks = max_blocks
        self.replays = 0
        self._metadata_cls = AttentionMetadata
        cfg = stack.cfg
        self._inv_freq = None
        # cos/sin tables inside the graph for scaled RoPE, and for plain RoPE past the kernel's angle range
        self._rope_tables = needs_rope_tables(cfg, max_blocks * cache.block_size)
        if self._rope_tables:
            inv = cfg.rope_inv_freq
            if inv is None:
                inv = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
            self._inv_freq = torch.as_tensor(inv, dtype=torch.float64).to(stack.ctx.device)
        # the padding rows' block: one real block of the cache, held by a scratch sequence (shared
        # by every graph set on this cache: what padding rows write there is never read as data)
        if SCRATCH_SEQ_ID not in cache.block_tables:
            cache.begin_step(StepBatch((SCRATCH_SEQ_ID,), (1,), (0,)))
        self.scratch_block = cache.block_tables[SCRATCH_SEQ_ID][0]
        self._cache_ptr = cache.k.data_ptr()
        self._cache_generation = cache.generation
        self._cache_view = _view_of(cache)
        self._fused = stack.fused  # the workspaces the graphs were captured on (kept alive with them)
        self.pool = torch.cuda.graph_pool_handle()
        self._steps: dict[int, _StaticStep] = {}
        for size in reversed(sizes):  # largest first: smaller graphs reuse its pool memory
            st = self._new_step(size)
            self._fill(None, None, st)
            st.index64.copy_(st.host64)
            st.index32.copy_(st.host32)
            self._capture(st)
            self._steps[size] = st

    def _static_step(self, size: int, rows: int, n32: int) -> _StaticStep:
        dev = self.stack.ctx.device
        return _StaticStep(
            size=size,
            hidden=torch.zeros((rows, self.stack.cfg.hidden_size), dtype=self.cache.k.dtype, device=dev),
            index64=torch.zeros((2, rows), dtype=torch.int64, device=dev),
            index32=torch.zeros(n32, dtype=torch.int32, device=dev),
            host64=torch.zeros((2, rows), dtype=torch.int64, pin_memory=True),
            host32=torch.zeros(n32, dtype=torch.int32, pin_memory=True),
        )

    # ---- capture ------------------------------------------------------------------------------
    def _run(self, st: _StaticStep) -> torch.Tensor:
        from fusedpar.kernels.reference import rope_cos_sin
        from fusedpar.layers.decoder import StepState

        stack = self.stack
        positions, slots = st.index64[0], st.index64[1]
        md = self._metadata(st)
        cfg, tables = stack.cfg, None
        if self._rope_tables:  # the table lives on the device already: no host copy inside a capture
            tables = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, torch.float32, self._inv_freq,
                                  cfg.rope_attention_scaling)
        rows = st.hidden.shape[0]
        batch = StepBatch((0,), (rows,), (0,))  # only its token count is read
        step = StepState(self.mode, batch, rows, positions, slots, md, tables)
        x = stack.layer_input(st.hidden, step)  # base mode: this SP rank's rows
        for layer in stack.layers:
            x = layer(x, step, self.cache)
        if self.mode == StepMode.BASE:
            from fusedpar.collectives.comm import all_gather_rows

            x = all_gather_rows(x, stack.ctx.sp)
        return x

    def _capture(self, st: _StaticStep) -> None:
        from fusedpar.kernels._sync import routing_as_captured

        side = torch.cuda.Stream(device=self.stack.ctx.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), routing_as_captured():
            self._run(st)  # warm-up: compiles the kernels the capture launches
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize(self.stack.ctx.device)
        st.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(st.graph, pool=self.pool):
            st.out = self._run(st)
        st.copied = torch.cuda.Event()

    # ---- replay -------------------------------------------------------------------------------
    def replay_last(self, size: int) -> None:
        """Replay the graph of `size` on its current static inputs: the last step staged for it
        again (it rewrites that step's own cache slots with the same values). For benchmarks that
        split a step's time into the graph's GPU time and the rest."""
        if size not in self._steps:
            raise ValueError(f"no {self.kind} graph of size {size} (captured sizes {self.sizes})")
        self._check_live()
        self._steps[size].graph.replay()

    def stale_reason(self) -> str | None:
        """Why a replay would touch memory the graphs no longer own (the cache was grown: new k/v
        tensors; the stack switched to other fused kernels: other workspaces; the scratch sequence
        was freed), or None while they are live."""
        if self.cache.generation != self._cache_generation or self.cache.k.data_ptr() != self._cache_ptr:
            return (f"the KV cache was grown after the {self.kind} graphs were captured: they still point "
                    f"at the old tensors; capture new {type(self).__name__} (or detach these, "
                    f"stack.graphs / stack.prefill_graphs = None, to run such steps eagerly)")
        if self.stack.fused is not self._fused:
            return (f"the stack's fused kernels changed (enable_fused) after the {self.kind} graphs were "
                    f"captured: capture new {type(self).__name__}")
        scratch = self.cache.block_tables.get(SCRATCH_SEQ_ID)
        if not scratch or scratch[0] != self.scratch_block:
            # padding rows read (and decode padding writes) that block: it may now hold a real sequence
            return (f"the {self.kind} graphs' scratch sequence (id SCRATCH_SEQ_ID = {SCRATCH_SEQ_ID}) was "
                    f"freed from the KV cache after capture, so its block {self.scratch_block} may belong "
                    f"to another sequence now: free only your own sequence ids, and capture new "
                    f"{type(self).__name__}")
        return None

    def rebind(self, cache) -> bool:
        """Point these graphs at `cache` when it shows the captured memory the same way: the same kv
        heads, block size, and k and v tensors with the captured data pointers, shapes, strides and
        dtype (e.g. the pool reinterpreted back to these heads after a KV migration, or after a switch
        to another layout and back). True when rebound (or already bound), False when `cache` is other
        memory (capture new graphs then). The scratch sequence is reserved on `cache`. The cache the
        graphs ran on before must no longer be used: its blocks now belong to `cache`."""
        if cache is self.cache:
            return True
        if _view_of(cache) != self._cache_view:
            return False
        if SCRATCH_SEQ_ID not in cache.block_tables:
            cache.begin_step(StepBatch((SCRATCH_SEQ_ID,), (1,), (0,)))
        self.cache = cache
        self.scratch_block = cache.block_tables[SCRATCH_SEQ_ID][0]
        self._cache_ptr = cache.k.data_ptr()
        self._cache_generation = cache.generation
        for st in self._steps.values():
            st.written.clear()  # the rows name the old cache's tables and scratch block: rewrite them all
        return True

    def shares_memory(self, cache) -> bool:
        """Whether `cache` lies on the memory these graphs were captured on (the same pool, seen for any
        kv heads): graphs worth keeping across a layout switch, to rebind() when their heads return."""
        return self.cache.k.untyped_storage().data_ptr() == cache.k.untyped_storage().data_ptr()

    def _check_live(self) -> None:
        reason = self.stale_reason()
        if reason is not None:
            raise RuntimeError(reason)

    def run(self, hidden: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """Replay the step of `batch` (size_for(batch) must not be None) on hidden [n, d]; returns
        [n, d], a view of the graph's static output, valid until the next replay."""
        st = self.stage(hidden, batch)
        st.graph.replay()
        self.replays += 1
        return st.out[:batch.num_tokens]

    def stage(self, hidden: torch.Tensor, batch: StepBatch) -> _StaticStep:
        """Reserve the step's cache slots and copy its inputs into the static buffers of the graph
        that will run it; returns that graph's _StaticStep (run() = stage + replay; benchmarks time
        st.graph.replay() alone)."""
        size = self.size_for(batch)
        if size is None:
            raise ValueError(f"no {self.kind} graph for {len(batch.seq_ids)} sequences / {batch.num_tokens} tokens "
                             f"(captured sizes {self.sizes}, max context {self.max_context}{self._limits()})")
        self._check_live()
        n, d = batch.num_tokens, self.stack.cfg.hidden_size
        if hidden.shape != (n, d):
            raise ValueError(f"hidden must be [{n}, {d}], got {tuple(hidden.shape)}")
        st = self._steps[size]
        slots = self.cache.begin_step(batch, device="cpu")
        st.copied.synchronize()  # the previous replay's copies have consumed the staging buffers
        self._fill(batch, slots, st)
        st.index64.copy_(st.host64, non_blocking=True)
        st.index32.copy_(st.host32, non_blocking=True)
        st.copied.record()
        st.hidden[:n].copy_(hidden)
        return st

    def _limits(self) -> str:
        return ""


class DecodeGraphs(_StackGraphs):
    """CUDA graphs of the stack's shift-mode decode step for a set of batch sizes (collective:
    every rank constructs it with the same arguments, at the same point of its step sequence).

    stack: a ShiftParallelStack with enable_fused() done; cache: the PagedKVCache the graphs will
    read and write (one scratch block is taken from it for padding rows); max_context: the
    longest context (cached + new token) any replayed sequence may have; sizes: batch sizes to
    capture (each <= the stack's shift threshold when SP > 1).
    """

    def __init__(self, stack, cache, *, max_context: int, sizes: tuple[int, ...] = DEFAULT_CAPTURE_SIZES):
        self._setup(stack, cache, max_context=max_context, sizes=sizes,
                    max_blocks=-(-max(max_context, 1) // cache.block_size))

    def _new_step(self, size: int) -> _StaticStep:
        return self._static_step(size, size, 2 * size + 1 + size * self.max_blocks)

    def _fill(self, batch: StepBatch | None, slots: torch.Tensor | None, st: _StaticStep) -> None:
        fill_decode_inputs(batch, slots, self.cache, st.size, self.max_blocks, self.scratch_block, st.host64,
                           st.host32, st.written)

    def _metadata(self, st: _StaticStep):
        size = st.size
        return self._metadata_cls(
            cu_seqlens_q=st.index32[: size + 1],
            context_lens=st.index32[size + 1 : 2 * size + 1],
            block_tables=st.index32[2 * size + 1 :].view(size, self.max_blocks),
            num_tokens=size, max_query_len=1, max_kv_len=self.max_context,
        )

    def size_for(self, batch: StepBatch) -> int | None:
        """The captured size that runs this step, or None when it must run eagerly (not a pure
        decode step, more sequences than the largest graph, or a context beyond max_context)."""
        n = len(batch.seq_ids)
        if n > self.sizes[-1] or batch.num_tokens != n or max(batch.context_lens) + 1 > self.max_context:
            return None
        return next(s for s in self.sizes if s >= n)


class PrefillGraphs(_StackGraphs):
    """CUDA graphs of the stack's shift-mode varlen step (prefill chunks, mixed prefill + decode,
    decode batches larger than the decode graphs) for a set of token counts. A step of n tokens
    replays the smallest captured size >= n, padded as fill_prefill_inputs describes.

    Why: launching a shift-mode step's ~12 kernels per layer from Python takes longer than their GPU
    work at 128-1024 tokens, so eagerly those steps run at the host's speed (the "prefill replay"
    records of perf/bench_layer.py in perf/results/layer.json against the eager ones). A replay costs
    one staging copy per step, whatever the layer count.

    stack, cache: as DecodeGraphs; sizes: token counts to capture (each <= the shift threshold when
    SP > 1, and <= enable_fused's max_tokens); max_seqs: the most sequences a replayed step may have;
    max_context: the longest context + new tokens of any replayed sequence. The attention is tiled
    for the captured size (prefill tiling, no split-KV), so a replay computes what the eager step
    does up to the order of floating-point sums.
    """

    kind = "prefill"

    def __init__(self, stack, cache, *, max_context: int, sizes: tuple[int, ...] = DEFAULT_PREFILL_SIZES,
                 max_seqs: int = 64):
        if max_seqs < 1:
            raise ValueError(f"max_seqs must be >= 1, got {max_seqs}")
        # A graph of `size` tokens launches the attention with max_seqs + 1 sequences (the padding
        # one included), some of them empty. The attention needs more tokens than that: with as many
        # tokens as sequences it takes the step for a decode batch (one token each), and with fewer it
        # refuses the launch, so a size <= max_seqs + 1 would compute wrong attention or fail to capture.
        small = [s for s in sizes if s < max_seqs + 2]
        if small:
            fix = (f"pass max_seqs <= {min(small) - 2} or larger sizes" if min(small) >= 3
                   else "sizes below 3 tokens cannot be captured")
            raise ValueError(f"prefill graph sizes {small} hold too few tokens for max_seqs={max_seqs}: each size must "
                             f"be >= max_seqs + 2 = {max_seqs + 2} (the graph's attention sees max_seqs + 1 sequences, "
                             f"some empty, and needs more tokens than sequences); {fix}")
        self.max_seqs = max_seqs
        bs = cache.block_size
        # the padding sequence's keys span up to size - 1 positions, all in the scratch block
        max_blocks = -(-max(max_context, max(sizes, default=1)) // bs)
        self._setup(stack, cache, max_context=max_context, sizes=sizes, max_blocks=max_blocks)

    def _new_step(self, size: int) -> _StaticStep:
        s = self.max_seqs
        return self._static_step(size, size, (s + 2) + (s + 1) + (s + 1) * self.max_blocks)

    def _fill(self, batch: StepBatch | None, slots: torch.Tensor | None, st: _StaticStep) -> None:
        fill_prefill_inputs(batch, slots, self.cache, st.size, self.max_seqs, self.max_blocks, self.scratch_block,
                            st.host64, st.host32)

    def _metadata(self, st: _StaticStep):
        s = self.max_seqs
        return self._metadata_cls(
            cu_seqlens_q=st.index32[: s + 2],
            context_lens=st.index32[s + 2 : 2 * s + 3],
            block_tables=st.index32[2 * s + 3 :].view(s + 1, self.max_blocks),
            num_tokens=st.size, max_query_len=st.size, max_kv_len=self.max_blocks * self.cache.block_size,
        )

    def size_for(self, batch: StepBatch) -> int | None:
        """The captured size that runs this step, or None when it must run eagerly (more tokens than
        the largest graph, more than max_seqs sequences, or a sequence longer than max_context)."""
        n = batch.num_tokens
        if n > self.sizes[-1] or len(batch.seq_ids) > self.max_seqs:
            return None
        if max(c + q for c, q in zip(batch.context_lens, batch.query_lens, strict=True)) > self.max_context:
            return None
        return next(s for s in self.sizes if s >= n)

    def _limits(self) -> str:
        return f", at most {self.max_seqs} sequences"


class BaseGraphs(PrefillGraphs):
    """CUDA graphs of the stack's base-mode (SP x TP) varlen steps, per token count: PrefillGraphs'
    static inputs, staging and padding, run as an eager base-mode step runs (this SP rank's rows of
    the step in, the Ulysses exchanges inside every layer, every rank's rows all-gathered at the end).

    Why: an eager base-mode step launches ~15 kernels per layer from Python whatever its size; at 8B
    shapes that host time exceeds the GPU work of steps of a few thousand tokens.

    sizes: token counts, each a multiple of SP and above the shift threshold (smaller steps are
    shift-mode steps); the rest as PrefillGraphs.
    """

    kind = "base"
    mode = StepMode.BASE

    def __init__(self, stack, cache, *, max_context: int, sizes: tuple[int, ...], max_seqs: int = 64):
        super().__init__(stack, cache, max_context=max_context, sizes=sizes, max_seqs=max_seqs)
