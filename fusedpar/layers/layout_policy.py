"""Which declared layout runs the next step: one interface, four policies.

Contract of every policy:
  * `layouts`: the declared ParallelLayouts (one world size, no duplicates), in declaration order;
    `initial`: the layout to start in.
  * `decide(facts, current) -> ParallelLayout`: the layout of the next step, always one of `layouts`
    (the declared object itself). `current` is the layout the ranks run now (one of `layouts`).
  * Deterministic and stateless: the answer is a function of (facts, current) and the policy's
    configuration only. StepFacts hold what the scheduler already hands every rank (the same
    numbers on every rank), so every rank reaches the same answer with no collective. A caller
    keeps `current` itself: current = policy.decide(facts, current) once per step.
  * A policy only decides. Carrying a switch out (weights views, KV re-sharding, pausing and resuming
    requests with their KV kept) is the caller's (e.g. the HF adapter's model.reshard(layout)).
  * Bad configurations and facts raise ValueError naming the constraint and the numbers.

Policies:
  ShiftThresholdPolicy  base (SP x TP) above a token threshold, shift (TP over the replica) otherwise:
                        the step's StepModeRule (fusedpar.layers.step_plan) as a choice of layout.
  LoadPolicy            DP under high load, TP when light, with hysteresis; an urgent request moves
                        to TP at once (dynamic DP <-> TP serving).
  PrefillDecodePolicy   prefill in one layout until the host KV tier is full or nothing waits, then
                        decode in another until the host tier is empty (prefill/decode re-sharding).
  AutoPolicy            the layout with the least estimated time to serve the visible work, among
                        those that meet a latency goal for the waiting requests, from measured
                        per-layout step-time curves.
"""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass

from fusedpar.layers.step_plan import StepModeRule
from fusedpar.layouts import ParallelLayout, StepMode


def _count(name: str, value: object, minimum: int = 0) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")
    return value


def _seconds(name: str, value: object, *, allow_zero: bool) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be a finite number of seconds {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class StepFacts:
    """What the scheduler knows before a step; every rank holds the same numbers.

    scheduled_tokens: tokens in the step about to run (>= 1).
    running / waiting: requests running (KV resident) and waiting for their first step.
    waiting_prefill_tokens: prompt tokens of the waiting requests not yet prefilled.
    host_tier_used / host_tier_capacity: host KV tier occupancy, in one unit (blocks or tokens);
        capacity 0 means no host tier.
    priorities: one int per visible (running or waiting) request, any order, lower = more urgent
        (vLLM's convention); empty when the scheduler does not use priorities.
    """

    scheduled_tokens: int
    running: int = 0
    waiting: int = 0
    waiting_prefill_tokens: int = 0
    host_tier_used: int = 0
    host_tier_capacity: int = 0
    priorities: tuple[int, ...] = ()

    def __post_init__(self):
        _count("scheduled_tokens", self.scheduled_tokens, 1)
        for name in ("running", "waiting", "waiting_prefill_tokens", "host_tier_used", "host_tier_capacity"):
            _count(name, getattr(self, name))
        if self.host_tier_used > self.host_tier_capacity:
            raise ValueError(f"host_tier_used={self.host_tier_used} exceeds host_tier_capacity="
                             f"{self.host_tier_capacity}")
        if self.waiting_prefill_tokens and not self.waiting:
            raise ValueError(f"waiting_prefill_tokens={self.waiting_prefill_tokens} with waiting=0 requests")
        prios = tuple(self.priorities)
        if any(isinstance(p, bool) or not isinstance(p, int) for p in prios):
            raise ValueError(f"priorities must be ints, got {prios!r}")
        if len(prios) > self.running + self.waiting:
            raise ValueError(f"{len(prios)} priorities for running + waiting = {self.running} + {self.waiting} "
                             "requests: at most one priority per visible request")
        object.__setattr__(self, "priorities", prios)


class LayoutPolicy:
    """Base of the policies: the declared layouts, their checks, and the decide() contract (module doc)."""

    def __init__(self, *layouts: ParallelLayout, initial: ParallelLayout | None = None):
        if not layouts:
            raise ValueError("a layout policy needs at least one declared layout")
        for lay in layouts:
            if not isinstance(lay, ParallelLayout):
                raise ValueError(f"declared layouts must be ParallelLayout, got {lay!r}")
        sizes = sorted({lay.world_size for lay in layouts})
        if len(sizes) > 1:
            raise ValueError(f"declared layouts must share one world size, got world sizes {sizes}: {list(layouts)}")
        if len(set(layouts)) != len(layouts):
            raise ValueError(f"declared layouts must differ, got {list(layouts)}")
        self.layouts: tuple[ParallelLayout, ...] = layouts
        self.initial = self._declared(layouts[0] if initial is None else initial, "initial")

    def _declared(self, layout: ParallelLayout, what: str) -> ParallelLayout:
        """The declared object equal to `layout` (ValueError if none)."""
        for lay in self.layouts:
            if lay == layout:
                return lay
        raise ValueError(f"{what} layout {layout!r} is not one of the declared layouts {list(self.layouts)}")

    def decide(self, facts: StepFacts, current: ParallelLayout) -> ParallelLayout:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(map(repr, self.layouts))})"


