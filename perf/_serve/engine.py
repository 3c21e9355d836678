"""One rank's side of the served model: the stacks of every layout, the KV pool, the layout switch.

Layouts over W ranks: tp = (tp=W), sp = (sp=W), dp = (dp=W, one rank per replica). Weights: each
rank holds the sp shard of every layer (tp is a view of it: ShardedDecoderWeights.viewing, 0 bytes)
and the full layer for dp (replica size 1). A stack per layout runs one mode: base where the layout
has sp > 1, shift otherwise (the layout policy picks the layout, the layout fixes the mode).

Around the stacks: a replicated embedding, final RMSNorm and lm_head (greedy argmax, first index on
ties), the same in every layout, so only the decoder differs.

KV: one pool per rank of `kv_blocks` blocks of ONE kv head; a layout caching h kv heads per rank
views it as kv_blocks // h blocks (PagedKVCache.reinterpret). A switch between layouts of one replica
size (sp <-> tp) keeps the cache (the same kv heads on the same ranks); across replica sizes the live
sequences' KV moves along fusedpar.layouts.kv_plan with fusedpar.layers.kv_reshard.migrate_kv, as the
HF adapter's switching does, into a pool grown to one agreed block count on every rank. On CUDA the
rows go through a symmetric staging of STAGING_BYTES per rank (pushed from the sender's pool
straight into the receiver's staging), on CPU through gloo's all-to-all.

CUDA: the stacks run the fused path (perf/_bench.enable_stack); the sp == 1 layouts replay CUDA graphs
of their decode steps (DecodeGraphs) and of their mixed prefill + decode steps up to the step budget
(PrefillGraphs), as a serving engine's graphs would; the sp > 1 layouts (every step in base mode)
replay BaseGraphs of the same token counts in multiples of SP. Graphs are
captured once per layout on its view of the pool and rebound (rebind, no capture) to the cache a
migration makes on that same view; captured again only when a migration had to grow the pool. CPU:
the reference path, eager.
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass

import _bench
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fusedpar.collectives import ParallelContext
from fusedpar.collectives.symmetric import SymmetricWorkspace
from fusedpar.kernels.reference import rms_norm
from fusedpar.layers import (
    DecoderConfig,
    HostKVTier,
    PagedKVCache,
    ShardedDecoderWeights,
    ShiftParallelDecoderLayer,
    ShiftParallelStack,
    StepBatch,
    StepModeRule,
    StepTimeCurve,
    measure_step_times,
    migrate_kv,
    random_decoder_weights,
)
from fusedpar.layers.graphs import DEFAULT_CAPTURE_SIZES
from fusedpar.layouts import ParallelLayout, kv_plan

LAYOUT_NAMES = ("tp", "sp", "dp")
STAGING_BYTES = 1 << 30  # per rank: a KV migration's staging; larger migrations push in layer groups


@dataclass(frozen=True)
class EngineOptions:
    cfg: DecoderConfig
    layers: int
    vocab: int
    dtype: torch.dtype
    seed: int
    block_size: int
    kv_blocks: int  # one-kv-head blocks per rank; 0: sized from free GPU memory (CUDA) or 4096 (CPU)
    max_batch_tokens: int  # per replica and step
    max_seqs: int  # resident sequences per replica
    max_context: int  # prompt + output of the longest request
    graphs: bool  # CUDA decode graphs


def layer_weights(cfg: DecoderConfig, layer: int, seed: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Full weights of one layer: random_decoder_weights on CPU (float64 draws, as the tests' oracle
    expects), a generator on the device on CUDA (8B-sized layers drawn on the host would take minutes)."""
    if device.type != "cuda":
        return random_decoder_weights(cfg, seed=seed + layer, dtype=dtype)
    from bench_layer import full_weights  # perf/ is on the path of every perf script

    return full_weights(cfg, device, dtype, seed=seed + layer)


