"""Bounded errors with a stalled or dead peer, on NCCL (2 GPUs) and on gloo (CPU, same harness).

The NCCL cases are marked gpu; they need 2 GPUs and run as one pytest process that spawns its two
ranks (not under torchrun):
    python -m pytest -m gpu -q tests/collectives/test_timeouts_gpu.py
Each rank builds a ParallelContext(timeout=TIMEOUT_S) (NCCL: world made with device_id, eager
communicators), checks a few collectives, then rank 1 stalls or exits while rank 0 runs one more
all-reduce and synchronises. The contract (ParallelContext's docstring):
  ctx.barrier(): rank 0 raises within TIMEOUT_S + SLACK_S; with TORCH_NCCL_ASYNC_ERROR_HANDLING=2
      (and always on gloo) it also outlives its error;
  NCCL without barrier(): the host blocks in its synchronisation until torch's watchdog ends the
      process with a logged timeout, TIMEOUT_S plus the watchdog's dump wait later.
The pytest process bounds every case (JOIN_S) and kills what is left.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

TIMEOUT_S = 10.0
SLACK_S = 10.0  # communicator abort and the host's poll interval, far below TIMEOUT_S
STALL_S = TIMEOUT_S + SLACK_S + 15.0  # the stalled rank stays away past every bound below
LINGER_S = 5.0  # the survivor stays alive this long after its error (a server handling it)
DUMP_WAIT_MS = 500  # TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC where set: the watchdog waits 4x this
JOIN_S = 240.0  # the whole case, process start-up included

CLEANUP_ONLY = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": str(DUMP_WAIT_MS)}
WATCHDOG_FAST = {"TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": str(DUMP_WAIT_MS), "TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}


def _skip_reason(backend: str) -> str | None:
    if "WORLD_SIZE" in os.environ or "RANK" in os.environ:
        return ("spawns its own 2 ranks: run as one process (python -m pytest -m gpu "
                "tests/collectives/test_timeouts_gpu.py), not under torchrun")
    if backend == "gloo":
        return None
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return "needs 2 CUDA GPUs"
    if not dist.is_nccl_available():
        return "torch.distributed was built without NCCL"
    return None


def _worker(rank: int, backend: str, scenario: str, guard: bool, env: dict, init_file: str, out_dir: str) -> None:
    """One rank. Rank 0 writes rank0.json (what happened) and, if it outlives its error, rank0.alive."""
    out = Path(out_dir)
    log = open(out / f"rank{rank}.stderr", "w")  # noqa: SIM115 (fd 2 points at it until the process ends)
    os.dup2(log.fileno(), 2)  # torch's C++ logging goes to fd 2
    from fusedpar.testing.gpu import MULTICAST_OFF

    os.environ.update(MULTICAST_OFF)
    os.environ.update(env)  # read when each process group is created: before init_process_group

    import datetime

    import torch
    import torch.distributed as dist

    from fusedpar import ParallelLayout
    from fusedpar.collectives import ParallelContext, all_gather_rows, all_reduce_sum

    torch.set_num_threads(1)
    nccl = backend == "nccl"
    device = torch.device("cuda", rank) if nccl else torch.device("cpu")
    if nccl:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S), device_id=device if nccl else None)
    ctx = ParallelContext(ParallelLayout(2, tp=2), timeout=TIMEOUT_S)
    warm = [all_reduce_sum(torch.full((4,), float(rank + 1), device=device), ctx.shift).tolist(),
            all_gather_rows(torch.full((1, 2), float(rank), device=device), ctx.tp).tolist()]
    ctx.barrier()
    if rank == 1:
        if scenario == "exit":
            os._exit(17)
        time.sleep(STALL_S)  # never joins the all-reduce below
        os._exit(0)

    def record(**kw):
        (out / "rank0.json").write_text(json.dumps({"warm": warm, "timeout": ctx.timeout.total_seconds(), **kw}))

    start, started_at = time.monotonic(), time.time()
    record(started_at=started_at, error=None, elapsed=None)
    try:
        x = all_reduce_sum(torch.ones(4, device=device), ctx.shift)
        if guard:
            ctx.barrier()
        elif nccl:
            torch.cuda.synchronize()
        error, value = None, x.tolist()
    except Exception as e:  # the expected outcome; its kind and message are recorded
        error, value = f"{type(e).__name__}: {e}"[:800], None
    record(started_at=started_at, error=error, value=value, elapsed=time.monotonic() - start)
    time.sleep(LINGER_S)
    (out / "rank0.alive").write_text("alive")
    os._exit(0)


def _run_case(tmp_path: Path, backend: str, scenario: str, *, guard: bool, env: dict):
    """Both ranks to their end (or JOIN_S). Returns (processes, rank 0's record, when rank 0 ended, its stderr)."""
    reason = _skip_reason(backend)
    if reason:
        pytest.skip(reason)
    import torch.multiprocessing as mp

    spawn = mp.get_context("spawn")
    procs = [spawn.Process(target=_worker, daemon=True,
                           args=(r, backend, scenario, guard, env, str(tmp_path / "pg"), str(tmp_path)))
             for r in range(2)]
    for p in procs:
        p.start()
    ended_at = None
    try:
        deadline = time.monotonic() + JOIN_S
        while time.monotonic() < deadline and any(p.is_alive() for p in procs):
            if ended_at is None and not procs[0].is_alive():
                ended_at = time.time()
            time.sleep(0.2)
        if ended_at is None and not procs[0].is_alive():
            ended_at = time.time()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=30)
    err_file = tmp_path / "rank0.stderr"
    stderr = err_file.read_text() if err_file.exists() else ""
    path = tmp_path / "rank0.json"
    assert path.exists(), (f"rank 0 never reached the failing collective (exit code {procs[0].exitcode}):\n"
                           f"{stderr[-3000:]}")
    rec = json.loads(path.read_text())
    assert rec["timeout"] == TIMEOUT_S
    assert rec["warm"] == [[3.0] * 4, [[0.0, 0.0], [1.0, 1.0]]], f"the collectives before the failure: {rec['warm']}"
    return procs, rec, ended_at, stderr


