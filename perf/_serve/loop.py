"""The continuous-batching loop of one policy over a trace (every rank runs it; the scheduler's state
is the same on every rank, so every rank takes the same decisions with no exchange but the clock).

Clock: virtual. Each iteration (policy decision, switch, swaps, scheduling, the step, bookkeeping) is
timed on the wall clock of every rank; the clock advances by the max over ranks (one all-reduce per
iteration, which also carries the switch and swap times). When nothing is running or waiting the
clock jumps to the next arrival instead of sleeping, so CPU runs of slow steps still replay the whole
trace, and a GPU run measures what real-time replay would (the engine idles in those gaps either way).
A request's first token is stamped at the end of the step that completes its prompt, every later one
at the end of its decode step. With fixed_step_s > 0 the clock advances by that much per iteration
instead (a simulated clock: the schedule, and every policy's decisions but auto's, which reads measured
step-time curves, no longer depend on the machine's speed). CUDA graph captures after a KV migration
(the new cache needs its own graphs) are left out of the clock and reported apart (graph_capture_s):
an engine keeping one pool per layout captures once.

Scheduling per step and replica (token budget max_batch_tokens): one decode token for every resident
sequence past its prompt, then chunks of the prompts in flight, then new requests in (priority,
arrival) order, each to the replica with the most free KV blocks; admission stops at the first request
that does not fit. Admission reserves the request's whole footprint (prompt + output - 1 tokens) in
KV blocks, so no sequence is ever preempted.

Prefill/decode policy (PrefillDecodePolicy + HostKVTier): in the prefill layout only prompts run, and
a sequence whose prompt is done (first token out) goes to the host tier; in the decode layout the
tier's sequences are swapped in as KV room allows and only decode steps run. Going back to prefill
swaps the decoding sequences out first (both layouts view one KV pool). The tier admits requests up to
host_tier_tokens of footprint in all, so every live sequence always fits it.

Stalls: every iteration over SLOW_STEP_S is listed (slow_steps) and every Triton compile during the
run is counted by kernel (compiles; none on CPU, where the kernels are interpreted): a kernel variant
first met mid-trace costs seconds that every waiting request sees in its TTFT.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from _serve.engine import Engine, world_max
from _serve.trace import Request
from fusedpar.layers import LayoutPolicy, PrefillDecodePolicy, StepBatch, StepFacts

SLOW_STEP_S = 0.25  # an iteration this long is a stall worth listing (a step of 2048 tokens takes ~20-50 ms)


@contextlib.contextmanager
def _count_compiles(into: Counter):
    """Count Triton compiles by kernel name into `into` while the block runs (Triton's post-compile hook)."""
    import triton

    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        yield
        return
    previous = runtime.jit_post_compile_hook

    def hook(*args, **kwargs):
        into[str(kwargs.get("repr", "?")).split("[", 1)[0]] += 1
        return previous(*args, **kwargs) if previous else None

    runtime.jit_post_compile_hook = hook
    try:
        yield
    finally:
        runtime.jit_post_compile_hook = previous


def scheduled_tokens(items: dict[int, list[Item]]) -> int:
    return sum(it.query for its in items.values() for it in its)


@dataclass
class Seq:
    req: Request
    replica: int
    prefilled: int = 0  # prompt tokens cached
    generated: int = 0  # output tokens sampled
    in_tier: bool = False

    @property
    def cached(self) -> int:
        return self.prefilled + max(0, self.generated - 1)


@dataclass
class Item:
    rid: int
    query: int
    context: int
    decode: bool


@dataclass
class RunResult:
    """What one policy did over the trace (the same on every rank; outputs complete on rank 0)."""

    policy: str
    first_t: dict[int, float] = field(default_factory=dict)
    done_t: dict[int, float] = field(default_factory=dict)
    outputs: dict[int, list[int]] = field(default_factory=dict)
    emitted: list[tuple[float, int]] = field(default_factory=list)  # (step end, output tokens)
    layout_spans: list[tuple[float, float, str]] = field(default_factory=list)  # (start, end, layout)
    steps: Counter = field(default_factory=Counter)  # layout -> steps
    switches: Counter = field(default_factory=Counter)  # "a->b" -> count
    switch_s: float = 0.0
    swap_s: float = 0.0
    graph_s: float = 0.0
    kv_bytes_received: int = 0
    end: float = 0.0
    wall_s: float = 0.0
    max_step_s: float = 0.0
    slow_steps: list[tuple[float, float, str, int, int]] = field(default_factory=list)  # (clock, s, layout, tokens,
    #                                                                    sequences) of steps over SLOW_STEP_S
    compiles: Counter = field(default_factory=Counter)  # Triton kernel -> compiles during the run (this rank)


class PolicyRun:
    """One policy over one trace on this rank (module doc); run() -> RunResult. Collective throughout."""

    def __init__(self, engine: Engine, name: str, policy: LayoutPolicy, requests: list[Request],
                 prompts: dict[int, torch.Tensor], *, priorities: bool, host_tier_tokens: int = 0,
                 fixed_step_s: float = 0.0, progress_s: float = 5.0, log=print):
        self.e, self.name, self.policy, self.requests, self.prompts = engine, name, policy, requests, prompts
        self.priorities, self.progress_s, self.log = priorities, progress_s, log
        self.fixed_step_s = fixed_step_s
        o = engine.opts
        self.budget, self.max_seqs, self.bs = o.max_batch_tokens, o.max_seqs, o.block_size
        self.pd = isinstance(policy, PrefillDecodePolicy)
        self.current = engine.name_of(policy.initial)
        self.res = RunResult(name)
        if self.pd:
            self.pd_names = (engine.name_of(policy.prefill), engine.name_of(policy.decode))
            self.caches = {k: engine.fresh_cache(k) for k in self.pd_names}
            self.cache = self.caches[self.current]
            self.tier_cap = host_tier_tokens
            self.tier = engine.host_tier(host_tier_tokens, min(r.footprint for r in requests))
            self.tier.drop(list(self.tier.sequences))
        else:
            self.cache = engine.fresh_cache(self.current)
        engine.drop_graphs(list(self.caches.values()) if self.pd else [self.cache])
        self.cap = engine.capacity(self.cache)
        self.res.graph_s += self.ready_graphs()
        self.seqs: dict[int, Seq] = {}
        self.queue: list[int] = []
        self.next = 0
        self.clock = 0.0
        self.outputs: dict[int, list[int]] = {}  # valid on the ranks of the sequence's replica
        self.span_start = 0.0

    # ---- helpers ------------------------------------------------------------------------------------
    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.bs)

    def reserved(self, replica: int) -> tuple[int, int]:
        """(KV blocks reserved, sequences) resident in `replica` of the current layout."""
        mine = [s for s in self.seqs.values() if s.replica == replica and not s.in_tier]
        return sum(self.blocks(s.req.footprint) for s in mine), len(mine)

    def queue_order(self) -> list[int]:
        return sorted(self.queue, key=lambda r: (self.requests[r].priority, self.requests[r].arrival, r))

    def tier_tokens(self) -> int:
        return sum(s.req.footprint for s in self.seqs.values())

    def pd_phase(self) -> str | None:
        if not self.pd:
            return None
        return "prefill" if self.current == self.pd_names[0] else "decode"

    def admissible_head(self) -> bool:
        """PD: whether the first queued request fits the host tier's footprint budget."""
        order = self.queue_order()
        return bool(order) and self.tier_tokens() + self.requests[order[0]].footprint <= self.tier_cap

    # ---- policy -------------------------------------------------------------------------------------
    def facts(self) -> StepFacts | None:
        resident = [s for s in self.seqs.values() if not s.in_tier]
        inflight = [s for s in resident if s.prefilled < s.req.prompt_len]
        decoding = sum(1 for s in resident if s.generated >= 1)
        pending = sum(s.req.prompt_len - s.prefilled for s in inflight)
        queued = sum(self.requests[r].prompt_len for r in self.queue)
        lay = self.e.layouts[self.current]
        scheduled = min(decoding + pending + queued, self.budget * lay.dp)
        if scheduled < 1 and not (self.pd and any(s.in_tier for s in self.seqs.values())):
            return None
        if not self.pd:
            prios = ()
            if self.priorities:
                prios = tuple(s.req.priority for s in self.seqs.values()) + tuple(self.requests[r].priority
                                                                                 for r in self.queue)
            return StepFacts(scheduled_tokens=max(1, scheduled), running=len(self.seqs), waiting=len(self.queue),
                             waiting_prefill_tokens=queued, priorities=prios)
        admissible = self.admissible_head()
        waiting = len(inflight) + (len(self.queue) if admissible else 0)
        wpt = pending + (queued if admissible else 0)
        cap = self.tier_cap
        if self.pd_phase() == "prefill":
            used = min(self.tier_tokens(), cap)
            if inflight:
                used = min(used, cap - 1)
            elif not admissible:
                used = cap
        else:
            used = min(cap, sum(s.req.footprint for s in self.seqs.values() if s.in_tier))
        return StepFacts(scheduled_tokens=max(1, scheduled), running=len(self.seqs) - len(inflight), waiting=waiting,
                         waiting_prefill_tokens=wpt, host_tier_used=used, host_tier_capacity=cap)

    # ---- switching ----------------------------------------------------------------------------------
    def share_outputs(self, rids: list[int], holder: dict[int, int], layout: str) -> None:
        """Make the outputs of `rids` known on every rank: each comes from the ranks of its replica
        `holder[rid]` in `layout`. Collective (one all_gather_object)."""
        mine = self.e.replica(layout)
        payload = {r: self.outputs.get(r, []) for r in rids if holder[r] == mine}
        got: list = [None] * self.e.world
        dist.all_gather_object(got, payload)
        for part in got:
            self.outputs.update(part)

    def assign(self, layout: str, seqs: list[Seq]) -> dict[int, int]:
        """rid -> replica in `layout`: every sequence to replica 0, or balanced by reserved blocks (dp)."""
        lay = self.e.layouts[layout]
        load = [0] * lay.dp
        out = {}
        for s in sorted(seqs, key=lambda s: s.req.rid):
            r = min(range(lay.dp), key=lambda d: (load[d], d))
            load[r] += self.blocks(s.req.footprint)
            out[s.req.rid] = r
        return out

    def switch(self, dst: str) -> None:
        src, e = self.current, self.e
        self.res.layout_spans.append((self.span_start, self.clock, src))
        self.span_start = self.clock
        self.res.switches[f"{src}->{dst}"] += 1
        ls, ld = e.layouts[src], e.layouts[dst]
        resident = [s for s in self.seqs.values() if not s.in_tier]
        if self.pd:  # a phase change: every live sequence waits in (or is in) the host tier
            live = list(self.seqs.values())
            if ls.replica_size != ld.replica_size:
                self.share_outputs([s.req.rid for s in live], {s.req.rid: s.replica for s in live}, src)
            if resident:  # back to prefill: the decoding sequences wait in the host tier
                t0 = time.perf_counter()
                self.tier.swap_out({s.req.rid: (s.replica, s.cached) for s in resident}, self.cache,
                                   ls).synchronize()
                self.res.swap_s += time.perf_counter() - t0
                for s in resident:
                    s.in_tier = True
            self.cache = self.caches[dst]
        elif ls.replica_size != ld.replica_size:
            target = self.assign(dst, resident)
            self.share_outputs([s.req.rid for s in resident], {s.req.rid: s.replica for s in resident}, src)
            moves = {s.req.rid: (s.replica, target[s.req.rid], s.cached) for s in resident if s.cached > 0}
            mine = e.replica(dst)
            need = sum(self.blocks(s.req.footprint) for s in resident if target[s.req.rid] == mine) + 1
            self.cache, received = e.migrate(src, dst, self.cache, moves, need)
            e.drop_graphs([self.cache])
            self.res.kv_bytes_received += received
            for s in resident:
                s.replica = target[s.req.rid]
        # else sp <-> tp: the same kv heads on the same ranks, the cache stays and nothing moves
        self.current = dst
        self.cap = e.capacity(self.cache)
        self.res.graph_s += self.ready_graphs()

    def ready_graphs(self) -> float:
        """Decode graphs of the current layout on its cache (none for the pd prefill layout, which only
        prefills); seconds spent capturing. Collective."""
        if self.pd_phase() == "prefill":
            return 0.0
        return self.e.ready_graphs(self.current, self.cache)

    def swap_in_ready(self) -> None:
        """PD decode phase: bring tier sequences in while KV room and max_seqs allow (collective)."""
        cand = sorted((s for s in self.seqs.values() if s.in_tier), key=lambda s: s.req.rid)
        if not cand:
            return
        target = self.assign(self.current, cand)
        lay = self.e.layouts[self.current]
        load = [self.reserved(d) for d in range(lay.dp)]
        chosen = {}
        for s in cand:
            d = target[s.req.rid]
            blocks, count = load[d]
            if blocks + self.blocks(s.req.footprint) > self.cap or count >= self.max_seqs:
                continue
            load[d] = (blocks + self.blocks(s.req.footprint), count + 1)
            chosen[s.req.rid] = d
        if not chosen:
            return
        t0 = time.perf_counter()
        self.tier.swap_in(chosen, self.cache, lay).synchronize()
        self.res.swap_s += time.perf_counter() - t0
        for rid, d in chosen.items():
            self.seqs[rid].in_tier, self.seqs[rid].replica = False, d

    # ---- scheduling ---------------------------------------------------------------------------------
    def schedule(self) -> dict[int, list[Item]]:
        lay = self.e.layouts[self.current]
        phase = self.pd_phase()
        budget = [self.budget] * lay.dp
        load = [self.reserved(d) for d in range(lay.dp)]
        items: dict[int, list[Item]] = {d: [] for d in range(lay.dp)}
        resident = sorted((s for s in self.seqs.values() if not s.in_tier), key=lambda s: s.req.rid)
        if phase != "prefill":
            for s in resident:
                if s.generated >= 1 and budget[s.replica] > 0:
                    items[s.replica].append(Item(s.req.rid, 1, s.cached, True))
                    budget[s.replica] -= 1
        if phase == "decode":
            return items
        for s in resident:
            if s.prefilled < s.req.prompt_len and budget[s.replica] > 0:
                q = min(s.req.prompt_len - s.prefilled, budget[s.replica])
                items[s.replica].append(Item(s.req.rid, q, s.prefilled, False))
                budget[s.replica] -= q
        in_tier = self.tier_tokens() if self.pd else 0
        for rid in self.queue_order():
            req = self.requests[rid]
            need = self.blocks(req.footprint)
            if self.pd and in_tier + req.footprint > self.tier_cap:
                break
            fits = [d for d in range(lay.dp) if budget[d] > 0 and load[d][0] + need <= self.cap
                    and load[d][1] < self.max_seqs]
            if not fits:
                break
            d = max(fits, key=lambda d: (self.cap - load[d][0], -d))
            self.queue.remove(rid)
            self.seqs[rid] = Seq(req, d)
            in_tier += req.footprint
            load[d] = (load[d][0] + need, load[d][1] + 1)
            q = min(req.prompt_len, budget[d])
            items[d].append(Item(rid, q, 0, False))
            budget[d] -= q
        return items

    # ---- the step -----------------------------------------------------------------------------------
    def execute(self, items: dict[int, list[Item]]) -> None:
        """This rank's replica runs its items; its ranks append the sampled tokens to the outputs."""
        mine = items.get(self.e.replica(self.current), [])
        if not mine:
            return
        last: list[int] = []  # the decode items' input tokens (they come first: one tensor for all)
        chunks: list[torch.Tensor] = []
        emit, rows, pos = [], [], 0
        for it in mine:
            if it.decode:
                last.append(self.outputs[it.rid][-1])
            else:
                chunks.append(self.prompts[it.rid][it.context:it.context + it.query])
            pos += it.query
            if it.decode or it.context + it.query == self.requests[it.rid].prompt_len:
                emit.append(it.rid)
                rows.append(pos - 1)
        batch = StepBatch(tuple(it.rid for it in mine), tuple(it.query for it in mine),
                          tuple(it.context for it in mine))
        ids = torch.cat([torch.tensor(last, dtype=torch.int64), *chunks])
        tokens = self.e.forward(self.current, self.cache, batch, ids, rows)
        for rid, tok in zip(emit, tokens, strict=True):
            self.outputs.setdefault(rid, []).append(int(tok))

    def account(self, items: dict[int, list[Item]]) -> tuple[int, list[Seq], list[int], list[int]]:
        """Advance every scheduled sequence (all ranks): (output tokens emitted, sequences whose prompt
        just completed and that go on decoding, rids with their first token, rids finished)."""
        emitted, prefilled, first, done = 0, [], [], []
        mine = self.e.replica(self.current)
        for d, its in items.items():
            for it in its:
                s = self.seqs[it.rid]
                if it.decode:
                    s.generated += 1
                else:
                    s.prefilled += it.query
                    if s.prefilled < s.req.prompt_len:
                        continue
                    s.generated = 1
                    first.append(it.rid)
                emitted += 1
                if s.generated == s.req.output_len:
                    done.append(it.rid)
                    if d == mine:
                        self.res.outputs[it.rid] = self.outputs.pop(it.rid)
                        self.cache.free(it.rid)
                    else:
                        self.outputs.pop(it.rid, None)
                    del self.seqs[it.rid]
                elif not it.decode:
                    prefilled.append(s)
        return emitted, prefilled, first, done

    # ---- the loop -----------------------------------------------------------------------------------
    def run(self) -> RunResult:
        with _count_compiles(self.res.compiles):
            return self._run()

    def _run(self) -> RunResult:
        n = len(self.requests)
        wall0 = last_log = time.perf_counter()
        idle = 0
        while len(self.res.done_t) < n:
            t0 = time.perf_counter()
            while self.next < n and self.requests[self.next].arrival <= self.clock:
                self.queue.append(self.next)
                self.next += 1
            if not self.seqs and not self.queue:
                self.clock = self.requests[self.next].arrival
                continue
            switch0, swap0, graph0 = self.res.switch_s, self.res.swap_s, self.res.graph_s
            facts = self.facts()
            switch_dt = 0.0
            if facts is not None:
                dst = self.e.name_of(self.policy.decide(facts, self.e.layouts[self.current]))
                if dst != self.current:
                    ts = time.perf_counter()
                    self.switch(dst)
                    switch_dt = time.perf_counter() - ts - (self.res.graph_s - graph0)
            if self.pd_phase() == "decode":
                self.swap_in_ready()
            items = self.schedule()
            lay = self.current
            self.execute(items)
            tokens_out, prefilled, first, done = self.account(items)
            if self.pd and prefilled:  # prompts done in the prefill layout wait in the host tier
                t1 = time.perf_counter()
                self.tier.swap_out({s.req.rid: (s.replica, s.cached) for s in prefilled}, self.cache,
                                   self.e.layouts[self.current]).synchronize()
                self.res.swap_s += time.perf_counter() - t1
                for s in prefilled:
                    s.in_tier = True
            scheduled = sum(len(v) for v in items.values())
            captured = self.res.graph_s - graph0  # left out of the clock (see the module doc)
            dt, switch_dt, swap_dt = world_max([time.perf_counter() - t0 - captured, switch_dt,
                                                self.res.swap_s - swap0], self.e.device)
            self.res.switch_s = switch0 + switch_dt
            self.res.swap_s = swap0 + swap_dt
            self.clock += self.fixed_step_s or dt
            self.res.max_step_s = max(self.res.max_step_s, dt)
            if dt > SLOW_STEP_S:
                self.res.slow_steps.append((self.clock, dt, lay, scheduled_tokens(items), scheduled))
            self.res.first_t.update(dict.fromkeys(first, self.clock))
            self.res.done_t.update(dict.fromkeys(done, self.clock))
            if scheduled:
                idle = 0
                self.res.steps[lay] += 1
                self.res.emitted.append((self.clock, tokens_out))
            else:
                idle += 1
                if self.next < n and not any(not s.in_tier for s in self.seqs.values()):
                    self.clock = max(self.clock, self.requests[self.next].arrival)
                elif idle > 3:
                    raise RuntimeError(f"{self.name}: the scheduler is stuck at t={self.clock:.3f}s in {self.current} "
                                       f"({len(self.seqs)} live, {len(self.queue)} queued, facts {facts})")
            if self.e.rank == 0 and time.perf_counter() - last_log >= self.progress_s:
                last_log = time.perf_counter()
                self.log(f"{self.name}: t={self.clock:8.2f}s done {len(self.res.done_t)}/{n} live {len(self.seqs)} "
                         f"queued {len(self.queue)} layout {self.current} steps {sum(self.res.steps.values())}")
        self.res.layout_spans.append((self.span_start, self.clock, self.current))
        self.res.end = self.clock
        self.res.wall_s = time.perf_counter() - wall0
        got: list = [None] * self.e.world
        dist.all_gather_object(got, self.res.outputs)
        for part in got:
            self.res.outputs.update(part)
        if self.pd:
            self.tier.drop(list(self.tier.sequences))
        return self.res