class ShiftThresholdPolicy(LayoutPolicy):
    """`base` when scheduled_tokens > threshold, else its shift layout (TP over each replica:
    sp=1, tp=base.sp*base.tp, same dp). The rule is StepModeRule's, including threshold=None for
    DEFAULT_SHIFT_THRESHOLD and sp == 1 (one layout, always answered)."""

    def __init__(self, base: ParallelLayout, threshold: int | None = None):
        if not isinstance(base, ParallelLayout):
            raise ValueError(f"base must be a ParallelLayout, got {base!r}")
        self.rule = StepModeRule(threshold)
        shift = ParallelLayout(base.world_size, sp=1, tp=base.replica_size, dp=base.dp)
        self.base, self.shift = base, (base if shift == base else shift)
        super().__init__(*((base,) if self.shift is base else (base, shift)))

    def decide(self, facts: StepFacts, current: ParallelLayout) -> ParallelLayout:
        self._declared(current, "current")
        return self.base if self.rule.mode(facts.scheduled_tokens, self.base.sp) == StepMode.BASE else self.shift

    def __repr__(self) -> str:
        return f"ShiftThresholdPolicy({self.base!r}, threshold={self.rule.threshold})"


class LoadPolicy(LayoutPolicy):
    """DP <-> TP by load, with hysteresis and urgent requests.

    load = running + waiting requests. From `tp`, switch to `dp` when load >= high; from `dp`,
    switch to `tp` when load <= low; in between stay (low < high, so no load flips it back and
    forth). Any visible request with priority <= urgent_priority makes the answer `tp` whatever the
    load (urgent_priority=None: priorities are ignored); once none is left the load rule resumes
    from `tp`. Paused DP work keeps its KV: the policy only names the layout.
    """

    def __init__(self, dp: ParallelLayout, tp: ParallelLayout, *, low: int, high: int,
                 urgent_priority: int | None = None, initial: ParallelLayout | None = None):
        super().__init__(dp, tp, initial=initial)
        low, high = _count("low", low), _count("high", high)
        if not low < high:
            raise ValueError(f"LoadPolicy needs low < high (the hysteresis band), got low={low}, high={high}")
        if urgent_priority is not None and (isinstance(urgent_priority, bool) or not isinstance(urgent_priority, int)):
            raise ValueError(f"urgent_priority must be an int or None, got {urgent_priority!r}")
        self.dp, self.tp = self.layouts
        self.low, self.high, self.urgent_priority = low, high, urgent_priority

    def decide(self, facts: StepFacts, current: ParallelLayout) -> ParallelLayout:
        current = self._declared(current, "current")
        if self.urgent_priority is not None and any(p <= self.urgent_priority for p in facts.priorities):
            return self.tp
        load = facts.running + facts.waiting
        if current is self.tp:
            return self.dp if load >= self.high else self.tp
        return self.tp if load <= self.low else self.dp

    def __repr__(self) -> str:
        return (f"LoadPolicy(dp={self.dp!r}, tp={self.tp!r}, low={self.low}, high={self.high}, "
                f"urgent_priority={self.urgent_priority})")


