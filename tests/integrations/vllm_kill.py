"""Kill one worker of a vLLM engine and time the error the caller of `generate` gets.

    python -m tests.integrations.vllm_kill SPEC.json OUT.json

SPEC: {"model": dir, "tensor_parallel_size": 2, "fusedpar": {...} or null, "engine_args": {...},
       "prompts": [[token ids], ...], "max_tokens": 64, "rank": 1,
       "when": "between" (kill, then generate) or "during" (kill `delay` seconds into a generate) or "move"
       (worker `rank` signals itself as the first KV move of direction `move` starts on it: "to_tp" (dp_move.move_kv)
       or "to_dp" (dp_move.move_kv_to_dp); `signal`: "kill" (SIGKILL) or "stop" (SIGSTOP, a stalled worker)),
       "delay": 2.0, "limit": 120, "arrivals": [engine step of each prompt] (when "move": served step by step,
       vllm_engine.staggered), "end_within": 60}
OUT:  {"killed_pid": pid, "error": "Type: message" or null, "seconds_to_error": s (from the kill),
       "warmup_tokens": [...], and when "move": "signalled" (the hook fired), "workers_ended_s" (seconds from the
       error until every worker process had ended by the engine's own shutdown, null if not within `end_within`)}

The "move" hook wraps the move function in every worker after the warm-up, through the engine's collective_rpc (the
CPU build spawns its workers, so a wrapper set here before the engine starts would not reach them).

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


def _hook_moves(worker, spec: dict, fired: str) -> None:
    """Run in every worker (collective_rpc): wrap the move function of spec["move"]'s direction so that worker
    spec["rank"] records its pid and the time in `fired` and signals itself as its first such move starts."""
    from fusedpar.integrations.vllm import dp_move

    name = {"to_tp": "move_kv", "to_dp": "move_kv_to_dp"}[spec["move"]]
    inner, victim = getattr(dp_move, name), spec.get("rank", 1)
    sig = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}[spec["signal"]]

    def hooked(moves, caches, P, dp_offset, rank, *args, **kwargs):
        if rank == victim and moves and not os.path.exists(fired):
            _write(fired + ".tmp", {"pid": os.getpid(), "at": time.monotonic()})
            os.replace(fired + ".tmp", fired)
            os.kill(os.getpid(), sig)
        return inner(moves, caches, P, dp_offset, rank, *args, **kwargs)

    setattr(dp_move, name, hooked)


def _write(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f)


def run(spec: dict, out_path: str) -> None:
    from vllm import LLM, SamplingParams

    when, fired = spec.get("when", "during"), out_path + ".fired"
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

    def watch_hook() -> None:
        while not os.path.exists(fired):
            time.sleep(0.05)
        with open(fired) as f:
            killed_at.append(json.load(f)["at"])

    threading.Thread(target=watchdog, daemon=True).start()
    if when == "between":
        kill()
    elif when == "move":
        result["killed_pid"] = None
        threading.Thread(target=watch_hook, daemon=True).start()
        llm.collective_rpc(_hook_moves, args=(spec, fired))
    else:
        threading.Timer(spec.get("delay", 2.0), kill).start()
    try:
        if when == "move":
            from tests.integrations.vllm_engine import staggered

            staggered(llm, "m", spec["prompts"], params, spec["arrivals"], None)
        else:
            llm.generate(prompts, params, use_tqdm=False)
    except Exception as e:  # the error the caller sees
        errored = time.monotonic()
        result["error"] = f"{type(e).__name__}: {e}"
        if when == "move" and os.path.exists(fired):
            with open(fired) as f:
                hook = json.load(f)
            result["killed_pid"], killed_at[:] = hook["pid"], [hook["at"]]
        result["seconds_to_error"] = errored - killed_at[0] if killed_at else None
        if when == "move":  # the engine's own shutdown ends every worker, the stalled one too
            deadline = errored + spec.get("end_within", 60)
            while any(h.proc.is_alive() for h in workers) and time.monotonic() < deadline:
                time.sleep(0.2)
            alive = [h.proc.pid for h in workers if h.proc.is_alive()]
            result["workers_ended_s"] = None if alive else time.monotonic() - errored
    else:
        result["seconds_to_error"] = None
    result["signalled"] = os.path.exists(fired)
    _write(out_path, result)
    end_workers()
    os._exit(0)  # skip vLLM's teardown of the dead engine


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    run(spec, sys.argv[2])


if __name__ == "__main__":
    main()
