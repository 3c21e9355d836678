"""Step-time curves for AutoPolicy, measured on the ranks that serve.

AutoPolicy (fusedpar.layers.layout_policy) prices every declared layout L by two StepTimeCurves:
t_L, seconds of a prefill step against its tokens, and d_L, seconds of a decode step against its
sequences (one new token each). Both come from here:

    measure_step_times(step, cache, tokens, *, replicas=1, decode=False, iters=3) -> StepTimeCurve
        any step function: step(batch) runs one step of `batch` on this rank's replica (the stack,
        with an embedding and a sampler around it if the server has them) on `cache`;
    stack_step_times(stack, cache, tokens, *, decode=False, iters=3, mode=None) -> StepTimeCurve
        a ShiftParallelStack alone, on fixed random hidden states: the plain PyTorch path (CPU or
        GPU), or the fused one and its CUDA graphs where the stack has them.

Point n of `tokens` (strictly increasing ints >= 1) is one step of the whole layout, split over its
replicas: q = ceil(n / replicas) tokens per replica,
    prefill (decode=False): one sequence of q new tokens, nothing cached;
    decode  (decode=True):  q sequences holding one cached token each (an untimed step writes it
                            first), one new token each.
Per point one warm-up step, then `iters` timed ones: each from a barrier of every rank (the device
synchronised first) to the step's end (the device synchronised again); the median; with
torch.distributed initialised, the max over ranks (a step is as slow as its slowest rank), so every
rank returns the same curve. Collective: every rank of the world calls it with the same arguments.
The steps use sequence ids -q .. -1 of `cache` (they must be free) and free them after every step,
so the cache needs room for one point's sequences and keeps what else it holds.
"""

from __future__ import annotations

import operator
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from fusedpar.layers.kv_cache import PagedKVCache
from fusedpar.layers.layout_policy import StepTimeCurve
from fusedpar.layers.stack import ShiftParallelStack
from fusedpar.layers.step_plan import StepBatch


def _positive(name: str, value: object) -> int:
    try:
        n = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        n = None
    if n is None or n < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return n


def _points(tokens: Sequence[int]) -> tuple[int, ...]:
    """tokens, checked as a StepTimeCurve checks its points (ValueError naming them)."""
    return StepTimeCurve([(n, 1.0) for n in tokens]).tokens


def step_batches(tokens: int, replicas: int = 1, decode: bool = False) -> tuple[StepBatch | None, StepBatch]:
    """(the untimed step that writes the decode sequences' cached token, None for a prefill point;
    the timed step) of the point `tokens`, per replica (module doc)."""
    q = -(-_positive("tokens", tokens) // _positive("replicas", replicas))
    if not decode:
        return None, StepBatch((-1,), (q,), (0,))
    seqs = tuple(range(-q, 0))
    return StepBatch(seqs, (1,) * q, (0,) * q), StepBatch(seqs, (1,) * q, (1,) * q)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _max_over_ranks(value: float, device: torch.device) -> float:
    if not _distributed():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def measure_step_times(step: Callable[[StepBatch], object], cache: PagedKVCache, tokens: Sequence[int], *,
                       replicas: int = 1, decode: bool = False, iters: int = 3) -> StepTimeCurve:
    """The step-time curve of `step` at the points `tokens` (module doc): prefill steps of n tokens, or
    with decode=True decode steps of n sequences, over `replicas` replicas. Collective."""
    points = _points(tokens)
    replicas, iters = _positive("replicas", replicas), _positive("iters", iters)
    device = cache.k.device
    out = []
    for n in points:
        setup, batch = step_batches(n, replicas, decode)
        taken = [s for s in batch.seq_ids if s in cache.block_tables]
        if taken:
            raise ValueError(f"measure_step_times: sequences {taken} are in the cache; the steps need ids "
                             f"{batch.seq_ids[0]} .. -1 free")
        times = []
        for i in range(iters + 1):
            try:
                if setup is not None:
                    step(setup)
                _sync(device)
                if _distributed():
                    dist.barrier()
                t0 = time.perf_counter()
                step(batch)
                _sync(device)
                if i:  # the first step warms up
                    times.append(time.perf_counter() - t0)
            finally:
                for seq in batch.seq_ids:
                    cache.free(seq)
        out.append((n, _max_over_ranks(statistics.median(times), device)))
    return StepTimeCurve(out)


def stack_step_times(stack: ShiftParallelStack, cache: PagedKVCache, tokens: Sequence[int], *,
                     decode: bool = False, iters: int = 3, mode: str | None = None, seed: int = 0) -> StepTimeCurve:
    """measure_step_times of `stack` itself on `cache` (one of its caches: stack.make_cache), over its
    layout's replicas, on seeded random hidden states; mode: forced for every step (None: the stack's
    policy, as serving runs it). Collective: every rank of the stack's world."""
    points = _points(tokens)
    replicas = stack.ctx.layout.dp
    rows = -(-points[-1] // replicas)
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn((rows, stack.cfg.hidden_size), generator=gen).to(stack.ctx.device, stack.weight_dtype)

    def step(batch: StepBatch) -> torch.Tensor:
        return stack(hidden[:batch.num_tokens], batch, cache, mode=mode)

    return measure_step_times(step, cache, points, replicas=replicas, decode=decode, iters=iters)
