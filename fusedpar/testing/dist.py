"""Run a function on N local CPU processes joined by a gloo process group.

run_distributed(fn, world_size, *args, **kwargs) calls fn(rank, world_size, *args, **kwargs) in each process and
returns the per-rank results in rank order. A failure on any rank raises RuntimeError carrying
that rank's traceback; a rank that hangs is killed after `timeout` seconds.

TwinRankGroup is a one-process stand-in for a process group of two identical ranks (its
allreduce doubles the tensor), for routing tests that need no second process.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world_size: int, init_file: str, fn: Callable, args: tuple, kwargs: dict, results,
            threads: int):
    # 4 ranks on a 2-core machine: one intra-op thread each avoids oversubscription stalls.
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=120))
        out = fn(rank, world_size, *args, **kwargs)
        # gloo's connectFullMesh for a new_group can finish on one rank while its peer is still mid-handshake;
        # a rank that returned and destroyed its groups then makes the peer fail with "Connection closed by
        # peer" (seen once in CI on test_shape_errors_name_the_numbers). Leave only when every rank is done.
        dist.barrier()
        # Pickled by value here: a tensor put on the queue as is travels as a shared-memory handle
        # that dies with this process, which may exit before the parent unpickles it.
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # report anything, including KeyboardInterrupt, to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 600.0, threads: int = 1,
                    **kwargs: Any) -> list:
    """fn must be importable by name (a module-level function): processes are spawned."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, f"pg-{socket.gethostname()}-{os.getpid()}")
        procs = [
            ctx.Process(target=_worker, daemon=True,
                        args=(r, world_size, init_file, fn, args, kwargs, results, threads))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        errors = []
        try:
            for _ in range(world_size):
                rank, status, payload = results.get(timeout=timeout)
                if status == "error":
                    errors.append(f"rank {rank} failed:\n{payload}")
                    break  # the others are likely blocked in a collective; do not wait for them
                out[rank] = pickle.loads(payload)
        except queue.Empty:
            errors.append(f"timed out after {timeout}s waiting for ranks {sorted(set(range(world_size)) - set(out))}")
        finally:
            for p in procs:
                p.join(timeout=5 if not errors else 0.1)
                if p.is_alive():
                    p.kill()
                    p.join()
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
