"""Row-parallel GEMM fused with its all-reduce: out = sum over ranks r of x_r @ w_r^T, no NCCL call.

Rank r of a group of W ranks holds x_r [M, K_r] (any strides) and w_r [N, K_r], the row-parallel
weight shard in nn.Linear orientation (typically a column view of the rank's base weight). Every
rank returns the same [M, N] tensor of x's dtype:

    out[m, n] = round( sum_{r = 0..W-1} round_p( sum_k x_r[m, k] w_r[n, k] ) )

The inner sum is the GEMM's fp32 accumulator; round_p rounds it once to the partial dtype (x's
dtype by default, what the plain path's all-reduce sends; fp32 on request); the rank sum runs in
fp32 in the fixed order 0..W-1 (NCCL rounds after every step), round() is the cast to x's dtype.
Every rank's output has identical bits. With split-K the partials are per (rank, K range).

Paths: one_shot (decode: GEMM + one-shot all-reduce in one launch), two_shot (prefill: GEMM +
reduce-scatter + all-gather), both in one kernel (kernels.py); unfused (cuBLAS + all_reduce: our
one-shot in graphs, NCCL otherwise) and local (a group of one). `gemm_all_reduce` routes by size
(fusedpar.kernels.routing: where each fused path beat the plain one) and by the workspace's room.
A residual identical on every rank can be added in the reduce epilogue, so the decode MLP tail
(silu_mul -> down -> all-reduce -> + residual) is two launches (perf/bench_gemm_all_reduce.py's
"mlp-tail graph" records in perf/results/gemm_all_reduce.json). A SwiGLU prologue (silu(gate) * up
in the A load) is not offered: it was slower than silu_mul + this kernel, since the exp and the
second A load in every K step cost more than one separate pass.

Modules: kernels (@triton.jit), plan (configs, tiling, workspace sizes), launch (checks, raw
launchers), ops (torch.library ops + fakes), this router. CPU: TRITON_INTERPRET=1 before the
first import; the interpreter cannot tl.dot bf16 (CPU tests use fp16/fp32); the emulated world
driver is fusedpar.testing.gemm_all_reduce_emulation.
"""

from __future__ import annotations

import torch

from fusedpar.collectives.symmetric import PeerTable, SymmetricWorkspace, as_peer_table
from fusedpar.kernels._host import SUPPORTED_DTYPES
from fusedpar.kernels._sync import group_size_and_pg, routes_as_captured
from fusedpar.kernels.allreduce import all_reduce, sum_over_group_
from fusedpar.kernels.fp8 import E4M3, fp8_product, quantize_for
from fusedpar.kernels.gemm_all_reduce.launch import check_operands, check_shapes, launch_gemm_all_reduce, plan_or_raise
from fusedpar.kernels.gemm_all_reduce.ops import _call_fused
from fusedpar.kernels.gemm_all_reduce.plan import (
    DEEP_K_ROWS,
    PATHS,
    SPLIT_K_MAX_ROWS,
    FusedConfig,
    FusedPlan,
    GemmAllReduceOptions,
    default_config,
    fused_plan,
    required_workspace,
    slot_bytes_of,
)
from fusedpar.kernels.routing import thresholds

__all__ = [
    "DEEP_K_ROWS",
    "PATHS",
    "SPLIT_K_MAX_ROWS",
    "FusedConfig",
    "FusedPlan",
    "GemmAllReduceOptions",
    "auto_path",
    "choose_path",
    "default_config",
    "fused_plan",
    "gemm_all_reduce",
    "gemm_all_reduce_reference",
    "launch_gemm_all_reduce",
    "required_workspace",
    "slot_bytes_of",
]

_DEFAULT = GemmAllReduceOptions()


