"""The plugin's stats: steps and tokens per mode (`StepCounter`), and what `stats(llm)` returns."""

from __future__ import annotations

from fusedpar.layouts import StepMode

from .shift_trace import decoder_compiled

STAT_KEYS = ("base_steps", "shift_steps", "base_tokens", "shift_tokens", "base_padding_tokens")


class StepCounter:
    """The stats of the workload's steps.

    A step the model runs is counted at its end (`model_step`). A step vLLM replays as a full CUDA
    graph (decode batches up to its capture size: always shift) runs no Python of the model; the
    sampler's logits call that follows every step sees it: a logits call with no model step since the last one
    is such a replay, of `rows` tokens (one per sequence). Model steps that are not the workload's
    (profile, warm-up: `counted` False) still pair with their logits call; graph captures pair with
    none and are not model steps here. Replays count once the engine serves (after its first
    counted step), so vLLM's warm-up sampler calls are not steps.
    """

    def __init__(self):
        self.stats = dict.fromkeys(STAT_KEYS, 0)
        self._pending = False  # a model step whose logits call has not come yet
        self._serving = False

    def model_step(self, mode: str, tokens: int, padding: int, counted: bool) -> None:
        self._pending = True
        if counted:
            self._serving = True
            self.stats[f"{mode}_steps"] += 1
            self.stats[f"{mode}_tokens"] += tokens
            if mode == StepMode.BASE:
                self.stats["base_padding_tokens"] += padding

    def logits(self, rows: int) -> None:
        if self._pending:
            self._pending = False
        elif self._serving:
            self.stats["shift_steps"] += 1
            self.stats["shift_tokens"] += rows

    def reset(self) -> None:
        self.stats = dict.fromkeys(STAT_KEYS, 0)


class DPRecord:
    """What one rank served in DP steps (layout "dp{P}"): steps and tokens of its own requests, and the
    ids of those requests (the ranks' sets are disjoint: each request lives on one rank)."""

    def __init__(self):
        self.steps = self.tokens = 0
        self.requests: set[str] = set()

    def step(self, request_tokens: dict[str, int]) -> None:
        if request_tokens:
            self.steps += 1
            self.tokens += sum(request_tokens.values())
            self.requests.update(request_tokens)

    def reset(self) -> None:
        self.__init__()

    def stats(self) -> dict:
        return {"dp_steps": self.steps, "dp_tokens": self.tokens, "dp_requests": sorted(self.requests)}


def snapshot(deployment, model, counter: StepCounter) -> dict:
    """One worker's entry of `stats(llm)`: the layout and decisions of its `deployment`
    (deployment.Deployment), what fusedpar made of its `model` (hooks.ModelHooks) and the counts."""
    dep, lay, runner = deployment, deployment.layout, model.runner
    return {
        "rank": dep.rank,
        "sequence_parallel_size": lay.sp,
        "base_tensor_parallel_size": lay.tp,
        "tensor_parallel_size": lay.replica_size,
        "shift_threshold": dep.policy.threshold,
        "fused_kernels": dep.use_fused,
        "base_graph_buckets": len(runner.graphs.sets) if runner and runner.graphs else 0,
        # whether vLLM runs the decoder model compiled (then shift steps use the compiled graph)
        "shift_compiled": decoder_compiled(model.decoder_model),
        # bytes behind the four sharded projections of every decoder layer (biases excluded):
        # exactly the base shards, the shift weights being views of them
        "weight_bytes": sum(m.weight.untyped_storage().nbytes() for m in model.modules),
        "base_shard_bytes": dep.base_shard_bytes(model.layers_taken.get("qkv", 0)),
        **counter.stats,
    }


def summary(deployment, counter: StepCounter) -> str:
    """The line each worker logs when it exits."""
    s, lay = counter.stats, deployment.layout
    return (f"fusedpar rank {deployment.rank} (SP={lay.sp} x TP={lay.tp} <-> TP={lay.replica_size}, "
            f"threshold {deployment.policy.threshold}): base {s['base_steps']} steps / {s['base_tokens']} tokens "
            f"(+{s['base_padding_tokens']} padding), shift {s['shift_steps']} steps / {s['shift_tokens']} tokens")