class PrefillDecodePolicy(LayoutPolicy):
    """Prefill phase in `prefill`, decode phase in `decode`; the phase changes only at two points:
      prefill -> decode when the host KV tier is full (used == capacity) or nothing waits;
      decode -> prefill when the host KV tier is empty and something waits.
    Otherwise the current layout stays. Needs a host tier (host_tier_capacity >= 1 in the facts).
    Starts in `prefill`."""

    def __init__(self, prefill: ParallelLayout, decode: ParallelLayout):
        super().__init__(prefill, decode)
        self.prefill, self.decode = self.layouts

    def decide(self, facts: StepFacts, current: ParallelLayout) -> ParallelLayout:
        current = self._declared(current, "current")
        if facts.host_tier_capacity < 1:
            raise ValueError(f"PrefillDecodePolicy needs a host KV tier: host_tier_capacity must be >= 1, "
                             f"got {facts.host_tier_capacity}")
        if current is self.prefill:
            full = facts.host_tier_used == facts.host_tier_capacity
            return self.decode if full or facts.waiting == 0 else self.prefill
        return self.prefill if facts.host_tier_used == 0 and facts.waiting > 0 else self.decode


class StepTimeCurve:
    """Measured seconds per step against tokens per step, for one layout.

    points: (tokens, seconds) pairs, tokens strictly increasing ints >= 1, seconds finite > 0.
    t(n): linear interpolation between the points; t(first) below the first point (a smaller step
    is taken to cost no less); above the last, t(last) * n / tokens(last) (at most linear growth).
    """

    def __init__(self, points):
        pts = [tuple(p) for p in points]
        if not pts or any(len(p) != 2 for p in pts):
            raise ValueError(f"a step-time curve needs (tokens, seconds) pairs, got {points!r}")
        tokens = [_count("curve tokens", n, 1) for n, _ in pts]
        if any(b <= a for a, b in itertools.pairwise(tokens)):
            raise ValueError(f"curve tokens must be strictly increasing, got {tokens}")
        self.tokens = tuple(tokens)
        self.seconds = tuple(_seconds("curve seconds", s, allow_zero=False) for _, s in pts)

    def __call__(self, n: int) -> float:
        n = _count("tokens", n, 1)
        ts, ss = self.tokens, self.seconds
        if n <= ts[0]:
            return ss[0]
        if n >= ts[-1]:
            return ss[-1] * n / ts[-1]
        i = next(k for k in range(1, len(ts)) if ts[k] >= n)
        return ss[i - 1] + (ss[i] - ss[i - 1]) * (n - ts[i - 1]) / (ts[i] - ts[i - 1])

    def __repr__(self) -> str:
        return f"StepTimeCurve({list(zip(self.tokens, self.seconds, strict=True))})"