def _limits(device: torch.device, world_size: int, opts: GemmAllReduceOptions) -> tuple[int, int]:
    """(one_shot_max_rows, two_shot_min_rows): the options' overrides, else the routing table's."""
    t = thresholds(device, world_size)
    one = t.one_shot_max_rows if opts.one_shot_max_rows is None else opts.one_shot_max_rows
    two = t.two_shot_min_rows if opts.two_shot_min_rows is None else opts.two_shot_min_rows
    return one, two


def _choose(m, n, k, dtype, world_size, table, device, partial_dtype, one_max: int, two_min: int) -> str:
    if world_size == 1:
        return "local"
    if table is None or dtype not in SUPPORTED_DTYPES or table.world_size != world_size:
        return "unfused"
    if device is not None and device != table.device:
        return "unfused"
    if m <= one_max and fused_plan("one_shot", m, n, k, dtype, table, partial_dtype=partial_dtype)[0]:
        return "one_shot"
    if m >= two_min and fused_plan("two_shot", m, n, k, dtype, table, partial_dtype=partial_dtype)[0]:
        return "two_shot"
    return "unfused"


def choose_path(
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    world_size: int,
    table: PeerTable | None,
    *,
    device: torch.device | None = None,
    options: GemmAllReduceOptions | None = None,
) -> str:
    """The path the router takes for x [m, k], w [n, k]: "local" | "one_shot" | "two_shot" | "unfused".

    Depends only on shapes, dtype, the thresholds (options' overrides, else the routing table's for
    `device`, default the table's device) and the workspace's sizes, so every rank of the group
    chooses alike. "local": a group of one (plain GEMM). "unfused": cuBLAS + all_reduce.
    """
    opts = options or _DEFAULT
    where = device if device is not None else (table.device if table is not None else torch.device("cpu"))
    one_max, two_min = _limits(where, world_size, opts)
    return _choose(m, n, k, dtype, world_size, table, device, opts.partial_dtype, one_max, two_min)


def _auto(m, n, k, dtype, world_size, table, device, partial_dtype, one_max: int, two_min: int) -> str:
    if device.type == "cuda" and not routes_as_captured(device):
        one_max = 0  # eager decode loses to the Triton launch's host cost
    return _choose(m, n, k, dtype, world_size, table, device, partial_dtype, one_max, two_min)


def auto_path(
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    world_size: int,
    table: PeerTable | None,
    device: torch.device,
    *,
    options: GemmAllReduceOptions | None = None,
) -> str:
    """The path gemm_all_reduce takes for x [m, k], w [n, k] with path "auto", right now.

    Eager CUDA decode loses to the Triton launch's host cost, so the one-shot is only taken while a
    CUDA graph is captured (or under routing_as_captured()); capture is the same on every rank of
    a collective, so the choice still agrees across ranks.
    """
    opts = options or _DEFAULT
    one_max, two_min = _limits(device, world_size, opts)
    return _auto(m, n, k, dtype, world_size, table, device, opts.partial_dtype, one_max, two_min)


def gemm_all_reduce_reference(x: torch.Tensor, w: torch.Tensor, group, workspace=None) -> torch.Tensor:
    """The plain path: cuBLAS F.linear, then fusedpar.kernels.allreduce.all_reduce (our one-shot for
    small messages inside a CUDA graph when a workspace is given, NCCL otherwise). Also the
    router's fallback."""
    y = torch.nn.functional.linear(x, w)
    if group is None:
        return y
    return all_reduce(y, group, workspace, inplace=True)


def _eager_pg_or_none(group, workspace):
    """The process group the eager short path reduces over, or None where the full path decides (a
    group of one, no process group, a workspace over another number of ranks). Fixed per (group,
    workspace), so a SymmetricWorkspace keeps the answer (`eager_route`)."""
    size, pg = group_size_and_pg(group)
    if size < 2 or pg is None or (workspace is not None and as_peer_table(workspace).world_size != size):
        return None
    return pg


