"""Every group ParallelContext creates carries one timeout: a stalled peer is an error within it."""

import datetime
import time

import torch

from fusedpar import ParallelLayout
from fusedpar.collectives import ParallelContext, all_reduce_sum
from fusedpar.testing.dist import run_distributed

STALL_S = 12.0


def _stall_worker(rank, world, timeout_s):
    ctx = ParallelContext(ParallelLayout(world, sp=1, tp=world), timeout=timeout_s)
    default = ParallelContext(ParallelLayout(world, sp=1, tp=world))
    if rank == 1:
        time.sleep(STALL_S)  # never joins the all-reduce below
        return {"timeout": ctx.timeout, "default": default.timeout}
    start = time.monotonic()
    try:
        all_reduce_sum(torch.ones(4), ctx.shift)
        error = None
    except RuntimeError as e:
        error = str(e)
    return {"timeout": ctx.timeout, "default": default.timeout, "elapsed": time.monotonic() - start, "error": error}


def test_a_stalled_peer_fails_the_collective_within_the_context_timeout():
    res = run_distributed(_stall_worker, 2, 3.0, timeout=120)
    assert res[0]["timeout"] == datetime.timedelta(seconds=3)
    # run_distributed creates the world group with a 120 s timeout: the default follows it
    assert res[0]["default"] == res[1]["default"] == datetime.timedelta(seconds=120)
    assert res[0]["error"] is not None, "the all-reduce with a stalled peer returned"
    assert res[0]["elapsed"] < 3.0 + 6.0, f"the error took {res[0]['elapsed']:.1f} s with a 3 s timeout"


BAD_TIMEOUTS = (0, -1.0, "10", True)


def _bad_timeout_worker(rank, world):
    messages = []
    for value in BAD_TIMEOUTS:
        try:
            ParallelContext(ParallelLayout(world), timeout=value)
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_timeout_must_be_positive_seconds_or_timedelta():
    (messages,) = run_distributed(_bad_timeout_worker, 1, timeout=120)
    for value, msg in zip(BAD_TIMEOUTS, messages, strict=True):
        assert msg is not None, f"timeout={value!r} was accepted"
        assert "timeout" in msg and repr(value) in msg, msg
