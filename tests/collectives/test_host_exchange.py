"""HostExchange: every rank gets every rank's row, call after call, through shared memory on one
host (gloo elsewhere); a peer that never arrives is a RuntimeError within the timeout."""

from __future__ import annotations

import platform

import pytest

from fusedpar.testing.dist import run_distributed


def _rows_worker(rank, world, shared):
    import random

    import torch.distributed as dist

    from fusedpar.collectives import CommGroup
    from fusedpar.collectives.host_exchange import HostExchange

    group = CommGroup(ranks=tuple(range(world)), rank=rank, pg=dist.group.WORLD)
    ex = HostExchange(group, 3, timeout=60)
    if not shared:
        ex.shared = None  # the gloo path
    out = {"shared": ex.shared is not None, "bad": []}
    for call in range(300):
        rng = random.Random(call)  # every rank knows every rank's row of this call
        want = [[rng.randrange(-2**62, 2**62) for _ in range(3)] for _ in range(world)]
        got = ex.all_gather(want[rank])
        if got != want:
            out["bad"].append((call, got, want))
    return out


def test_every_rank_gets_every_row_in_order():
    for world in (2, 4):
        for shared in (True, False):
            for rank, out in enumerate(run_distributed(_rows_worker, world, shared, timeout=120)):
                assert not out["bad"], f"world {world}, rank {rank}, shared {shared}: {out['bad'][:2]}"
                if shared:
                    assert out["shared"] == (platform.machine() in ("x86_64", "AMD64")), out
                else:
                    assert not out["shared"]


def _late_peer_worker(rank, world):
    import time

    import torch.distributed as dist

    from fusedpar.collectives import CommGroup
    from fusedpar.collectives.host_exchange import HostExchange

    ex = HostExchange(CommGroup(ranks=tuple(range(world)), rank=rank, pg=dist.group.WORLD), 1, timeout=2)
    if ex.shared is None:
        return "gloo"  # its bound is the process group's timeout (tests/collectives/test_timeouts.py)
    ex.all_gather([rank])
    if rank == 1:
        time.sleep(6)  # never makes the second call in time
        return None
    t0 = time.monotonic()
    try:
        ex.all_gather([rank])
    except RuntimeError as e:
        return time.monotonic() - t0, str(e)
    return time.monotonic() - t0, None


def test_a_peer_that_does_not_arrive_is_an_error_within_the_timeout():
    res = run_distributed(_late_peer_worker, 2, timeout=60, fresh=True)
    if res[0] == "gloo":
        pytest.skip("no shared-memory exchange on this machine")
    seconds, err = res[0]
    assert err is not None and "rank(s) [1] did not reach call 2 within 2 s" in err, err
    assert 2 <= seconds < 10, seconds  # the 2 s bound, plus scheduling slack on a loaded machine