def _eager_plain_or_none(x, w, group, workspace, residual, two_shot_min_rows: int) -> torch.Tensor | None:
    """The router's eager CUDA answer below the two-shot range, cuBLAS + the process group's
    allreduce [+ residual], reached in as few Python steps as possible; None where the full path
    must decide (capture, a group of one, a workspace of another size, a residual of another shape).

    Such calls are bound by the host's launch cost, where every Python step shows, so this path skips
    the full router's prelude (views, checks, table lookups). Its time against F.linear + dist.all_reduce:
    routed_ms of the eager records (perf/bench_gemm_all_reduce.py, perf/results/gemm_all_reduce.json)."""
    if x.shape[0] >= two_shot_min_rows or routes_as_captured(x.device):
        return None
    route = getattr(workspace, "eager_route", None)  # a SymmetricWorkspace's cached answer
    if route is None or route[0] is not group:
        route = (group, _eager_pg_or_none(group, workspace))
        if isinstance(workspace, SymmetricWorkspace):
            workspace.eager_route = route
    pg = route[1]
    if pg is None:
        return None
    if residual is not None and tuple(residual.shape) != (x.shape[0], w.shape[0]):
        return None  # the full path names the shape it wants
    check_shapes(x, w)
    y = sum_over_group_(torch.nn.functional.linear(x, w), pg)
    return y if residual is None else residual + y


