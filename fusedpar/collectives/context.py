"""ParallelContext: every process group a rank will ever use, created once at construction.

torch.distributed.new_group must be called by every rank of the world, in the same order, for
every group, members or not. Creating all groups eagerly here (instead of lazily on first
use) keeps that order identical on all ranks and keeps communicator setup off the step path.
Groups with identical rank lists are created once and shared (e.g. the SP group and the shift
group when tp == 1), so no communicator is duplicated. Every group gets one timeout (by default
the world group's), so a stalled or dead peer ends the other ranks' waits within that bound (how,
on NCCL, depends on torch's error-handling mode: see ParallelContext).

ParallelContext.close() destroys the groups; contexts still open when the interpreter exits are
released by an atexit hook (see close), so no gloo worker thread of theirs outlives them.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import gc
import warnings
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fusedpar.layouts import ParallelLayout, RankCoords, StepMode, check_mode


@dataclass(frozen=True)
class CommGroup:
    """One process group as seen from this rank: its members in group order and our index."""

    ranks: tuple[int, ...]
    rank: int  # index of this process inside `ranks`
    pg: dist.ProcessGroup | None  # None only for a size-1 group, which never communicates

    @property
    def size(self) -> int:
        return len(self.ranks)

    def _revoke(self) -> None:
        """Drop the process group (its ParallelContext closed): every later use of `pg` raises."""
        if self.pg is not None:
            object.__setattr__(self, "pg", _ClosedGroup(self.ranks))

    def __repr__(self) -> str:
        return f"CommGroup(ranks={list(self.ranks)}, rank={self.rank})"


class _ClosedGroup:
    """The `pg` of a CommGroup whose ParallelContext was closed: any use raises RuntimeError."""

    __slots__ = ("ranks",)

    def __init__(self, ranks: tuple[int, ...]):
        self.ranks = ranks

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise RuntimeError(f"the process group of ranks {list(self.ranks)} was destroyed by ParallelContext.close()")

    def __repr__(self) -> str:
        return f"<closed process group of ranks {list(self.ranks)}>"


def _default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def world_timeout() -> datetime.timedelta:
    """The timeout the world process group was created with (torch's default for its backend if the
    backend does not expose it)."""
    pg = dist.group.WORLD
    backend = dist.get_backend(pg)
    device = torch.device("cuda" if backend == "nccl" else "cpu")
    try:
        return pg._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return dist.distributed_c10d._get_default_timeout(backend)


class ParallelContext:
    """This rank's view of a ParallelLayout: coordinates, device and the four groups.

    Requires torch.distributed to be initialised with world size == layout.world_size.
    backend: for the subgroups; default "nccl" on CUDA devices and "gloo" on CPU.
    timeout: of every subgroup's collectives (a timedelta or seconds); default the world group's.
    host_groups: also create gloo twins of the shift groups and of the world (`host(group)`), for
        exchanges of host values that must not wait for the device.

    What a stalled or dead peer does to the other ranks (the `timeout` bounds each case):
      gloo: their collective raises RuntimeError within `timeout`.
      nccl: a collective only enqueues GPU work and returns; the host learns of the missing peer
        at a synchronisation. barrier() is the bounded one: it raises
        torch.distributed.DistBackendError (a RuntimeError) within `timeout`, naming the timed-out
        collective, and aborts this context's communicators, so no kernel of theirs keeps spinning.
        Call it once per step (where the step synchronises anyway) to turn a stalled or dead peer
        into an exception. Without it the host blocks in its next synchronisation (.item(), .cpu(),
        torch.cuda.synchronize()) until torch's NCCL watchdog acts, `timeout` after the collective
        was enqueued: it logs "Watchdog caught collective operation timeout", waits for debug dumps
        (TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC), then ends the process (SIGABRT) under torch's default
        TORCH_NCCL_ASYNC_ERROR_HANDLING=3. That teardown also follows an error barrier() raised; to
        keep the process alive for its error handling, set TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (the
        watchdog then aborts communicators instead) in every rank's environment before
        init_process_group. TORCH_NCCL_BLOCKING_WAIT=1 does not
        help: fusedpar's collectives are synchronous (async_op=False), which gives torch no work
        handle to wait on, and that mode also stops the watchdog.
      Creating the world group with device_id (eager NCCL communicators) keeps communicator set-up
      out of the first collective, so the timeout covers the collectives alone.

    Shutdown: call close() on every rank before dist.destroy_process_group() (see close). A context
    still open at interpreter exit is released without the barrier by an atexit hook.
    """

    def __init__(self, layout: ParallelLayout, backend: str | None = None, device: torch.device | str | None = None,
                 timeout: datetime.timedelta | float | None = None, host_groups: bool = False):
        if not dist.is_initialized():
            raise RuntimeError("ParallelContext needs torch.distributed initialised (init_process_group) first")
        world = dist.get_world_size()
        if world != layout.world_size:
            raise ValueError(
                f"layout.world_size={layout.world_size} but torch.distributed world size is {world}"
            )
        self.layout = layout
        self.global_rank = dist.get_rank()
        self.coords: RankCoords = layout.coords(self.global_rank)
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if backend == "nccl" or (backend is None and dist.get_backend() == "nccl")
                else torch.device("cpu")
            )
        self.device = torch.device(device)
        self.backend = backend or _default_backend(self.device)
        if timeout is None:
            timeout = world_timeout()
        elif not isinstance(timeout, datetime.timedelta):
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
                raise ValueError(f"ParallelContext: timeout must be a positive number of seconds or a timedelta, "
                                 f"got {timeout!r}")
            timeout = datetime.timedelta(seconds=timeout)
        self.timeout: datetime.timedelta = timeout
        self.closed = False
        # this rank's groups, each once, in creation order: (ranks, group, backend)
        self._owned: list[tuple[tuple[int, ...], dist.ProcessGroup, str]] = []

        made: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        # Same iteration order on every rank: the order of new_group calls must match.
        for groups in (layout.sp_groups, layout.tp_groups, layout.shift_groups, layout.dp_groups):
            for ranks in groups:
                key = tuple(ranks)
                if key not in made:
                    made[key] = (self._new_group(key, self.backend) if len(key) > 1 else None)
        self._pgs = made
        self._host_pgs: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        if host_groups:
            for ranks in (*layout.shift_groups, list(range(world))):
                key = tuple(ranks)
                if key not in self._host_pgs:
                    if len(key) == 1:
                        self._host_pgs[key] = None
                    elif self.backend == "gloo" and key in made:
                        self._host_pgs[key] = made[key]
                    else:
                        self._host_pgs[key] = self._new_group(key, "gloo")
        # the CommGroups handed out, one per rank list: close() revokes them
        self._issued: dict[tuple[int, ...], CommGroup] = {}
        self._issued_host: dict[tuple[int, ...], CommGroup] = {}
        self.sp = self._mine(layout.sp_group_of(self.global_rank))
        self.tp = self._mine(layout.tp_group_of(self.global_rank))
        self.shift = self._mine(layout.shift_group_of(self.global_rank))
        self.dp = self._mine(layout.dp_group_of(self.global_rank))
        _track_open(self)

    def _new_group(self, key: tuple[int, ...], backend: str) -> dist.ProcessGroup:
        pg = dist.new_group(list(key), backend=backend, timeout=self.timeout)
        if self.global_rank in key:
            self._owned.append((key, pg, backend))
        return pg

    def _mine(self, ranks: list[int]) -> CommGroup:
        key = tuple(ranks)
        if key not in self._issued:
            self._issued[key] = CommGroup(ranks=key, rank=key.index(self.global_rank), pg=self._pgs[key])
        return self._issued[key]

    def host(self, group: CommGroup) -> CommGroup:
        """The gloo twin of `group` (same ranks; CPU tensors): a shift group or the world, built with
        host_groups=True."""
        if self.closed:
            raise RuntimeError("ParallelContext.host: the context is closed")
        if group.ranks not in self._host_pgs:
            raise ValueError(f"ParallelContext.host: no host group for ranks {list(group.ranks)} (the context makes "
                             f"them for the shift groups and the world, with host_groups=True; it has "
                             f"{[list(k) for k in self._host_pgs]})")
        if group.ranks not in self._issued_host:
            self._issued_host[group.ranks] = CommGroup(ranks=group.ranks, rank=group.rank,
                                                       pg=self._host_pgs[group.ranks])
        return self._issued_host[group.ranks]

    def close(self) -> None:
        """Destroy this context's process groups. Collective: every rank calls it, before
        dist.destroy_process_group(); a second call does nothing.

        A barrier on each of this rank's groups (so no rank tears a group down while a peer still
        uses it), then each group is destroyed (reverse creation order) and every CommGroup this
        context handed out (sp, tp, shift, dp, host twins) is revoked: its `pg` raises on any use.
        Once nothing references a gloo group any more its worker threads are joined, here, with
        the interpreter intact: a gloo worker finishes each collective by releasing the tensors
        it held, which takes the GIL, and a thread that takes the GIL while the interpreter
        finalises is ended by the interpreter, which aborts the process ("terminate called
        without an active exception"). A gloo group still referenced elsewhere (a `.pg` kept
        outside a CommGroup) is warned about.

        A context still open at interpreter exit is released the same way by an atexit hook,
        without the barrier (its peers may be gone) and destroying only its gloo groups in
        torch.distributed (NCCL ones are left to dist.destroy_process_group).
        """
        if self.closed:
            return
        try:
            if dist.is_initialized():
                self._barriers()
        finally:
            self._release(destroy_all=True)

    def _barriers(self) -> None:
        """A barrier on each of this rank's groups, in creation order (the same on every rank)."""
        for ranks, pg, backend in self._owned:
            if backend == "gloo":  # no tensor: leaves the group's worker threads nothing to release
                dist.barrier(group=pg, timeout=self.timeout)
            else:
                self.barrier(CommGroup(ranks=ranks, rank=ranks.index(self.global_rank), pg=pg))

    def _release(self, destroy_all: bool) -> None:
        """Revoke the issued CommGroups, drop this context's references to its groups and destroy them
        in torch.distributed (all of them, or the gloo ones only); then check the gloo ones are gone."""
        self.closed = True
        _OPEN.discard(self)
        owned, self._owned = self._owned, []
        for group in (*self._issued.values(), *self._issued_host.values()):
            group._revoke()
        self._pgs, self._host_pgs = {}, {}
        if dist.is_initialized():
            _destroy([pg for _, pg, backend in reversed(owned) if destroy_all or backend == "gloo"])
        gloo = [weakref.ref(pg) for _, pg, backend in owned if backend == "gloo"]
        del owned
        if any(ref() is not None for ref in gloo):
            gc.collect()  # a reference cycle may still hold one
        alive = sum(ref() is not None for ref in gloo)
        if alive:
            warnings.warn(f"ParallelContext.close: {alive} gloo process group(s) of this context are still referenced "
                          "outside it (a .pg kept beyond its CommGroup); their worker threads run until those "
                          "references go", RuntimeWarning, stacklevel=3)

    def barrier(self, group: CommGroup | None = None) -> None:
        """Return once every rank of `group` (default: the shift group, i.e. the replica) reached this
        call and this rank's earlier collectives on the current CUDA stream finished; else raise
        RuntimeError (DistBackendError on NCCL) within `timeout`. Collective over `group`.

        One 1-element all-reduce whose host wait is bounded by `timeout` (Work.wait(timeout)). On
        NCCL the host waits for the GPU to drain the stream up to it, polling (about 1 ms apart): use
        it at most once per step. On an NCCL error every communicator of this context is aborted
        before the error propagates: the groups are unusable afterwards (see the class doc)."""
        g = self.shift if group is None else group
        if g.size == 1:
            return
        flag = torch.zeros(1, device=self.device)
        try:
            dist.all_reduce(flag, group=g.pg, async_op=True).wait(self.timeout)
        except RuntimeError:
            if self.backend == "nccl":
                for pg in filter(None, self._pgs.values()):
                    with contextlib.suppress(Exception):  # the timeout above is the error to report
                        pg.abort()  # ends any kernel of this context's still spinning on the GPU
            raise

    def attention_group(self, mode: str) -> CommGroup:
        """The group the post-attention row-parallel all-reduce spans: TP in base, shift in shift."""
        if mode == StepMode.BASE:
            return self.tp
        if mode == StepMode.SHIFT:
            return self.shift
        # Checked after the two valid modes, so the per-layer lookup costs nothing extra.
        raise ValueError(f"attention_group: {check_mode(mode)!r} is no step mode")

    def __repr__(self) -> str:
        closed = ", closed" if self.closed else ""
        return (f"ParallelContext(rank={self.global_rank}, {self.coords}, {self.layout!r}, "
                f"backend={self.backend!r}{closed})")


def _destroy(pgs: list[dist.ProcessGroup]) -> None:
    """dist.destroy_process_group for each of `pgs` still registered (a helper: no loop variable outlives it)."""
    for pg in pgs:
        with contextlib.suppress(ValueError):  # already destroyed (torch raises "Invalid process group")
            dist.destroy_process_group(pg)


_OPEN: weakref.WeakSet[ParallelContext] = weakref.WeakSet()  # contexts not closed yet


def _track_open(ctx: ParallelContext) -> None:
    """Remember an open context; the exit hook is registered with the first one (nothing at import)."""
    _register_exit_hook()
    _OPEN.add(ctx)


@functools.cache
def _register_exit_hook() -> None:
    atexit.register(_release_open_contexts)


def _release_open_contexts() -> None:
    """At interpreter exit, before it finalises: release every context still open (see close)."""
    for ctx in list(_OPEN):
        ctx._release(destroy_all=False)
