"""Synchronisation primitives of the PeerTable epoch protocol, shared by the communication kernels.

Used by fusedpar.kernels.allreduce (one-shot all-reduce), fusedpar.kernels.gemm_all_reduce and
fusedpar.kernels.ulysses; the workspace and its memory layout are fusedpar/collectives/symmetric.py.

The protocol
    Epoch-valued flags. A launch uses epoch e = counters[EPOCH] + 1 (`launch_epoch`); the last of
    its programs to retire stores counters[EPOCH] = e (`retire` / `retire_system`). The counter
    lives in device memory, so CUDA-graph replays advance it. Flags are never reset: a flag word
    holds the epoch of the last launch that published it, and a wait is for ">= e" (a fast peer
    may already have published e + 1; epochs never repeat, so a stale value never passes).
    One word per (row, source rank). Every rank owns int64 flag words [max_blocks * W]; word
    [row * W + src] is written only by rank src, so no word has two writers on different GPUs.
    What a row means is the kernel's business (a program index, a tile band, READY / DONE).
    Release / acquire at system scope. Producer: data stores (local or over NVLink), a CTA
    barrier, then an atomic exchange of e into the flag word with release semantics at system
    scope (`publish`); the release is cumulative over the CTA's stores ordered before it by the
    barrier. Consumer: RMW atomics (add 0: stock Triton has no atomic load) with acquire
    semantics at system scope on LOCAL flag words until every word is >= e, then a CTA barrier so
    every thread's later loads are ordered after the few threads' acquire (`wait_flags`).
    Bounded spins. SPIN_LIMIT > 0 makes a wait give up after that many polls and set
    counters[STATUS] = 1: a reported error (wrong data, no hang). The interpreter always bounds
    the spin (INTERPRETER_SPIN_LIMIT: its phased emulations set every flag before it is waited
    on, so a miss is a protocol bug); GPUs use a per-kernel limit (or 0: unbounded).

Each helper is the code its callers used to inline (Triton inlines @triton.jit calls): the same
atomics with the same sem / scope, the same CTA barriers, in the same order, spelled out once here.
Variants that differ in a scope or a barrier are separate functions (`retire` vs `retire_system`),
never a switch.

Host side: the small helpers the three launchers share (sizes, SM count, spin limit, device guard,
group resolution, emulation status check) and the routers' capture test (`routes_as_captured`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from fusedpar.collectives.symmetric import ALIGN_BYTES, COUNTER_EPOCH, COUNTER_RETIRED, COUNTER_STATUS
from fusedpar.kernels._host import INTERPRETER_NUM_SMS, device_num_sms
from fusedpar.kernels._host import next_pow2 as next_pow2  # re-exported: the launchers import it from here

# Counter indices as Triton constexprs: a @jit function may only read constexpr globals.
EPOCH = tl.constexpr(COUNTER_EPOCH)
RETIRED = tl.constexpr(COUNTER_RETIRED)
STATUS = tl.constexpr(COUNTER_STATUS)

# Interpreter: the phased emulations set every flag before it is waited on; a few polls suffice.
INTERPRETER_SPIN_LIMIT = 8
# GPUs: polls of a local flag word (a system-scope acquire RMW each) before a wait gives up and
# reports counters[STATUS] = 1: seconds, far above any legitimate wait (a peer's GEMM, launch
# skew, a peer's first-call Triton compile), yet a reported error rather than a hang.
GPU_SPIN_LIMIT = 1 << 25


# =============================================================================== device side


@triton.jit
def launch_epoch(counters_ptr, AHEAD: tl.constexpr):
    """counters[EPOCH] + AHEAD: the epoch of this launch (AHEAD = 1) or of the last one (AHEAD = 0).

    Written by the previous launch's last program, so stream order makes it visible here.
    """
    return tl.load(counters_ptr + EPOCH) + AHEAD


@triton.jit
def flags_of(signal_ptrs, rank):
    """Base of `rank`'s int64 flag words (an address loaded from the signal pointer table)."""
    return tl.load(signal_ptrs + rank).to(tl.pointer_type(tl.int64))


@triton.jit
def publish(signal_ptrs, word, epoch, mask):
    """Exchange `epoch` into flag word `word` of every rank selected by `mask`: release, system scope.

    mask: [P] over ranks 0..P-1 (P a power of two >= W). Cumulative release: everything this CTA
    stored before the caller's CTA barrier (or acq_rel chain) is visible to a peer that acquires
    the word. Ranks outside the mask are neither loaded nor written.
    """
    peers = tl.arange(0, mask.shape[0])
    dst = tl.load(signal_ptrs + peers, mask=mask, other=0).to(tl.pointer_type(tl.int64))
    tl.atomic_xchg(dst + word, epoch, mask=mask, sem="release", scope="sys")


