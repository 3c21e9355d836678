"""A stack of shift-parallel decoder layers with the per-step mode switch (Algorithm 3).

Input and output are the full hidden states [n, d], identical on every rank of a replica (as
an embedding lookup and a sampler see them). Base mode slices this SP rank's rows of the
padded step on the way in and all-gathers them on the way out; shift mode runs on all rows.
With capture_decode_graphs(), shift-mode decode steps that fit a captured batch size replay a
CUDA graph of the whole stack (fusedpar.layers.graphs); with capture_prefill_graphs(), so do the
other shift-mode steps (prefill chunks, mixed batches) that fit a captured token count. Every
other step runs eagerly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fusedpar.collectives import ParallelContext, all_gather_rows
from fusedpar.layers.comm import FusedComm, PlainComm
from fusedpar.layers.config import DecoderConfig
from fusedpar.layers.decoder import ShiftParallelDecoderLayer, StepState, needs_rope_tables, rope_tables
from fusedpar.layers.fp8_weights import FP8Weight, fused_fp8_problems
from fusedpar.layers.graphs import SCRATCH_SEQ_ID
from fusedpar.layers.kv_cache import PagedKVCache
from fusedpar.layers.step_plan import StepBatch, StepModeRule, padded_token_count
from fusedpar.layouts import StepMode, check_mode


class ShiftParallelStack(nn.Module):
    def __init__(self, cfg: DecoderConfig, ctx: ParallelContext, layers: list[ShiftParallelDecoderLayer],
                 policy: StepModeRule | None = None):
        super().__init__()
        self.cfg, self.ctx = cfg, ctx
        self.layers = nn.ModuleList(layers)
        self.policy = policy or StepModeRule()
        self.steps = {StepMode.BASE: 0, StepMode.SHIFT: 0}
        self.fused: FusedComm | PlainComm | None = None  # the fused path's communicator (enable_fused)
        self.fused_max_tokens = 0  # enable_fused's max_tokens: the fused workspaces' and graphs' largest step
        self.graphs = None  # DecodeGraphs, once captured
        self.prefill_graphs = None  # PrefillGraphs, once captured
        self.base_graphs = None  # BaseGraphs (base-mode steps), once captured
        self.graph_steps = 0  # steps that replayed a graph of any kind

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype of the layers' weights (of their norms, for FP8 weights): what the hidden states and the KV
        cache must hold."""
        w = self.layers[0].w
        return w.replicated["input_norm"].dtype if isinstance(w.base["qkv"], FP8Weight) else w.base["qkv"].dtype

    def enable_fused(self, *, max_tokens: int, comm: FusedComm | PlainComm | None = None) -> ShiftParallelStack:
        """Switch the layers to the Triton path (norms, paged attention; CUDA only) with the communicator
        `comm` for its stages, by default a FusedComm whose symmetric workspaces fit steps of up to
        max_tokens tokens (larger ones fall back per stage). A benchmark's baseline passes its own
        communicator: comm=PlainComm(ctx) runs cuBLAS + NCCL around the same Triton attention and norms.
        max_tokens also bounds the captured graphs' sizes. Collective: every rank.
        CUDA graphs captured before belong to the old communicator: they are dropped (capture again)."""
        fp8 = sorted({name for layer in self.layers for name, w in layer.w.base.items() if isinstance(w, FP8Weight)})
        if fp8 and not isinstance(comm, PlainComm) and self.ctx.device.type == "cuda":
            raise ValueError(f"FP8 weights ({', '.join(fp8)}) run on the plain GEMMs on CUDA: enable_fused(..., "
                             "comm=PlainComm(ctx)); the fused kernels' e4m3 variants are not enabled on CUDA")
        if not isinstance(comm, PlainComm):
            problems = sorted({f"{mode} {name}: {p}" for layer in self.layers for mode, ws in (("base", layer.w.base),
                               ("shift", layer.w.shift)) for name, w in ws.items() if isinstance(w, FP8Weight)
                               for p in fused_fp8_problems(w)})
            if problems:
                raise ValueError("the fused kernels do not take these FP8 weights (enable_fused(..., "
                                 "comm=PlainComm(ctx)) runs them on the plain GEMMs): " + "; ".join(problems))
        self.graphs = self.prefill_graphs = None
        if comm is None:
            comm = FusedComm(self.ctx, self.cfg, max_tokens=max_tokens, dtype=self.weight_dtype)
        elif isinstance(comm, FusedComm) and comm.max_tokens != max_tokens:
            raise ValueError(f"comm's workspaces fit steps of {comm.max_tokens} tokens, max_tokens is {max_tokens}")
        self.fused, self.fused_max_tokens = comm, max_tokens
        for layer in self.layers:
            layer.fused = self.fused
        return self

    @property
    def graph_token_cap(self) -> int:
        """The most tokens a captured step may hold (fused path only): the fused kernels' max_tokens,
        and with SP > 1 the shift threshold (larger steps run in base mode: capture_base_graphs)."""
        if self.fused is None:
            raise ValueError("CUDA graphs need the fused path: call enable_fused(...) first")
        if self.ctx.sp.size == 1:
            return self.fused_max_tokens
        return min(self.policy.threshold, self.fused_max_tokens)

    def capture_decode_graphs(self, cache: PagedKVCache, *, max_context: int,
                              sizes: tuple[int, ...] | None = None):
        """Capture CUDA graphs of shift-mode decode steps on `cache` (collective: every rank, same
        arguments). sizes default: DEFAULT_CAPTURE_SIZES up to the shift threshold (SP > 1) and
        max_tokens. Later decode steps of at most max(sizes) sequences, each with a context below
        max_context, replay a graph; the rest run eagerly."""
        from fusedpar.layers.graphs import DEFAULT_CAPTURE_SIZES, DecodeGraphs

        if self.fused is None:
            raise ValueError("capture_decode_graphs needs the fused path: call enable_fused(...) first")
        if sizes is None:
            sizes = tuple(s for s in DEFAULT_CAPTURE_SIZES if s <= self.graph_token_cap)
        self.graphs = None  # release the old graphs' memory before capturing new ones
        self.graphs = DecodeGraphs(self, cache, max_context=max_context, sizes=sizes)
        return self.graphs

    def capture_prefill_graphs(self, cache: PagedKVCache, *, max_context: int, sizes: tuple[int, ...] | None = None,
                               max_seqs: int = 64):
        """Capture CUDA graphs of shift-mode varlen steps on `cache` (collective: every rank, same
        arguments). sizes (token counts) default: DEFAULT_PREFILL_SIZES up to the shift threshold (SP > 1)
        and max_tokens. Later shift-mode steps of at most max(sizes) tokens in at most max_seqs
        sequences, each with context + new tokens <= max_context, replay the smallest graph that fits
        (a pure decode step that fits a decode graph replays that one instead); the rest run eagerly.
        Every size must be >= max_seqs + 2 (the graph's attention sees max_seqs + 1 sequences, the
        padding one included, and needs more tokens than sequences)."""
        from fusedpar.layers.graphs import DEFAULT_PREFILL_SIZES, PrefillGraphs

        if self.fused is None:
            raise ValueError("capture_prefill_graphs needs the fused path: call enable_fused(...) first")
        if sizes is None:
            cap = self.graph_token_cap
            sizes = tuple(s for s in DEFAULT_PREFILL_SIZES if s <= cap)
            if not sizes:
                raise ValueError(f"no default prefill graph size ({DEFAULT_PREFILL_SIZES}) is <= {cap} (the shift "
                                 f"threshold / max_tokens): pass sizes")
        self.prefill_graphs = None
        self.prefill_graphs = PrefillGraphs(self, cache, max_context=max_context, sizes=sizes, max_seqs=max_seqs)
        return self.prefill_graphs

    def capture_base_graphs(self, cache: PagedKVCache, *, max_context: int, sizes: tuple[int, ...],
                            max_seqs: int = 64):
        """Capture CUDA graphs of base-mode varlen steps on `cache` (collective: every rank, same arguments).
        sizes: token counts, each a multiple of SP, above the shift threshold and <= max_tokens. Later
        base-mode steps of at most max(sizes) tokens in at most max_seqs sequences, each with context + new
        tokens <= max_context, replay the smallest graph that fits; the rest run eagerly. Every size must be
        >= max_seqs + 2 (as capture_prefill_graphs)."""
        from fusedpar.layers.graphs import BaseGraphs

        if self.fused is None:
            raise ValueError("capture_base_graphs needs the fused path: call enable_fused(...) first")
        self.base_graphs = None  # release the old graphs' memory before capturing new ones
        self.base_graphs = BaseGraphs(self, cache, max_context=max_context, sizes=sizes, max_seqs=max_seqs)
        return self.base_graphs

    @classmethod
    def from_full_weights(cls, cfg: DecoderConfig, ctx: ParallelContext, layer_weights: list[dict],
                          policy: StepModeRule | None = None) -> ShiftParallelStack:
        layers = [ShiftParallelDecoderLayer.from_full_weights(cfg, ctx, w, i) for i, w in enumerate(layer_weights)]
        return cls(cfg, ctx, layers, policy)

    def make_cache(self, *, block_size: int = 16, num_blocks: int = 256, dtype: torch.dtype | None = None,
                   ) -> PagedKVCache:
        """One cache for this rank's kv heads, shared by both modes."""
        dtype = dtype or self.weight_dtype
        return PagedKVCache(num_layers=len(self.layers), kv_heads=self.layers[0].kv_heads,
                            head_dim=self.cfg.head_dim, block_size=block_size, num_blocks=num_blocks,
                            dtype=dtype, device=self.ctx.device)

    def plan(self, batch: StepBatch, cache: PagedKVCache, mode: str | None = None) -> StepState:
        """Pick the mode (policy, unless forced) and reserve cache slots for the step's tokens.

        Everything that can reject the step is checked before the cache reserves anything, so a
        rejected step leaves the cache as it was."""
        mode = check_mode(mode) if mode is not None else self.policy.mode(batch.num_tokens, self.ctx.sp.size)
        if cache.kv_heads != self.layers[0].kv_heads:
            raise ValueError(f"cache holds kv heads {cache.kv_heads}, this rank computes {self.layers[0].kv_heads}")
        layers, _, _, _, head_dim = cache.k.shape
        dtype = self.weight_dtype
        if (layers, head_dim, cache.k.dtype) != (len(self.layers), self.cfg.head_dim, dtype):
            raise ValueError(f"cache holds {layers} layers of head_dim {head_dim} in {cache.k.dtype}; this stack "
                             f"needs {len(self.layers)} layers of head_dim {self.cfg.head_dim} in {dtype}")
        padded = padded_token_count(batch.num_tokens, self.ctx.sp.size) if mode == StepMode.BASE else batch.num_tokens
        slots = cache.begin_step(batch)
        positions = batch.positions(self.ctx.device)
        metadata = tables = None
        if self.fused is not None:
            from fusedpar.layers.attention import step_metadata

            metadata = step_metadata(batch, cache, device=self.ctx.device)
            # scaled RoPE, or positions past the kernel's angle range: cos/sin tables once per step
            if needs_rope_tables(self.cfg, metadata.max_kv_len):
                tables = rope_tables(self.cfg, positions)
        return StepState(mode, batch, padded, positions, slots, metadata, tables)

    def layer_input(self, hidden: torch.Tensor, step: StepState) -> torch.Tensor:
        """What the first layer takes from the step's hidden states [n, d]: in base mode this SP rank's
        rows of the step padded to padded_tokens (a view of a padded copy), in shift mode all rows."""
        if step.mode != StepMode.BASE:
            return hidden
        rows = step.padded_tokens // self.ctx.sp.size
        return F.pad(hidden, (0, 0, 0, step.padded_tokens - step.num_tokens)).narrow(0, self.ctx.sp.rank * rows, rows)

    def forward(self, hidden: torch.Tensor, batch: StepBatch, cache: PagedKVCache,
                mode: str | None = None, use_graphs: bool = True) -> torch.Tensor:
        """One step of every layer on hidden [n, d] (n = batch.num_tokens) -> [n, d]. A shift-mode
        step that fits captured graphs on `cache` replays one unless use_graphs is False (a step whose
        layer outputs are observed, e.g. by forward hooks, must run its layers eagerly)."""
        n = batch.num_tokens
        if hidden.dim() != 2 or hidden.shape != (n, self.cfg.hidden_size):
            raise ValueError(f"hidden must be [{n}, {self.cfg.hidden_size}] for this batch, got {tuple(hidden.shape)}")
        dtype = self.weight_dtype
        if hidden.dtype != dtype:  # checked before the step reserves cache slots: a refused step changes nothing
            raise ValueError(f"hidden is {hidden.dtype}, the stack's weights are {dtype}")
        if mode is not None:
            mode = check_mode(mode)
        if SCRATCH_SEQ_ID in cache.block_tables and SCRATCH_SEQ_ID in batch.seq_ids:
            raise ValueError(f"sequence id {SCRATCH_SEQ_ID} (fusedpar.layers.graphs.SCRATCH_SEQ_ID) is reserved: the "
                             f"CUDA graphs' padding rows use its cache block")
        if use_graphs and (self.graphs is not None or self.prefill_graphs is not None or self.base_graphs is not None):
            step_mode = mode or self.policy.mode(n, self.ctx.sp.size)
            for graphs in (self.graphs, self.prefill_graphs) if step_mode == StepMode.SHIFT else (self.base_graphs,):
                if graphs is not None and graphs.cache is cache and graphs.size_for(batch) is not None:
                    self.steps[step_mode] += 1
                    self.graph_steps += 1
                    return graphs.run(hidden, batch).clone()  # the output buffer is reused by the next replay
        step = self.plan(batch, cache, mode)
        self.steps[step.mode] += 1
        x = self.layer_input(hidden, step)
        for layer in self.layers:
            x = layer(x, step, cache)
        if step.mode == StepMode.BASE:
            x = all_gather_rows(x, self.ctx.sp)[:n]  # padding rows dropped here, never returned
        return x
