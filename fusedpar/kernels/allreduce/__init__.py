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

Modules: kernels (@triton.jit), config (OneShotConfig, AllReduceOptions, the workspace's capacity),
launch (checks; `launch_one_shot_all_reduce`: the raw launcher, phases switchable for the CPU
emulation), ops (torch.library ops `torch.ops.fusedpar.one_shot_all_reduce` / `_out`, fake impls:
torch.compile, CUDA graphs), this module: `one_shot_all_reduce`, the router `all_reduce` (one-shot
for small messages inside CUDA graphs, NCCL otherwise) and `sum_over_group_` (the process group's
allreduce without dist's wrapper).

CPU: interpreted programs run one after another, so the emulation (fusedpar.testing.
allreduce_emulation) runs the phases as separate launches, every rank's copy-in first; the flag
code still runs, and the interpreter's bounded spin turns a missing flag into counters[STATUS].
Set TRITON_INTERPRET=1 before the first import; bf16 is fine here (no tl.dot).
"""

from __future__ import annotations

import functools

import torch

from fusedpar.collectives.symmetric import as_peer_table
from fusedpar.kernels._host import SUPPORTED_DTYPES
from fusedpar.kernels._sync import group_size_and_pg, routes_as_captured
from fusedpar.kernels.allreduce.config import (
    DEFAULT_OPTIONS,
    AllReduceOptions,
    OneShotConfig,
    default_config,
    one_shot_capacity_bytes,
)
from fusedpar.kernels.allreduce.launch import _check, _launch_both, launch_one_shot_all_reduce
from fusedpar.kernels.allreduce.ops import _call_op
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
    options: AllReduceOptions (its config); None: defaults.
    """
    opts = options or DEFAULT_OPTIONS
    table = as_peer_table(peers)
    slot_bytes = one_shot_capacity_bytes(table)
    _check(x, table.device, slot_bytes, out)
    cfg = opts.config or default_config()
    if torch.compiler.is_compiling():
        return _call_op(x, table, out, cfg)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_both(x, out, table.buffer_ptrs, table.signal_ptrs, table.counters, table.rank, table.world_size,
                 slot_bytes, table.max_blocks, cfg)
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
        opts = options or DEFAULT_OPTIONS
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
