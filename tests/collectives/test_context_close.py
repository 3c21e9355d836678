"""ParallelContext.close() and the release of contexts still open at exit: their gloo process groups are
destroyed, and their worker threads joined, before the interpreter finalises.

A gloo worker thread ends every collective by releasing the tensors it held, which takes the GIL; one
that does so while the interpreter finalises is ended by it, and the process aborts ("terminate called
without an active exception")."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import warnings
import weakref
from pathlib import Path

import pytest
import torch

from fusedpar import ParallelLayout
from fusedpar.collectives import ParallelContext, all_reduce_sum
from fusedpar.testing.dist import run_distributed

ROOT = Path(__file__).resolve().parents[2]


def _gloo_workers() -> int | None:
    """This process's gloo worker threads (torch names them pt_gloo_runloop), None where /proc is missing."""
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return None
    names = []
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return names.count("pt_gloo_runloop")


def _settled_gloo_workers(done, timeout: float = 10.0) -> int | None:
    """The gloo worker count once `done(count)` holds or `timeout` passed: a new thread takes its name only
    once it is scheduled, and a joined one leaves /proc a moment after its joiner returns."""
    deadline = time.monotonic() + timeout
    count = _gloo_workers()
    while count is not None and not done(count) and time.monotonic() < deadline:
        time.sleep(0.01)
        count = _gloo_workers()
    return count


def _close_worker(rank, world):
    baseline = _settled_gloo_workers(lambda n: n >= 2)  # the world group's threads
    ctx = ParallelContext(ParallelLayout(world, sp=2), host_groups=True)
    held = [ctx.sp, ctx.shift, ctx.host(ctx.shift)]  # as the layers and the HF call check hold them
    pgs = [weakref.ref(g.pg) for g in held]
    summed = all_reduce_sum(torch.full((3,), float(rank + 1)), ctx.shift)
    workers = None if baseline is None else _settled_gloo_workers(lambda n: n >= baseline + 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no group may stay referenced
        ctx.close()
        ctx.close()  # a second call does nothing
    try:
        all_reduce_sum(torch.ones(3), held[1])
        used = "no error"
    except (RuntimeError, ValueError) as e:  # torch's logging wrapper re-raises ours as a ValueError
        used = str(e)
    with pytest.raises(RuntimeError, match="closed"):
        ctx.host(ctx.shift)
    after = _settled_gloo_workers(lambda n: n <= (baseline or 0))
    return {"sum": summed.tolist(), "closed": ctx.closed, "repr": repr(ctx), "alive": [r() is not None for r in pgs],
            "workers": (baseline, workers, after), "used": used, "pg": repr(held[0].pg)}


def test_close_destroys_the_groups_and_revokes_the_comm_groups_it_handed_out():
    for res in run_distributed(_close_worker, 2, fresh=True):  # counts this process's gloo threads
        assert res["sum"] == [3.0, 3.0, 3.0]
        assert res["closed"] and res["repr"].endswith("closed)")
        assert res["alive"] == [False, False, False], "close() left a process group alive"
        baseline, before, after = res["workers"]
        if baseline is not None:
            assert before >= baseline + 2, f"the context's groups started no gloo threads: {baseline} -> {before}"
            assert after == baseline, f"close() left gloo worker threads: {baseline} -> {before} -> {after}"
        assert "closed process group of ranks [0, 1]" in res["used"], res["used"]
        assert res["pg"] == "<closed process group of ranks [0, 1]>"


# A collective whose tensors only the gloo worker holds when it completes, released slowly: the worker
# frees the tensor, the finalizer sleeps without the GIL, and the worker takes the GIL again a second
# later, well after this script ended. Were the group still alive when the interpreter finalises, that
# would abort the process. The probe is registered before fusedpar is imported, so atexit runs it after
# fusedpar's own hook: it sees what is left of the context's groups when the interpreter starts finalising.
EXIT_SCRIPT = """
import atexit, os, time, weakref, torch, torch.distributed as dist
def workers():
    if not os.path.isdir("/proc/self/task"):
        return None
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{tid}/comm").read().strip())
        except OSError:
            pass
    return names.count("pt_gloo_runloop")
dist.init_process_group("gloo")
atexit.register(lambda: print("RESULT", REF() is not None, workers(), HELD[0].pg, flush=True))
from fusedpar import ParallelLayout
from fusedpar.collectives import ParallelContext
ctx = ParallelContext(ParallelLayout(2, sp=2), host_groups=True)
HELD = [ctx.shift, ctx.host(ctx.shift)]  # as a parallelized model holds them
REF = weakref.ref(ctx.shift.pg)
x = torch.ones(3)
weakref.finalize(x, time.sleep, 1.0)
dist.all_reduce(x, group=ctx.shift.pg, async_op=True)  # neither the work nor x kept: the worker frees x
del x
dist.all_reduce(torch.ones(1), group=ctx.shift.pg)  # queued behind it: the first one completed too
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_contexts_left_open_are_released_at_exit_before_the_interpreter_finalises():
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-c", EXIT_SCRIPT], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT,
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
             for r in range(2)]
    try:
        for rank, p in enumerate(procs):
            out, _ = p.communicate(timeout=300)
            assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{out[-4000:]}"
            line = [x for x in out.splitlines() if x.startswith("RESULT")]
            assert line, f"rank {rank}:\n{out[-4000:]}"
            _, alive, workers, pg = line[-1].split(" ", 3)
            assert alive == "False", f"rank {rank}: the context's group outlived the atexit hook"
            assert workers in ("0", "None"), f"rank {rank}: {workers} gloo worker threads left at finalisation"
            assert pg == "<closed process group of ranks [0, 1]>"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