class AutoPolicy(LayoutPolicy):
    """The layout that serves the visible work soonest, within a latency goal for waiting requests.

    Layouts of one replica size (SP <-> TP splits of the same replicas, e.g. SP=P and TP=P) switch
    for free: their KV stays where it is (fusedpar.layouts.kv_plan moves none) and the weights are
    views. Any other switch costs switch_s. For each declared layout L, with n = scheduled_tokens,
    W = waiting_prefill_tokens, B = running + waiting requests, t_L its step-time curve (prefill
    steps: tokens per step) and d_L its decode curve (B sequences, one token each; t_L if none given):
        step_L   = d_L(n) for a decode step (nothing waits and n == running: one token per request),
                   t_L(n) otherwise
        switch_L = 0 if L has the current layout's replica size, else switch_s
        ttft_L   = switch_L + step_L + (t_L(W) if W > 0 else 0)
                   (the waiting requests have their first token once this step and one step of their
                   prefill have run in L)
        decode_L = min of d_M(B) over the declared M of L's replica size (L itself included)
                   (after this step the decode steps run in whichever of those is fastest, for free)
        serve_L  = ttft_L + decode_steps * decode_L   (B >= 1; else no decode term)
    The goal holds for L when nothing waits or ttft_L <= latency_goal_s. Answer: the L with the least
    serve_L among those meeting the goal; if none does, the L with the least ttft_L. Ties go to
    `current`, then to declaration order. switch_s > 0 keeps the current replica size unless another
    saves more than the switch costs.
    """

    def __init__(self, curves: dict[ParallelLayout, StepTimeCurve | list], *, latency_goal_s: float,
                 decode_steps: int = 0, switch_s: float = 0.0, initial: ParallelLayout | None = None,
                 decode_curves: dict[ParallelLayout, StepTimeCurve | list] | None = None):
        if not isinstance(curves, dict) or not curves:
            raise ValueError(f"AutoPolicy needs a non-empty dict layout -> step-time curve, got {curves!r}")
        super().__init__(*curves, initial=initial)
        self.curves = {lay: c if isinstance(c, StepTimeCurve) else StepTimeCurve(c) for lay, c in curves.items()}
        if decode_curves is None:
            self.decode_curves = dict(self.curves)
        else:
            if not isinstance(decode_curves, dict) or set(decode_curves) != set(curves):
                got = list(decode_curves) if isinstance(decode_curves, dict) else decode_curves
                raise ValueError(f"AutoPolicy: decode_curves must cover the same layouts as curves "
                                 f"({list(curves)}), got {got!r}")
            self.decode_curves = {lay: c if isinstance(c, StepTimeCurve) else StepTimeCurve(c)
                                  for lay, c in decode_curves.items()}
        self.latency_goal_s = _seconds("latency_goal_s", latency_goal_s, allow_zero=False)
        self.decode_steps = _count("decode_steps", decode_steps)
        self.switch_s = _seconds("switch_s", switch_s, allow_zero=True)

    def estimates(self, facts: StepFacts, current: ParallelLayout) -> dict[ParallelLayout, tuple[float, float]]:
        """Layout -> (ttft_L, serve_L) as defined in the class doc."""
        current = self._declared(current, "current")
        batch = facts.running + facts.waiting
        decode_step = facts.waiting == 0 and facts.scheduled_tokens == facts.running
        out = {}
        for lay in self.layouts:
            t = self.curves[lay]
            free = lay.replica_size == current.replica_size
            step = (self.decode_curves[lay] if decode_step else t)(facts.scheduled_tokens)
            ttft = (0.0 if free else self.switch_s) + step
            if facts.waiting_prefill_tokens:
                ttft += t(facts.waiting_prefill_tokens)
            decode = min(self.decode_curves[m](batch) for m in self.layouts
                         if m.replica_size == lay.replica_size) if batch else 0.0
            out[lay] = (ttft, ttft + self.decode_steps * decode)
        return out

    def decide(self, facts: StepFacts, current: ParallelLayout) -> ParallelLayout:
        current = self._declared(current, "current")
        est = self.estimates(facts, current)
        order = [current] + [lay for lay in self.layouts if lay is not current]  # min() keeps the first of ties
        meeting = [lay for lay in order if facts.waiting == 0 or est[lay][0] <= self.latency_goal_s]
        if meeting:
            return min(meeting, key=lambda lay: est[lay][1])
        return min(order, key=lambda lay: est[lay][0])

    def __repr__(self) -> str:
        return (f"AutoPolicy({list(self.layouts)}, latency_goal_s={self.latency_goal_s}, "
                f"decode_steps={self.decode_steps}, switch_s={self.switch_s})")
