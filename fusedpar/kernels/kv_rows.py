"""Gather and scatter of token rows of a paged KV pool, k and v in one Triton launch.

A KV migration (fusedpar.layers.kv_reshard.migrate_kv) reads the pieces it sends out of the paged
pool and writes what it receives into fresh blocks; the host KV tier (fusedpar.layers.host_tier)
stages swapped sequences the same way. Seen as [layers, rows, head_dim] (row = cache slot * local
kv heads + head index), both are row moves with one row index shared by every layer:

    gather:  chunk[k, l, i] = k_pool[l, idx[i]]    chunk[v, l, i] = v_pool[l, idx[i]]
    scatter: k_pool[l, idx[i]] = chunk[k, l, i]    v_pool[l, idx[i]] = chunk[v, l, i]

idx int64 [n] (no repeats for a scatter); idx[i] < 0 names no pool row: a gather writes zeros into
chunk row i, a scatter skips it. chunk, contiguous, in one of two orders:
    [2 (k | v), layers, n, head_dim]           rows: what the exchange of a migration sends;
    [n / B, layers, 2 (k | v), B, head_dim]    blocks of B rows: the host tier's block order.
One program per (BLOCK_R rows, layer, k | v) loads its row indices once and copies head_dim-wide
rows. torch's index_select / index_copy_ along dim 1 do the same more slowly (their index kernels
address element by element). A migration's time: perf/bench_reshard.py, perf/results/reshard.json.

push_kv_rows is the gather of a migration that exchanges through peer-addressable memory (a
symmetric staging buffer per rank): row i of idx goes to destination p, the one with bounds[p] <= i <
bounds[p + 1], as row offs[p] + i - bounds[p] of p's buffer [rows, layers, 2 (k | v), 1, head_dim] at
address ptrs[p] (a peer's staging over NVLink, or a local buffer), in one launch for every destination.

The row indices themselves come from the sequences' block tables (paged_rows): for piece p (one
kv head of one sequence) and its token t,

    rows[start_p + t] = (table[trow_p, t // block_size] * block_size + t % block_size) * heads + head_p

so that a migration uploads block tables and one line per piece, never a row per token.

_move_rows_kernel (@triton.jit) -> move_kv_rows, _push_rows_kernel -> push_kv_rows, _paged_rows_kernel ->
paged_rows (checks, strides, grid; the torch ops where Triton cannot run: CPU tensors without
TRITON_INTERPRET=1; push_kv_rows needs Triton, its destinations being raw addresses).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedpar.kernels._host import INTERPRETED, cdiv, next_pow2

BLOCK_R = 32  # rows per program: 32 x 128 bf16 = 8 KiB moved per program
BLOCK_T = 256  # tokens per program of paged_rows


@triton.jit(do_not_specialize=["n", "idx_ptr"])  # idx: often a slice of one index tensor, at any offset
def _move_rows_kernel(k_pool_ptr, v_pool_ptr, idx_ptr, chunk_ptr, n, stride_pool_layer, rows_per_block,
                      stride_c_block, stride_c_layer, stride_c_kv, HD: tl.constexpr, HD_P2: tl.constexpr,
                      SCATTER: tl.constexpr, BLOCKED: tl.constexpr, BLOCK_R: tl.constexpr):
    """Program (row block, layer, kv): the rows idx[rb * BLOCK_R ...] of one layer of k (kv 0) or v.
    Chunk row i of (layer, kv) starts at kv * stride_c_kv + layer * stride_c_layer + i * HD (rows), or
    at ... + (i // rows_per_block) * stride_c_block + (i % rows_per_block) * HD (BLOCKED)."""
    rb = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    kv = tl.program_id(2).to(tl.int64)
    rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, HD_P2)
    in_range = rows < n
    idx = tl.load(idx_ptr + rows, mask=in_range, other=-1).to(tl.int64)
    cmask = (cols < HD)[None, :]
    moved = (in_range & (idx >= 0))[:, None] & cmask
    r64 = rows.to(tl.int64)
    if BLOCKED:  # noqa: SIM108 (kept as the kernel's two address forms)
        crow = (r64 // rows_per_block) * stride_c_block + (r64 % rows_per_block) * HD
    else:
        crow = r64 * HD
    chunk = chunk_ptr + kv * stride_c_kv + layer * stride_c_layer + crow[:, None] + cols[None, :]
    pool_off = layer * stride_pool_layer + tl.maximum(idx, 0)[:, None] * HD + cols[None, :]
    if kv == 0:  # noqa: SIM108 (a runtime scalar: Triton takes an if, not a ternary)
        pool = k_pool_ptr + pool_off
    else:
        pool = v_pool_ptr + pool_off
    if SCATTER:
        tl.store(pool, tl.load(chunk, mask=moved), mask=moved)
    else:
        tl.store(chunk, tl.load(pool, mask=moved, other=0), mask=in_range[:, None] & cmask)


@triton.jit(do_not_specialize=["n", "idx_ptr", "meta_ptr"])
def _push_rows_kernel(k_pool_ptr, v_pool_ptr, idx_ptr, meta_ptr, anchor, n, stride_pool_layer, row_elems,
                      HD: tl.constexpr, HD_P2: tl.constexpr, ELT: tl.constexpr, WORLD: tl.constexpr,
                      WORLD_P2: tl.constexpr, BLOCK_R: tl.constexpr):
    """Program (row block, layer, kv): rows idx[rb * BLOCK_R ...] of one layer of k (kv 0) or v, each to
    its destination. meta: ptrs [WORLD] | bounds [WORLD + 1] | offs [WORLD] (int64). anchor: k_pool_ptr's
    address, ELT its element size."""
    rb = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    kv = tl.program_id(2).to(tl.int64)
    rows = (rb * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, HD_P2)
    in_range = rows < n
    idx = tl.load(idx_ptr + rows, mask=in_range, other=-1).to(tl.int64)
    peers = tl.arange(0, WORLD_P2)
    upper = tl.load(meta_ptr + WORLD + 1 + peers, mask=peers < WORLD - 1, other=n)  # bounds[1 .. WORLD - 1]
    dest = tl.sum((rows[:, None] >= upper[None, :]).to(tl.int32), axis=1)
    start = tl.load(meta_ptr + WORLD + dest)
    drow = tl.load(meta_ptr + 2 * WORLD + 1 + dest) + rows - start
    # a destination as k_pool_ptr + elements: the compiler knows that pointer's alignment, and the hint
    # gives the distance's (16-byte aligned addresses, push_kv_rows' contract), so the stores go out 16
    # bytes at a time (an address read from memory as a pointer would get 2-byte stores)
    delta = tl.multiple_of((tl.load(meta_ptr + dest) - anchor) // ELT, 16 // ELT)
    moved = (in_range & (idx >= 0))[:, None] & (cols < HD)[None, :]
    pool_off = layer * stride_pool_layer + tl.maximum(idx, 0)[:, None] * HD + cols[None, :]
    if kv == 0:  # noqa: SIM108 (a runtime scalar: Triton takes an if, not a ternary)
        pool = k_pool_ptr + pool_off
    else:
        pool = v_pool_ptr + pool_off
    dst = k_pool_ptr + (delta + drow * row_elems + (layer * 2 + kv) * HD)[:, None] + cols[None, :]
    tl.store(dst, tl.load(pool, mask=moved), mask=moved)


@triton.jit(do_not_specialize=["table_ptr", "pieces_ptr", "width"])  # slices of one upload, at any offset
def _paged_rows_kernel(table_ptr, pieces_ptr, rows_ptr, width, block_size, heads, BLOCK_T: tl.constexpr):
    """Program (token block, piece): the rows of tokens [tb * BLOCK_T, ...) of piece p, whose line in
    pieces is (table row, head index, tokens, first output position)."""
    tb = tl.program_id(0)
    p = tl.program_id(1).to(tl.int64)
    trow = tl.load(pieces_ptr + 4 * p)
    head = tl.load(pieces_ptr + 4 * p + 1)
    ntok = tl.load(pieces_ptr + 4 * p + 2)
    start = tl.load(pieces_ptr + 4 * p + 3)
    pos = tb * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    m = pos < ntok
    blk = tl.load(table_ptr + trow * width + pos // block_size, mask=m, other=0)
    tl.store(rows_ptr + start + pos, (blk * block_size + pos % block_size) * heads + head, mask=m)


def _chunk_order(chunk: torch.Tensor, layers: int, n: int, hd: int) -> tuple[str, int] | str:
    """("rows", n) or ("blocks", B) for a chunk in one of the two orders, else the problem."""
    shape = tuple(chunk.shape)
    if chunk.dim() == 5 and shape[1:3] == (layers, 2) and shape[4] == hd and shape[0] * shape[3] == n:
        order: tuple[str, int] | None = ("blocks", shape[3])
    elif shape == (2, layers, n, hd):
        order = ("rows", n)
    else:
        order = None
    if order is None or not chunk.is_contiguous():
        got = f"{shape}{'' if chunk.is_contiguous() else ' non-contiguous'}"
        return (f"chunk must be contiguous {(2, layers, n, hd)} (k | v, layers, n, head_dim) or "
                f"(n / B, {layers}, 2, B, {hd}) (blocks of B rows, B dividing n = {n}), got {got}")
    return order


def _check(k_pool: torch.Tensor, v_pool: torch.Tensor, idx: torch.Tensor, chunk: torch.Tensor) -> tuple[str, int]:
    problems = []
    order: tuple[str, int] | str = ""
    if k_pool.dim() != 3 or v_pool.shape != k_pool.shape or k_pool.stride() != v_pool.stride():
        problems.append(f"k_pool / v_pool must be one [layers, rows, head_dim] shape and strides, got "
                        f"{tuple(k_pool.shape)} {k_pool.stride()} / {tuple(v_pool.shape)} {v_pool.stride()}")
    elif k_pool.stride(2) != 1 or k_pool.stride(1) != k_pool.shape[2]:
        problems.append(f"pool rows must be contiguous (strides (., {k_pool.shape[2]}, 1)), got {k_pool.stride()}")
    if idx.dim() != 1 or idx.dtype != torch.int64:
        problems.append(f"idx must be int64 [n], got {idx.dtype} {tuple(idx.shape)}")
    if k_pool.dim() == 3 and idx.dim() == 1:
        order = _chunk_order(chunk, k_pool.shape[0], idx.numel(), k_pool.shape[2])
        if isinstance(order, str):
            problems.append(order)
    if not (k_pool.dtype == v_pool.dtype == chunk.dtype):
        problems.append(f"dtypes differ: k_pool {k_pool.dtype}, v_pool {v_pool.dtype}, chunk {chunk.dtype}")
    if len({t.device for t in (k_pool, v_pool, idx, chunk)}) != 1:
        problems.append(f"tensors on several devices: {[str(t.device) for t in (k_pool, v_pool, idx, chunk)]}")
    if problems or isinstance(order, str):
        raise ValueError("fusedpar.move_kv_rows: " + "; ".join(problems))
    return order


def _as_rows(chunk: torch.Tensor, order: tuple[str, int]) -> torch.Tensor:
    """chunk seen as [2, layers, n, head_dim] (a view for rows, a permuted view for blocks)."""
    if order[0] == "rows":
        return chunk
    return chunk.permute(2, 1, 0, 3, 4)  # [2, layers, n / B, B, hd]


def move_kv_rows(k_pool: torch.Tensor, v_pool: torch.Tensor, idx: torch.Tensor, chunk: torch.Tensor, *,
                 scatter: bool) -> None:
    """Gather (scatter=False) rows idx of k_pool / v_pool [layers, rows, head_dim] into chunk
    ([2, layers, n, head_dim] or [n / B, layers, 2, B, head_dim]), or scatter chunk into those rows
    (idx without repeats); idx < 0: zeros gathered, nothing scattered. In place."""
    order = _check(k_pool, v_pool, idx, chunk)
    n = idx.numel()
    if n == 0:
        return
    if k_pool.device.type == "cpu" and not INTERPRETED:  # Triton compiled for a GPU: the torch ops
        _move_torch(k_pool, v_pool, idx, chunk, order, scatter)
        return
    layers, _, hd = k_pool.shape
    if order[0] == "rows":
        strides = (1, 0, n * hd, layers * n * hd)  # rows_per_block unused: 1, not n (no variant per n)
    else:
        rb = order[1]
        strides = (rb, layers * 2 * rb * hd, 2 * rb * hd, rb * hd)
    grid = (cdiv(n, BLOCK_R), layers, 2)
    guard = torch.cuda.device(k_pool.device) if k_pool.device.type == "cuda" else None
    args = (k_pool, v_pool, idx, chunk, n, k_pool.stride(0), *strides)
    kw = {"HD": hd, "HD_P2": next_pow2(hd), "SCATTER": scatter, "BLOCKED": order[0] == "blocks", "BLOCK_R": BLOCK_R}
    if guard is None:
        _move_rows_kernel[grid](*args, **kw)
    else:
        with guard:
            _move_rows_kernel[grid](*args, **kw)


def _move_torch(k_pool, v_pool, idx, chunk, order, scatter) -> None:
    layers, _, hd = k_pool.shape
    n = idx.numel()
    has = idx >= 0
    view = _as_rows(chunk, order)
    for j, pool in enumerate((k_pool, v_pool)):
        if scatter:
            part = view[j].reshape(layers, n, hd)
            pool.index_copy_(1, idx[has], part[:, has])
        else:
            part = torch.index_select(pool, 1, idx.clamp(min=0)).masked_fill_(~has.view(1, n, 1), 0)
            view[j].copy_(part.view(view[j].shape))


def move_kv_rows_reference(k_pool: torch.Tensor, v_pool: torch.Tensor, idx: torch.Tensor, chunk: torch.Tensor, *,
                           scatter: bool) -> None:
    """The plain-torch meaning of move_kv_rows (tests)."""
    has = idx >= 0
    rows = chunk if chunk.dim() == 4 else chunk.permute(2, 1, 0, 3, 4)  # [2, layers, (n / B, B,) hd]
    for j, pool in enumerate((k_pool, v_pool)):
        part = rows[j].reshape(pool.shape[0], idx.numel(), pool.shape[2])
        if scatter:
            pool[:, idx[has]] = part[:, has]
        else:
            part = pool[:, idx.clamp(min=0)]
            part[:, ~has] = 0
            rows[j].copy_(part.view(rows[j].shape))


def push_kv_rows(k_pool: torch.Tensor, v_pool: torch.Tensor, idx: torch.Tensor, meta: torch.Tensor, *,
                 world: int) -> None:
    """Row idx[i] of k_pool / v_pool [layers, rows, head_dim] -> row offs[p] + i - bounds[p] of the buffer
    [rows, layers, 2 (k | v), 1, head_dim] at address ptrs[p], p the destination with bounds[p] <= i <
    bounds[p + 1] (the pool view's layers are the buffer's). meta: int64 [3 * world + 1] on the pool's
    device, ptrs | bounds (bounds[0] = 0, bounds[world] = n) | offs. The addresses are not checked: each
    must be 16-byte aligned and hold its rows (a peer's symmetric buffer, or a local tensor kept alive
    until the launch is done). idx < 0: nothing moved."""
    problems = []
    if k_pool.dim() != 3 or v_pool.shape != k_pool.shape or k_pool.stride() != v_pool.stride() \
            or k_pool.stride(2) != 1 or k_pool.stride(1) != k_pool.shape[2]:
        problems.append(f"k_pool / v_pool must be one [layers, rows, head_dim] shape with contiguous rows, got "
                        f"{tuple(k_pool.shape)} {k_pool.stride()} / {tuple(v_pool.shape)} {v_pool.stride()}")
    if idx.dim() != 1 or idx.dtype != torch.int64:
        problems.append(f"idx must be int64 [n], got {idx.dtype} {tuple(idx.shape)}")
    if meta.dtype != torch.int64 or tuple(meta.shape) != (3 * world + 1,) or not meta.is_contiguous():
        problems.append(f"meta must be contiguous int64 [{3 * world + 1}] (ptrs, bounds, offs of {world} "
                        f"destinations), got {meta.dtype} {tuple(meta.shape)}")
    if len({t.device for t in (k_pool, v_pool, idx, meta)}) != 1:
        problems.append(f"tensors on several devices: {[str(t.device) for t in (k_pool, v_pool, idx, meta)]}")
    if k_pool.device.type == "cpu" and not INTERPRETED:
        problems.append("a CPU pool needs TRITON_INTERPRET=1 (the addresses are raw pointers)")
    if k_pool.data_ptr() % 16 or k_pool.element_size() > 16:
        problems.append(f"k_pool must start 16-byte aligned with elements of at most 16 bytes (the stores are "
                        f"addressed from it), got address {k_pool.data_ptr()}, {k_pool.element_size()}-byte elements")
    if problems:
        raise ValueError("fusedpar.push_kv_rows: " + "; ".join(problems))
    n = idx.numel()
    if n == 0:
        return
    layers, _, hd = k_pool.shape
    grid = (cdiv(n, BLOCK_R), layers, 2)
    args = (k_pool, v_pool, idx, meta, k_pool.data_ptr(), n, k_pool.stride(0), layers * 2 * hd)
    kw = {"HD": hd, "HD_P2": next_pow2(hd), "ELT": k_pool.element_size(), "WORLD": world,
          "WORLD_P2": next_pow2(max(world, 2)), "BLOCK_R": BLOCK_R}
    if k_pool.device.type == "cuda":
        with torch.cuda.device(k_pool.device):
            _push_rows_kernel[grid](*args, **kw)
    else:
        _push_rows_kernel[grid](*args, **kw)


def push_kv_rows_reference(k_pool: torch.Tensor, v_pool: torch.Tensor, idx: torch.Tensor,
                           outs: list[torch.Tensor], bounds: list[int], offs: list[int]) -> None:
    """The meaning of push_kv_rows with the destinations as tensors outs[p] [rows, layers, 2, 1, head_dim]
    (tests)."""
    for p, out in enumerate(outs):
        for i in range(bounds[p], bounds[p + 1]):
            if int(idx[i]) >= 0:
                out[offs[p] + i - bounds[p], :, 0, 0] = k_pool[:, int(idx[i])]
                out[offs[p] + i - bounds[p], :, 1, 0] = v_pool[:, int(idx[i])]


def paged_rows(table: torch.Tensor, pieces: torch.Tensor, rows: torch.Tensor, *, block_size: int, heads: int,
               max_tokens: int) -> None:
    """rows[start_p + t] = (table[trow_p, t // block_size] * block_size + t % block_size) * heads + head_p
    for every piece p (a line (trow_p, head_p, tokens_p, start_p) of pieces, int64 [P, 4]) and t <
    tokens_p <= max_tokens; table int64 [S, width] (block ids, rows padded anywhere past a sequence's
    blocks); rows int64 [n]. Other entries of rows are left as they were. In place."""
    problems = []
    for name, t, dims in (("table", table, 2), ("pieces", pieces, 2), ("rows", rows, 1)):
        if t.dim() != dims or t.dtype != torch.int64 or not t.is_contiguous():
            problems.append(f"{name} must be contiguous int64 with {dims} dims, got {t.dtype} {tuple(t.shape)}")
    if pieces.dim() == 2 and pieces.shape[1] != 4:
        problems.append(f"pieces must be [P, 4] (table row, head, tokens, start), got {tuple(pieces.shape)}")
    if len({t.device for t in (table, pieces, rows)}) != 1:
        problems.append(f"tensors on several devices: {[str(t.device) for t in (table, pieces, rows)]}")
    if block_size < 1 or heads < 1 or max_tokens < 0:
        problems.append(f"block_size {block_size} and heads {heads} must be >= 1, max_tokens {max_tokens} >= 0")
    if problems:
        raise ValueError("fusedpar.paged_rows: " + "; ".join(problems))
    if pieces.shape[0] == 0 or max_tokens == 0:
        return
    if rows.device.type == "cpu" and not INTERPRETED:
        _paged_rows_torch(table, pieces, rows, block_size, heads)
        return
    grid = (cdiv(max_tokens, BLOCK_T), pieces.shape[0])
    args = (table, pieces, rows, table.shape[1], block_size, heads)
    if rows.device.type == "cuda":
        with torch.cuda.device(rows.device):
            _paged_rows_kernel[grid](*args, BLOCK_T=BLOCK_T)
    else:
        _paged_rows_kernel[grid](*args, BLOCK_T=BLOCK_T)


def _paged_rows_torch(table, pieces, rows, block_size, heads) -> None:
    counts = pieces[:, 2]
    total = int(counts.sum())
    piece = torch.repeat_interleave(torch.arange(pieces.shape[0]), counts, output_size=total)
    pos = torch.arange(total) - (torch.cumsum(counts, 0) - counts)[piece]
    out = (table[pieces[piece, 0], pos // block_size] * block_size + pos % block_size) * heads + pieces[piece, 1]
    rows[pieces[piece, 3] + pos] = out


def paged_rows_reference(table, pieces, rows, *, block_size: int, heads: int) -> None:
    """The meaning of paged_rows, one token at a time (tests)."""
    for trow, head, ntok, start in pieces.tolist():
        for t in range(ntok):
            rows[start + t] = (int(table[trow, t // block_size]) * block_size + t % block_size) * heads + head


__all__ = ["BLOCK_R", "BLOCK_T", "move_kv_rows", "move_kv_rows_reference", "paged_rows", "paged_rows_reference",
           "push_kv_rows", "push_kv_rows_reference"]
