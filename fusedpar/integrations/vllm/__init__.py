"""vLLM plugin (the `vllm` extra): Shift Parallelism inside vLLM, switched on per engine.

    vllm serve MODEL --tensor-parallel-size 4 \\
        --additional-config '{"fusedpar": {"sequence_parallel_size": 2}}'

    llm = LLM(MODEL, tensor_parallel_size=4,
              additional_config={"fusedpar": {"sequence_parallel_size": 2}})
    fusedpar.integrations.vllm.stats(llm)   # one dict per worker: base/shift steps and tokens

With the canonical rank order (docs/design.md, section 2) vLLM's own TP = P model *is* the shift
configuration; the plugin only adds the base (SP x TP) path on the same weights and KV cache:
- `register` (entry point `vllm.general_plugins: fusedpar`, run by vLLM in every process)
  registers three PluggableLayer out-of-tree linear layers (layers.py). They are inert unless
  the engine's additional_config has a "fusedpar" section.
- In each worker the first such layer validates the deployment (config.py, deployment.py; every
  problem named, the engine fails to start), builds fusedpar's process groups after vLLM's
  (comms.py), and the layers load their base shard with the shift shard as a view (layers.py).
- Per step, the mode comes from the scheduled token count (state.py, which also explains why
  this is correct under vLLM's torch.compile and CUDA graphs).

Modules: config (pure Python: knobs and checks), deployment (the validated deployment and the
decisions taken from it), state (the per-worker object wiring the others together, and the RPC
worker methods), step (the facts of the running step), hooks (the hooks on vLLM's model),
comms (process groups and base-mode communicators: warm-up, graph capture), base_runner /
base_step (a base step's forward and kernels), shift_trace (when the compiled shift path is
traced), counters (step counts; a submodule named `stats` would shadow the function `stats`
once imported), layers (the linear layers); the DP layout (policies "dp", "priority", "load",
docs/vllm.md): dp_engine (the engine checks and the three classes it sets), dp_scheduler / dp_kv
(placement, the per-class and per-rank KV pools, the step's mode and tag), dp_worker (a rank's own
requests, or the TP/SP class's step), dp_executor (the ranks' outputs merged), dp_runner (the DP
forward). Only this package imports vllm; fusedpar's core never does.
"""

from __future__ import annotations

import functools

from .config import (
    SUPPORTED_ARCHITECTURES,
    DeploymentInfo,
    FusedparConfigError,
    FusedparVllmConfig,
    check_deployment,
    parse_additional_config,
)

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "DeploymentInfo",
    "FusedparConfigError",
    "FusedparVllmConfig",
    "check_deployment",
    "check_engine_config",
    "parse_additional_config",
    "register",
    "reset_stats",
    "stats",
]

_registered = False


def register() -> None:
    """vLLM general-plugin entry point: register the layers (idempotent, cheap, changes nothing by itself)."""
    global _registered
    if _registered:
        return
    from .layers import register_layers

    register_layers()
    _check_configs_where_built()
    _check_requests_where_added()
    _registered = True


def check_engine_config(vllm_config) -> None:
    """Raise FusedparConfigError naming every problem of the engine's fusedpar section (and of the
    deployment it asks for); nothing when the engine has no fusedpar section."""
    cfg = parse_additional_config(vllm_config.additional_config)
    if cfg is not None:
        from .deployment import deployment_info
        from .dp_engine import dp_engine_problems, install_dp_classes

        dp = dp_engine_problems(vllm_config, policy=cfg.policy) if cfg.dp_size else []
        try:
            check_deployment(cfg, deployment_info(vllm_config))
        except FusedparConfigError as e:  # one error naming every problem, the DP layout's too
            if dp:
                raise FusedparConfigError("; ".join([str(e), *dp])) from None
            raise
        install_dp_classes(vllm_config, cfg)


def _check_configs_where_built() -> None:
    """Check the fusedpar section in the process that builds the engine config (the caller of LLM(...)
    or `vllm serve`), so a bad section fails there at once with fusedpar's message instead of in each
    worker's log after the engine started. The workers check it again (deployment.Deployment.of)."""
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config
    if getattr(original, "_fusedpar_checks", False):
        return

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        vllm_config = original(self, *args, **kwargs)
        check_engine_config(vllm_config)
        return vllm_config

    create_engine_config._fusedpar_checks = True
    EngineArgs.create_engine_config = create_engine_config


def _check_requests_where_added() -> None:
    """Refuse, where a request enters the engine (vLLM's InputProcessor.process_inputs, in the caller of
    `LLM.generate` or the API server), a request that no KV pool of an engine with a DP layout can ever hold
    (dp_engine.check_request_kv): the caller gets the error and the engine core never sees the request. An
    error raised by the engine core while it adds a request would end an engine core running in a process of
    its own. Engines without a DP layout are not affected; a vLLM without this input processor runs no DP
    layout (dp_engine.dp_engine_problems refuses its version)."""
    try:
        from vllm.v1.engine.input_processor import InputProcessor
    except ImportError:
        return
    original = getattr(InputProcessor, "process_inputs", None)
    if original is None or getattr(original, "_fusedpar_checks", False):
        return

    @functools.wraps(original)
    def process_inputs(self, *args, **kwargs):
        request = original(self, *args, **kwargs)
        from .dp_engine import check_request_kv

        check_request_kv(self.vllm_config, request)
        return request

    process_inputs._fusedpar_checks = True
    InputProcessor.process_inputs = process_inputs


def stats(llm) -> list[dict]:
    """Per-worker counters of a `vllm.LLM` running fusedpar, in worker (TP rank) order.

    Each dict has base_steps, shift_steps, base_tokens, shift_tokens, base_padding_tokens (rows
    added to make base steps divisible by SP; never part of any output) and the layout
    (rank, sequence_parallel_size, base_tensor_parallel_size, tensor_parallel_size,
    shift_threshold, fused_kernels). Only real model steps count (not vLLM's profile or warm-up
    runs); steps replayed as full CUDA graphs run no Python and are not counted. With a DP layout
    (policies "dp", "priority", "load", "auto") also dp_steps / dp_tokens / dp_requests (this rank's own DP
    requests), tp_steps / tp_tokens / tp_requests (the TP/SP class, the same on every rank), switches
    (steps whose mode, DP or TP, differs from the previous step's: the same on every rank), kv_bytes_moved
    (KV bytes moved between classes: 0, a request keeps its class) and recomputed_tokens (tokens a step
    computed again that an earlier step had computed: 0).
    """
    return _rpc(llm, "fusedpar_stats")


def reset_stats(llm) -> None:
    """Zero the counters of every worker."""
    _rpc(llm, "fusedpar_reset_stats")


def _rpc(llm, method: str):
    # The worker methods are added by the plugin's worker state (state.add_worker_methods), so
    # a plain name travels to the workers without vLLM's insecure (pickle) serialization.
    try:
        return llm.collective_rpc(method)
    except Exception as e:
        if "not implemented" in str(e) or "fusedpar_" in str(e):
            raise ValueError("fusedpar is not enabled in this engine (additional_config has no 'fusedpar' "
                             "section, or the plugin is not installed in the engine's environment)") from e
        raise
