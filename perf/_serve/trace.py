"""A bursty request trace: Poisson arrivals in alternating low-load and burst phases.

Phases alternate low, burst, low, ... starting with low; each phase lasts its kind's duration and
draws its rate uniformly from its kind's range (requests/s, times rate_scale). Inside a phase the
gaps between arrivals are exponential with that rate; the trace ends at the n-th arrival (the last
phase is cut there). Prompt and output lengths are uniform integers in their inclusive ranges; a
request is high priority (0, else 1) with probability priority_frac. One random.Random(seed) draws
everything in a fixed order, so a seed gives the same trace on every rank and for every policy.
make_flood draws the requests of a saturated run the same way, all arriving at t = 0.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Request:
    rid: int
    arrival: float  # seconds from the start of the trace
    prompt_len: int
    output_len: int  # tokens generated, the prefill's first token included
    priority: int  # 0: high, 1: normal (lower = more urgent)
    phase: int  # index of the phase it arrived in

    @property
    def footprint(self) -> int:
        """Tokens it caches at most: prompt + every output token but the last."""
        return self.prompt_len + self.output_len - 1


@dataclass(frozen=True)
class Phase:
    kind: str  # "low" or "burst"
    start: float
    end: float
    rate: float  # offered requests/s


@dataclass(frozen=True)
class TraceSpec:
    requests: int
    seed: int = 0
    low_rate: tuple[float, float] = (2.0, 5.0)
    burst_rate: tuple[float, float] = (10.0, 30.0)
    low_seconds: float = 20.0
    burst_seconds: float = 5.0
    prompt: tuple[int, int] = (100, 2000)
    output: tuple[int, int] = (50, 500)
    priority_frac: float = 0.0
    rate_scale: float = 1.0

    def __post_init__(self):
        if self.requests < 1:
            raise ValueError(f"requests must be >= 1, got {self.requests}")
        for name in ("low_rate", "burst_rate", "prompt", "output"):
            lo, hi = getattr(self, name)
            if not 0 < lo <= hi:
                raise ValueError(f"{name} range must satisfy 0 < lo <= hi, got {(lo, hi)}")
        if min(self.low_seconds, self.burst_seconds, self.rate_scale) <= 0:
            raise ValueError("phase durations and rate_scale must be > 0")
        if not 0 <= self.priority_frac <= 1:
            raise ValueError(f"priority_frac must be in [0, 1], got {self.priority_frac}")


def make_trace(spec: TraceSpec) -> tuple[list[Request], list[Phase]]:
    """(requests in arrival order, phases up to the last arrival)."""
    rng = random.Random(spec.seed)
    requests: list[Request] = []
    phases: list[Phase] = []
    start = 0.0
    while len(requests) < spec.requests:
        kind = "low" if len(phases) % 2 == 0 else "burst"
        lo, hi = spec.low_rate if kind == "low" else spec.burst_rate
        rate = rng.uniform(lo, hi) * spec.rate_scale
        end = start + (spec.low_seconds if kind == "low" else spec.burst_seconds)
        t = start
        while len(requests) < spec.requests:
            t += rng.expovariate(rate)
            if t >= end:
                break
            requests.append(Request(len(requests), t, rng.randint(*spec.prompt), rng.randint(*spec.output),
                                    0 if rng.random() < spec.priority_frac else 1, len(phases)))
        if len(requests) == spec.requests:
            end = requests[-1].arrival
        phases.append(Phase(kind, start, end, rate))
        start = end
    return requests, phases


def make_flood(spec: TraceSpec, n: int) -> list[Request]:
    """n requests arriving at once (t = 0, one "flood" phase), lengths and priorities drawn as in the trace
    from random.Random(spec.seed + 1): the saturated run that measures a layout policy's capacity."""
    if n < 1:
        raise ValueError(f"a flood needs >= 1 request, got {n}")
    rng = random.Random(spec.seed + 1)
    return [Request(i, 0.0, rng.randint(*spec.prompt), rng.randint(*spec.output),
                    0 if rng.random() < spec.priority_frac else 1, 0) for i in range(n)]


def prompt_ids(req: Request, vocab: int, seed: int) -> torch.Tensor:
    """The request's prompt token ids [prompt_len] (int64, CPU): the same on every rank and in the reference."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + req.rid)
    return torch.randint(vocab, (req.prompt_len,), generator=gen, dtype=torch.int64)
