"""Checks, buffer views and raw launchers of the Ulysses kernels (kernels.py).

Every launcher runs one launch as `table.rank` on the op's own PeerTable: all phases on a GPU,
or the phases named by its switches in the CPU emulation (fusedpar.testing.ulysses_emulation),
where interpreted programs run one after another and every rank's phase must come before any
rank's next phase. The launch switches live here (tile configs, rotate, spin_limit, the qkv
timeline; use_flags=False, the flagless variant for the emulation and A/B tests, correct only when
something else orders the ranks); the routers in __init__ pick the defaults, always with flags.

Buffers: the qkv receive buffer [W*m, blk] and the o staging buffer [W, m, C] (or [m, W*C] for
the scattering attention, o_scatter_target) start at offset 0 of the table's data buffer, in the
activation dtype. One slot each: the READY handshake (or, for scattered_o_proj, the step's qkv
exchange) orders every write after the peers' reads of the previous call (fusedpar/kernels/_sync.py).
"""

from __future__ import annotations

import dataclasses

import torch

from fusedpar.collectives.symmetric import PeerTable, as_peer_table
from fusedpar.kernels._host import INTERPRETED, SUPPORTED_DTYPES, cdiv, max_offset, next_pow2
from fusedpar.kernels._sync import GPU_SPIN_LIMIT, device_guard, resolve_spin_limit, sm_count
from fusedpar.kernels.attention import ScatterOut
from fusedpar.kernels.fp8 import E4M3, NO_FP8_SCALES, FP8Operands, check_fp8_operands
from fusedpar.kernels.fp8.launch import MIN_BLOCK_K, check_block_view, mm_block_k
from fusedpar.kernels.gemm import GemmConfig, split_w_descriptor, tma_compatible, tma_descriptors
from fusedpar.kernels.ulysses.config import (
    QKV_ROTATE_ROWS,
    OProjConfig,
    default_o_config,
    o_launch_shape,
    o_proj_fp8_layout,
    o_proj_workspace_bytes,
    pick_qkv_config,
    pick_qkv_fp8_config,
    qkv_workspace_bytes,
)
from fusedpar.kernels.ulysses.kernels import (
    QKV_TIMELINE_POINTS,
    _all_to_all_o_proj_kernel,
    _o_arrival_kernel,
    _qkv_all_to_all_kernel,
)

# ================================================================================ checks


def _spin_limit(spin_limit: int | None) -> int:
    return resolve_spin_limit(spin_limit, INTERPRETED, GPU_SPIN_LIMIT)


def check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name}: tensor on {t.device} but the peer table is on {device}")
    if t.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError(
            f"{name} got CPU tensors but its Triton kernel was compiled for a GPU: set TRITON_INTERPRET=1 "
            "before fusedpar.kernels.ulysses is first imported to use the CPU interpreter"
        )
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} supports CUDA (and CPU under TRITON_INTERPRET=1), got {t.device}")


def _check_int32(name: str, **tensors: torch.Tensor) -> None:
    for what, t in tensors.items():
        if max_offset(t) >= 2**31:
            raise ValueError(f"{name}: {what} {tuple(t.shape)} strides {t.stride()} spans >= 2**31 elements")


def check_status(peers) -> None:
    """Raise RuntimeError if a bounded flag wait on this table timed out (host sync; tests/debugging)."""
    table = as_peer_table(peers)
    if table.status() != 0:
        raise RuntimeError(
            f"rank {table.rank}: a Ulysses flag wait timed out (counters[STATUS] = {table.status()}): a peer "
            "never reached the same launch (ranks issued different launch sequences on this table, or a "
            "peer died); the data of that launch is wrong"
        )


