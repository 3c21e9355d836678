"""Shift-parallel decoder runs checked step by step against the unsharded oracle.

`run_layer_scenario` is the per-rank body of a multi-process run (see dist.run_distributed, or
torchrun on GPUs): it builds a ShiftParallelStack from seeded full weights (on the fused
kernels with fused=True), drives a list of steps (each forced
to a mode or left to the policy) on one shared PagedKVCache, and compares every step's output
with DenseDecoderStack in float64. It returns plain data so tests can assert on it and the
demo can print it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from fusedpar.collectives import ParallelContext
from fusedpar.kernels.fp8 import FP8Scheme
from fusedpar.layers import (
    DecoderConfig,
    DenseDecoderStack,
    ShiftParallelStack,
    StepBatch,
    StepModeRule,
    random_decoder_weights,
)
from fusedpar.layers.comm import FusedComm
from fusedpar.layers.fp8_weights import FP8Weight
from fusedpar.layouts import ParallelLayout, StepMode

FP8_SOURCES = ("q", "k", "v", "o", "gate", "up", "down")  # the weights an FP8 checkpoint quantises


@dataclass(frozen=True)
class Step:
    """A step: sequences with their new-token counts; mode None lets the policy choose.

    Context lengths are tracked by the runner (a sequence continues where it stopped).
    """

    seqs: tuple[tuple[int, int], ...]  # (seq_id, new tokens)
    mode: str | None = None


@dataclass
class StepRecord:
    mode: StepMode
    tokens: int
    padded_tokens: int
    rel_error: float
    seconds: float


@dataclass
class ScenarioResult:
    rank: int
    steps: list[StepRecord] = field(default_factory=list)
    cache_lengths: dict[int, int] = field(default_factory=dict)
    cache_rel_error: float = 0.0  # rank's cached k/v vs the oracle's, over every layer and sequence
    cache_rows_written: int = 0  # non-zero (layer, slot) rows in the cache: padding must add none
    kv_heads: tuple[int, ...] = ()

    def to_dict(self) -> dict:
        return asdict(self)


class FallbackFusedComm(FusedComm):
    """FusedComm without workspaces, so on any device: every stage takes the path of a group of one or
    of a step larger than the workspaces, its PlainComm fallback or, for half-precision GEMMs of at
    most fusedpar.kernels.gemv.MAX_M rows with nothing to exchange, the decode GEMM where the routing table
    routes them (on the Triton interpreter on CPU). Tests that fallback and routing logic on CPU."""

    def _build_workspaces(self) -> None:
        pass


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| in float64."""
    a, e = actual.double(), expected.double()
    return ((a - e).abs().max() / e.abs().max().clamp_min(1e-30)).item()


def run_layer_scenario(
    rank: int,
    world_size: int,
    cfg: DecoderConfig,
    sp: int,
    tp: int,
    steps: list[Step],
    *,
    num_layers: int = 2,
    threshold: int | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    block_size: int = 4,
    fused: bool = False,
    fused_ops: Callable[[ParallelContext, DecoderConfig], object] | None = None,
    fp8: FP8Scheme | None = None,
) -> ScenarioResult:
    """fused_ops: optional factory of a stand-in for FusedComm (same qkv / column_parallel / o_proj /
    row_parallel methods, e.g. plain collectives); the layers then run fused_fwd, on CPU too (the Triton
    attention needs TRITON_INTERPRET=1 there). Tests the fused layer's own logic without CUDA.
    fp8: quantise the seven projection weights with this scheme (FP8Weight), for the oracle and the stack alike."""
    layout = ParallelLayout(world_size, sp=sp, tp=tp)
    ctx = ParallelContext(layout)
    dev = ctx.device  # CPU under gloo, this rank's GPU under NCCL
    full = [random_decoder_weights(cfg, seed=seed + i, dtype=torch.float64, device=dev) for i in range(num_layers)]
    if fp8 is not None:
        full = [{k: FP8Weight.quantize(v, fp8) if k in FP8_SOURCES else v for k, v in w.items()} for w in full]
    oracle = DenseDecoderStack(cfg, full)
    stack = ShiftParallelStack.from_full_weights(
        cfg, ctx, [{k: v if isinstance(v, FP8Weight) else v.to(dtype) for k, v in w.items()} for w in full],
        StepModeRule(threshold)
    )
    total = sum(q for s in steps for _, q in s.seqs)
    if fused:  # Triton + symmetric-memory path (CUDA); workspaces sized for the largest step
        stack.enable_fused(max_tokens=max(-(-sum(q for _, q in s.seqs) // sp) * sp for s in steps))
    elif fused_ops is not None:
        stack.fused = fused_ops(ctx, cfg)
        for layer in stack.layers:
            layer.fused = stack.fused
            layer.forward = layer.fused_fwd  # forward() picks the fused path only for CUDA inputs
    cache = stack.make_cache(block_size=block_size, num_blocks=-(-total // block_size) + 2 * len(steps) + 4)
    result = ScenarioResult(rank=rank, kv_heads=stack.layers[0].kv_heads)
    gen = torch.Generator().manual_seed(seed + 1000)  # same inputs on every rank
    lengths: dict[int, int] = {}
    for step in steps:
        batch = StepBatch(tuple(s for s, _ in step.seqs), tuple(q for _, q in step.seqs),
                          tuple(lengths.get(s, 0) for s, _ in step.seqs))
        x = torch.randn(batch.num_tokens, cfg.hidden_size, generator=gen, dtype=torch.float64).to(dev)
        before = dict(stack.steps)
        t0 = time.perf_counter()
        y = stack(x.to(dtype), batch, cache, mode=step.mode)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        seconds = time.perf_counter() - t0
        mode = next(m for m in stack.steps if stack.steps[m] != before[m])
        expected = oracle.forward(x, batch)
        if y.shape != expected.shape:
            raise AssertionError(f"output shape {tuple(y.shape)} != expected {tuple(expected.shape)}")
        padded = -(-batch.num_tokens // sp) * sp if mode == StepMode.BASE else batch.num_tokens
        result.steps.append(StepRecord(mode, batch.num_tokens, padded, rel_error(y, expected), seconds))
        for s, q in step.seqs:
            lengths[s] = lengths.get(s, 0) + q

    kv = list(stack.layers[0].kv_heads)
    errs = []
    for li in range(num_layers):
        for sid in lengths:
            k, v = cache.gather(li, sid)
            rk, rv = oracle.kv[(li, sid)]
            errs += [rel_error(k, rk[:, kv]), rel_error(v, rv[:, kv])]
    result.cache_rel_error = max(errs)
    result.cache_lengths = dict(cache.lengths)
    result.cache_rows_written = int((cache.k.flatten(3).abs().sum(-1) != 0).sum())
    return result
