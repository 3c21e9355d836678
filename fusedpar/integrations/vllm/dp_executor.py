"""The executor of an engine with a "dp{P}" layout (policies "dp", "priority", "load").

vLLM's MultiprocExecutor broadcasts each step to all ranks and reads the answer of one
(`output_rank`), which in TP is everyone's answer. In a DP step every rank answers for its own
requests, so `DPExecutor` collects every rank's answer to `execute_model`, then, where a rank ran a
forward and holds its sampling state (vLLM's model runner answers None), broadcasts `sample_tokens`
and collects every answer again (a rank without pending state answers an empty output), and returns
one ModelRunnerOutput: the ranks' outputs concatenated. The engine then never calls
`sample_tokens` itself (the merged output is not None). `Scheduler.update_from_output` looks results
up by request id, and the ranks' request sets are disjoint. A TP step (the scheduler's tag says so)
is vLLM's: every rank answers for the same requests, vLLM reads one.

Structured outputs (grammar bitmasks) and logprobs are not merged in this version: a DP step whose
outputs carry them is an error naming it.
"""

from __future__ import annotations

from concurrent.futures import Future

from vllm import envs
from vllm.v1.executor.multiproc_executor import MultiprocExecutor
from vllm.v1.outputs import ModelRunnerOutput

from .dp_scheduler import TAG, TP_STEP


def merge_outputs(outputs: list) -> ModelRunnerOutput:
    """One ModelRunnerOutput of the ranks' outputs for disjoint request sets, in rank order."""
    req_ids: list[str] = []
    sampled: list[list[int]] = []
    prompt_logprobs: dict = {}
    nans: dict[str, int] = {}
    for rank, out in enumerate(outputs):
        if not isinstance(out, ModelRunnerOutput):
            raise RuntimeError(f"fusedpar DP: rank {rank} answered {type(out).__name__}, not a ModelRunnerOutput")
        unsupported = [name for name in ("logprobs", "pooler_output", "kv_connector_output", "ec_connector_output",
                                         "aux_output_connector_output", "sampling_masks")
                       if getattr(out, name, None) is not None]
        if unsupported or out.prompt_token_id_logprobs_dict:
            raise RuntimeError(f"fusedpar DP: rank {rank}'s output carries {unsupported or ['prompt logprobs']}, "
                               "which DP steps do not merge in this version")
        overlap = set(out.req_ids) & set(req_ids)
        if overlap:
            raise RuntimeError(f"fusedpar DP: requests {sorted(overlap)} ran on more than one rank")
        req_ids += out.req_ids
        sampled += out.sampled_token_ids
        prompt_logprobs.update(out.prompt_logprobs_dict)
        nans.update(out.num_nans_in_logits or {})
    if len(sampled) != len(req_ids):
        raise RuntimeError(f"fusedpar DP: {len(req_ids)} requests with {len(sampled)} sampled token lists")
    return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
                             sampled_token_ids=sampled, prompt_logprobs_dict=prompt_logprobs,
                             num_nans_in_logits=nans or None)


class DPExecutor(MultiprocExecutor):
    """vLLM's MultiprocExecutor that merges every rank's output in a DP step (module docstring)."""

    def execute_model(self, scheduler_output, non_block: bool = False):
        tag = getattr(scheduler_output, TAG, None)
        if tag is None or tag.mode == TP_STEP:
            return super().execute_model(scheduler_output, non_block=non_block)
        if scheduler_output.has_structured_output_requests:
            raise RuntimeError("fusedpar DP: structured outputs (grammar bitmasks) in a DP step are not supported in "
                               "this version")
        timeout = envs.VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS
        outputs = self.collective_rpc("execute_model", args=(scheduler_output,), timeout=timeout)
        if any(out is None for out in outputs):
            sampled = self.collective_rpc("sample_tokens", args=(None,), timeout=timeout)
            outputs = [s if out is None else out for out, s in zip(outputs, sampled, strict=True)]
        merged = merge_outputs(outputs)
        if not non_block:
            return merged
        future: Future = Future()
        future.set_result(merged)
        return future