def check_qkv(x: torch.Tensor, w: torch.Tensor, table: PeerTable, fp8: FP8Operands | None = None) -> int:
    """Shape, dtype and workspace checks of qkv_all_to_all (fp8: e4m3 x and w with these scales, the
    receive buffer in fp8.out_dtype); returns blk."""
    W = table.world_size
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"qkv_all_to_all: x must be [m, d] and w [W*blk, d], got {tuple(x.shape)}, {tuple(w.shape)}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(
            f"qkv_all_to_all: x {tuple(x.shape)} and w {tuple(w.shape)} disagree on d (nn.Linear [out, in])"
        )
    if w.shape[0] % W:
        raise ValueError(f"qkv_all_to_all: w has {w.shape[0]} rows, not a multiple of the SP size {W}")
    if fp8 is not None:
        check_fp8_operands("qkv_all_to_all", x, w, fp8)
    elif x.dtype not in SUPPORTED_DTYPES or w.dtype != x.dtype:
        raise TypeError(
            f"qkv_all_to_all: x and w must share one dtype of {SUPPORTED_DTYPES}, got {x.dtype}, {w.dtype} "
            "(e4m3 operands come with their scales: fp8=FP8Operands)"
        )
    blk = w.shape[0] // W
    dtype = x.dtype if fp8 is None else fp8.out_dtype
    need = qkv_workspace_bytes(x.shape[0], blk, W, dtype)
    if need > table.buffer_bytes:
        raise ValueError(
            f"qkv_all_to_all: the receive buffer [{W}*{x.shape[0]}, {blk}] {dtype} needs {need} bytes, the "
            f"workspace has {table.buffer_bytes} (size it with qkv_workspace_bytes for the largest step)"
        )
    if table.max_blocks < 2:
        raise ValueError("qkv_all_to_all: the peer table needs max_blocks >= 2 (flag rows READY and DONE)")
    if W * x.shape[0] * blk >= 2**31:
        raise ValueError("qkv_all_to_all: the receive buffer spans >= 2**31 elements (int32 offsets)")
    return blk


