"""Run one vLLM engine in this process and write what it produced as JSON.

    python -m tests.integrations.vllm_engine SPEC.json OUT.json

SPEC: {"model": dir, "tensor_parallel_size": 2, "fusedpar": {...} or null, "max_tokens": 8,
       "batches": [[[token ids], ...], ...], "dtype": "float32", "logprobs": false,
       "priorities": [[vLLM priority per prompt] per batch] (optional; needs scheduling_policy "priority"),
       "engine_args": {more LLM(...) keywords}, "record_errors": false,
       "arrivals": [[engine step at which each prompt arrives] or null per batch] (optional; null: the batch
       arrives at once through LLM.generate)}
OUT:  {"tokens": [[[generated ids] per prompt] per batch], "logprobs": [same shape: the chosen
       tokens' logprobs] or null, "stats": [per batch: fusedpar.stats(llm) or null], "seconds": {...},
       "errors": [per batch: null, or the error its generate raised (with record_errors; its tokens are
       null); without record_errors such an error ends the run]}

test_vllm.py (the CPU build) and test_vllm_gpu.py run each engine in its own process (vLLM's
workers keep process-wide state: one engine per process keeps the cases independent). Greedy
decoding with ignore_eos, so every prompt generates exactly max_tokens tokens. Between batches
the fusedpar counters are reset, so each batch's stats describe that batch alone.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB per worker (CPU build)
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # CI machines have few cores; no pinning
# The engine core runs in this process (vLLM's in-process client), not in a child process of its
# own. With a child, shutdown sends it SIGTERM and relies on its Python signal handler; now and
# then (1 of 17 engines here with a cold compile cache) that handler never ran, the client
# force-killed the process tree after its timeout, and the workers died before their exit
# handlers - fusedpar's summary line is one - could run (test_summary_logged_at_shutdown failed
# in CI that way, with "force killing" and leaked shared_memory warnings in the log). In process,
# shutdown closes the workers' death pipes directly and waits for them to exit.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# The executor gives its workers 5 s to exit before SIGTERM; a teardown takes ~4 s here, so on a
# loaded 2-core CI machine that is too short.
os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "60")


def run(spec: dict) -> dict:
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams

    kwargs = {}
    if spec.get("fusedpar") is not None:
        kwargs["additional_config"] = {"fusedpar": spec["fusedpar"]}
    llm = LLM(spec["model"], tensor_parallel_size=spec.get("tensor_parallel_size", 2),
              dtype=spec.get("dtype", "float32"), skip_tokenizer_init=True,
              max_model_len=spec.get("max_model_len", 256), seed=0, enforce_eager=spec.get("enforce_eager", False),
              **spec.get("engine_args", {}), **kwargs)
    t1 = time.perf_counter()
    want_logprobs = spec.get("logprobs", False)
    params = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 8), ignore_eos=True,
                            detokenize=False, logprobs=1 if want_logprobs else None)
    tokens, logprobs, stats, errors = [], [], [], []
    priorities = spec.get("priorities") or [None] * len(spec["batches"])
    arrivals = spec.get("arrivals") or [None] * len(spec["batches"])
    for index, (batch, priority, arrival) in enumerate(zip(spec["batches"], priorities, arrivals, strict=True)):
        if spec.get("fusedpar") is not None:
            from fusedpar.integrations.vllm import reset_stats

            reset_stats(llm)
        try:
            if arrival is None:
                outs = llm.generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False,
                                    priority=priority)
            else:
                outs = staggered(llm, f"b{index}", batch, params, arrival, priority)
        except Exception as e:
            if not spec.get("record_errors"):
                raise
            errors.append(f"{type(e).__name__}: {e}")
            tokens.append(None)
            logprobs.append(None)
            stats.append(None)
            continue
        errors.append(None)
        tokens.append([list(o.outputs[0].token_ids) for o in outs])
        if want_logprobs:
            logprobs.append([[step[t].logprob for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs,
                                                                  strict=True)] for o in outs])
        if spec.get("fusedpar") is not None:
            from fusedpar.integrations.vllm import stats as fp_stats

            stats.append(fp_stats(llm))
        else:
            stats.append(None)
    t2 = time.perf_counter()
    # the workers log fusedpar's summary line as they exit; this waits for them
    llm.llm_engine.engine_core.shutdown()
    return {"tokens": tokens, "logprobs": logprobs if want_logprobs else None, "stats": stats, "errors": errors,
            "seconds": {"startup": t1 - t0, "generate": t2 - t1}}


def staggered(llm, prefix: str, batch, params, arrival, priority) -> list:
    """Serve `batch` through the engine step by step, prompt i added before engine step arrival[i] (steps counted
    from 0 as the loop runs them); the finished outputs in the batch's order."""
    engine = llm.llm_engine
    ids = [f"{prefix}-{i}" for i in range(len(batch))]
    done: dict = {}
    step = 0
    while len(done) < len(batch):
        for i, at in enumerate(arrival):
            if at == step:
                engine.add_request(ids[i], {"prompt_token_ids": batch[i]}, params,
                                   priority=priority[i] if priority else 0)
        if engine.has_unfinished_requests():
            done.update((out.request_id, out) for out in engine.step() if out.finished)
        step += 1
        if step > 100 * (len(batch) + max(arrival)) + 1000:
            raise RuntimeError(f"staggered batch {prefix}: {len(done)} of {len(batch)} requests done after {step} "
                               "steps")
    return [done[rid] for rid in ids]


def main() -> None:
    spec_path, out_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    result = run(spec)
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
