"""Run a function on N local CPU processes joined by a gloo process group.

run_distributed(fn, world_size, *args, **kwargs) calls fn(rank, world_size, *args, **kwargs) in each process and
returns the per-rank results in rank order. A failure on any rank raises RuntimeError carrying
that rank's traceback; a rank that hangs is killed after `timeout` seconds.

The processes outlive a call: the next call of the same world size and thread count runs in them,
inside the same world group, without spawning and importing again. Between calls each rank waits at
a barrier, then every process group the call made is destroyed (contexts still open are released);
the parent's environment variables, working directory, stdout and stderr are applied before each call. A failed or
timed-out call ends its processes (the next call starts fresh ones), and so does a call that destroyed
the world group. `fresh=True` runs in new processes that end with the call: for fault tests (stalled or
dying peers) whose groups may be left mid-collective, and for bodies that set up the world themselves.

TwinRankGroup is a one-process stand-in for a process group of two identical ranks (its
allreduce doubles the tensor), for routing tests that need no second process.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import pickle
import queue
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing import reduction
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD_TIMEOUT = timedelta(seconds=120)


def _release_groups() -> None:
    """Destroy every process group but the world's: contexts still open first (their CommGroups are
    revoked), then any group made outside a context, newest first."""
    from fusedpar.collectives import context

    for ctx in list(context._OPEN):
        ctx._release(destroy_all=True)
    world = dist.group.WORLD
    for pg in reversed(list(dist.distributed_c10d._world.pg_map)):
        if pg is not world:
            dist.destroy_process_group(pg)


def _call(rank: int, world_size: int, task: tuple, results) -> bool:
    """Run one task on this rank and report it; True while the world group is still usable."""
    call, threads, env, cwd, path, outputs = task
    try:
        _redirect(outputs)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.path[:] = path  # before unpickling: fn's module may sit on a path added since the spawn
        torch.set_num_threads(threads)
        fn, args, kwargs = pickle.loads(call)
        out = fn(rank, world_size, *args, **kwargs)
        if not dist.is_initialized():
            raise RuntimeError("the function destroyed the world process group; run it with fresh=True")
        # gloo's connectFullMesh for a new_group can finish on one rank while its peer is still mid-handshake;
        # a rank that returned and destroyed its groups then makes the peer fail with "Connection closed by
        # peer". Leave only when every rank is done.
        dist.barrier()
        _release_groups()
        # Pickled by value here: a tensor put on the queue as is travels as a shared-memory handle
        # that dies with this process, which may exit before the parent unpickles it.
        results.put((rank, "ok", pickle.dumps(out)))
        return True
    except BaseException:  # report anything, including KeyboardInterrupt, to the parent
        results.put((rank, "error", traceback.format_exc()))
        return False
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _redirect(outputs: tuple | None) -> None:
    """Point this process's stdout and stderr at the caller's current ones (kept processes were
    spawned while those may have been elsewhere, e.g. another test's capture)."""
    if outputs is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    for target, dup in zip((1, 2), outputs, strict=True):
        fd = dup.detach()
        os.dup2(fd, target)
        os.close(fd)


def _worker(rank: int, world_size: int, init_file: str, tasks, results, reuse: bool) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=WORLD_TIMEOUT)
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        return
    parent = mp.parent_process()
    try:
        while True:
            try:
                task = tasks.get(timeout=1.0)
            except queue.Empty:
                if parent is not None and not parent.is_alive():  # the caller was killed: leave with it
                    break
                continue
            if task is None or not _call(rank, world_size, task, results) or not reuse:
                break
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class _Pool:
    """world_size processes in one gloo world, each running the tasks put on its own queue."""

    def __init__(self, world_size: int, reuse: bool) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self._tmp = tempfile.TemporaryDirectory()
        init_file = os.path.join(self._tmp.name, f"pg-{socket.gethostname()}-{os.getpid()}")
        self.procs = [ctx.Process(target=_worker, daemon=True,
                                  args=(r, world_size, init_file, self.tasks[r], self.results, reuse))
                      for r in range(world_size)]
        for p in self.procs:
            p.start()

    def run(self, task: tuple, timeout: float, redirect: bool) -> tuple[dict[int, Any], list[str]]:
        sys.stdout.flush()
        sys.stderr.flush()
        for q in self.tasks:
            q.put((*task, (reduction.DupFd(1), reduction.DupFd(2)) if redirect else None))
        out: dict[int, Any] = {}
        errors: list[str] = []
        try:
            for _ in range(self.world_size):
                rank, status, payload = self.results.get(timeout=timeout)
                if status == "error":
                    errors.append(f"rank {rank} failed:\n{payload}")
                    break  # the others are likely blocked in a collective; do not wait for them
                out[rank] = pickle.loads(payload)
        except queue.Empty:
            missing = sorted(set(range(self.world_size)) - set(out))
            errors.append(f"timed out after {timeout}s waiting for ranks {missing}")
        return out, errors

    def close(self, wait: float) -> None:
        """Ask the processes to leave (they destroy the world group), wait up to `wait` s, then kill."""
        for q in self.tasks:
            with contextlib.suppress(ValueError, OSError):  # the queue is already closed
                q.put(None)
        for p in self.procs:
            p.join(timeout=wait)
            if p.is_alive():
                p.kill()
                p.join()
        for q in (*self.tasks, self.results):
            q.close()
            q.cancel_join_thread()
        self._tmp.cleanup()