def check_o_fp8(attn: torch.Tensor, w: torch.Tensor, W: int, fp8: FP8Operands) -> list[str]:
    """The FP8 operands of all_to_all_o_proj, every violated constraint with its numbers: e4m3 attn [W*m, C]
    and w_o [N, W*C]; x_scale [W*m, C / x_group] (contiguous); the activation group a divisor of C (each SP
    peer's columns whole groups); w_scale of the weight tile's grid; a K step inside one group, one weight
    tile and one peer's C columns."""
    problems = []
    for name, t in (("attn", attn), ("w_o", w)):
        if t.dtype != E4M3:
            problems.append(f"{name} dtype {t.dtype} must be {E4M3}")
    (wm, c), (n, k) = attn.shape, w.shape
    g, (tn, tk) = fp8.x_group, fp8.w_tile
    if g < 1 or c % g:
        problems.append(f"the activation group of {g} columns must divide C = {c} (each SP peer's columns)")
    elif tuple(fp8.x_scale.shape) != (wm, c // g) or not fp8.x_scale.is_contiguous():
        problems.append(f"x_scale {tuple(fp8.x_scale.shape)} must be a contiguous [W*m, C / {g}] = {(wm, c // g)}")
    want_w = (-(-n // tn), -(-k // tk)) if tn >= 1 and tk >= 1 else None
    if want_w is None or tuple(fp8.w_scale.shape) != want_w:
        problems.append(f"w_scale {tuple(fp8.w_scale.shape)} must be [ceil(N / {tn}), ceil(K / {tk})] = {want_w} "
                        f"for w_o {tuple(w.shape)}")
    if fp8.x_scale.dtype != torch.float32 or fp8.w_scale.dtype != torch.float32:
        problems.append(f"scales must be torch.float32, got {fp8.x_scale.dtype} and {fp8.w_scale.dtype}")
    if fp8.w_scale.dim() == 2:
        try:
            check_block_view(w, fp8.w_tile, fp8.w_scale.shape[0], fp8.w_scale.shape[1])
        except ValueError as e:
            problems.append(str(e).split(": ", 1)[-1])
    if not problems and o_fp8_block_k(c, W, fp8, 128) is None:
        problems.append(f"no K step of >= {MIN_BLOCK_K} columns lies inside one {g}-column group, one {tk}-column "
                        f"weight tile and one peer's C = {c} columns")
    return problems


def o_fp8_block_k(c: int, W: int, fp8: FP8Operands, block_k: int) -> int | None:
    """all_to_all_o_proj's K step on e4m3 operands: <= block_k, inside one activation group and one weight tile
    (mm_block_k over the chunk's C columns), and dividing C where the weight tiles are narrower than W*C."""
    tk = fp8.w_tile[1]
    bk = mm_block_k(c, tk if tk < W * c else c, fp8.x_group, block_k)
    while bk is not None and tk < W * c and c % bk:
        bk = mm_block_k(c, tk, fp8.x_group, bk // 2) if bk > MIN_BLOCK_K else None
    return bk


def check_o(attn: torch.Tensor, w: torch.Tensor, table: PeerTable, out: torch.Tensor | None,
            fp8: FP8Operands | None = None) -> tuple[int, int]:
    """Shape, dtype and workspace checks of all_to_all_o_proj (fp8: e4m3 attn and w_o with these scales, out of
    fp8.out_dtype or fp32); returns (m, C)."""
    W = table.world_size
    if attn.dim() != 2 or w.dim() != 2:
        raise ValueError(
            f"all_to_all_o_proj: attn must be [W*m, C] and w_o [N, W*C], got {tuple(attn.shape)}, {tuple(w.shape)}"
        )
    if attn.shape[0] % W:
        raise ValueError(
            f"all_to_all_o_proj: {attn.shape[0]} attention rows are not divisible by the SP size {W} "
            "(pad the step to a multiple of SP first)"
        )
    m, C = attn.shape[0] // W, attn.shape[1]
    if w.shape[1] != W * C:
        raise ValueError(f"all_to_all_o_proj: w_o {tuple(w.shape)} must have W*C = {W}*{C} = {W * C} columns")
    if fp8 is not None:
        problems = check_o_fp8(attn, w, W, fp8)
        if problems:
            raise ValueError("all_to_all_o_proj: " + "; ".join(problems))
    elif attn.dtype not in SUPPORTED_DTYPES or w.dtype != attn.dtype:
        raise TypeError(
            f"all_to_all_o_proj: attn and w_o must share one dtype of {SUPPORTED_DTYPES}, got {attn.dtype}, {w.dtype}"
        )
    dtype = attn.dtype if fp8 is None else fp8.out_dtype
    need = o_proj_workspace_bytes(m, C, W, attn.dtype) if fp8 is None else o_proj_fp8_layout(m, C, W, fp8.x_group)[1]
    if need > table.buffer_bytes:
        raise ValueError(
            f"all_to_all_o_proj: the staging buffer [{W}, {m}, {C}] {attn.dtype} needs {need} bytes, the workspace "
            f"has {table.buffer_bytes} (size it with o_proj_workspace_bytes for the largest step)"
        )
    if table.max_blocks < 2:
        raise ValueError("all_to_all_o_proj: the peer table needs max_blocks >= 2 (flag rows READY and DONE)")
    if W * m * C >= 2**31:
        raise ValueError("all_to_all_o_proj: the staging buffer spans >= 2**31 elements (int32 offsets)")
    if out is not None:
        if tuple(out.shape) != (m, w.shape[0]):
            raise ValueError(f"all_to_all_o_proj: out must be [m, N] = {(m, w.shape[0])}, got {tuple(out.shape)}")
        if out.dtype not in (dtype, torch.float32):
            raise TypeError(f"all_to_all_o_proj: out dtype must be {dtype} or float32, got {out.dtype}")
        if out.device != attn.device:
            raise ValueError(f"all_to_all_o_proj: out is on {out.device} but attn on {attn.device}")
    return m, C


# ================================================================================ buffer views


def qkv_recv_view(peers, tokens: int, blk: int, dtype: torch.dtype) -> torch.Tensor:
    """This rank's receive buffer as [W * tokens, blk] of dtype (where qkv_all_to_all's result lives).

    Same address on every call: attention reads it in place, and a CUDA graph may capture it.
    Valid until the next qkv_all_to_all launch on the same table.
    """
    table = as_peer_table(peers)
    n = table.world_size * tokens
    return table.view(dtype, n * blk).view(n, blk)


def o_scatter_target(peers, tokens: int, c: int, dtype: torch.dtype) -> ScatterOut:
    """The ScatterOut that makes paged_attention do this SP rank's share of the return all-to-all.

    tokens: m, rows per rank of the padded step; c: C = q * hd, this rank's attention columns.
    Every rank's staging buffer is [m, W * C] of dtype at the start of its data buffer (the memory
    all_to_all_o_proj stages in, o_proj_workspace_bytes); rank s stores its output row t into
    rank t // m's buffer, row t % m, columns [s * C, (s + 1) * C).
    """
    table = as_peer_table(peers)
    W = table.world_size
    need = o_proj_workspace_bytes(tokens, c, W, dtype)
    if tokens < 1 or need > table.buffer_bytes:
        raise ValueError(
            f"o_scatter_target: {tokens} rows x {W} x {c} columns of {dtype} need {need} bytes, the workspace has "
            f"{table.buffer_bytes} (and rows must be >= 1)"
        )
    local = table.view(dtype, tokens * W * c).view(tokens, W * c)
    return ScatterOut(peer_ptrs=table.buffer_ptrs, local=local, rows_per_rank=tokens, col_offset=table.rank * c)


def zeroed_padding(table: PeerTable, tokens: int, num_tokens: int, c: int, dtype: torch.dtype) -> torch.Tensor:
    """This rank's [m, W * C] staging with its padding rows (step rows >= num_tokens, which no
    attention stores) zero-filled, as the reference sends them."""
    local = o_scatter_target(table, tokens, c, dtype).local
    first_pad = min(tokens, max(0, num_tokens - table.rank * tokens))
    if first_pad < tokens:
        local[first_pad:].zero_()
    return local


# ================================================================================ qkv_all_to_all


def launch_qkv_all_to_all(
    x: torch.Tensor,
    w: torch.Tensor,
    table: PeerTable,
    *,
    send_ready: bool = True,
    produce: bool = True,
    wait: bool = True,
    use_flags: bool = True,
    spin_limit: int | None = None,
    config: GemmConfig | None = None,
    timeline: torch.Tensor | None = None,
    rotate: bool | None = None,
    fp8: FP8Operands | None = None,
):
    """Launch the qkv kernel as `table.rank`: all phases (GPU) or some of them (CPU emulation).

    Phases: send_ready (publish READY e), produce (wait READY, GEMM + peer stores, retire, DONE),
    wait (wait DONE). A wait-only launch (send_ready=produce=False) waits for the epoch the last
    produce advanced to. use_flags=False skips all flag traffic. config: the GEMM tiling (None:
    pick_qkv_config). rotate: the kernel's ROTATE (None: by QKV_ROTATE_ROWS; a rank's own tile
    order, so ranks need not agree). timeline (GPU diagnostic): an int64 [>= programs, 4] tensor
    that receives each program's %globaltimer ns at QKV_TIMELINE_POINTS (qkv_timeline_summary).
    fp8: e4m3 x and w with these scales; the tiling is pick_qkv_fp8_config's (no split tiles), its K
    step lowered to the scale blocks.
    Returns Triton's compiled kernel (None when interpreting).
    """
    table = as_peer_table(table)
    check_device("qkv_all_to_all", x, table.device)
    blk = check_qkv(x, w, table, fp8)
    if not (send_ready or produce or wait):
        raise ValueError("launch_qkv_all_to_all: nothing to do")
    m, k = x.shape
    _check_int32("qkv_all_to_all", x=x, w=w)
    W = table.world_size
    num_sms = sm_count(x.device, INTERPRETED)
    tma_ok = tma_compatible(x, w)
    if fp8 is None:
        cfg = config or pick_qkv_config(m, W * blk, k, blk, x.dtype, num_sms, tma_ok=tma_ok)
    else:
        cfg = config or pick_qkv_fp8_config(m, W * blk, k, blk, fp8.out_dtype, num_sms, tma_ok=tma_ok)
        if cfg.block_n2 or fp8.block_k(k, cfg.block_k) != cfg.block_k:
            cfg = dataclasses.replace(cfg, block_n2=0, block_k=fp8.block_k(k, cfg.block_k))
    scale_args = NO_FP8_SCALES if fp8 is None else fp8.kernel_args()
    grid = max(1, min(num_sms, cdiv(m, cfg.block_m) * W * cdiv(blk, cfg.tile_n))) if produce else 1
    if timeline is not None:
        if not produce:
            raise ValueError("launch_qkv_all_to_all: a timeline times the produce phase; this launch has none")
        _check_timeline(timeline, grid, x.device)
    use_tma = produce and cfg.tma and tma_ok
    x_desc, w_desc = tma_descriptors(x, w, cfg.block_m, cfg.block_n, cfg.block_k) if use_tma else (None, None)
    w2_desc = split_w_descriptor(w, cfg, use_tma)
    with device_guard(x.device):
        return _qkv_all_to_all_kernel[(grid,)](
            x, w, x_desc, w_desc, w2_desc,
            table.buffer_ptrs, table.signal_ptrs, table.counters,
            table.counters if timeline is None else timeline,
            table.rank, m, blk, k, x.stride(0), x.stride(1), w.stride(0), w.stride(1), scale_args,
            WORLD=W,
            WORLD_P2=next_pow2(W),
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            GROUP_M=cfg.group_m,
            NUM_SMS=num_sms,
            EVEN_K=k % cfg.block_k == 0,
            INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            EPOCH_AHEAD=1 if (send_ready or produce) else 0,
            SEND_READY=send_ready,
            PRODUCE=produce,
            WAIT=wait,
            USE_FLAGS=use_flags,
            SPIN_LIMIT=_spin_limit(spin_limit),
            TIMELINE=timeline is not None,
            TMA=use_tma,
            FLATTEN=cfg.flatten,
            BLOCK_N2=cfg.block_n2,
            ROTATE=QKV_ROTATE_ROWS[0] <= m <= QKV_ROTATE_ROWS[1] if rotate is None else rotate,
            FP8=fp8 is not None,
            SCALE_IN_LOOP=fp8 is not None and fp8.scale_in_loop(k),
            OUT_DTYPE=None if fp8 is None else fp8.tl_out_dtype,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )


def launch_qkv_wait(signal_ptrs, counters, rank: int, world_size: int, *, use_flags: bool = True,
                    spin_limit: int | None = None) -> None:
    """One-program launch of the qkv kernel's WAIT phase (epoch = the last produce's)."""
    W = world_size
    dummy = counters.new_empty((1, 1), dtype=torch.float16)  # x / w unused by a wait-only launch
    with device_guard(counters.device):
        _qkv_all_to_all_kernel[(1,)](
            dummy, dummy, None, None, None,
            signal_ptrs,  # buffer_ptrs unused
            signal_ptrs, counters,
            counters,  # timeline unused
            rank, 1, 1, 1, 1, 1, 1, 1,
            NO_FP8_SCALES,
            WORLD=W,
            WORLD_P2=next_pow2(W),
            BLOCK_M=16,
            BLOCK_N=16,
            BLOCK_K=16,
            GROUP_M=1,
            NUM_SMS=1,
            EVEN_K=True,
            INPUT_PRECISION="tf32",
            EPOCH_AHEAD=0,
            SEND_READY=False,
            PRODUCE=False,
            WAIT=True,
            USE_FLAGS=use_flags,
            SPIN_LIMIT=_spin_limit(spin_limit),
            TIMELINE=False,
            num_warps=1,
        )


def _check_timeline(timeline: torch.Tensor, programs: int, device: torch.device) -> None:
    if timeline.dtype != torch.int64 or timeline.device != device or not timeline.is_contiguous():
        raise ValueError(f"qkv_all_to_all: timeline must be a contiguous int64 tensor on {device}, got "
                         f"{timeline.dtype} on {timeline.device} (contiguous={timeline.is_contiguous()})")
    if timeline.numel() < programs * len(QKV_TIMELINE_POINTS):
        raise ValueError(f"qkv_all_to_all: timeline has {timeline.numel()} elements; this launch has {programs} "
                         f"programs x {len(QKV_TIMELINE_POINTS)} points (size it [#SMs, 4])")
    if INTERPRETED:
        raise ValueError("qkv_all_to_all: timeline reads the GPU's %globaltimer; the interpreter has none")


def qkv_timeline_summary(timeline: torch.Tensor) -> dict[str, float]:
    """Phase times (us) of one timed qkv launch from its [programs, 4] timeline (QKV_TIMELINE_POINTS).

    Rows still holding a negative poison value (programs that did not run) are dropped.
    enter_spread: last - first program start. ready_wait: per program, ready - enter (median and
    max): the wait for the latest peer to enter the launch (rank skew). gemm: per program ready ->
    gemm (median, max): its tiles, remote stores included. done_wait: the waiter's gemm -> exit,
    max over programs. total: first enter -> last exit. All from one GPU's clock.
    """
    t = timeline.reshape(-1, len(QKV_TIMELINE_POINTS)).to("cpu", torch.int64)
    t = t[(t >= 0).all(dim=1)]
    if t.shape[0] == 0:
        raise ValueError("qkv_timeline_summary: no program wrote the timeline (plain path taken, or not launched)")
    if bool((t.diff(dim=1) < 0).any()):
        raise ValueError("qkv_timeline_summary: a program's points are out of order (not one launch's timeline?)")
    us = t.double() / 1e3
    enter, ready, gemm, exit_ = us.unbind(dim=1)
    return {
        "programs": float(t.shape[0]),
        "enter_spread_us": float(enter.max() - enter.min()),
        "ready_wait_median_us": float((ready - enter).median()),
        "ready_wait_max_us": float((ready - enter).max()),
        "gemm_median_us": float((gemm - ready).median()),
        "gemm_max_us": float((gemm - ready).max()),
        "done_wait_us": float((exit_ - gemm).max()),
        "total_us": float(exit_.max() - enter.min()),
    }


# ================================================================================ all_to_all_o_proj


def launch_all_to_all_o_proj(
    attn: torch.Tensor,
    w: torch.Tensor,
    table: PeerTable,
    out: torch.Tensor,
    *,
    send_ready: bool = True,
    push: bool = True,
    gemm: bool = True,
    use_flags: bool = True,
    spin_limit: int | None = None,
    config: OProjConfig | None = None,
    fp8: FP8Operands | None = None,
):
    """Launch the o_proj kernel as `table.rank`: all phases (GPU) or some (CPU emulation).
    fp8: e4m3 attn and w_o with these scales (check_o_fp8); the staging holds e4m3 rows, then their scales.

    Phases: send_ready (publish READY e), push (comm programs: wait READY, copy rows to their
    owners, flag each band), gemm (all programs: out = A @ w^T with per-band waits; retires the
    launch). config: None takes default_o_config(). Returns Triton's compiled kernel.
    """
    table = as_peer_table(table)
    check_device("all_to_all_o_proj", attn, table.device)
    m, C = check_o(attn, w, table, out, fp8)
    if not (send_ready or push or gemm):
        raise ValueError("launch_all_to_all_o_proj: nothing to do")
    if out is None:
        raise ValueError("launch_all_to_all_o_proj: out is required")
    _check_int32("all_to_all_o_proj", attn=attn, w=w, out=out)
    W, n = table.world_size, w.shape[0]
    num_sms = sm_count(attn.device, INTERPRETED)
    cfg = config or default_o_config()
    shape = o_launch_shape(m, n, C, W, attn.dtype if fp8 is None else fp8.out_dtype, out.dtype, table.max_blocks,
                           cfg, num_sms)
    gcfg = shape.gemm
    if fp8 is not None and o_fp8_block_k(C, W, fp8, gcfg.block_k) != gcfg.block_k:
        gcfg = dataclasses.replace(gcfg, block_k=o_fp8_block_k(C, W, fp8, gcfg.block_k))
    comm = shape.comm_programs if push else 0
    tiles = cdiv(m, gcfg.block_m) * cdiv(n, gcfg.block_n)
    grid = max(comm + (min(num_sms - comm, tiles) if gemm else 0), 1)  # >= 1: a READY-only launch
    stage = table.view(attn.dtype, W * m * C)
    scale_off, groups, stage_s = 0, 1, None
    if fp8 is not None:
        scale_off = o_proj_fp8_layout(m, C, W, fp8.x_group)[0]
        groups = C // fp8.x_group
        stage_s = table.view(torch.float32, W * m * groups, byte_offset=scale_off)
    with device_guard(attn.device):
        return _all_to_all_o_proj_kernel[(grid,)](
            attn, w, out, stage,
            table.buffer_ptrs, table.signal_ptrs, table.counters,
            table.rank, m, n, C,
            attn.stride(0), attn.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1),
            shape.band_rows, shape.num_bands,
            NO_FP8_SCALES if fp8 is None else fp8.kernel_args(), stage_s, scale_off, groups,
            WORLD=W,
            WORLD_P2=next_pow2(W),
            BLOCK_M=gcfg.block_m,
            BLOCK_N=gcfg.block_n,
            BLOCK_K=gcfg.block_k,
            GROUP_M=gcfg.group_m,
            EVEN_C=C % gcfg.block_k == 0,
            INPUT_PRECISION="ieee" if attn.dtype == torch.float32 else "tf32",
            COMM_PROGRAMS=comm,
            COPY_ROWS=cfg.copy_rows,
            COPY_COLS=cfg.copy_cols,
            SEND_READY=send_ready,
            PUSH=push and W > 1,
            GEMM=gemm,
            USE_FLAGS=use_flags,
            SPIN_LIMIT=_spin_limit(spin_limit),
            FP8=fp8 is not None,
            G_P2=next_pow2(groups),
            num_warps=gcfg.num_warps,
            num_stages=gcfg.num_stages,
        )


# ================================================================================ scattered_o_proj


def launch_o_arrival(table: PeerTable, *, publish: bool = True, wait: bool = True,
                     spin_limit: int | None = None) -> None:
    """scattered_o_proj's arrival barrier, one program (epoch e = counters[EPOCH] + 1).

    publish: release e into word [DONE * W + rank] of every rank (this rank's attention, earlier
    on the stream, completed: its stores into the peers' staging are performed). wait: acquire
    every peer's word >= e, then counters[EPOCH] = e; kernels after it may read the staging.
    """
    W = table.world_size
    with device_guard(table.device):
        _o_arrival_kernel[(1,)](
            table.signal_ptrs, table.counters, table.rank, WORLD=W, WORLD_P2=next_pow2(W), PUBLISH=publish,
            WAIT=wait, SPIN_LIMIT=_spin_limit(spin_limit), num_warps=1,
        )
