"""The @triton.jit kernel of the one-shot all-reduce (launcher: launch.py; protocol: __init__.py).

_one_shot_all_reduce_kernel: the COPY_IN phase (x into this rank's slot e % 2, then a flag to every
rank) and the REDUCE phase (wait for every rank's flag, sum the W copies in fp32 in rank order,
retire). One launch runs both on a GPU; the CPU emulation runs them as separate launches. The flag
primitives: fusedpar/kernels/_sync.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fusedpar.kernels._sync import flags_of, launch_epoch, publish, retire, wait_flags


@triton.jit
def _one_shot_all_reduce_kernel(
    x_ptr,
    out_ptr,
    numel,
    buffer_ptrs,  # int64 [WORLD]: every rank's data buffer
    signal_ptrs,  # int64 [WORLD]: every rank's flag words, int64 [max_blocks * WORLD] each
    counters_ptr,  # int64 local: EPOCH, RETIRED, STATUS
    rank,
    slot_bytes,  # data bytes per double-buffer slot (multiple of ALIGN_BYTES)
    WORLD: tl.constexpr,
    WORLD_P2: tl.constexpr,  # next power of two >= WORLD (tl.arange needs one)
    BLOCK: tl.constexpr,
    COPY_IN: tl.constexpr,
    REDUCE: tl.constexpr,
    USE_FLAGS: tl.constexpr,
    SPIN_LIMIT: tl.constexpr,  # 0: spin until the flag arrives (GPU); > 0: give up, set STATUS
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    num_tiles = tl.cdiv(numel, BLOCK)
    dtype = x_ptr.dtype.element_ty
    lanes = tl.arange(0, BLOCK)
    peers = tl.arange(0, WORLD_P2)
    peer_mask = peers < WORLD
    # Epoch of this launch: completed launches + 1. Written by the previous launch's last program,
    # so stream order makes it visible here; it lives in device memory so CUDA-graph replays
    # advance it (a kernel argument would be frozen at capture).
    epoch = launch_epoch(counters_ptr, 1)
    slot_off = (epoch % 2) * slot_bytes

    # Grid-stride loops are `while` loops: the triton 3.6 interpreter with numpy >= 2.4 cannot
    # take runtime bounds in range() (triton-lang/triton#9171: int() of a 1-element array), and
    # these loops take 1-8 iterations of independent loads, so software pipelining adds nothing.
    if COPY_IN:
        mine = (tl.load(buffer_ptrs + rank) + slot_off).to(tl.pointer_type(dtype))
        # Addresses loaded from memory carry no alignment facts; the workspace guarantees
        # ALIGN_BYTES, and without the hint Triton would not emit 16-byte vector accesses.
        mine = tl.multiple_of(mine, 16)
        tile = pid
        while tile < num_tiles:
            offs = tile * BLOCK + lanes
            m = offs < numel
            tl.store(mine + offs, tl.load(x_ptr + offs, mask=m), mask=m)
            tile += nprog
        if USE_FLAGS:
            # Every thread's copy must be done before the flag goes out: CTA barrier, then one
            # release at system scope per destination (cumulative: publishes the CTA's stores).
            tl.debug_barrier()
            # Word [pid, rank] of every rank: written only by this (block, rank) pair.
            publish(signal_ptrs, pid * WORLD + rank, epoch, peer_mask)

    if REDUCE:
        if USE_FLAGS:
            my_flags = flags_of(signal_ptrs, rank) + pid * WORLD
            # Until flag words [pid, 0..W-1] are all >= epoch (a fast peer may already have
            # published epoch + 1), then a CTA barrier: every thread's peer loads come after it.
            wait_flags(my_flags + peers, peer_mask, epoch, counters_ptr, SPIN_LIMIT)

        tile = pid
        while tile < num_tiles:
            offs = tile * BLOCK + lanes
            m = offs < numel
            acc = tl.zeros((BLOCK,), dtype=tl.float32)
            # Fixed rank order 0..WORLD-1 on every rank: identical fp32 sums, identical outputs.
            for p in tl.static_range(WORLD):
                src = (tl.load(buffer_ptrs + p) + slot_off).to(tl.pointer_type(dtype))
                src = tl.multiple_of(src, 16)
                # .cg: bypass L1, so no line cached before the flag wait can be served stale.
                acc += tl.load(src + offs, mask=m, cache_modifier=".cg").to(tl.float32)
            tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=m)
            tile += nprog

        # Retire: the last program of this launch publishes the epoch for the next launch.
        retire(counters_ptr, epoch, nprog)