def head_weights(cfg: DecoderConfig, vocab: int, seed: int, dtype: torch.dtype, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(embedding [vocab, d], final norm [d], lm_head [vocab, d]), the same on every rank."""
    gen = torch.Generator(device=device).manual_seed(seed + 999_983)
    d = cfg.hidden_size
    embed = torch.randn((vocab, d), generator=gen, device=device, dtype=torch.float32)
    norm = 1.0 + 0.1 * torch.randn((d,), generator=gen, device=device, dtype=torch.float32)
    head = torch.randn((vocab, d), generator=gen, device=device, dtype=torch.float32) / d ** 0.5
    return embed.to(dtype), norm.to(dtype), head.to(dtype)


def greedy(h: torch.Tensor, norm: torch.Tensor, lm_head: torch.Tensor, eps: float) -> torch.Tensor:
    """[n, d] final hidden states -> [n] greedy token ids (first index among equal logits)."""
    return torch.argmax(F.linear(rms_norm(h, norm, eps), lm_head).float(), dim=-1)


def decode_sizes(cap: int) -> tuple[int, ...]:
    """Sequence counts of the decode graphs: DEFAULT_CAPTURE_SIZES, then multiples of 32, then cap itself,
    all <= cap (cap: resident sequences per replica): a decode step of any resident batch replays one."""
    return tuple(sorted({s for s in (*DEFAULT_CAPTURE_SIZES, *range(96, cap + 1, 32)) if s <= cap} | {cap}))


def _graph_sizes(cap: int, multiple: int) -> tuple[int, ...]:
    """Powers of two from 256 below cap, and cap rounded down to `multiple`; () when that is below 256."""
    cap -= cap % multiple
    if cap < 256:
        return ()
    return tuple(sorted({s for s in (256, 512, 1024, 2048, 4096, 8192) if s < cap} | {cap}))


def world_max(values: list[float], device: torch.device) -> list[float]:
    """Element-wise max over the world (one all-reduce)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def world_min(value: int, device: torch.device) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


class Engine:
    """This rank's stacks (one per layout), head, KV pool and host tier; every method that says
    collective is called by every rank with the same arguments."""

    def __init__(self, opts: EngineOptions, rank: int, world: int, device: torch.device, log=print):
        if world < 2:
            raise ValueError("serve_bench needs >= 2 ranks: with one the tp, sp and dp layouts are the same")
        self.opts, self.rank, self.world, self.device = opts, rank, world, device
        self.cuda = device.type == "cuda"
        cfg = opts.cfg
        self.layouts = {"tp": ParallelLayout(world, tp=world), "sp": ParallelLayout(world, sp=world),
                        "dp": ParallelLayout(world)}
        self.ctxs = {k: ParallelContext(lay, device=device) for k, lay in self.layouts.items()}
        per: dict[str, list] = {k: [] for k in LAYOUT_NAMES}
        for i in range(opts.layers):
            full = layer_weights(cfg, i, opts.seed, opts.dtype, device)
            held = ShardedDecoderWeights.from_full(cfg, self.layouts["sp"], rank, full)
            per["sp"].append(held)
            per["tp"].append(ShardedDecoderWeights.viewing(held, cfg, self.layouts["sp"], self.layouts["tp"], rank))
            per["dp"].append(ShardedDecoderWeights.from_full(cfg, self.layouts["dp"], rank, full))
            del full
            if (i + 1) % 8 == 0 or i + 1 == opts.layers:
                log(f"weights: {i + 1}/{opts.layers} layers")
        self.stacks: dict[str, ShiftParallelStack] = {}
        for k in LAYOUT_NAMES:
            ctx = self.ctxs[k]
            layers = [ShiftParallelDecoderLayer(cfg, ctx, w, i) for i, w in enumerate(per[k])]
            stack = ShiftParallelStack(cfg, ctx, layers, StepModeRule.always(self.mode(k)))
            if self.cuda:
                _bench.enable_stack(stack, max_tokens=opts.max_batch_tokens, fused=True)
            self.stacks[k] = stack
        self.heads = {k: tuple(self.stacks[k].layers[0].kv_heads) for k in LAYOUT_NAMES}
        self.embed, self.norm, self.lm_head = head_weights(cfg, opts.vocab, opts.seed, opts.dtype, device)
        # KV migrations push through this (fusedpar.layers.kv_reshard); made before the pool takes its share
        self.staging = SymmetricWorkspace(dist.group.WORLD, STAGING_BYTES) if self.cuda else None
        blocks = opts.kv_blocks or self._auto_kv_blocks()
        # a multiple of the kv heads: every layout's view of the pool, reached directly or through another
        # layout's view, then has the same block count (decode graphs rebind across switches)
        blocks = max(cfg.num_kv_heads, blocks - blocks % cfg.num_kv_heads)
        self.pool = PagedKVCache(num_layers=opts.layers, kv_heads=(0,), head_dim=cfg.head_dim,
                                 block_size=opts.block_size, num_blocks=blocks, dtype=opts.dtype, device=device)
        self.tier: HostKVTier | None = None
        self.graph_s = 0.0  # CUDA graph captures, cumulated

    # ---- layouts ------------------------------------------------------------------------------------
    def mode(self, name: str) -> str:
        return "base" if self.layouts[name].sp > 1 else "shift"

    def name_of(self, layout: ParallelLayout) -> str:
        return next(k for k, lay in self.layouts.items() if lay == layout)

    def replica(self, name: str) -> int:
        """This rank's replica in layout `name`."""
        return self.layouts[name].coords(self.rank).dp

    def _auto_kv_blocks(self) -> int:
        if not self.cuda:
            return 4096
        o = self.opts
        per_block = 2 * o.layers * o.block_size * o.cfg.head_dim * torch.tensor([], dtype=o.dtype).element_size()
        free = torch.cuda.mem_get_info(self.device)[0]
        return world_min(max(1, int(0.3 * free) // per_block), self.device)

    # ---- caches -------------------------------------------------------------------------------------
    def fresh_cache(self, name: str) -> PagedKVCache:
        """An empty cache of layout `name` on the pool's memory (what it held is overwritten by use)."""
        return self.pool.reinterpret(self.heads[name])

    def capacity(self, cache: PagedKVCache) -> int:
        """Blocks the scheduler may reserve per replica in `cache`: the block count agreed over the world,
        less one for the CUDA graphs' scratch sequence. Collective."""
        return world_min(cache.num_blocks, self.device) - 1

    def ready_graphs(self, name: str, cache: PagedKVCache) -> float:
        """CUDA graphs of layout `name` on `cache` (CUDA, graphs on), rebound when they were captured on this
        view of the pool, captured otherwise; seconds spent capturing. sp == 1 layouts: decode graphs
        (decode_sizes: up to max_seqs sequences) and varlen graphs for the mixed prefill + decode steps (prefill_sizes);
        sp > 1 layouts (every step in base mode): base-mode varlen graphs (base_sizes). Collective: every
        rank calls it at the same switch."""
        stack = self.stacks[name]
        if not (self.cuda and self.opts.graphs):
            return 0.0
        o = self.opts
        if self.layouts[name].sp > 1:
            wanted = {"base_graphs": self.base_sizes(stack)}
        else:
            wanted = {"graphs": decode_sizes(min(o.max_seqs, stack.graph_token_cap)),
                      "prefill_graphs": self.prefill_sizes(stack)}
        wanted = {attr: sizes for attr, sizes in wanted.items() if sizes}
        if all(getattr(stack, attr) is not None and getattr(stack, attr).rebind(cache) for attr in wanted):
            return 0.0  # the same memory, seen the same way
        t0 = time.perf_counter()
        for attr, sizes in wanted.items():
            if attr == "graphs":
                stack.capture_decode_graphs(cache, max_context=o.max_context, sizes=sizes)
            else:
                capture = stack.capture_base_graphs if attr == "base_graphs" else stack.capture_prefill_graphs
                capture(cache, max_context=o.max_context, sizes=sizes, max_seqs=min(o.max_seqs, sizes[0] - 2))
        torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        self.graph_s += dt
        return dt

    def prefill_sizes(self, stack: ShiftParallelStack) -> tuple[int, ...]:
        """Token counts of the varlen graphs: powers of two from 256 and the step budget (a graph of s tokens
        takes at most s - 2 sequences, so 256 serves steps of up to 254 sequences); () when the budget is
        below 256 tokens."""
        return _graph_sizes(min(self.opts.max_batch_tokens, stack.graph_token_cap), 1)

    def base_sizes(self, stack: ShiftParallelStack) -> tuple[int, ...]:
        """Token counts of the base-mode graphs of an sp > 1 stack: as prefill_sizes, in multiples of SP."""
        return _graph_sizes(min(self.opts.max_batch_tokens, stack.fused_max_tokens), stack.ctx.sp.size)

    def drop_graphs(self, keep: list[PagedKVCache]) -> None:
        """Forget the CUDA graphs captured on memory none of `keep` lies on (they hold those tensors);
        graphs on the pool's memory stay, for ready_graphs to rebind when their layout returns."""
        for stack in self.stacks.values():
            if stack.graphs is not None and not any(stack.graphs.shares_memory(c) for c in keep):
                stack.graphs = None
            for attr in ("prefill_graphs", "base_graphs"):
                g = getattr(stack, attr)
                if g is not None and not any(g.shares_memory(c) for c in keep):
                    setattr(stack, attr, None)

    def migrate(self, src: str, dst: str, cache: PagedKVCache, moves: dict[int, tuple[int, int, int]],
                need_blocks: int) -> tuple[PagedKVCache, int]:
        """(the dst cache holding every moved sequence, KV bytes this rank received). moves: seq -> (its
        replica in src, its replica in dst, cached tokens), every live sequence of the world. The dst
        pool gets one block count on every rank: at least need_blocks and what the memory holds for the
        dst heads. Collective."""
        ls, ld = self.layouts[src], self.layouts[dst]
        plan = kv_plan(ls, ld, self.opts.cfg.dims, {s: (a, b) for s, (a, b, _) in moves.items()})
        here, there = ls.coords(self.rank).dp, ld.coords(self.rank).dp
        sequences = {s: (a == here, b == there, n) for s, (a, b, n) in moves.items()}
        heads = self.heads[dst]
        fit = cache.num_blocks * len(cache.kv_heads) // len(heads)
        t = torch.tensor([max(fit, need_blocks, 1)], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return migrate_kv(cache, self.rank, plan, heads, sequences, min_blocks=int(t.item()),
                          staging=self.staging)

    def host_tier(self, tokens: int, min_footprint: int) -> HostKVTier:
        """The host KV tier, sized so that sequences of at most `tokens` tokens in all fit whichever rank
        writes them (one rank may write every kv head: dp). Made once, emptied by the caller."""
        o, cfg = self.opts, self.opts.cfg
        seqs = -(-tokens // max(1, min_footprint))
        blocks = cfg.num_kv_heads * (-(-tokens // o.block_size) + seqs)
        if self.tier is None or self.tier.num_blocks < blocks:
            self.tier = None
            self.tier = HostKVTier(rank=self.rank, world_size=self.world, num_layers=o.layers,
                                   num_q_heads=cfg.num_q_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                   block_size=o.block_size, num_blocks=blocks, dtype=o.dtype, device=self.device)
        return self.tier

    # ---- steps --------------------------------------------------------------------------------------
    def forward(self, name: str, cache: PagedKVCache, batch: StepBatch, ids: torch.Tensor,
                emit_rows: list[int]) -> list[int]:
        """One step of layout `name` on this rank's replica: ids [n] token ids packed as `batch`; the
        greedy tokens of the rows emit_rows (host list: the step ends when the tokens are on the host)."""
        hidden = self.embed[ids.to(self.device)]
        h = self.stacks[name](hidden, batch, cache, mode=self.mode(name))
        if not emit_rows:
            if self.cuda:
                torch.cuda.synchronize(self.device)
            return []
        rows = torch.tensor(emit_rows, device=self.device)
        return greedy(h[rows], self.norm, self.lm_head, self.opts.cfg.rms_norm_eps).tolist()

    def step_curve(self, name: str, points: list[int], iters: int, decode: bool = False) -> StepTimeCurve:
        """Layout `name`'s step-time curve at `points` (fusedpar.layers.measure_step_times: prefill steps of n
        tokens, or with decode=True decode steps of n sequences, split over its replicas) on a fresh cache,
        through forward (embedding, stack, greedy head) and the graphs serving replays. Collective."""
        cache = self.fresh_cache(name)
        self.ready_graphs(name, cache)  # the path serving takes: graph replays where a step fits one

        def step(batch: StepBatch) -> list[int]:
            last_rows = list(itertools.accumulate(batch.query_lens, initial=-1))[1:]  # each sequence's last token
            return self.forward(name, cache, batch, torch.zeros(batch.num_tokens, dtype=torch.int64), last_rows)

        return measure_step_times(step, cache, points, replicas=self.layouts[name].dp, decode=decode, iters=iters)

    def warm_base(self, name: str, log=print) -> int:
        """Run the eager base-mode steps of layout `name` (sp > 1) once per shape the scheduler can hand
        it, so that the Triton kernels' specialisations compile here and not mid-trace (a compile is
        seconds of host time: every request waiting then sees it in its TTFT). Shapes: one sequence of
        n tokens and n sequences of one token (a decode step), n = 1..16 and every multiple of 16 and the
        one above it, up to the step budget / max_seqs. Returns the steps run. Collective."""
        if self.layouts[name].sp == 1:
            return 0
        o = self.opts
        cache = self.fresh_cache(name)

        def grid(top: int) -> list[int]:
            return sorted({n for n in (*range(1, 17), *range(16, top + 1, 16), *range(17, top + 1, 16)) if n <= top})

        shapes = [((0,), (n,), (0,)) for n in grid(o.max_batch_tokens)]
        shapes += [(tuple(range(n)), (1,) * n, (1,) * n) for n in grid(min(o.max_seqs, o.max_batch_tokens))]
        last = time.perf_counter()
        for i, (seqs, lens, ctx) in enumerate(shapes):
            if ctx[0]:  # a decode step: its sequences hold one token first
                self.forward(name, cache, StepBatch(seqs, (1,) * len(seqs), (0,) * len(seqs)),
                             torch.zeros(len(seqs), dtype=torch.int64), [])
            n = sum(lens)
            self.forward(name, cache, StepBatch(seqs, lens, ctx), torch.zeros(n, dtype=torch.int64), [])
            for sid in seqs:
                cache.free(sid)
            if time.perf_counter() - last > 10:
                log(f"warm-up {name}: base-mode shapes {i + 1}/{len(shapes)}")
                last = time.perf_counter()
        return len(shapes)

    def switch_cost(self, tokens: int, iters: int) -> float:
        """Seconds of a dp <-> tp switch carrying `tokens` cached tokens per replica (mean of the two
        directions, median of iters, max over ranks). Collective."""
        cfg = self.opts.cfg
        times = []
        for _ in range(iters):
            cache = self.fresh_cache("dp")
            k = torch.zeros((self.opts.layers, tokens, len(self.heads["dp"]), cfg.head_dim), dtype=self.opts.dtype,
                            device=self.device)
            cache.fill(self.rank, k, k)
            for src, dst in (("dp", "tp"), ("tp", "dp")):
                moves = {r: (r if src == "dp" else 0, r if dst == "dp" else 0, tokens) for r in range(self.world)}
                need = -(-tokens // self.opts.block_size) * (self.world if dst == "tp" else 1)
                if self.cuda:
                    torch.cuda.synchronize(self.device)
                dist.barrier()
                t0 = time.perf_counter()
                cache, _ = self.migrate(src, dst, cache, moves, need)
                if self.cuda:
                    torch.cuda.synchronize(self.device)
                times.append(time.perf_counter() - t0)
        return world_max([statistics.median(times)], self.device)[0]
