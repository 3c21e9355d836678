"""The engine side of the "dp{P}" layout: what an engine must be for it, and the three classes it sets.

Runs in the process that builds the engine config (`check_engine_config`, from the plugin's
`EngineArgs.create_engine_config` wrapper), after vLLM's platform resolved the worker class and
async scheduling. For the policies with DP steps ("dp", "priority", "load", "auto") it refuses every engine feature
this version does not carry through a DP step (one FusedparConfigError naming each), then points
vLLM at:

  scheduler_cls                 dp_scheduler.DPScheduler  per-class, per-rank KV pools, the step's tag
  worker_cls                    dp_worker.DPWorker        the step's mode, its own requests, the DP forward
  distributed_executor_backend  dp_executor.DPExecutor    every rank's output of a DP step, merged

as qualified names (strings travel to the engine core and worker processes as they are).

Where requests enter the engine (the caller of `LLM.generate`, the API server: vLLM's
`InputProcessor.process_inputs`, wrapped by the plugin) `check_request_kv` refuses a request that no
KV pool of the engine can ever hold, before it reaches the engine core (dp_kv.outgrows_dp_pool).
"""

from __future__ import annotations

from .config import FusedparConfigError, FusedparVllmConfig, parse_additional_config
from .dp_compat import INTERNALS, internals_of
from .dp_kv import KVSplit, outgrows_dp_pool

SCHEDULER = "fusedpar.integrations.vllm.dp_scheduler.DPScheduler"
WORKER = "fusedpar.integrations.vllm.dp_worker.DPWorker"
EXECUTOR = "fusedpar.integrations.vllm.dp_executor.DPExecutor"
CPU_WORKER = "vllm.v1.worker.cpu_worker.CPUWorker"


def dp_version_problem(vllm_version: str, policy: str = "dp") -> str | None:
    """What keeps the DP classes off vLLM `vllm_version` (None: a release they are written against, an entry of
    dp_compat.INTERNALS); policy: the section's, named in the message."""
    if internals_of(vllm_version) is not None:
        return None
    releases = " and ".join(sorted(INTERNALS))
    needs = "; ".join(f"{r}'s {', '.join(i.names)}" for r, i in sorted(INTERNALS.items()))
    return (f'policy "{policy}": a DP layout on vLLM {vllm_version} is not supported; DP layouts run on vLLM '
            f"{releases} only (fusedpar's DP scheduler, worker and executor build on their scheduler internals: "
            f'{needs}); policy "threshold" (base / shift steps) does not need them')


def dp_engine_problems(vllm_config, vllm_version: str | None = None, *, policy: str = "dp") -> list[str]:
    """Every engine setting the DP layout cannot run with (vLLM's names, the values found). vllm_version:
    the running vLLM's (default: the installed one); the DP classes build on its scheduler's internals.
    policy: the section's; "priority" reads vLLM's per-request priority, which needs vLLM's priority
    scheduling."""
    if vllm_version is None:
        import vllm

        vllm_version = vllm.__version__
    cache, sched, par = vllm_config.cache_config, vllm_config.scheduler_config, vllm_config.parallel_config
    problems = []
    version = dp_version_problem(vllm_version, policy)
    if version:
        problems.append(version)
    if cache.enable_prefix_caching:
        problems.append("prefix caching with a DP layout (enable_prefix_caching=True); pass "
                        "enable_prefix_caching=False")
    if vllm_config.speculative_config is not None:
        problems.append("speculative decoding with a DP layout (speculative_config)")
    if vllm_config.lora_config is not None:
        problems.append("LoRA with a DP layout (enable_lora)")
    if par.pipeline_parallel_size != 1:
        problems.append(f"pipeline parallelism with a DP layout (pipeline_parallel_size={par.pipeline_parallel_size})")
    if sched.async_scheduling:
        problems.append("async scheduling with a DP layout (async_scheduling=True)")
    if getattr(vllm_config, "use_v2_model_runner", False):
        problems.append("vLLM's V2 model runner with a DP layout (set VLLM_USE_V2_MODEL_RUNNER=0)")
    if vllm_config.kv_transfer_config is not None:
        problems.append("a KV connector with a DP layout (kv_transfer_config)")
    if policy == "priority" and sched.policy != "priority":
        problems.append(f'policy "priority" with scheduling_policy={sched.policy!r}: the TP/SP class is chosen by '
                        "vLLM's per-request priority, which needs scheduling_policy='priority' "
                        "(--scheduling-policy priority)")
    if sched.scheduler_cls not in (None, SCHEDULER) and not (
            isinstance(sched.scheduler_cls, str) and sched.scheduler_cls.startswith("vllm.")):
        problems.append(f"a custom scheduler_cls={sched.scheduler_cls!r} with a DP layout (fusedpar sets its own)")
    if par.worker_cls not in (CPU_WORKER, WORKER):
        problems.append(f"worker class {par.worker_cls!r} with a DP layout: this version runs on vLLM's CPU build "
                        f"({CPU_WORKER})")
    if par.distributed_executor_backend not in ("mp", EXECUTOR):
        problems.append(f"distributed_executor_backend={par.distributed_executor_backend!r} with a DP layout "
                        "(fusedpar's executor is a MultiprocExecutor: use 'mp')")
    return problems


def install_dp_classes(vllm_config, cfg: FusedparVllmConfig) -> None:
    """Refuse what the DP layout cannot run (FusedparConfigError), then set the three classes."""
    if not cfg.dp_size:
        return
    problems = dp_engine_problems(vllm_config, policy=cfg.policy)
    if problems:
        raise FusedparConfigError("fusedpar cannot run this engine: " + "; ".join(problems))
    vllm_config.scheduler_config.scheduler_cls = SCHEDULER
    vllm_config.parallel_config.worker_cls = WORKER
    vllm_config.parallel_config.distributed_executor_backend = EXECUTOR


def check_request_kv(vllm_config, request) -> None:
    """KVTooLargeError (a ValueError) naming the request, its KV need and every pool's capacity when the engine's
    DP layout has no pool that can ever hold the request (vLLM's EngineCoreRequest `request`, as the input
    processor made it): a request that outgrows one DP pool with policy "dp", or the TP/SP class's pool too.
    Nothing for an engine without a DP layout, a request without sampling parameters, or before the engine
    knows its KV block count (the scheduler places and checks every request again: dp_scheduler.py)."""
    cfg = parse_additional_config(vllm_config.additional_config)
    blocks = vllm_config.cache_config.num_gpu_blocks
    params = request.sampling_params
    if cfg is None or not cfg.dp_size or not blocks or params is None or request.prompt_token_ids is None:
        return
    split = KVSplit.of(blocks, vllm_config.parallel_config.tensor_parallel_size, tp_class=cfg.has_tp_class)
    outgrows_dp_pool(split, vllm_config.cache_config.block_size, request.request_id, len(request.prompt_token_ids),
                     params.max_tokens or 0, vllm_config.model_config.max_model_len)
