"""HostExchange: all-gather a few host integers among the ranks of a group without the device.

Per call every rank contributes `width` int64 and gets every rank's row, in group order. Ranks on
one x86-64 host share a small mapped file (/dev/shm): each rank writes its row, then the call's
sequence number, into its slot of one of two buffers (alternating per call), and waits until every
slot of that buffer carries the number. x86-64 keeps stores in order and loads in order, so a rank
that reads a peer's number reads the row written before it; a rank cannot reuse a buffer before
every peer has read it (it needs their next number first). A call costs a few microseconds of host
time; gloo's all-gather (TCP) costs hundreds. Ranks on several hosts, or another CPU architecture,
use the group's gloo all-gather instead.

Bounded: a rank that waits longer than `timeout` for a peer raises RuntimeError naming the peers
that did not arrive and the call. Collective: every rank of the group builds it together (one gloo
exchange, one broadcast) and calls `all_gather` the same number of times.
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
import time
import uuid

import torch
import torch.distributed as dist

from fusedpar.collectives.context import CommGroup

_SHARED_MEMORY = "/dev/shm"
_SPIN_SECONDS = 200e-6  # peers in step arrive within this; later ones are waited for asleep


class HostExchange:
    """All-gather of `width` int64 per rank over `group` (a CommGroup on a gloo process group)."""

    def __init__(self, group: CommGroup, width: int, timeout: datetime.timedelta | float):
        if width < 1:
            raise ValueError(f"HostExchange: width must be >= 1, got {width}")
        self.group, self.width = group, width
        self.timeout = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
        self.calls = 0
        self.shared: torch.Tensor | None = None
        if group.size == 1:
            return
        here = (socket.gethostname(), platform.machine())
        hosts: list = [None] * group.size
        dist.all_gather_object(hosts, here, group=group.pg)
        if len(set(hosts)) == 1 and here[1] in ("x86_64", "AMD64") and os.path.isdir(_SHARED_MEMORY):
            self.shared = self._map()

    def _map(self) -> torch.Tensor | None:
        """The mapped buffers [2, ranks, 1 + width], or None on every rank when any rank could not
        make or map the file (then gloo serves)."""
        numel = 2 * self.group.size * (self.width + 1)
        name: list[str | None] = [None]
        if self.group.rank == 0:
            path = f"{_SHARED_MEMORY}/fusedpar-exchange-{uuid.uuid4().hex}"
            try:
                with open(path, "wb") as f:
                    f.write(bytes(8 * numel))
                name = [path]
            except OSError:  # /dev/shm full or read-only: every rank falls back to gloo below
                name = [""]
        dist.broadcast_object_list(name, src=self.group.ranks[0], group=self.group.pg)
        shared = None
        if name[0]:
            try:
                with torch.inference_mode(False):  # a normal tensor: calls under inference mode and outside write it
                    shared = torch.from_file(name[0], shared=True, size=numel, dtype=torch.int64)
            except (OSError, RuntimeError):
                shared = None
        mapped: list = [None] * self.group.size
        dist.all_gather_object(mapped, shared is not None, group=self.group.pg)  # also: every rank mapped it
        if self.group.rank == 0 and name[0]:
            os.unlink(name[0])  # the mappings stay
        if not all(mapped):
            return None
        return shared.view(2, self.group.size, self.width + 1)

    def all_gather(self, row: list[int]) -> list[list[int]]:
        """Every rank's `row` (length `width`), in group order."""
        if len(row) != self.width:
            raise ValueError(f"HostExchange: a row of {len(row)} values, the exchange takes {self.width}")
        self.calls += 1
        if self.group.size == 1:
            return [list(row)]
        if self.shared is None:
            mine = torch.tensor(row, dtype=torch.int64)
            rows = [torch.empty_like(mine) for _ in range(self.group.size)]
            dist.all_gather(rows, mine, group=self.group.pg)
            return [r.tolist() for r in rows]
        buf = self.shared[self.calls % 2]
        slot = buf[self.group.rank]
        slot[1:].copy_(torch.tensor(row, dtype=torch.int64))
        slot[0] = self.calls  # after the row: a peer that sees the number sees the row
        seqs = buf[:, 0]
        start = pause = None
        while not bool((seqs == self.calls).all()):
            now = time.monotonic()
            if start is None:
                start = now
            elif now - start > self.timeout:
                late = [self.group.ranks[i] for i, s in enumerate(seqs.tolist()) if s != self.calls]
                raise RuntimeError(f"HostExchange: rank(s) {late} did not reach call {self.calls} within "
                                   f"{self.timeout:.0f} s (ranks {list(self.group.ranks)})")
            elif now - start > _SPIN_SECONDS:  # a peer far behind: sleep, backing off to 1 ms
                pause = min(1e-3, 2 * pause) if pause else 1e-5
                time.sleep(pause)
        return buf[:, 1:].tolist()
