"""The two Ulysses all-to-alls of base mode, fused into the attention projections.

One SP group of W ranks, this rank s; m token rows per rank; d hidden; q / kv local heads per
rank after the exchange, hd head_dim; blk = (q + 2 kv) * hd; C = q * hd.

qkv_all_to_all(x [m, d], w [W*blk, d]) -> recv [W*m, blk]
    = seq_to_head_all_to_all(F.linear(x, w), sp_group): recv[p*m + r, c] = sum_k x_p[r, k] w_p[g*blk + c, k]
    on rank g. Block g of the base qkv weight is [q | k | v] of peer g (fusedpar/layouts/shards.py),
    so GEMM column block g is exactly peer g's share: the kernel stores it into g's receive buffer.
all_to_all_o_proj(attn [W*m, C], w_o [N, W*C]) -> out [m, N]
    = F.linear(head_to_seq_all_to_all(attn, sp_group), w_o): push the rows to their owners, then
    a GEMM per chunk that waits for each band as it needs it, in one launch.
FP8 (e4m3) weights: each op takes w_scale / w_tile beside the e4m3 weight, quantises its activations
once (fusedpar.kernels.fp8.fp8_quantize) and runs the scaled e4m3 GEMM on the fused and plain paths.
scattered_o_proj(w_o, peers) -> out [m, N]: the same result when the attention already stored its
    rows into the owners' staging (paged_attention(scatter=o_scatter_target(...))): an arrival
    barrier, then cuBLAS on the staging.

Routing: the fused kernels run for row counts in fusedpar.kernels.routing's thresholds (and when
the workspace holds the step), F.linear + fusedpar.collectives' NCCL all-to-all elsewhere; every
rank decides from shapes alone, so all agree. UlyssesOptions forces a path or tunes the kernels.
The epoch / flag protocol: fusedpar/kernels/_sync.py; every rank of the group issues the same
launches on an op's workspace, same shapes, one stream; each op needs its own workspace (except
all_to_all_o_proj and scattered_o_proj, which share the o workspace: their epochs only rise).

Modules: kernels (@triton.jit), config (options, tilings, sizes), launch (checks, launchers),
ops (torch.library ops); the CPU emulation is fusedpar.testing.ulysses_emulation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusedpar.collectives.symmetric import PeerTable, as_peer_table
from fusedpar.kernels._host import SUPPORTED_DTYPES
from fusedpar.kernels._sync import group_size_and_pg
from fusedpar.kernels.fp8 import E4M3, fp8_product, quantize_for
from fusedpar.kernels.routing import in_ranges, thresholds
from fusedpar.kernels.ulysses.config import (
    DEFAULT_OPTIONS,
    PATHS,
    OProjConfig,
    UlyssesOptions,
    default_o_config,
    o_proj_fp8_layout,
    o_proj_workspace_bytes,
    qkv_workspace_bytes,
)
from fusedpar.kernels.ulysses.launch import (
    check_device,
    check_o,
    check_qkv,
    check_status,
    launch_all_to_all_o_proj,
    launch_o_arrival,
    launch_qkv_all_to_all,
    launch_qkv_wait,
    o_scatter_target,
    qkv_recv_view,
    zeroed_padding,
)
from fusedpar.kernels.ulysses.ops import o_arrival_op, o_proj_op, o_proj_out_op, qkv_op, qkv_wait_op

__all__ = [
    "PATHS",
    "OProjConfig",
    "UlyssesOptions",
    "all_to_all_o_proj",
    "check_status",
    "launch_all_to_all_o_proj",
    "launch_qkv_all_to_all",
    "o_proj_workspace_bytes",
    "o_scatter_target",
    "qkv_all_to_all",
    "qkv_all_to_all_wait",
    "qkv_recv_view",
    "qkv_workspace_bytes",
    "scattered_o_proj",
]


class _Group:
    """The (size, pg) pair fusedpar.collectives.comm needs, from a CommGroup or a ProcessGroup."""

    def __init__(self, group):
        self.size, self.pg = group_size_and_pg(group)


def _fused(opts: UlyssesOptions, ranges, possible: bool, rows: int, table: PeerTable | None, group, op: str) -> bool:
    """Whether a call takes the fused path: forced by opts.path, else by size where it can run
    (ranges: the options' override, else routing.thresholds' `op`_fused_rows)."""
    if opts.path != "auto":
        return opts.path == "fused"
    if group is None:
        return True  # no plain path to take; the fused path's checks say what is wrong
    if not possible:
        return False
    if ranges is None:
        ranges = getattr(thresholds(table.device, table.world_size), f"{op}_fused_rows")
    return in_ranges(rows, ranges)


def _fits(t: torch.Tensor, table: PeerTable | None) -> bool:
    return table is not None and t.dtype in SUPPORTED_DTYPES and t.device == table.device


def qkv_all_to_all(
    x: torch.Tensor,
    w_qkv: torch.Tensor,
    peers=None,
    group=None,
    *,
    wait: bool = True,
    options: UlyssesOptions | None = None,
    w_scale: torch.Tensor | None = None,
    w_tile: tuple[int, int] | None = None,
) -> torch.Tensor:
    """recv [W*m, blk] = seq_to_head_all_to_all(F.linear(x, w_qkv), sp_group), one fused kernel.

    x: [m, d], this rank's token rows (padded step: every SP rank has the same m).
    w_qkv: [W*blk, d] base qkv weight (block g = [q | k | v] rows of SP peer g), any strides.
    peers: the SP group's SymmetricWorkspace / PeerTable for THIS op (qkv_workspace_bytes of the
        largest step); None: plain path only.
    group: the SP group (CommGroup or ProcessGroup) for the plain path; None: fused path only.
    wait: False returns right after the producing phase; call qkv_all_to_all_wait(peers) before
        reading the result.
    Returns (fused, eager) the receive buffer view: fixed address, valid until the next call on
    the same workspace; under torch.compile a copy of it (registered op); plain path: a new tensor.
    w_scale, w_tile: an e4m3 w_qkv with fp32 scales, one per w_tile = (rows, columns) of it
    (fusedpar.kernels.fp8's schemes); x (fp16 / bf16 / fp32) is quantised once (fp8_quantize: per token
    and group of w_tile[1] columns) and both paths run the scaled e4m3 GEMM; the result in x's dtype.
    Collective: every rank of the SP group calls it with the same shapes, in the same order.
    """
    opts = options or DEFAULT_OPTIONS
    table = None if peers is None else as_peer_table(peers)
    m = x.shape[0]
    quantized = quantize_for("qkv_all_to_all", x, w_qkv, w_scale, w_tile)
    a, fp8 = (x, None) if quantized is None else quantized
    possible = False
    if _fits(x, table) and w_qkv.shape[0] % table.world_size == 0:
        W = table.world_size
        possible = qkv_workspace_bytes(m, w_qkv.shape[0] // W, W, x.dtype) <= table.buffer_bytes
    if not _fused(opts, opts.qkv_fused_rows, possible, m, table, group, "qkv"):
        if group is None:
            raise ValueError("qkv_all_to_all: the plain path needs the SP group (group=...)")
        from fusedpar.collectives.comm import seq_to_head_all_to_all

        return seq_to_head_all_to_all(F.linear(x, w_qkv) if fp8 is None else fp8_product(a, w_qkv, fp8),
                                      _Group(group))
    if table is None:
        raise ValueError("qkv_all_to_all: the fused path needs the SP group's workspace (peers=...)")
    blk = check_qkv(a, w_qkv, table, fp8)
    check_device("qkv_all_to_all", x, table.device)
    if m == 0:
        return qkv_recv_view(table, 0, blk, x.dtype)
    if torch.compiler.is_compiling():
        return qkv_op(a, w_qkv, table, config=opts.qkv_config, fp8=fp8)
    launch_qkv_all_to_all(a, w_qkv, table, wait=wait, spin_limit=opts.spin_limit, config=opts.qkv_config, fp8=fp8)
    return qkv_recv_view(table, m, blk, x.dtype)


def qkv_all_to_all_wait(peers, *, options: UlyssesOptions | None = None) -> None:
    """Consumer step after qkv_all_to_all(..., wait=False): stream-ordered wait until every peer's tiles landed.

    Launch it before the first kernel that reads the receive buffer. Not needed after the default
    wait=True (the launch itself completes only when the buffer is whole).
    """
    opts = options or DEFAULT_OPTIONS
    table = as_peer_table(peers)
    if torch.compiler.is_compiling():
        qkv_wait_op(table)
        return
    launch_qkv_wait(table.signal_ptrs, table.counters, table.rank, table.world_size, spin_limit=opts.spin_limit)


def all_to_all_o_proj(
    attn: torch.Tensor,
    w_o: torch.Tensor,
    peers=None,
    group=None,
    *,
    out: torch.Tensor | None = None,
    options: UlyssesOptions | None = None,
    w_scale: torch.Tensor | None = None,
    w_tile: tuple[int, int] | None = None,
) -> torch.Tensor:
    """out [m, N] = F.linear(head_to_seq_all_to_all(attn, sp_group), w_o), one fused kernel.

    attn: [W*m, C] this rank's attention output for all W*m tokens of the step, its q heads
        (C = q * hd), rows in source-rank order; any strides.
    w_o: [N, W*C] base O weight (input columns = the SP peers' heads in SP order), any strides.
    peers: the SP group's workspace for THIS op (o_proj_workspace_bytes of the largest step).
    group: as in qkv_all_to_all.
    out: optional [m, N] destination (attn's dtype or fp32, any strides). The result still needs
        the TP all-reduce (fusedpar's gemm_all_reduce / all_reduce).
    w_scale, w_tile: an e4m3 w_o with its scales (as qkv_all_to_all's). attn is quantised once per token
        and group of min(w_tile[1], C) columns (each SP peer's C columns whole groups: C a multiple of
        the group), before the exchange on the fused path (e4m3 rows and their scales are pushed), after
        it on the plain path: the same codes and scales either way.
    """
    opts = options or DEFAULT_OPTIONS
    table = None if peers is None else as_peer_table(peers)
    fp8_weight = w_scale is not None or w_tile is not None or w_o.dtype == E4M3
    group_cols = min(int(w_tile[1]), max(attn.shape[-1], 1)) if fp8_weight and w_tile is not None else None
    possible, m = False, None
    if _fits(attn, table) and attn.shape[0] % table.world_size == 0:
        W = table.world_size
        m = attn.shape[0] // W
        need = (o_proj_workspace_bytes(m, attn.shape[1], W, attn.dtype) if group_cols is None
                else o_proj_fp8_layout(m, attn.shape[1], W, group_cols)[1])
        possible = need <= table.buffer_bytes and (group_cols is None or attn.shape[1] % group_cols == 0)
    if not _fused(opts, opts.o_proj_fused_rows, possible, m, table, group, "o_proj"):
        if group is None:
            raise ValueError("all_to_all_o_proj: the plain path needs the SP group (group=...)")
        from fusedpar.collectives.comm import head_to_seq_all_to_all

        rows = head_to_seq_all_to_all(attn, _Group(group))
        if fp8_weight:
            qx, fp8 = quantize_for("all_to_all_o_proj", rows, w_o, w_scale, w_tile, group=group_cols)
            result = fp8_product(qx, w_o, fp8)
        else:
            result = F.linear(rows, w_o)
        if out is None:
            return result
        out.copy_(result)
        return out
    if table is None:
        raise ValueError("all_to_all_o_proj: the fused path needs the SP group's workspace (peers=...)")
    check_device("all_to_all_o_proj", attn, table.device)
    a, fp8 = quantize_for("all_to_all_o_proj", attn, w_o, w_scale, w_tile) if fp8_weight else (attn, None)
    m, _ = check_o(a, w_o, table, out, fp8)
    cfg = opts.o_config or default_o_config()
    if torch.compiler.is_compiling():
        if out is None:
            return o_proj_op(a, w_o, table, cfg, fp8=fp8)
        o_proj_out_op(a, w_o, out, table, cfg, fp8=fp8)
        return out
    if out is None:
        out = torch.empty((m, w_o.shape[0]), dtype=attn.dtype, device=attn.device)
    if m == 0:
        return out
    launch_all_to_all_o_proj(a, w_o, table, out, spin_limit=opts.spin_limit, config=cfg, fp8=fp8)
    return out


def scattered_o_proj(
    w_o: torch.Tensor,
    peers,
    *,
    tokens: int,
    num_tokens: int,
    c: int,
    options: UlyssesOptions | None = None,
    w_scale: torch.Tensor | None = None,
    w_tile: tuple[int, int] | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """out [m, N] = F.linear(head_to_seq_all_to_all(attn), w_o), where every SP rank's attention
    already stored its rows into the owners' staging buffers (paged_attention(scatter=
    o_scatter_target(peers, m, C, dtype))).

    tokens: m; num_tokens: the step's real rows (rows >= num_tokens are padding no attention
    stores: zero-filled here); c: C. Publishes this rank's arrival and waits for every peer's (one
    tiny launch), then runs cuBLAS on the [m, W * C] staging view. Of the options only spin_limit
    applies. w_scale, w_tile: an e4m3 w_o with its scales (as qkv_all_to_all's); the staging then holds the
    attention's dtype, `dtype`, and the GEMM on it is the scaled e4m3 one (the staged rows quantised
    once, per token and group of w_tile[1] columns).
    Buffer reuse: a peer stores into this rank's staging only in base-mode attention, which runs
    after the step's qkv exchange (fused or NCCL) has received this rank's share - sent only after
    (stream order) its previous o-projection finished reading the staging. So one buffer suffices
    without a READY handshake; a caller outside the decoder layer must keep that order (a data
    exchange with every peer between two uses).
    Collective: every SP rank calls it once per attention launch, same shapes, one stream.
    """
    opts = options or DEFAULT_OPTIONS
    table = as_peer_table(peers)
    if w_o.device != table.device:
        raise ValueError(f"scattered_o_proj: w_o is on {w_o.device}, the workspace on {table.device}")
    W = table.world_size
    if w_o.dim() != 2 or w_o.shape[1] != W * c:
        raise ValueError(f"scattered_o_proj: w_o must be [N, W * C] = [N, {W * c}], got {tuple(w_o.shape)}")
    if not 0 <= num_tokens <= W * tokens:
        raise ValueError(f"scattered_o_proj: num_tokens={num_tokens} outside [0, W * m = {W * tokens}]")
    fp8_weight = w_scale is not None or w_tile is not None or w_o.dtype == E4M3
    if fp8_weight and dtype is None:
        raise ValueError("scattered_o_proj: an e4m3 w_o needs the staging's dtype (dtype=, the attention's)")
    local = zeroed_padding(table, tokens, num_tokens, c, dtype if fp8_weight else w_o.dtype)
    if torch.compiler.is_compiling():
        o_arrival_op(local, table)
    else:
        launch_o_arrival(table, spin_limit=opts.spin_limit)
    if fp8_weight:
        qx, fp8 = quantize_for("scattered_o_proj", local, w_o, w_scale, w_tile)
        return fp8_product(qx, w_o, fp8)
    return F.linear(local, w_o)
