"""Kill one worker of a vLLM engine and time the error the caller of `generate` gets.

    python -m tests.integrations.vllm_kill SPEC.json OUT.json

SPEC: {"model": dir, "tensor_parallel_size": 2, "fusedpar": {...} or null, "engine_args": {...},
       "prompts": [[token ids], ...], "max_tokens": 64, "rank": 1,
       "when": "between" (kill, then generate) or "during" (kill `delay` seconds into a generate),
       "delay": 2.0, "limit": 120}
OUT:  {"killed_pid": pid, "error": "Type: message" or null, "seconds_to_error": s (from the kill),
       "warmup_tokens": [...]}

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, as in vllm_engine.py); the worker
processes are its executor's children. A watchdog thread writes OUT with error null and exits the process
when `generate` has not returned or raised `limit` seconds after the kill (a hang).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# vLLM waits this long for the other workers to exit after one died before it cancels a waiting call: long
# here, so the time to the error shows whether the executor waits for it
os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "60")


def _write(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f)


def run(spec: dict, out_path: str) -> None:
    from vllm import LLM, SamplingParams

    kwargs = {"additional_config": {"fusedpar": spec["fusedpar"]}} if spec.get("fusedpar") is not None else {}
    llm = LLM(spec["model"], tensor_parallel_size=spec.get("tensor_parallel_size", 2), dtype="float32",
              skip_tokenizer_init=True, max_model_len=256, seed=0, enforce_eager=True,
              **spec.get("engine_args", {}), **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 64), ignore_eos=True,
                            detokenize=False)
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]
    warm = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, detokenize=False),
                        use_tqdm=False)
    pid = llm.llm_engine.engine_core.engine_core.model_executor.workers[spec.get("rank", 1)].proc.pid
    result = {"killed_pid": pid, "error": None, "seconds_to_error": None,
              "warmup_tokens": [list(o.outputs[0].token_ids) for o in warm]}
    killed_at: list[float] = []

    def kill() -> None:
        killed_at.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    workers = llm.llm_engine.engine_core.engine_core.model_executor.workers

    def end_workers() -> None:
        # the engine is dead and vLLM's monitor may still be shutting its workers down: end them (they are
        # this process's children), so that none outlives the run
        for handle in workers:
            if handle.proc.is_alive():
                handle.proc.kill()
            handle.proc.join(30)

    def watchdog() -> None:
        while not killed_at:
            time.sleep(0.1)
        time.sleep(spec.get("limit", 120))
        _write(out_path, {**result, "error": None, "hung": True})
        end_workers()
        os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    if spec.get("when", "during") == "between":
        kill()
    else:
        threading.Timer(spec.get("delay", 2.0), kill).start()
    try:
        llm.generate(prompts, params, use_tqdm=False)
    except Exception as e:  # the error the caller sees
        result["error"] = f"{type(e).__name__}: {e}"
        result["seconds_to_error"] = time.monotonic() - killed_at[0] if killed_at else None
    else:
        result["seconds_to_error"] = None
    _write(out_path, result)
    end_workers()
    os._exit(0)  # skip vLLM's teardown of the dead engine


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    run(spec, sys.argv[2])


if __name__ == "__main__":
    main()