CASES = [pytest.param("nccl", env, scenario, marks=pytest.mark.gpu, id=f"nccl-{name}-{scenario}")
         for name, env in (("default", {}), ("cleanup-only", CLEANUP_ONLY)) for scenario in ("stall", "exit")]
CASES.append(pytest.param("gloo", {}, "exit", id="gloo-exit"))  # CPU: the harness and barrier() in CI


@pytest.mark.parametrize(("backend", "env", "scenario"), CASES)
def test_barrier_raises_on_every_survivor_within_the_timeout(tmp_path, backend, env, scenario):
    procs, rec, _, stderr = _run_case(tmp_path, backend, scenario, guard=True, env=env)
    what = "stalled" if scenario == "stall" else "exited"
    assert rec["elapsed"] is not None, f"rank 0 never returned (exit code {procs[0].exitcode}):\n{stderr[-3000:]}"
    assert rec["error"] is not None, f"the step whose peer {what} completed with {rec['value']}"
    assert rec["elapsed"] < TIMEOUT_S + SLACK_S, f"the error came after {rec['elapsed']:.1f} s: {rec['error']}"
    if scenario == "stall":  # a dead peer may be reported before the timeout; a stalled one is not
        assert rec["elapsed"] >= TIMEOUT_S - 1.0, f"raised after {rec['elapsed']:.1f} s: {rec['error']}"
    if backend == "gloo" or env is CLEANUP_ONLY:  # the watchdog (if any) has acted within LINGER_S
        assert (tmp_path / "rank0.alive").exists() and procs[0].exitcode == 0, (
            f"rank 0 did not outlive its error by {LINGER_S} s (exit code {procs[0].exitcode}):\n{stderr[-3000:]}")
    assert procs[1].exitcode == (17 if scenario == "exit" else 0), procs[1].exitcode


@pytest.mark.gpu
def test_without_barrier_the_watchdog_ends_a_stalled_survivor(tmp_path):
    procs, rec, ended_at, stderr = _run_case(tmp_path, "nccl", "stall", guard=False, env=WATCHDOG_FAST)
    bound = TIMEOUT_S + 4 * DUMP_WAIT_MS / 1000 + SLACK_S
    assert rec["elapsed"] is None, f"the synchronisation after a stalled all-reduce returned: {rec}"
    assert ended_at is not None, f"rank 0 still hung {JOIN_S} s in"
    assert procs[0].exitcode != 0, "rank 0 ended with status 0 although its all-reduce never completed"
    assert ended_at - rec["started_at"] < bound, f"rank 0 ended {ended_at - rec['started_at']:.1f} s after the call"
    assert re.search(r"(?i)timed? ?out", stderr), f"rank 0 ended without naming the timeout:\n{stderr[-3000:]}"
