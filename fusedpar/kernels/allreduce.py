"""One-shot all-reduce over a PeerTable: the decode-sized all-reduce of the row-parallel layers.

out = sum over ranks of x, in fp32 in rank order 0..W-1, identical bits on every rank.

Protocol of one launch with epoch e (the PeerTable epoch protocol, fusedpar/kernels/_sync.py):
program b of rank r, over its tiles t = b, b + G, ... (G programs on every rank):
    1. COPY_IN: copy x's tiles into r's own data buffer, slot e % 2 (double buffering); CTA
       barrier; exchange e into flag word [b, r] of every rank (release, system scope).
    2. REDUCE: wait until flag words [b, 0..W-1] of r's own flags are >= e (acquire, system
       scope); sum the W ranks' slot-(e % 2) copies of each tile in fp32, in rank order, into
       out; retire (the last program stores counters[EPOCH] = e).
One flag round per launch suffices: a rank rewrites slot e % 2 only at launch e + 2, which it
cannot reach before every peer finished reading launch e.

Sections: kernel -> configs and options -> checks and launchers (`launch_one_shot_all_reduce`:
the raw launcher, phases switchable for the CPU emulation) -> registered ops
`torch.ops.fusedpar.one_shot_all_reduce` / `_out` (fake impls: torch.compile, CUDA graphs) ->
`one_shot_all_reduce` -> the router `all_reduce` (one-shot for small messages inside CUDA graphs,
NCCL otherwise) and `sum_over_group_` (the process group's allreduce without dist's wrapper).

CPU: interpreted programs run one after another, so the emulation (fusedpar.testing.
allreduce_emulation) runs the phases as separate launches, every rank's copy-in first; the flag
code still runs, and the interpreter's bounded spin turns a missing flag into counters[STATUS].
Set TRITON_INTERPRET=1 before the first import; bf16 is fine here (no tl.dot).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fusedpar.collectives.symmetric import PeerTable, as_peer_table
from fusedpar.kernels._host import INTERPRETED, SUPPORTED_DTYPES, cdiv, require_pow2
from fusedpar.kernels._sync import (
    flags_of,
    group_size_and_pg,
    launch_epoch,
    next_pow2,
    publish,
    resolve_spin_limit,
    retire,
    routes_as_captured,
    slot_size,
    wait_flags,
)
from fusedpar.kernels.routing import thresholds

__all__ = [
    "AllReduceOptions",
    "OneShotConfig",
    "all_reduce",
    "default_config",
    "launch_one_shot_all_reduce",
    "one_shot_all_reduce",
    "one_shot_capacity_bytes",
    "sum_over_group_",
]


# ==================================================================================== kernel


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


# ======================================================================= configs and options


@dataclass(frozen=True)
class OneShotConfig:
    """Launch shape: BLOCK elements per tile, num_warps per program, at most max_blocks programs.

    GPU default: 2048 elements = 8 per thread with 8 warps = one 16-byte access per rank per
    thread for bf16; at most 32 programs, well under the 132 SMs of an H200, so every program is
    co-resident with the peer programs it waits for.
    """

    block: int = 2048
    num_warps: int = 8
    max_blocks: int = 32

    def __post_init__(self) -> None:
        # max_blocks=0 would launch an empty grid: out left unwritten and the epoch never advanced.
        require_pow2("OneShotConfig", block=self.block, num_warps=self.num_warps)
        if self.max_blocks < 1:
            raise ValueError(f"OneShotConfig: max_blocks={self.max_blocks} must be >= 1")


# Interpreter: small tiles and a few programs so the CPU tests exercise several programs, the
# grid-stride loop and partial tiles on small messages.
_INTERPRETER_CONFIG = OneShotConfig(block=256, num_warps=1, max_blocks=4)


_GPU_CONFIG = OneShotConfig()  # one instance: the default is taken per call


def default_config() -> OneShotConfig:
    """The launch shape used when none is given: small under the interpreter, OneShotConfig() on GPUs."""
    return _INTERPRETER_CONFIG if INTERPRETED else _GPU_CONFIG


@dataclass(frozen=True)
class AllReduceOptions:
    """Tuning and A/B switches of all_reduce and one_shot_all_reduce (the defaults: None / True).

    max_one_shot_bytes: all_reduce takes the one-shot up to this many bytes (None: the routing
        table's all_reduce_one_shot_max_bytes, fusedpar.kernels.routing).
    config: the one-shot's launch shape (None: default_config()).
    use_flags: False skips the flag protocol: correct only when something else orders the ranks
        (a phased emulation); a data race on GPUs.
    """

    max_one_shot_bytes: int | None = None
    config: OneShotConfig | None = None
    use_flags: bool = True


_DEFAULT_OPTIONS = AllReduceOptions()


def one_shot_capacity_bytes(peers: PeerTable) -> int:
    """Largest message (bytes) one launch can reduce: one double-buffer slot."""
    return slot_size(peers)


# ==================================================================== checks and launchers


def _check(x: torch.Tensor, device: torch.device, slot_bytes: int, out: torch.Tensor | None) -> None:
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"one-shot all-reduce supports {SUPPORTED_DTYPES}, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"one-shot all-reduce: x is on {x.device} but the peer table is on {device}")
    if x.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError(
            "one-shot all-reduce on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 "
            "before fusedpar.kernels.allreduce is first imported"
        )
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"one-shot all-reduce supports CUDA (and CPU under TRITON_INTERPRET=1), got {x.device}")
    if x.numel() * x.element_size() > slot_bytes:
        raise ValueError(
            f"one-shot all-reduce: {x.numel() * x.element_size()} bytes exceed the workspace slot of "
            f"{slot_bytes} bytes (buffer_bytes / 2); use a bigger workspace or all_reduce(), which falls "
            "back to NCCL"
        )
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or out.device != x.device):
        raise ValueError(
            f"one-shot all-reduce: out must match x ({tuple(x.shape)}, {x.dtype}, {x.device}), "
            f"got ({tuple(out.shape)}, {out.dtype}, {out.device})"
        )
    if out is not None and not out.is_contiguous():
        raise ValueError("one-shot all-reduce: out must be contiguous")


def _launch(
    x: torch.Tensor,
    out: torch.Tensor,
    buffer_ptrs: torch.Tensor,
    signal_ptrs: torch.Tensor,
    counters: torch.Tensor,
    rank: int,
    world_size: int,
    slot_bytes: int,
    max_blocks: int,
    *,
    copy_in: bool,
    reduce: bool,
    use_flags: bool,
    spin_limit: int | None,
    config: OneShotConfig | None,
):
    """Launch; returns Triton's compiled-kernel handle (None when nothing ran or interpreting)."""
    n = x.numel()
    if n == 0:
        return None
    cfg = config or default_config()
    grid = min(cdiv(n, cfg.block), cfg.max_blocks, max_blocks)
    return _one_shot_all_reduce_kernel[(grid,)](
        x.contiguous(),
        out,
        n,
        buffer_ptrs,
        signal_ptrs,
        counters,
        rank,
        slot_bytes,
        WORLD=world_size,
        WORLD_P2=next_pow2(world_size),
        BLOCK=cfg.block,
        COPY_IN=copy_in,
        REDUCE=reduce,
        USE_FLAGS=use_flags,
        SPIN_LIMIT=resolve_spin_limit(spin_limit, INTERPRETED, 0),
        num_warps=cfg.num_warps,
    )


def _launch_both(x, out, buffer_ptrs, signal_ptrs, counters, rank, world_size, slot_bytes, max_blocks, use_flags,
                 cfg: OneShotConfig | None):
    """Both phases in one launch, default spin limit: the path of the registered ops and of eager calls."""
    return _launch(x, out, buffer_ptrs, signal_ptrs, counters, rank, world_size, slot_bytes, max_blocks,
                   copy_in=True, reduce=True, use_flags=use_flags, spin_limit=None, config=cfg)


def launch_one_shot_all_reduce(
    x: torch.Tensor,
    table: PeerTable,
    out: torch.Tensor,
    *,
    copy_in: bool = True,
    reduce: bool = True,
    use_flags: bool = True,
    spin_limit: int | None = None,
    config: OneShotConfig | None = None,
):
    """Launch the kernel as `table.rank` (both phases, or one of them for the CPU emulation).

    Raw launcher, no op registration: callers normally want one_shot_all_reduce(). copy_in only:
    publishes x (out untouched); reduce only: waits, sums into out, advances the epoch.
    use_flags=False skips the flag protocol: correct only when something else orders the ranks
    (the phased emulation), a data race on GPUs. spin_limit None: unbounded on GPU, bounded
    under the interpreter. Returns Triton's compiled-kernel handle on GPUs (PTX inspection).
    """
    if out is None:
        raise ValueError("launch_one_shot_all_reduce: out is required (one_shot_all_reduce allocates it)")
    slot_bytes = one_shot_capacity_bytes(table)
    _check(x, table.device, slot_bytes, out)
    if not (copy_in or reduce):
        raise ValueError("launch_one_shot_all_reduce: nothing to do (copy_in=False and reduce=False)")
    return _launch(
        x,
        out,
        table.buffer_ptrs,
        table.signal_ptrs,
        table.counters,
        table.rank,
        table.world_size,
        slot_bytes,
        table.max_blocks,
        copy_in=copy_in,
        reduce=reduce,
        use_flags=use_flags,
        spin_limit=spin_limit,
        config=config,
    )


# ============================================================================ registered ops
# The peer table travels as its tensors + ints (no registry of workspaces: no module globals).
# counters is declared mutated: it is (the epoch advances), and it keeps the op from being
# dead-code eliminated or reordered across another launch on the same table, which would
# desynchronise the ranks.


@torch.library.custom_op("fusedpar::one_shot_all_reduce", mutates_args=("counters",))
def _one_shot_op(
    x: torch.Tensor,
    buffer_ptrs: torch.Tensor,
    signal_ptrs: torch.Tensor,
    counters: torch.Tensor,
    rank: int,
    world_size: int,
    slot_bytes: int,
    max_blocks: int,
    block: int,
    num_warps: int,
    grid_cap: int,
    use_flags: bool,
) -> torch.Tensor:
    _check(x, counters.device, slot_bytes, None)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_both(x, out, buffer_ptrs, signal_ptrs, counters, rank, world_size, slot_bytes, max_blocks, use_flags,
                 OneShotConfig(block, num_warps, grid_cap))
    return out


@_one_shot_op.register_fake
def _one_shot_fake(
    x,
    buffer_ptrs,
    signal_ptrs,
    counters,
    rank,
    world_size,
    slot_bytes,
    max_blocks,
    block,
    num_warps,
    grid_cap,
    use_flags,
):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("fusedpar::one_shot_all_reduce_out", mutates_args=("out", "counters"))
def _one_shot_out_op(
    x: torch.Tensor,
    buffer_ptrs: torch.Tensor,
    signal_ptrs: torch.Tensor,
    counters: torch.Tensor,
    out: torch.Tensor,
    rank: int,
    world_size: int,
    slot_bytes: int,
    max_blocks: int,
    block: int,
    num_warps: int,
    grid_cap: int,
    use_flags: bool,
) -> None:
    _check(x, counters.device, slot_bytes, out)
    _launch_both(x, out, buffer_ptrs, signal_ptrs, counters, rank, world_size, slot_bytes, max_blocks, use_flags,
                 OneShotConfig(block, num_warps, grid_cap))


@_one_shot_out_op.register_fake
def _one_shot_out_fake(
    x,
    buffer_ptrs,
    signal_ptrs,
    counters,
    out,
    rank,
    world_size,
    slot_bytes,
    max_blocks,
    block,
    num_warps,
    grid_cap,
    use_flags,
):
    return None


def _call_op(
    x: torch.Tensor, table: PeerTable, out: torch.Tensor | None, use_flags: bool, cfg: OneShotConfig
) -> torch.Tensor:
    """Run through the registered op (what torch.compile traces): both phases, one launch."""
    args = (table.buffer_ptrs, table.signal_ptrs, table.counters)
    meta = (
        table.rank,
        table.world_size,
        one_shot_capacity_bytes(table),
        table.max_blocks,
        cfg.block,
        cfg.num_warps,
        cfg.max_blocks,
        use_flags,
    )
    if out is None:
        return torch.ops.fusedpar.one_shot_all_reduce(x, *args, *meta)
    torch.ops.fusedpar.one_shot_all_reduce_out(x, *args, out, *meta)
    return out


# ========================================================================== public functions


def one_shot_all_reduce(
    x: torch.Tensor,
    peers,
    *,
    out: torch.Tensor | None = None,
    options: AllReduceOptions | None = None,
) -> torch.Tensor:
    """Sum of x over the ranks of `peers` (a SymmetricWorkspace or PeerTable), one kernel, one flag round.

    Collective: every rank calls it with the same shape and dtype, in the same order relative to
    other launches on the same workspace, from one stream. x may be any tensor of at most
    one_shot_capacity_bytes(peers) bytes (it is copied into the workspace); out=x is allowed
    (in place). Capture-safe: allocates only `out` (nothing when out is given).
    Under torch.compile it is the registered op; in eager it launches directly, because the
    custom-op dispatcher's host cost is a sizeable part of a decode-size all-reduce.
    options: AllReduceOptions (config, use_flags); None: defaults.
    """
    opts = options or _DEFAULT_OPTIONS
    table = as_peer_table(peers)
    slot_bytes = one_shot_capacity_bytes(table)
    _check(x, table.device, slot_bytes, out)
    cfg = opts.config or default_config()
    if torch.compiler.is_compiling():
        return _call_op(x, table, out, opts.use_flags, cfg)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_both(x, out, table.buffer_ptrs, table.signal_ptrs, table.counters, table.rank, table.world_size,
                 slot_bytes, table.max_blocks, opts.use_flags, cfg)
    return out


# ==================================================================================== router


def all_reduce(
    x: torch.Tensor,
    group,
    workspace=None,
    *,
    inplace: bool = False,
    options: AllReduceOptions | None = None,
) -> torch.Tensor:
    """Sum of x over `group`: one-shot through `workspace` for small messages, NCCL otherwise.

    group: a torch ProcessGroup or a CommGroup (fusedpar.collectives.context; .size, .pg).
    workspace: SymmetricWorkspace / PeerTable of the same group, or None (always NCCL).
    On CUDA the one-shot is taken only inside a CUDA-graph capture (or routing_as_captured()):
    eager, NCCL's launch is cheaper than ours. The choice depends only on x's size and dtype, the
    arguments and the capture state, so every rank makes the same one. Size limit: options'
    max_one_shot_bytes, else fusedpar.kernels.routing's all_reduce_one_shot_max_bytes (where ours
    beat torch's symm_mem one-shot and NCCL in CUDA graphs). inplace=True reduces into x (both
    paths) and returns x; otherwise x is untouched.
    """
    size, pg = group_size_and_pg(group)
    if size == 1:
        return x if inplace else x.clone()
    if workspace is not None and (x.device.type != "cuda" or routes_as_captured(x.device)):
        table = as_peer_table(workspace)
        if table.world_size != size:
            raise ValueError(f"all_reduce: workspace spans {table.world_size} ranks but the group has {size}")
        opts = options or _DEFAULT_OPTIONS
        max_bytes = opts.max_one_shot_bytes
        if max_bytes is None:
            max_bytes = thresholds(x.device, size).all_reduce_one_shot_max_bytes
        nbytes = x.numel() * x.element_size()
        if (
            x.dtype in SUPPORTED_DTYPES
            and x.device == table.device
            and nbytes <= min(max_bytes, one_shot_capacity_bytes(table))
        ):
            if inplace and not x.is_contiguous():  # the kernel writes a contiguous out
                return x.copy_(one_shot_all_reduce(x, table, options=opts))
            return one_shot_all_reduce(x, table, out=x if inplace else None, options=opts)
    return sum_over_group_(x if inplace else x.clone(), pg)


@functools.cache
def _sum_options():
    import torch.distributed as dist

    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    # What dist.all_reduce(async_op=False) sets. The default (True) makes NCCL run the collective
    # on its internal stream, fenced by events both ways: the same host cost, but more GPU time per
    # eager decode-size GEMM + all-reduce than the synchronous form on the caller's stream.
    if hasattr(opts, "asyncOp"):
        opts.asyncOp = False
    return opts


def sum_over_group_(y: torch.Tensor, pg) -> torch.Tensor:
    """y summed in place over the ProcessGroup `pg` (NCCL on GPUs, gloo on CPU); returns y.

    What dist.all_reduce(y, group=pg) does, minus its Python wrapper (logging decorator, argument
    and membership checks): the process group's own allreduce with the same options (synchronous,
    asyncOp=False), then wait() (on NCCL: the current stream waits for the collective, no host
    block). That wrapper is about half of an eager decode all-reduce's host cost, and eager decode
    is host-bound. Under torch.compile it is dist.all_reduce
    itself, which dynamo knows how to trace.
    y may be any strided tensor: a non-contiguous one is reduced through a contiguous copy, since the
    process groups want dense tensors (gloo reduced a column slice's storage from its first element as
    if it were contiguous: wrong sums, and stores outside the view).
    """
    if not y.is_contiguous():
        return y.copy_(sum_over_group_(y.contiguous(), pg))
    if torch.compiler.is_compiling():
        import torch.distributed as dist

        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=pg)
        return y
    work = pg.allreduce([y], _sum_options())
    if work is not None:  # NCCL returns none for a synchronous collective: it is already on this stream
        work.wait()
    return y