def gemm_all_reduce(
    x: torch.Tensor,
    w: torch.Tensor,
    group,
    workspace=None,
    *,
    out: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    options: GemmAllReduceOptions | None = None,
    w_scale: torch.Tensor | None = None,
    w_tile: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Row-parallel linear + all-reduce: [residual +] sum over the group of x @ w^T, the same on every rank.

    x: [..., K_local] activations (any strides; leading dims are flattened); w: [N, K_local]
    weight shard in nn.Linear orientation, any strides (a column view of the base weight is read
    in place); fp16/bf16/fp32, same dtype. group: a ProcessGroup or a CommGroup (.size, .pg); None
    only with a fused or local path forced by options (the size then comes from the workspace).
    workspace: SymmetricWorkspace / PeerTable over the same group, or None (always unfused). The
    fused paths need room (required_workspace): a flag row per program (max_blocks >= the SM count
    for decode, plus tiles / W for prefill) and a data buffer of ~4 x the output bytes for
    one-launch prefill (less: row chunks). Without room the router falls back to the unfused path.
    residual: optional [..., N] tensor, identical on every rank (the residual stream), added to the
    reduced sum with the plain path's roundings (sum rounded to x's dtype, then torch's add).
    out: optional [..., N] destination (fully overwritten); on the fused paths it must not share
    memory with x, w or itself (ValueError), and may be residual itself but no other view of it.
    options: GemmAllReduceOptions (forced path, partial dtype, tiling, thresholds); None: defaults.
    w_scale, w_tile: an e4m3 w with fp32 scales, one per w_tile = (rows, columns) of it (fusedpar.kernels.fp8:
    per tensor, per output channel (1, K_local), 128 x 128 blocks). x (fp16 / bf16 / fp32) is quantised
    once (fp8_quantize: one dynamic scale per token and group of w_tile[1] columns, per token where the
    tile spans K_local) and every path runs the scaled e4m3 GEMM; out, residual and the partials are in
    x's dtype.
    Collective: every rank calls it with the same shapes, in the same order relative to other
    launches on the workspace, from one stream. Capture-safe (CUDA graphs): no host sync, no
    allocation besides the output (and, with an e4m3 weight, the quantised activations and their
    scales). No autograd (inference).
    """
    opts = options or _DEFAULT
    path = opts.path
    fp8_weight = w_scale is not None or w_tile is not None or w.dtype == E4M3
    if not fp8_weight and path == "auto" and out is None and group is not None and x.dim() == 2 and x.is_cuda:
        two_min = _limits(x.device, group_size_and_pg(group)[0], opts)[1]
        y = _eager_plain_or_none(x, w, group, workspace, residual, two_min)
        if y is not None:
            return y
    if x.dim() < 1 or w.dim() != 2:
        raise ValueError(f"gemm_all_reduce: x must be [..., K] and w [N, K], got {tuple(x.shape)}, {tuple(w.shape)}")
    flat = x.dim() == 2  # the common case: no reshapes (each costs host time in an eager decode step)
    lead = x.shape[:-1]
    x2 = x if flat else x.reshape(-1, x.shape[-1])
    check_shapes(x2, w)
    # an e4m3 weight: the activations are quantised once, for whichever path runs
    qx, fp8 = quantize_for("gemm_all_reduce", x2, w, w_scale, w_tile) if fp8_weight else (None, None)
    res2 = None
    if residual is not None:
        if tuple(residual.shape) != (*lead, w.shape[0]):
            raise ValueError(f"gemm_all_reduce: residual must be {(*lead, w.shape[0])}, got {tuple(residual.shape)}")
        res2 = residual if flat else residual.reshape(-1, w.shape[0])
    out2 = None
    if out is not None:
        if tuple(out.shape) != (*lead, w.shape[0]):
            raise ValueError(f"gemm_all_reduce: out must be {(*lead, w.shape[0])}, got {tuple(out.shape)}")
        # A view (never a copy): the result must land in `out` itself; view() raises otherwise.
        out2 = out if out.dim() == 2 else out.view(-1, w.shape[0])
    table = as_peer_table(workspace) if workspace is not None else None
    if group is None:
        if table is None or path not in ("one_shot", "two_shot", "local"):
            raise ValueError("gemm_all_reduce: group=None needs a workspace and an explicit fused path")
        size, pg = table.world_size, None
    else:
        size, pg = group_size_and_pg(group)
    if table is not None and table.world_size != size:
        raise ValueError(f"gemm_all_reduce: workspace spans {table.world_size} ranks but the group has {size}")

    # An eager CUDA call is host-bound at the sizes where this matters: its unfused path goes
    # straight to cuBLAS + the process group's allreduce (what the plain path launches, minus
    # dist.all_reduce's Python wrapper), and auto below the two-shot range needs no lookups
    # (auto_path answers "unfused" there for every eager call).
    eager_cuda = size > 1 and pg is not None and x2.device.type == "cuda" and not routes_as_captured(x2.device)
    if path == "auto":
        one_max, two_min = _limits(x2.device, size, opts)
        if eager_cuda and x2.shape[0] < two_min:
            path = "unfused"
        else:
            path = _auto(x2.shape[0], w.shape[0], w.shape[1], x2.dtype, size, table, x2.device, opts.partial_dtype,
                         one_max, two_min)
    if path in ("one_shot", "two_shot"):
        if table is None:
            raise ValueError(f"gemm_all_reduce: path {path!r} needs a workspace")
        a = x2 if fp8 is None else qx
        check_operands(a, w, out2, table.device, res2, fp8)
        plan = plan_or_raise(path, a, w, table, opts.partial_dtype, opts.config, x2.dtype)
        result = _call_fused(a, w, table, out2, plan, residual=res2, fp8=fp8)
        res2 = None  # added in the kernel
    elif fp8 is not None:
        result = fp8_product(qx, w, fp8)
        if path != "local":
            result = sum_over_group_(result, pg) if eager_cuda else all_reduce(result, group, table, inplace=True)
    elif path == "local":
        result = torch.nn.functional.linear(x2, w)
    elif eager_cuda:
        result = sum_over_group_(torch.nn.functional.linear(x2, w), pg)
    else:
        result = gemm_all_reduce_reference(x2, w, group, table)
    if res2 is not None:
        result = res2 + result
    if out is not None:
        if result is not out2:
            out2.copy_(result)
        return out
    return result if flat else result.reshape(*lead, w.shape[0])
