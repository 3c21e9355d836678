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


class ClassRecord:
    """What one rank served of one request class (`name`: "dp" or "tp") in a layout with DP steps: the steps
    in which it ran requests of the class, their tokens, and the ids of those requests (a DP rank's sets
    are disjoint from the other ranks'; every rank runs every TP/SP-class request)."""

    def __init__(self, name: str):
        self.name = name
        self.steps = self.tokens = 0
        self.requests: set[str] = set()

    def step(self, request_tokens: dict[str, int]) -> None:
        if request_tokens:
            self.steps += 1
            self.tokens += sum(request_tokens.values())
            self.requests.update(request_tokens)

    def stats(self) -> dict:
        return {f"{self.name}_steps": self.steps, f"{self.name}_tokens": self.tokens,
                f"{self.name}_requests": sorted(self.requests)}


class RecomputeWatch:
    """Tokens a step computes again that an earlier step of the same request had computed: a request whose
    computed tokens went back (vLLM's preemption by recompute). The layouts keep every request's KV in
    place, so the count stays 0; it is measured from the steps this rank runs, not assumed."""

    def __init__(self):
        self.reach: dict[str, int] = {}  # request id -> tokens its steps on this rank have computed
        self.recomputed = 0

    def step(self, request_tokens: dict[str, int], computed: dict[str, int], finished) -> None:
        for rid in finished:
            self.reach.pop(rid, None)
        for rid, n in request_tokens.items():
            before = computed[rid]
            self.recomputed += max(0, self.reach.get(rid, 0) - before)
            self.reach[rid] = before + n


class ModeSwitches:
    """The engine's steps whose mode ("dp" or "tp") differs from the previous step's. Every rank sees every step
    of the engine (a DP step too, whether it has requests of its own or not), so every rank counts the same."""

    def __init__(self):
        self.last: str | None = None
        self.switches = 0

    def step(self, mode: str) -> None:
        if self.last is not None and mode != self.last:
            self.switches += 1
        self.last = mode


class ClassLedger:
    """One rank's record of the steps of an engine with a DP layout, per request class (ClassRecord), the switches
    between DP and TP steps (ModeSwitches), the KV bytes written into this rank's blocks by requests moving between
    the classes (its TP blocks for moves from DP ranks, dp_move.move_kv; its DP blocks for moves to this rank,
    dp_move.move_kv_to_dp; 0 unless move_to_tp / move_to_dp move them), the ids of those requests, and the tokens
    recomputed (RecomputeWatch)."""

    def __init__(self):
        self.reset()

    def record(self, mode: str, request_tokens: dict[str, int], computed: dict[str, int], finished, *,
               engine_step: bool = True) -> None:
        """A step in `mode` ("dp" or "tp") that runs `request_tokens` (request id -> scheduled tokens) on this
        rank, whose requests had `computed` tokens before it; `finished`: request ids vLLM has finished;
        engine_step: whether the engine scheduled any token in the step (on any rank)."""
        if engine_step:
            self.modes.step(mode)
        self.classes[mode].step(request_tokens)
        self.recompute.step(request_tokens, computed, finished)

    def reset(self) -> None:
        self.classes = {name: ClassRecord(name) for name in ("dp", "tp")}
        self.modes = ModeSwitches()
        self.kv_bytes_moved = 0
        self.moved: set[str] = set()  # requests moved between the classes, either way
        self.recompute = RecomputeWatch()

    def stats(self) -> dict:
        out = {k: v for record in self.classes.values() for k, v in record.stats().items()}
        out["switches"] = self.modes.switches
        out["kv_bytes_moved"] = self.kv_bytes_moved
        out["moved_requests"] = sorted(self.moved)
        out["recomputed_tokens"] = self.recompute.recomputed
        return out

    def summary(self) -> str:
        dp, tp = self.classes["dp"], self.classes["tp"]
        return (f", dp {dp.steps} steps / {dp.tokens} tokens / {len(dp.requests)} requests, tp class {tp.steps} "
                f"steps / {tp.tokens} tokens / {len(tp.requests)} requests, {self.modes.switches} switches, "
                f"{self.kv_bytes_moved} KV bytes moved, {self.recompute.recomputed} recomputed")


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
        # FP8 checkpoints: the weight scale scheme and what runs the shift GEMMs on the views (vLLM's FP8
        # kernel by its class name, or "fusedpar": fusedpar's FP8 linear layer); None when unquantized
        "fp8": None if dep.fp8 is None else {
            "scheme": dep.fp8.scheme.weight,
            "shift_kernels": sorted({type(m._fp_vllm_kernel).__name__ if m._fp_vllm_kernel is not None
                                     else "fusedpar" for m in model.modules})},
        **counter.stats,
    }


def summary(deployment, counter: StepCounter) -> str:
    """The line each worker logs when it exits."""
    s, lay = counter.stats, deployment.layout
    return (f"fusedpar rank {deployment.rank} (SP={lay.sp} x TP={lay.tp} <-> TP={lay.replica_size}, "
            f"threshold {deployment.policy.threshold}): base {s['base_steps']} steps / {s['base_tokens']} tokens "
            f"(+{s['base_padding_tokens']} padding), shift {s['shift_steps']} steps / {s['shift_tokens']} tokens")
