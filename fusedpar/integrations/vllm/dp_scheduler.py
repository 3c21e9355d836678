"""The scheduler of an engine with a "dp{P}" layout: every step a DP step (policy "dp"), or DP steps and
TP/SP steps side by side (policies "priority", "load" and "auto").

`DPScheduler` is vLLM's Scheduler with
  - placement (`Admission`, `LoadAdmission`): a request is placed once and keeps its place for its
    whole life. Policy "priority": when the engine admits it, a request whose vLLM priority value is
    at most tp_priority (vLLM serves lower values first) joins the TP/SP class. Policy "load": at the
    start of the first step that finds it waiting, by the engine's load then (running + waiting
    requests, fusedpar.layers.layout_policy.LoadPolicy with its hysteresis band): DP ranks while the
    load is high, the TP/SP class while it is low. Policy "auto": likewise at the first step that finds it
    waiting, in the class whose layout fusedpar.layers.layout_policy.AutoPolicy answers from the section's
    step-time curves and the queue then. Every other request is a DP request, the i-th DP
    request placed on rank i % P. Whatever the policy, a request whose full KV need (prompt + max_tokens)
    is more than one DP pool can ever hold joins the TP/SP class when the engine admits it, or, without a
    TP/SP class (policy "dp"), is refused there (dp_kv.outgrows_dp_pool);
  - KV pools: `kv_cache_manager` is a dp_kv.RoutingKVCacheManager of P DP pools and, with the TP/SP
    class, a TP pool on disjoint block ranges of every rank's buffer (dp_kv.KVSplit), so every
    allocation lands in the pool of the request's class and rank;
  - the step's mode (`Alternation`): each step is a DP step (DP requests only) or a TP step (TP/SP
    requests only: vLLM's base / shift path over the TP pool). While both classes have requests the
    modes alternate; otherwise every step is the mode of the class that has requests. vLLM's
    scheduling runs once per step over the step's class: a request of the other class is left out of
    the step (`_in_step`), keeping its KV blocks and computed tokens;
  - the step's tag: each SchedulerOutput carries `fusedpar_dp` (a DPTag: the step's mode, the rank of
    every request of a DP step, the new DP blocks each rank must zero, the DP pools' offset in the
    buffer), pickled with it to the workers: every rank takes the step's mode from it (dp_worker.py);
  - moves (policies "load" and "auto" with move_to_tp / move_to_dp, `MoveRule`; under "auto" read "the load" as "the
    placement's answer", which then charges each change the time its moves would take): at a step at which the load
    has fallen to TP, the TP/SP class has no request and DP requests are decoding, those requests move into the
    TP/SP class with their KV: the scheduler frees their DP blocks, allocates TP blocks for their computed tokens,
    makes the step a TP step and puts the plan (`KVMove`: request, source rank, source DP blocks, destination TP
    blocks) in the step's tag; every worker copies its kv-head group's slice of the source blocks into its TP blocks
    before the step's forward (dp_move.py). The way back: at a step at which the load has risen to DP, decoding
    TP/SP-class requests move to the DP ranks (each to the rank with the fewest DP requests whose pool holds its
    blocks), the step a DP step, every rank's kv-head group of the TP blocks gathered into the destination's DP
    blocks. The workers take a moved request as a new request whose prompt is its tokens so far and whose computed
    tokens are kept (`as_new_request`), so nothing is recomputed; the source blocks are free for the steps of their
    class after this step only (a step allocates no block of the other class);
  - no preemption: vLLM preempts by recompute and picks its victim among all running requests, which
    with per-class, per-rank pools may be in another pool than the full one; in this version a
    preemption is an error (give the engine more KV cache or fewer concurrent requests).
The token budget (max_num_batched_tokens) and max_num_seqs stay engine-wide, as in TP.

How vLLM's scheduling loop leaves a request out of a step depends on its release (dp_compat.py, one entry per
release): on 0.32 (vllm/v1/core/sched/scheduler.py, `Scheduler.schedule`) a running request for which
`_reserve_prefill_lookahead` answers 0 tokens is skipped ("num_new_tokens == 0: continue") and a waiting request for
which `_handle_blocked_waiting_request` answers False is skipped for the step and re-queued in its place; both
overrides below answer for the other class only and defer to vLLM's otherwise. On 0.26 the loop asks no such
question: for the step, the other class's running requests get a closed `next_decode_eligible_step` gate and its
waiting requests leave the queues (dp_compat.excluded). Every step's output is checked to hold its class alone.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from dataclasses import dataclass, field

from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from fusedpar.layers.layout_policy import AutoPolicy, LoadPolicy, StepFacts
from fusedpar.layouts import ParallelLayout

from . import dp_compat
from .config import parse_additional_config
from .dp_handoff import take
from .dp_kv import TP_CLASS, KVSplit, RoutingKVCacheManager, outgrows_dp_pool

TAG = "fusedpar_dp"
DP_STEP, TP_STEP = "dp", "tp"


@dataclass(frozen=True)
class KVMove:
    """One request moving between a DP rank and the TP/SP class at a step, with its KV for `tokens` computed tokens:
    DP blocks `dp_blocks` (pool-local ids of rank `rank`'s pool) and TP blocks `tp_blocks` (TP pool ids), the same
    count. In a TP step it moves into the TP/SP class (every rank receives its kv-head group's slice of the DP
    blocks), in a DP step to DP rank `rank` (which gathers every rank's kv-head group of the TP blocks)."""

    request_id: str
    rank: int
    dp_blocks: tuple[int, ...]
    tp_blocks: tuple[int, ...]
    tokens: int


@dataclass(frozen=True)
class DPTag:
    """What a step tells the workers beyond vLLM's SchedulerOutput.

    mode: DP_STEP (each rank runs its own requests) or TP_STEP (vLLM's base / shift path for the TP/SP
    class's requests, on every rank); ranks: request id -> rank for every request scheduled in a DP step;
    zero: rank -> the DP block ids (pool-local) of that rank's pool that vLLM wants zeroed before the
    step (each is P TP blocks on that rank); size: P; dp_offset: the DP block of the buffer that is id 0
    of every DP pool (dp_kv.KVSplit); moves: the requests moving between the classes at this step, into the TP/SP
    class in a TP step, to DP ranks in a DP step, whose KV every rank copies before the step's forward (KVMove)."""

    ranks: dict[str, int]
    size: int
    zero: dict[int, list[int]] = field(default_factory=dict)
    mode: str = DP_STEP
    dp_offset: int = 0
    moves: tuple[KVMove, ...] = ()


def movable(request) -> bool:
    """Whether a running request can move into the TP/SP class with its KV: it is decoding (its prompt computed)
    and the workers' sampling state of it reads nothing of its output tokens but the tokens themselves (the
    workers take it as a new request whose prompt is its tokens so far: no presence, frequency or repetition
    penalty, no seed, no min_tokens still pending, no bad words, logprobs, structured output or multimodal
    input)."""
    sp = request.sampling_params
    if (request.status != RequestStatus.RUNNING or request.num_computed_tokens < request.num_prompt_tokens
            or sp is None or request.mm_features or request.prompt_embeds is not None
            or getattr(request, "structured_output_request", None) is not None):
        return False
    return (sp.presence_penalty == 0 and sp.frequency_penalty == 0 and sp.repetition_penalty == 1
            and sp.seed is None and sp.min_tokens <= request.num_output_tokens and not sp.bad_words
            and sp.logprobs is None and sp.prompt_logprobs is None)


class MoveRule:
    """When running requests move between the classes with their KV (policy "load" or "auto" with move_to_tp /
    move_to_dp; under "auto" the load's answer is AutoAdmission's):
      - into the TP/SP class (to_tp): at the start of a step at which the placement answers the TP/SP class (the
        load has fallen to load_low), the class has no request (running or waiting) and DP requests are running;
        then every movable DP request (`movable`) whose blocks the TP pool can hold moves, in vLLM's running order;
      - to the DP ranks (to_dp): at the start of a step at which the placement answers DP (the load has risen to
        load_high) and TP/SP-class requests are running; then every movable one moves, in vLLM's running order, to
        the DP rank with the fewest requests among those whose pool can hold its blocks (none: it stays)."""

    def __init__(self, to_tp: bool, to_dp: bool = False):
        self.to_tp, self.to_dp = to_tp, to_dp

    @property
    def enabled(self) -> bool:
        return self.to_tp or self.to_dp

    def candidates(self, admission: Admission, running, waiting, placement) -> list:
        if getattr(admission, "current", None) is not getattr(admission, "tp_layout", False):
            return []
        return self.movers(True, running, waiting, placement)

    def candidates_to_dp(self, admission: Admission, running, placement) -> list:
        if getattr(admission, "current", None) is not getattr(admission, "dp_layout", False):
            return []
        return self.movers(False, running, (), placement)

    def movers(self, to_tp: bool, running, waiting, placement) -> list:
        """The requests that move into the TP/SP class (to_tp) or to the DP ranks at a step whose placement answers
        that way, before the destination pools' room is checked."""
        if not (self.to_tp if to_tp else self.to_dp):
            return []
        if to_tp and any(placement.get(r.request_id) == TP_CLASS for r in itertools.chain(running, waiting)):
            return []
        source = (lambda p: p is not None and p != TP_CLASS) if to_tp else (lambda p: p == TP_CLASS)
        return [r for r in running if source(placement.get(r.request_id)) and movable(r)]


def moves_priced(cfg) -> bool:
    """Whether the section's placement charges its changes of answer the KV moves they make (policy "auto" with
    move_to_tp or move_to_dp): its executor times KV moves at start-up (dp_executor.DPExecutor)."""
    return cfg is not None and cfg.policy == "auto" and (cfg.move_to_tp or cfg.move_to_dp)


def as_new_request(request, cached_index: int, c: CachedRequestData, block_ids) -> NewRequestData:
    """What the workers get for a request moved at this step: a new request whose prompt is its tokens so far
    (prompt and outputs up to the step's input), its computed tokens and its TP blocks, in place of its entry
    `cached_index` of the step's CachedRequestData `c` (taken before the step advanced it)."""
    computed = c.num_computed_tokens[cached_index]
    tokens = list(request.all_token_ids)
    new = NewRequestData.from_request(request, block_ids)
    is_ids = None if request.prompt_is_token_ids is None else [True] * len(tokens)
    return dataclasses.replace(new, prompt_token_ids=tokens, num_computed_tokens=computed, prompt_is_token_ids=is_ids)


def without_requests(c: CachedRequestData, drop: set[str]) -> CachedRequestData:
    """CachedRequestData `c` without the requests in `drop`."""
    keep = [i for i, rid in enumerate(c.req_ids) if rid not in drop]

    def pick(values: list) -> list:
        return [values[i] for i in keep] if len(values) == len(c.req_ids) else values

    return CachedRequestData(
        req_ids=[c.req_ids[i] for i in keep],
        resumed_req_ids={rid for rid in c.resumed_req_ids if rid not in drop},
        new_token_ids=pick(c.new_token_ids),
        all_token_ids={rid: ids for rid, ids in c.all_token_ids.items() if rid not in drop},
        new_block_ids=pick(c.new_block_ids),
        num_computed_tokens=pick(c.num_computed_tokens),
        num_output_tokens=pick(c.num_output_tokens),
    )


def zero_without_moves(zero: dict[int, list[int]], moves) -> dict[int, list[int]]:
    """The DP blocks to zero per rank (pool-local ids) without those a DP step's moves copy KV into."""
    copied = {(m.rank, b) for m in moves for b in m.dp_blocks}
    kept = {r: [b for b in ids if (r, b) not in copied] for r, ids in zero.items()}
    return {r: ids for r, ids in kept.items() if ids}


class Admission:
    """Where each request is served: TP_CLASS for a request whose vLLM priority value is at most
    tp_priority (None: no TP/SP class), else the DP ranks in turn. Placed when the engine admits it."""

    at_arrival = True  # placed by add_request; else at the start of the first step that finds it waiting

    def __init__(self, size: int, tp_priority: int | None = None):
        self.tp_priority = tp_priority
        self._ranks = itertools.cycle(range(size))

    def observe(self, running: int, waiting: int, waiting_prefill_tokens: int = 0, switch_s: float = 0.0) -> None:
        """The engine's requests at the start of a step and the prompt tokens its waiting requests have not
        computed yet (placement by priority does not read them); switch_s: the seconds the moves a change of answer
        would make take (read by policy "auto" with moves)."""

    def place(self, priority: int) -> int:
        if self.tp_priority is not None and priority <= self.tp_priority:
            return TP_CLASS
        return next(self._ranks)


class LoadAdmission(Admission):
    """Where each request is served by the engine's load (policy "load"): fusedpar's LoadPolicy between the
    DP layout (P replicas of one rank) and the TP/SP layout (one replica of P ranks), asked once per step
    with the running and waiting requests; the requests first seen waiting at that step join the TP/SP
    class while it answers TP, else the DP ranks in turn. Starts in the TP/SP class."""

    at_arrival = False

    def __init__(self, size: int, low: int, high: int):
        super().__init__(size)
        self.dp_layout, self.tp_layout = ParallelLayout(size, tp=1), ParallelLayout(size, tp=size)
        self.policy = LoadPolicy(self.dp_layout, self.tp_layout, low=low, high=high, initial=self.tp_layout)
        self.current = self.tp_layout

    def observe(self, running: int, waiting: int, waiting_prefill_tokens: int = 0, switch_s: float = 0.0) -> None:
        # LoadPolicy reads running and waiting; the step's token count is not known before it is scheduled
        self.current = self.policy.decide(StepFacts(scheduled_tokens=1, running=running, waiting=waiting),
                                          self.current)

    def place(self, priority: int) -> int:
        return TP_CLASS if self.current is self.tp_layout else next(self._ranks)


class AutoAdmission(Admission):
    """Where each request is served by step-time curves (policy "auto"): fusedpar's AutoPolicy between the DP
    layout and the TP/SP layout, fed with the section's curves (layout name -> (tokens, seconds) points) and
    asked at each step that finds requests waiting, with the queue then: the step's tokens (the running
    requests' one token each and the waiting prompt tokens, within the engine's token budget), the running
    and waiting requests and the waiting prompt tokens. The requests first seen waiting at that step join the
    class it answers. Without moves placement moves nothing, so no switch cost enters the estimates. With moves
    (moves True: move_to_tp / move_to_dp) it is asked at every step that finds requests running or waiting, since
    a change of answer moves the running requests (MoveRule), and each change costs the seconds those moves would
    take (switch_s of observe). Starts in the TP/SP class."""

    at_arrival = False

    def __init__(self, size: int, step_times, latency_goal_s: float, decode_steps: int, budget: int,
                 moves: bool = False):
        super().__init__(size)
        self.dp_layout, self.tp_layout = ParallelLayout(size, tp=1), ParallelLayout(size, tp=size)
        curves = dict(step_times)
        self.policy = AutoPolicy({self.dp_layout: curves[f"dp{size}"], self.tp_layout: curves[f"tp{size}"]},
                                 latency_goal_s=latency_goal_s, decode_steps=decode_steps, initial=self.tp_layout)
        self.budget, self.moves = budget, moves
        self.current = self.tp_layout

    def observe(self, running: int, waiting: int, waiting_prefill_tokens: int = 0, switch_s: float = 0.0) -> None:
        if not waiting and not (self.moves and running):
            return  # nothing to place or move
        tokens = max(1, min(self.budget, running + waiting_prefill_tokens))
        facts = StepFacts(scheduled_tokens=tokens, running=running, waiting=waiting,
                          waiting_prefill_tokens=waiting_prefill_tokens)
        self.policy.switch_s = switch_s if self.moves else 0.0
        self.current = self.policy.decide(facts, self.current)

    def place(self, priority: int) -> int:
        return TP_CLASS if self.current is self.tp_layout else next(self._ranks)


def admission_of(cfg, size: int, budget: int = 1, step_times=None) -> Admission:
    """The placement rule of the section's policy; budget: the engine's token budget per step
    (max_num_batched_tokens), which policy "auto" estimates steps with; step_times: policy "auto"'s curves when
    the section gives none (measured at start-up, dp_curves.py)."""
    if cfg.policy == "load":
        return LoadAdmission(size, cfg.load_low, cfg.load_high)
    if cfg.policy == "auto":
        return AutoAdmission(size, step_times or cfg.step_times, cfg.latency_goal_s, cfg.decode_steps, budget,
                             moves_priced(cfg))
    return Admission(size, cfg.tp_priority if cfg.policy == "priority" else None)


class Alternation:
    """The mode of each step from which classes have requests: the other mode than the last step's while
    both have, the mode of the one that has otherwise (the last step's when neither has). The first step
    that finds both classes with requests is a TP step."""

    def __init__(self):
        self.last = DP_STEP

    def next(self, dp_work: bool, tp_work: bool) -> str:
        if dp_work and tp_work:
            mode = TP_STEP if self.last == DP_STEP else DP_STEP
        elif dp_work or tp_work:
            mode = DP_STEP if dp_work else TP_STEP
        else:
            mode = self.last
        self.last = mode
        return mode


class DPScheduler(Scheduler):
    """vLLM's Scheduler with placement, per-class and per-rank KV pools and per-step modes (module docstring)."""

    def __init__(self, vllm_config, kv_cache_config, *args, **kwargs):
        super().__init__(vllm_config, kv_cache_config, *args, **kwargs)
        cfg = parse_additional_config(vllm_config.additional_config)
        P = vllm_config.parallel_config.tensor_parallel_size
        self.dp_size = P
        self.split = KVSplit.of(kv_cache_config.num_blocks, P, tp_class=cfg.has_tp_class)
        self.placement: dict[str, int] = {}
        self.cfg = cfg
        # policy "auto" without step_times: a placeholder until _measure_curves, at the end of __init__
        self.curves_pending = cfg.policy == "auto" and not cfg.step_times
        self.admission = (Admission(P) if self.curves_pending
                          else admission_of(cfg, P, self.scheduler_config.max_num_batched_tokens))
        self.alternation = Alternation()
        self.step_mode = DP_STEP
        self.move_rule = MoveRule(cfg.move_to_tp, cfg.move_to_dp)
        self.move_cost = take(vllm_config, "move_cost", "KV move cost") if moves_priced(cfg) else None
        # KV bytes of one token over every rank: each layer's page (one block of this rank's kv heads) per token
        self.kv_token_bytes = P * sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names)
                                      for g in kv_cache_config.kv_cache_groups) // self.block_size
        dp_pools = [self._make_pool(dataclasses.replace(kv_cache_config, num_blocks=self.split.dp_blocks))
                    for _ in range(P)]
        tp_pool = (self._make_pool(dataclasses.replace(kv_cache_config, num_blocks=self.split.tp_blocks))
                   if cfg.has_tp_class else None)
        self.kv_cache_manager = RoutingKVCacheManager(dp_pools, self.placement, tp_pool)
        if self.curves_pending:
            self._measure_curves(take(vllm_config, "executor", "executor"))
            self.curves_pending = False

    @functools.cached_property
    def vllm_internals(self) -> dp_compat.VllmInternals:
        """The running vLLM release's entry of dp_compat.INTERNALS."""
        return dp_compat.running()

    def _make_pool(self, kv_cache_config) -> KVCacheManager:
        # the arguments of vLLM's own manager (Scheduler.__init__), on one pool's blocks
        return KVCacheManager(
            kv_cache_config=kv_cache_config,
            max_model_len=self.max_model_len,
            max_in_flight_tokens=self.vllm_config.max_in_flight_tokens,
            enable_caching=False,
            **dp_compat.pool_arguments(self.vllm_internals, self),
            log_stats=self.log_stats,
            enable_kv_cache_events=self.enable_kv_cache_events,
            dcp_world_size=self.dcp_world_size,
            pcp_world_size=1,
            scheduler_block_size=self.block_size,
            hash_block_size=self.hash_block_size,
            metrics_collector=self.kv_metrics_collector,
            watermark=self.scheduler_config.watermark,
        )

    def add_request(self, request) -> None:
        rid = request.request_id
        if rid not in self.placement and rid not in self.requests:
            if outgrows_dp_pool(self.split, self.block_size, rid, request.num_prompt_tokens, request.max_tokens,
                                self.max_model_len):
                self.placement[rid] = TP_CLASS
            elif self.admission.at_arrival:
                self.placement[rid] = self.admission.place(request.priority)
        super().add_request(request)

    def _place_waiting(self) -> None:
        """Place the requests that wait unplaced (policies "load", "auto"), by the queue at the start of this
        step."""
        waiting = list(dp_compat.waiting_requests(self.vllm_internals, self))
        prefill = sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in waiting)
        self.admission.observe(len(self.running), len(waiting), prefill, self._switch_seconds(waiting))
        for request in waiting:
            if request.request_id not in self.placement:
                self.placement[request.request_id] = self.admission.place(request.priority)

    def _switch_seconds(self, waiting) -> float:
        """The seconds the moves a change of the placement's answer would make take (move_cost: timed at start-up):
        the requests MoveRule would move the other way, their computed tokens' KV over every rank. 0 without priced
        moves."""
        if self.move_cost is None:
            return 0.0
        to_tp = self.admission.current is not self.admission.tp_layout
        movers = self.move_rule.movers(to_tp, self.running, waiting, self.placement)
        return self.move_cost.seconds(len(movers), self.kv_token_bytes * sum(r.num_computed_tokens for r in movers))

    # ---- the step's class ----------------------------------------------------------------------------
    def _mode_of(self, request_id: str) -> str:
        return TP_STEP if self.placement[request_id] == TP_CLASS else DP_STEP

    def _in_step(self, request) -> bool:
        return self._mode_of(request.request_id) == self.step_mode

    def _classes_with_requests(self) -> tuple[bool, bool]:
        modes = {self._mode_of(r.request_id) for r in itertools.chain(
            self.running, dp_compat.waiting_requests(self.vllm_internals, self))}
        return DP_STEP in modes, TP_STEP in modes

    # vLLM's questions through which a step leaves the other class out, where its release asks them (dp_compat)
    def _reserve_prefill_lookahead(self, request, num_computed_tokens: int, num_new_tokens: int) -> int:
        if not self._in_step(request):
            return 0  # vLLM's running loop skips the request for this step
        return super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)

    def _handle_blocked_waiting_request(self, request) -> bool:
        # False: vLLM's waiting loop skips the request for this step and re-queues it in its place
        return self._in_step(request) and super()._handle_blocked_waiting_request(request)

    # ---- the step ------------------------------------------------------------------------------------
    def _relocate(self, request, src_pool, dst_pool, place: int) -> tuple[list[int], list[int]]:
        """Move `request`'s blocks from src_pool to dst_pool (placed at `place`): free its source blocks, allocate
        destination blocks for its computed tokens and the next one; (source blocks, destination blocks) of its
        computed tokens."""
        rid, tokens = request.request_id, request.num_computed_tokens
        n = -(-tokens // self.block_size)
        src = src_pool.get_block_ids(rid)
        if len(src) != 1 or len(src[0]) < n:
            raise RuntimeError(f"fusedpar DP: request {rid} holds blocks {src} for {tokens} computed tokens (one KV "
                               "cache group of whole blocks expected)")
        src_pool.free(request)
        self.placement[rid] = place
        if dst_pool.allocate_slots(request, 1) is None:
            raise RuntimeError(f"fusedpar DP: the destination pool could not allocate the blocks of moved request "
                               f"{rid}")
        return src[0][:n], dst_pool.get_block_ids(rid)[0][:n]

    def _blocks_needed(self, request) -> int:
        return -(-(request.num_computed_tokens + 1) // self.block_size)

    def _move_to_tp(self) -> list[KVMove]:
        """Move the requests MoveRule names from their DP pools into the TP pool (module docstring): free their DP
        blocks, place them in the TP/SP class, allocate TP blocks for their computed tokens and the next one."""
        kv = self.kv_cache_manager
        waiting = list(dp_compat.waiting_requests(self.vllm_internals, self))
        moves = []
        for request in self.move_rule.candidates(self.admission, self.running, waiting, self.placement):
            if kv.tp_pool.block_pool.get_num_free_blocks() < self._blocks_needed(request):
                break  # the TP pool holds no more: the rest stay on their ranks
            rank = self.placement[request.request_id]
            dp, tp = self._relocate(request, kv.dp_pools[rank], kv.tp_pool, TP_CLASS)
            moves.append(KVMove(request.request_id, rank, tuple(dp), tuple(tp), request.num_computed_tokens))
        return moves

    def _move_to_dp(self) -> list[KVMove]:
        """Move the requests MoveRule names from the TP pool to DP pools (module docstring), each to the rank with
        the fewest DP requests whose pool holds its blocks, at most one token budget of them (each needs one token of
        this step, and they go first in vLLM's running order so that the step schedules them)."""
        kv = self.kv_cache_manager
        moves = []
        budget = self.scheduler_config.max_num_batched_tokens
        for request in self.move_rule.candidates_to_dp(self.admission, self.running, self.placement)[:budget]:
            need = self._blocks_needed(request)
            load = [0] * self.dp_size
            for place in self.placement.values():
                if place != TP_CLASS:
                    load[place] += 1
            room = [r for r in range(self.dp_size) if kv.dp_pools[r].block_pool.get_num_free_blocks() >= need]
            if not room:
                continue  # no DP pool holds it: it stays in the TP/SP class
            rank = min(room, key=lambda r: (load[r], r))
            tp, dp = self._relocate(request, kv.tp_pool, kv.dp_pools[rank], rank)
            moves.append(KVMove(request.request_id, rank, tuple(dp), tuple(tp), request.num_computed_tokens))
        moved = {m.request_id for m in moves}
        self.running.sort(key=lambda r: r.request_id not in moved)  # stable: the moved first, in their order
        return moves

    def _deliver_moves(self, out, moves: list[KVMove]) -> None:
        """Turn the moved requests' entries of the step's output into new requests (as_new_request) and keep
        their copied TP blocks out of the blocks to zero (a TP step's moves; a DP step's: zero_without_moves)."""
        c = out.scheduled_cached_reqs
        missing = [m.request_id for m in moves if m.request_id not in c.req_ids]
        if missing:
            raise RuntimeError(f"fusedpar DP: moved requests {missing} were not scheduled in the step they moved at")
        new = [as_new_request(self.requests[m.request_id], c.req_ids.index(m.request_id), c,
                              self.kv_cache_manager.get_block_ids(m.request_id)) for m in moves]
        out.scheduled_cached_reqs = without_requests(c, {m.request_id for m in moves})
        out.scheduled_new_reqs = [*out.scheduled_new_reqs, *new]
        copied = {b for m in moves for b in m.tp_blocks}
        if out.new_block_ids_to_zero and self.step_mode == TP_STEP:
            out.new_block_ids_to_zero = [b for b in out.new_block_ids_to_zero if b not in copied] or None

    def schedule(self, *args, **kwargs):
        if not self.admission.at_arrival:
            self._place_waiting()
        moves = self._move_to_tp() if self.move_rule.to_tp else []
        to_dp = self._move_to_dp() if self.move_rule.to_dp and not moves else []
        self.step_mode = self.alternation.next(*self._classes_with_requests())
        if moves or to_dp:  # the moved requests run in this step, which copies their KV
            self.step_mode = self.alternation.last = TP_STEP if moves else DP_STEP
            moves = moves or to_dp
        with dp_compat.excluded(self.vllm_internals, self, self._in_step):
            out = super().schedule(*args, **kwargs)
        if moves:
            self._deliver_moves(out, moves)
        strays = sorted(rid for rid in out.num_scheduled_tokens if self._mode_of(rid) != self.step_mode)
        if strays:
            raise RuntimeError(f"fusedpar DP: a {self.step_mode} step scheduled requests {strays} of the other class "
                               "(vLLM's scheduling loop did not leave them out: a vLLM version this plugin does not "
                               "know)")
        zero = zero_without_moves(self.kv_cache_manager.take_new_block_ids_by_rank(), to_dp)
        ranks = {rid: self.placement[rid] for rid in out.num_scheduled_tokens} if self.step_mode == DP_STEP else {}
        tag = DPTag(ranks=ranks, size=self.dp_size, zero=zero if self.needs_kv_cache_zeroing else {},
                    mode=self.step_mode, dp_offset=self.split.dp_offset, moves=tuple(moves))
        setattr(out, TAG, tag)
        return out

    # ---- policy "auto"'s curves, measured at start-up ---------------------------------------------------------
    def _measure_curves(self, executor) -> None:
        """Measure policy "auto"'s step-time curves through the engine's executor (its workers and KV cache are up,
        the engine serves nothing yet) and place requests by them (dp_curves.py): each point's requests, placed by
        hand, run as the engine core runs a step (`_step`); the workers' stats are reset afterwards."""
        from vllm import SamplingParams
        from vllm.v1.request import Request

        from .dp_curves import measure_curves

        vocab = self.vllm_config.model_config.get_vocab_size()
        budget = self.scheduler_config.max_num_batched_tokens

        def run_step(layout: str, tokens: int, index: int) -> float:
            dp = layout.startswith("dp")
            count = self.dp_size if dp else 1
            rids = [f"fusedpar-measure-{index}-{r}" for r in range(count)]
            for r, rid in enumerate(rids):
                ids = [(7 * index + 13 * r + 31 * t) % vocab for t in range(-(-tokens // count))]
                params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
                self.placement[rid] = r if dp else TP_CLASS
                self.add_request(Request(rid, ids, params, None))
            t0 = time.perf_counter()
            self._step(executor)
            seconds = time.perf_counter() - t0
            left = [rid for rid in rids if rid in self.requests]
            if left:
                raise RuntimeError(f"requests {left} of a {tokens}-token step did not finish in that step")
            for _ in range(2):  # the finished requests' ids reach the workers in the next (empty) step
                if self.has_requests():
                    self._step(executor)
            if self.has_requests():
                raise RuntimeError(f"the scheduler still holds requests after a {tokens}-token step and two more")
            return seconds

        curves = measure_curves(run_step, self.dp_size, budget)
        step_times = tuple((name, tuple(points)) for name, points in curves.items())
        self.admission = admission_of(self.cfg, self.dp_size, budget, step_times)
        self.alternation = Alternation()
        executor.collective_rpc("fusedpar_reset_stats")

    def _step(self, executor) -> None:
        """One step as vLLM's EngineCore.step runs it (vllm/v1/engine/core.py): schedule, execute, sample where the
        workers answered None, update from the output."""
        out = self.schedule()
        result = executor.execute_model(out)
        if result is None:
            result = executor.sample_tokens(self.get_grammar_bitmask(out))
        self.update_from_output(out, result)

    def _preempt_request(self, request, *args, **kwargs) -> None:
        kv = self.kv_cache_manager
        place = self.placement.get(request.request_id)
        where = "the TP/SP class" if place == TP_CLASS else f"rank {place}"
        usage = [round(p.usage, 3) for p in kv.dp_pools]
        tp = (f"; TP pool: {round(kv.tp_pool.usage, 3)} of {self.split.tp_blocks} TP blocks"
              if kv.tp_pool is not None else "")
        raise RuntimeError(
            f"fusedpar DP: vLLM would preempt request {request.request_id} ({where}); preemption with per-class, "
            f"per-rank KV pools is not supported in this version. KV usage per rank: {usage} of "
            f"{self.split.dp_blocks} DP blocks each{tp}; give the engine more KV cache "
            "(VLLM_CPU_KVCACHE_SPACE / gpu_memory_utilization) or lower max_num_seqs")

    def _free_request_blocks(self, request) -> None:
        if request.request_id in self.placement:  # one finished before any step placed it holds no blocks
            super()._free_request_blocks(request)

    def _free_blocks(self, request) -> None:
        super()._free_blocks(request)
        self.placement.pop(request.request_id, None)
