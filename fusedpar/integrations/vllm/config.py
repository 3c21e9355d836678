"""What the user asked for (`--additional-config '{"fusedpar": {...}}'`) and whether it can run.

Pure Python (no vllm, no torch.distributed): `deployment.deployment_info` extracts the numbers from
vLLM's config; `check_deployment` runs on them where the engine config is built (`check_engine_config`
in `__init__.py`) and again in each worker (`deployment.Deployment.of`), and the unit tests call it directly.
Every problem found is collected and raised together as one `FusedparConfigError` (a
ValueError) whose message names each constraint and its numbers.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, field

from fusedpar.layouts import ModelDims, ParallelLayout

CONFIG_KEY = "fusedpar"
KNOWN_KEYS = ("sequence_parallel_size", "shift_threshold", "fused_kernels", "layouts", "policy", "tp_priority",
              "load_low", "load_high", "move_to_tp", "move_to_dp", "step_times", "latency_goal_s", "decode_steps",
              "decode_step_times")
# policy: how a step picks its layout. "threshold": base / shift by token count (the default); "dp": every
# step of the workload is a DP step over the one "dp{P}" layout; "priority": two classes side by side, the
# requests whose vLLM priority value is at most tp_priority in the TP/SP class (base / shift steps), the
# others in the "dp{P}" layout's DP steps; "load": the same two classes, each new request placed by the
# engine's load when it is first scheduled (DP while running + waiting requests are many, TP/SP when they are
# few, with hysteresis between load_low and load_high); "auto": the same two classes, each new request placed
# in the class fusedpar.layers.layout_policy.AutoPolicy answers from the step-time curves in step_times and the
# queue (docs/vllm-resharding.md).
POLICIES = ("threshold", "dp", "priority", "load", "auto")
DP_POLICIES = ("dp", "priority", "load", "auto")  # the policies that run DP steps over a "dp{P}" layout
TP_CLASS_POLICIES = ("priority", "load", "auto")  # the policies with a TP/SP class beside the DP ranks
AUTO_KEYS = ("step_times", "latency_goal_s", "decode_steps", "decode_step_times")  # policy "auto" only
MOVE_KEYS = ("move_to_tp", "move_to_dp")  # live moves between the classes, each way
MOVE_POLICIES = ("load", "auto")  # the policies whose placement moves live requests
_DP_LAYOUT = re.compile(r"^dp(\d+)$")
MAX_SHIFT_THRESHOLD = 2**31 - 1  # any value >= max_num_batched_tokens already means "always shift"
FUSED_KERNEL_CHOICES = ("auto", True, False)
# shift_threshold when the section names none (default_shift_threshold). With base-step CUDA graphs (bf16 /
# fp16 with the fused kernels, base TP = 1, vLLM graphs on) it is vLLM's largest graph at every P: above it
# vLLM runs its compiled model without graphs (TTFT sweep: perf/bench_vllm.py; perf/results/vllm.json).
# Eager base steps are bound by host time up to a few thousand tokens, so their default is the TTFT
# crossover per P (tensor_parallel_size); a P without an entry gets FALLBACK_SHIFT_THRESHOLD.
# Eager base steps, Qwen3-32B shape, 4x H200: the eager TTFT sweep of perf/bench_vllm.py (enforce_eager).
EAGER_SHIFT_THRESHOLDS = {4: 3584}
FALLBACK_SHIFT_THRESHOLD = 4096
GRAPH_CAPTURE_DEFAULT = 512  # vLLM's default max_cudagraph_capture_size


def default_shift_threshold(tensor_parallel_size: int, *, base_graphs: bool = False, capture_size: int = 0) -> int:
    """The shift_threshold a section without one gets on `tensor_parallel_size` GPUs: vLLM's largest CUDA
    graph (`capture_size`) when base steps run as graphs, else the eager table; never below capture_size,
    which a shift step must be able to replay."""
    if base_graphs:
        return capture_size or GRAPH_CAPTURE_DEFAULT
    return max(EAGER_SHIFT_THRESHOLDS.get(tensor_parallel_size, FALLBACK_SHIFT_THRESHOLD), capture_size)


# The decoder families whose layers are qkv_proj / o_proj / gate_up_proj / down_proj around one
# full-attention module (vLLM's llama.py / qwen2.py / qwen3.py), with model.layers[i] and a final
# model.norm(hidden, residual): what the plugin's hooks and weight maps assume.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


class FusedparConfigError(ValueError):
    """The fusedpar additional config, or the engine it is used in, cannot run shift parallelism."""


@dataclass(frozen=True)
class FusedparVllmConfig:
    """The user's knobs.

    sequence_parallel_size: SP of the base mode (base = SP x TP with TP = P / SP, where P is
        vLLM's tensor_parallel_size); must divide P.
    shift_threshold: steps of at most this many tokens run in shift mode (vLLM's own TP = P),
        larger ones in base mode. 0 = always base; at most MAX_SHIFT_THRESHOLD. None: the default
        for the deployment (default_shift_threshold; `threshold(...)` resolves it).
    fused_kernels: "auto" (fusedpar's Triton kernels for the base mode on CUDA with bf16/fp16),
        True (required) or False (plain torch + NCCL/gloo collectives).
    layouts: layouts beside base and shift; this version knows one, "dp{P}" (P = tensor_parallel_size:
        every rank serves its own requests with full weights and its own KV pool).
    policy: "threshold" (base / shift by shift_threshold), "dp" (every step of the workload in the
        "dp{P}" layout; needs sequence_parallel_size = P, whose base shard is the full weight) or
        "priority" (the TP/SP class beside the "dp{P}" layout: see tp_priority) or "load" (the same
        classes, see load_low / load_high) or "auto" (the same classes, see step_times).
    tp_priority: with policy "priority", the level of vLLM's per-request `priority` (lower value = served
        first, as in vLLM's priority scheduling) at or above which a request runs in the TP/SP class:
        priority value <= tp_priority -> TP/SP class (base / shift steps), else a DP rank. None otherwise.
    load_low, load_high: with policy "load", the hysteresis band of the engine's load (running + waiting
        requests) that places new requests (fusedpar.layers.layout_policy.LoadPolicy): from the TP/SP
        class to DP ranks when the load reaches load_high, back when it falls to load_low. None otherwise.
    move_to_tp: with policy "load" or "auto", whether a step at which the load has fallen to TP (policy "auto": at
        which it answers the TP/SP class), the TP/SP class has no requests and DP requests are decoding moves those
        requests, with their KV, into the TP/SP class (dp_scheduler.MoveRule; their KV is copied, never
        recomputed). False: a request keeps its class.
    move_to_dp: with policy "load" or "auto", whether a step at which the load has risen to DP (policy "auto": at
        which it answers DP) moves decoding TP/SP-class requests, with their KV, to the DP ranks (balanced over the
        ranks whose pool holds them). False: they stay.
    step_times, latency_goal_s, decode_steps: with policy "auto", the step-time curves of the DP layout
        ("dp{P}") and of the TP/SP class ("tp{P}"): layout name -> ((tokens, seconds), ...) points,
        tokens strictly increasing (empty: the engine measures them at start-up, dp_curves.py); the TTFT goal
        for waiting requests in seconds; the decode steps each placement looks ahead
        (fusedpar.layers.layout_policy.AutoPolicy). Empty / None otherwise.
    decode_step_times: with policy "auto", the decode-step curves of the same two layouts: layout name ->
        ((sequences, seconds), ...) points, a step of B sequences decoding one token each. Empty: the engine measures
        them at start-up with the step-time curves when step_times is empty too (dp_curves.py); with step_times given,
        decode steps are priced by step_times. Empty otherwise.
    """

    sequence_parallel_size: int
    shift_threshold: int | None = None
    fused_kernels: str | bool = "auto"
    layouts: tuple[str, ...] = ()
    policy: str = "threshold"
    tp_priority: int | None = None
    load_low: int | None = None
    load_high: int | None = None
    move_to_tp: bool = False
    move_to_dp: bool = False
    step_times: tuple[tuple[str, tuple[tuple[int, float], ...]], ...] = ()
    latency_goal_s: float | None = None
    decode_steps: int = 0
    decode_step_times: tuple[tuple[str, tuple[tuple[int, float], ...]], ...] = ()
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def has_tp_class(self) -> bool:
        """Whether TP/SP-class requests (base / shift steps) run beside the DP layout's (policies "priority",
        "load")."""
        return self.policy in TP_CLASS_POLICIES

    @property
    def dp_size(self) -> int:
        """D of the "dp{D}" layout DP steps run in (policies "dp", "priority", "load", "auto"); 0 when every step runs
        base / shift."""
        if self.policy not in DP_POLICIES:
            return 0
        return next(int(m.group(1)) for m in map(_DP_LAYOUT.match, self.layouts) if m)

    def threshold(self, tensor_parallel_size: int, *, base_graphs: bool = False, capture_size: int = 0) -> int:
        """The threshold in force on `tensor_parallel_size` GPUs (see default_shift_threshold)."""
        if self.shift_threshold is None:
            return default_shift_threshold(tensor_parallel_size, base_graphs=base_graphs, capture_size=capture_size)
        return self.shift_threshold


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_additional_config(additional_config) -> FusedparVllmConfig | None:
    """The fusedpar section of vLLM's additional_config; None when there is none (plugin idle)."""
    if not isinstance(additional_config, dict):
        return None
    if CONFIG_KEY not in additional_config:
        near = [k for k in additional_config if isinstance(k, str) and re.sub(r"[^a-z]", "", k.lower()) == CONFIG_KEY]
        if near:
            raise FusedparConfigError(
                f'fusedpar: additional_config has a section {near[0]!r}, not "{CONFIG_KEY}": the section is spelled '
                f'"{CONFIG_KEY}" (lowercase); with any other name fusedpar stays off')
        return None
    section = additional_config[CONFIG_KEY]
    if section is None:
        return None
    if not isinstance(section, dict):
        raise FusedparConfigError(
            f'fusedpar: additional_config["{CONFIG_KEY}"] must be a JSON object like '
            '{"sequence_parallel_size": 2, "shift_threshold": 256}, got '
            f"{section!r} ({type(section).__name__})"
        )
    problems = []
    unknown = sorted(set(section) - set(KNOWN_KEYS))
    if unknown:
        problems.append(f"unknown key(s) {unknown} (known: {list(KNOWN_KEYS)})")
    sp = section.get("sequence_parallel_size")
    if sp is None:
        problems.append("sequence_parallel_size is required (the SP degree of the base mode)")
    elif not _is_int(sp) or sp < 1:
        problems.append(f"sequence_parallel_size must be an int >= 1, got {sp!r}")
    threshold = section.get("shift_threshold")
    if threshold is not None and (not _is_int(threshold) or not 0 <= threshold <= MAX_SHIFT_THRESHOLD):
        # bounded: the value travels in stats() through vLLM's msgpack RPC, which cannot encode
        # ints >= 2**64 (the call then never returns); any value >= max_num_batched_tokens already
        # means "always shift"
        problems.append(f"shift_threshold must be an int in [0, {MAX_SHIFT_THRESHOLD}] (tokens per step; any value >= "
                        f"max_num_batched_tokens means always shift), got {threshold!r}")
    fused = section.get("fused_kernels", "auto")
    if not (fused is True or fused is False or fused == "auto"):
        problems.append(f'fused_kernels must be "auto", true or false, got {fused!r}')
    layouts = section.get("layouts", [])
    policy = section.get("policy", "threshold")
    if not isinstance(layouts, list) or not all(isinstance(x, str) for x in layouts):
        problems.append(f'layouts must be a list of layout names like ["dp2"], got {layouts!r}')
        layouts = []
    else:
        bad = [x for x in layouts if not _DP_LAYOUT.match(x) or int(_DP_LAYOUT.match(x).group(1)) < 2]
        if bad:
            problems.append(f'layouts {bad} are not supported (this version knows "dp{{D}}" with D >= 2, '
                            "D = tensor_parallel_size)")
        if len(layouts) > 1:
            problems.append(f"layouts {layouts}: this version runs one extra layout, got {len(layouts)}")
    if policy not in POLICIES:
        problems.append(f"policy must be one of {list(POLICIES)}, got {policy!r}")
    elif policy in DP_POLICIES and not layouts:
        problems.append(f'policy "{policy}" needs a DP layout in layouts (e.g. "layouts": ["dp2"])')
    elif policy not in DP_POLICIES and layouts:
        problems.append(f"layouts {layouts} need policy \"dp\", \"priority\", \"load\" or \"auto\" (policy "
                        f"{policy!r} runs base / shift steps only)")
    tp_priority = section.get("tp_priority")
    if "tp_priority" in section and not _is_int(tp_priority):
        problems.append(f"tp_priority must be an int (vLLM's request priority: requests whose priority value is at "
                        f"most tp_priority run in the TP/SP class), got {tp_priority!r}")
    elif policy == "priority" and tp_priority is None:
        problems.append('policy "priority" needs tp_priority (an int: requests whose vLLM priority value is at most '
                        "tp_priority run in the TP/SP class, the others in DP steps)")
    elif policy != "priority" and tp_priority is not None:
        problems.append(f'tp_priority={tp_priority} needs policy "priority", got policy {policy!r}')
    load = {k: section.get(k) for k in ("load_low", "load_high")}
    given = [k for k in load if k in section]
    if policy != "load" and given:
        problems.append(f'{", ".join(f"{k}={load[k]!r}" for k in given)} need policy "load", got policy {policy!r}')
    elif policy == "load":
        bad = {k: v for k, v in load.items() if not _is_int(v) or v < 0}
        if bad:
            problems.append(f'policy "load" needs load_low and load_high, ints >= 0 (running + waiting requests), got '
                            f"{', '.join(f'{k}={v!r}' for k, v in bad.items())}")
        elif load["load_low"] >= load["load_high"]:
            problems.append(f"load_low={load['load_low']} must be below load_high={load['load_high']} (the hysteresis "
                            "band: new requests go to DP ranks once the load reaches load_high and to the TP/SP class "
                            "again once it falls to load_low)")
    moves = {k: section.get(k, False) for k in MOVE_KEYS}
    for key, value in moves.items():
        if value is not True and value is not False:
            problems.append(f"{key} must be true or false, got {value!r}")
        elif value and policy not in MOVE_POLICIES:
            problems.append(f'{key}=true needs policy {" or ".join(map(json.dumps, MOVE_POLICIES))}, got policy '
                            f"{policy!r}")
    step_times, decode_step_times = _auto_problems(section, policy, layouts, problems)
    _raise(problems)
    return FusedparVllmConfig(sequence_parallel_size=sp, shift_threshold=threshold, fused_kernels=fused,
                              layouts=tuple(layouts), policy=policy, tp_priority=tp_priority,
                              load_low=load["load_low"], load_high=load["load_high"],
                              move_to_tp=moves["move_to_tp"] is True, move_to_dp=moves["move_to_dp"] is True,
                              step_times=step_times,
                              latency_goal_s=section.get("latency_goal_s"),
                              decode_steps=section.get("decode_steps", 0), decode_step_times=decode_step_times,
                              raw=dict(section))


def _curve_problem(name: str, points, key: str = "step_times", unit: str = "tokens") -> str | None:
    """What is wrong with one curve of the section's `key` (None: nothing); unit: what its first coordinates
    count."""
    if (not isinstance(points, list) or not points
            or not all(isinstance(p, list | tuple) and len(p) == 2 for p in points)):
        return f"{key}[{name!r}] must be a list of [{unit}, seconds] pairs, got {points!r}"
    counts = [n for n, _ in points]
    if not all(_is_int(n) and n >= 1 for n in counts) or any(b <= a for a, b in itertools.pairwise(counts)):
        return f"{key}[{name!r}] {unit} must be strictly increasing ints >= 1, got {counts}"
    seconds = [t for _, t in points]
    if not all(isinstance(t, int | float) and not isinstance(t, bool) and 0 < t < float("inf") for t in seconds):
        return f"{key}[{name!r}] seconds must be finite numbers > 0, got {seconds}"
    return None


def _curves(section: dict, key: str, what: str, unit: str, names: list[str], problems: list[str]):
    """The section's curves under `key` as a tuple of (layout name, points) in the order of `names`; empty when the
    key is absent or wrong (what is wrong appended to `problems`)."""
    if key not in section:
        return ()
    curves = section[key]
    if not isinstance(curves, dict) or sorted(curves) != sorted(names):
        problems.append(f'policy "auto" needs {key} with the {what} curves of {names} (layout name -> '
                        f"[[{unit}, seconds], ...]), got {curves!r}")
        return ()
    bad = [m for m in (_curve_problem(n, curves[n], key, unit) for n in names) if m]
    problems.extend(bad)
    return () if bad else tuple((n, tuple((int(a), float(b)) for a, b in curves[n])) for n in names)


def _auto_problems(section: dict, policy: str, layouts: list, problems: list[str]):
    """Append what is wrong with the keys of policy "auto" to `problems`; return its step_times and
    decode_step_times, each a tuple of (layout name, points) in the order dp{P}, tp{P} (empty when absent, wrong or
    the policy is not "auto")."""
    given = [k for k in AUTO_KEYS if k in section]
    if policy != "auto":
        if given:
            problems.append(f'{", ".join(given)} need policy "auto", got policy {policy!r}')
        return (), ()
    dp = next((x for x in layouts if _DP_LAYOUT.match(x)), None)
    goal, steps = section.get("latency_goal_s"), section.get("decode_steps", 0)
    if not isinstance(goal, int | float) or isinstance(goal, bool) or not 0 < goal < float("inf"):
        problems.append(f'policy "auto" needs latency_goal_s, a finite number of seconds > 0 (the TTFT goal for '
                        f"waiting requests), got {goal!r}")
    if not _is_int(steps) or steps < 0:
        problems.append(f"decode_steps must be an int >= 0 (decode steps each placement looks ahead), got {steps!r}")
    if dp is None:
        return (), ()
    # without step_times the engine measures the curves at start-up (dp_curves.py)
    names = [dp, "tp" + dp[2:]]
    return (_curves(section, "step_times", "step-time", "tokens", names, problems),
            _curves(section, "decode_step_times", "decode-step", "sequences", names, problems))


@dataclass(frozen=True)
class DeploymentInfo:
    """The numbers of one vLLM engine that decide whether fusedpar can run it."""

    tensor_parallel_size: int
    architectures: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    v_head_dim: int | None = None
    quantization: str | None = None
    quantization_config: dict | None = None  # the checkpoint's (config.json's) quantization_config
    kv_cache_dtype: str = "auto"
    lora: bool = False
    speculative: bool = False
    model_impl: str = "auto"
    compilation_mode: str = "VLLM_COMPILE"
    full_cudagraphs: bool = False
    max_cudagraph_capture_size: int | None = None


def check_deployment(cfg: FusedparVllmConfig, info: DeploymentInfo) -> ParallelLayout:
    """Raise FusedparConfigError naming every problem; return the replica's ParallelLayout."""
    problems: list[str] = []
    P, sp = info.tensor_parallel_size, cfg.sequence_parallel_size
    threshold = cfg.threshold(P, capture_size=info.max_cudagraph_capture_size or 0)
    layout = None
    if P % sp:
        problems.append(
            f"sequence_parallel_size={sp} does not divide tensor_parallel_size={P} (P = number of GPUs = "
            "SP x TP; use an SP among the divisors of P)"
        )
    else:
        try:
            layout = ParallelLayout(P, sp=sp, tp=P // sp)
        except ValueError as e:  # pragma: no cover - P % sp == 0 already
            problems.append(str(e))
    if cfg.fused_kernels is True and sp == 1:
        problems.append(
            "fused_kernels=true with sequence_parallel_size=1: the fused kernels run the base mode, and with SP=1 "
            "every step is vLLM's own TP path; use SP > 1 or fused_kernels \"auto\""
        )
    if info.pipeline_parallel_size != 1:
        problems.append(f"pipeline parallelism (pipeline_parallel_size={info.pipeline_parallel_size}); use 1")
    if info.data_parallel_size != 1:
        problems.append(f"data parallelism (data_parallel_size={info.data_parallel_size}); use 1 engine per replica")
    if info.decode_context_parallel_size != 1 or info.prefill_context_parallel_size != 1:
        problems.append(
            f"context parallelism (decode_context_parallel_size={info.decode_context_parallel_size}, "
            f"prefill_context_parallel_size={info.prefill_context_parallel_size}); use 1"
        )
    bad_arch = [a for a in info.architectures if a not in SUPPORTED_ARCHITECTURES]
    if bad_arch or not info.architectures:
        problems.append(
            f"model architecture {list(info.architectures)} (supported: {', '.join(SUPPORTED_ARCHITECTURES)}: "
            "decoder layers of full GQA attention + SwiGLU MLP)"
        )
    if info.model_impl not in ("auto", "vllm"):
        problems.append(
            f"model_impl={info.model_impl!r}: fusedpar hooks into vLLM's own implementations of the supported "
            "architectures; use model_impl 'auto' or 'vllm'"
        )
    if info.v_head_dim is not None and info.v_head_dim != info.head_dim:
        problems.append(f"unsupported attention: v head size {info.v_head_dim} != q/k head size {info.head_dim}")
    problems.extend(quantization_problems(cfg, info, layout))
    if info.lora:
        problems.append("LoRA adapters (enable_lora); LoRA wraps the linear layers fusedpar shards")
    if info.speculative:
        problems.append("speculative decoding (speculative_config)")
    if info.compilation_mode == "STOCK_TORCH_COMPILE":
        problems.append(
            "compilation mode STOCK_TORCH_COMPILE (it compiles the whole model, including the per-step mode "
            "switch); use the default mode or enforce_eager"
        )
    if (layout is not None and sp > 1 and info.full_cudagraphs and info.max_cudagraph_capture_size is not None
            and info.max_cudagraph_capture_size > threshold):
        fix = ("pass --compilation-config '{\"cudagraph_mode\": \"PIECEWISE\"}' (threshold 0 runs every step in base "
               "mode, which full graphs cannot hold), or a larger shift_threshold" if threshold < 1 else
               f"pass --compilation-config '{{\"max_cudagraph_capture_size\": {threshold}}}' (or "
               "cudagraph_mode PIECEWISE, or a larger shift_threshold)")
        problems.append(
            f"full CUDA graphs are captured up to {info.max_cudagraph_capture_size} tokens, above "
            f"shift_threshold={threshold}: a replayed graph cannot switch to base mode; {fix}"
        )
    if cfg.dp_size:
        problems.extend(dp_problems(cfg, info))
    if layout is not None:
        try:
            layout.weight_shards(ModelDims(info.num_attention_heads, info.num_key_value_heads, info.head_dim,
                                           info.intermediate_size))
        except ValueError as e:
            problems.append(f"heads / MLP do not fit SP={sp} x TP={P // sp}: {e}")
    _raise(problems)
    return layout


_PROJECTION_NAMES = ("self_attn", "mlp", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fp8_checkpoint(info: DeploymentInfo):
    """The FP8 format (fusedpar.integrations.hf.fp8.FP8Format) of the engine's checkpoint, and what keeps
    fusedpar from running it: (None, []) for an unquantized model."""
    if not info.quantization:
        return None, []
    if info.quantization not in ("fp8", "compressed-tensors"):
        return None, [f"quantized weights (quantization={info.quantization!r}; supported: FP8 checkpoints, "
                      "'compressed-tensors' FP8 with dynamic per-token activations and 'fp8' with weight_block_size)"]
    from fusedpar.integrations.hf.fp8 import fp8_format  # torch: imported only for a quantized checkpoint

    fmt, problems = fp8_format(info.quantization_config)
    qc = info.quantization_config or {}
    if fmt is None and not problems:
        problems.append(f"quantization={info.quantization!r} without an FP8 quantization_config in the checkpoint "
                        f"(got {qc!r})")
    ignored = [m for m in qc.get("ignore") or () if any(p in str(m) for p in _PROJECTION_NAMES)]
    if ignored:  # compressed-tensors (fp8_format names the fine-grained format's modules_to_not_convert)
        problems.append(f"FP8 checkpoints that keep projection weights unquantized (ignore={ignored})")
    if fmt is not None and fmt.scheme.weight == "tensor" and info.quantization == "fp8":
        problems.append("quantization='fp8' without weight_block_size (per-tensor weight scales): vLLM requantizes "
                        "a merged qkv / gate_up to the largest of its scales and, without CUTLASS FP8 kernels (CPU), "
                        "quantizes activations with one dynamic scale per step, which a base step over part of the "
                        "tokens cannot reproduce; use a compressed-tensors FP8 checkpoint (per-tensor or per-channel "
                        "weights, dynamic per-token activations) or block FP8")
    return (None if problems else fmt), problems


def quantization_problems(cfg: FusedparVllmConfig, info: DeploymentInfo, layout: ParallelLayout | None) -> list[str]:
    """What stops fusedpar on this engine's quantization (checkpoint and KV cache), each with its names and
    numbers."""
    problems = []
    if str(info.kv_cache_dtype).startswith("fp8"):
        problems.append(f"an FP8 KV cache (kv_cache_dtype={info.kv_cache_dtype!r}); use kv_cache_dtype 'auto'")
    fmt, fp8 = fp8_checkpoint(info)
    problems.extend(fp8)
    if fmt is None:
        return problems
    if cfg.fused_kernels is True:
        problems.append("fused_kernels=true with FP8 weights: the fused kernels take bf16 / fp16 weights (FP8 base "
                        "steps run fusedpar's FP8 linear layers on plain collectives); use fused_kernels \"auto\"")
    if cfg.dp_size:
        problems.append(f"layout dp{cfg.dp_size} with FP8 weights (DP steps run dense weights)")
    if fmt.scheme.weight == "block" and layout is not None:
        from fusedpar.layouts import scale_block_problems

        bo, bi = fmt.scheme.block
        try:
            cuts = scale_block_problems(layout, ModelDims(info.num_attention_heads, info.num_key_value_heads,
                                                          info.head_dim, info.intermediate_size), fmt.scheme.block)
        except ValueError:
            cuts = []  # the shard map itself does not fit: named by check_deployment
        problems.extend(f"FP8 weights in {bo}x{bi} scale blocks: {p}" for p in cuts)
    return problems


def dp_problems(cfg: FusedparVllmConfig, info: DeploymentInfo) -> list[str]:
    """What stops the "dp{D}" layout (policies "dp", "priority", "load", "auto") on this engine, each with its
    numbers."""
    P, sp, D = info.tensor_parallel_size, cfg.sequence_parallel_size, cfg.dp_size
    kv = info.num_key_value_heads
    problems = []
    if D != P:
        problems.append(f"layout dp{D} on tensor_parallel_size={P}: this version runs dp{P} only (one replica per "
                        "rank)")
    if sp != P:
        problems.append(f"layout dp{D} needs sequence_parallel_size={P} (= tensor_parallel_size: the base shard is "
                        f"then the full weight on every rank), got {sp}; other DP replicas would cost weight bytes")
    if kv % P:
        problems.append(f"layout dp{D} needs num_key_value_heads={kv} divisible by tensor_parallel_size={P} (a DP "
                        "KV block is P TP blocks of one rank, each holding kv_heads / P heads)")
    return problems


def _raise(problems: list[str]) -> None:
    if problems:
        raise FusedparConfigError("fusedpar cannot run this engine: " + "; ".join(dict.fromkeys(problems)))