_POOLS: dict[tuple[int, int], _Pool] = {}  # (world_size, threads) -> processes kept between calls


@functools.cache
def _register_exit_hook() -> None:
    atexit.register(close_pools)


def close_pools() -> None:
    """End the kept processes now (they also end at this process's exit): a test session calls it when it
    finishes, so that the processes are gone, and have written what they leave behind at their exit
    (coverage data), before the session reports."""
    while _POOLS:
        _POOLS.popitem()[1].close(wait=10)


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 600.0, threads: int = 1,
                    fresh: bool = False, **kwargs: Any) -> list:
    """fn must be importable by name (a module-level function): processes are spawned.

    threads: intra-op threads per rank (4 ranks on 2 cores: 1 avoids oversubscription stalls).
    fresh: new processes for this call only (see the module doc); otherwise the kept ones.
    """
    # Pickled here, by value (tensors too): an unpicklable argument is an error at once, not one the
    # queue's feeder thread prints while the ranks wait.
    call = pickle.dumps((fn, args, kwargs))
    task = (call, threads, dict(os.environ), os.getcwd(), list(sys.path))
    key = (world_size, threads)
    kept = None if fresh else _POOLS.pop(key, None)
    pool = kept or _Pool(world_size, reuse=not fresh)
    out, errors = pool.run(task, timeout, redirect=kept is not None)
    if fresh or errors:
        pool.close(wait=5 if not errors else 0.1)
    else:
        _register_exit_hook()
        _POOLS[key] = pool
    if errors:
        raise RuntimeError("\n".join(errors))
    return [out[r] for r in range(world_size)]


class TwinRankGroup:
    """A stand-in for a two-rank ProcessGroup whose ranks hold identical tensors: allreduce (SUM)
    doubles the tensor in place. Records each call (the tensor, then "waited" when its work is
    waited on) in `calls`; returns_work=False returns no work object, as NCCL does for a
    synchronous allreduce (asyncOp=False: enqueued on the caller's stream). Pass it as `pg` of a
    CommGroup-like SimpleNamespace(size=2, pg=...)."""

    def __init__(self, returns_work: bool = True) -> None:
        self.calls: list = []
        self.returns_work = returns_work  # False: as NCCL answers a synchronous (asyncOp=False) allreduce

    def allreduce(self, tensors: list[torch.Tensor], opts) -> Any:
        from types import SimpleNamespace

        if len(tensors) != 1 or opts.reduceOp != dist.ReduceOp.SUM:
            raise AssertionError(f"TwinRankGroup: expected one tensor and SUM, got {len(tensors)}, {opts.reduceOp}")
        if getattr(opts, "asyncOp", False):  # dist.all_reduce(async_op=False)'s options: NCCL runs it in stream
            raise AssertionError("TwinRankGroup: expected the synchronous options (asyncOp=False)")
        self.calls.append(tensors[0])
        tensors[0].mul_(2.0)
        if not self.returns_work:
            return None
        return SimpleNamespace(wait=lambda: self.calls.append("waited"))