@triton.jit
def wait_flags(flag_ptrs, mask, epoch, counters_ptr, SPIN_LIMIT: tl.constexpr):
    """Spin until every int64 word flag_ptrs[i] with mask[i] is >= epoch (acquire, system scope).

    Stock Triton has no atomic load: an atomic add of 0 with acquire semantics is one. SPIN_LIMIT
    > 0 bounds the spin: on timeout counters[STATUS] = 1 and the caller goes on (no hang).
    The closing CTA barrier orders every thread's later loads after the acquire of the few
    threads that ran the atomics.
    """
    seen = tl.atomic_add(flag_ptrs, 0, mask=mask, sem="acquire", scope="sys")
    missing = tl.sum((mask & (seen < epoch)).to(tl.int32), axis=0)
    spins = 0
    while missing > 0:
        seen = tl.atomic_add(flag_ptrs, 0, mask=mask, sem="acquire", scope="sys")
        missing = tl.sum((mask & (seen < epoch)).to(tl.int32), axis=0)
        if SPIN_LIMIT > 0:
            spins += 1
            if spins >= SPIN_LIMIT:
                tl.atomic_xchg(counters_ptr + STATUS, 1)
                missing = 0
    tl.debug_barrier()


@triton.jit
def retire(counters_ptr, epoch, nprog):
    """Count this program out (acq_rel, GPU scope); the last one of the launch stores counters[EPOCH] = epoch.

    For kernels whose programs published their own flags before retiring: the counter only orders
    the launches of one GPU (the next launch reads the epoch), so GPU scope and no barrier.
    """
    retired = tl.atomic_add(counters_ptr + RETIRED, 1, sem="acq_rel", scope="gpu")
    if retired == nprog - 1:
        tl.atomic_xchg(counters_ptr + RETIRED, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(counters_ptr + EPOCH, epoch, sem="relaxed", scope="gpu")


@triton.jit
def retire_system(counters_ptr, epoch, nprog):
    """Count this program out; the last one of the launch stores counters[EPOCH] = epoch.

    acq_rel at SYSTEM scope, after a CTA barrier: the release makes this CTA's earlier stores
    (peer stores over NVLink included) performed at system scope before the counter moves, and
    the last program's acquire observes every other program's stores, so a release it issues
    next covers the whole launch. Returns True in the last program.
    """
    tl.debug_barrier()
    retired = tl.atomic_add(counters_ptr + RETIRED, 1, sem="acq_rel", scope="sys")
    last = retired == nprog - 1
    if last:
        tl.atomic_xchg(counters_ptr + RETIRED, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(counters_ptr + EPOCH, epoch, sem="relaxed", scope="gpu")
    return last


# ================================================================================= host side


def esize(dtype: torch.dtype) -> int:
    """Bytes per element of dtype (no tensor construction: traceable by torch.compile)."""
    return dtype.itemsize


def align_up(nbytes: int) -> int:
    """nbytes rounded up to a multiple of ALIGN_BYTES (the workspace's region alignment)."""
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


def slot_size(table) -> int:
    """Bytes of one double-buffer slot of a PeerTable: half the data buffer, ALIGN_BYTES-aligned.

    Every kernel that double-buffers on a table uses this size, so the slots of launches of
    different kernels on one table coincide (the slot parity is global).
    """
    return (table.buffer_bytes // 2) // ALIGN_BYTES * ALIGN_BYTES


def sm_count(device: torch.device, interpreted: bool) -> int:
    """Persistent-grid width: the device's SM count, or a few interpreter "SMs"."""
    if interpreted:
        return INTERPRETER_NUM_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return device_num_sms(index)


def resolve_spin_limit(spin_limit: int | None, interpreted: bool, gpu_limit: int) -> int:
    """spin_limit if given, else INTERPRETER_SPIN_LIMIT under the interpreter and gpu_limit on GPUs."""
    if spin_limit is not None:
        return spin_limit
    return INTERPRETER_SPIN_LIMIT if interpreted else gpu_limit


def device_guard(device: torch.device):
    """Triton launches on the current CUDA device: make it `device` (a no-op on CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


_ROUTING = threading.local()


@contextlib.contextmanager
def routing_as_captured() -> Iterator[None]:
    """Within the block, the size routers (all_reduce, gemm_all_reduce path="auto") choose as if a
    CUDA graph were being captured. For the eager warm-up run before a capture: it compiles exactly
    the kernels the capture will launch, so no Triton compile happens inside the capture."""
    before = getattr(_ROUTING, "as_captured", False)
    _ROUTING.as_captured = True
    try:
        yield
    finally:
        _ROUTING.as_captured = before


def routes_as_captured(device: torch.device) -> bool:
    """Whether a router on `device` picks its CUDA-graph choice: a capture is under way on the current
    stream, or routing_as_captured() is active. Eager CUDA calls are bound by the host's launch cost
    at decode sizes, where a Triton launch costs more than NCCL's or cuBLAS's, so they route to the
    stock path. Capture is the same on every rank of a collective, so all ranks still agree."""
    return device.type == "cuda" and (getattr(_ROUTING, "as_captured", False)
                                      or torch.cuda.is_current_stream_capturing())


def group_size_and_pg(group):
    """(size, ProcessGroup or None) of a ProcessGroup or a CommGroup-like object (.size, .pg)."""
    pg = getattr(group, "pg", group)
    size = group.size() if callable(getattr(group, "size", None)) else group.size
    return int(size), pg


def check_emulated_rank(table, rank: int, what: str) -> None:
    """Raise RuntimeError if a bounded flag wait of rank `rank` (its PeerTable) timed out."""
    if table.status() != 0:
        raise RuntimeError(f"emulated {what}: rank {rank} waited for a flag that never came")
