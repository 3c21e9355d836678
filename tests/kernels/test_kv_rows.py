"""Row gather / scatter of a paged KV pool (fusedpar.kernels.kv_rows) vs plain torch indexing.

A move copies bytes, so every dtype must match bit for bit. CPU: the Triton interpreter on
fragmented block tables (the rows a DP -> TP migration sends), odd row counts (a partial last row
block), odd head dims (masked columns), a pool view with a layer stride larger than its rows, and
NaN-poisoned outputs; a scatter leaves every other row as it was. The host tier's block order
([n / B, layers, 2, B, head_dim]) with missing rows (idx < 0: zeros gathered, nothing scattered),
through the kernel and through the torch path that CPU runs take without the interpreter. GPU
(pytest -m gpu): bf16 at the Llama-3-8B shape, both orders. The push of a migration through
peer-addressable memory (push_kv_rows: every row to its destination's buffer at a raw address) vs
the same rows written by indexing, destinations of 0, 1 and many rows at odd offsets.
"""

from __future__ import annotations

import pytest
import torch

from fusedpar.kernels._host import INTERPRETED
from fusedpar.kernels.kv_rows import (
    BLOCK_R,
    BLOCK_T,
    _move_torch,
    _paged_rows_torch,
    move_kv_rows,
    move_kv_rows_reference,
    paged_rows,
    paged_rows_reference,
    push_kv_rows,
    push_kv_rows_reference,
)
from fusedpar.testing.numerics import poison_

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or INTERPRETED),
    reason="no CUDA and fusedpar.kernels.kv_rows was imported without TRITON_INTERPRET=1",
)


def _rows(gen: torch.Generator, blocks: int, block: int, heads: int, seqs: int, tokens: int, leaving: int):
    """Rows (slot * heads + head) of `seqs` sequences of `tokens` tokens on shuffled blocks, for the last
    `leaving` heads: what one rank sends one peer."""
    per_seq = -(-tokens // block)
    table = torch.randperm(blocks, generator=gen)[: seqs * per_seq].view(seqs, per_seq)
    parts = []
    for s in range(seqs):
        slots = (table[s].view(-1, 1) * block + torch.arange(block)).view(-1)[:tokens]
        parts += [slots * heads + h for h in range(heads - leaving, heads)]
    return torch.cat(parts)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def _pools(layers: int, rows: int, hd: int, dtype, device, gen, padded: bool):
    """k, v [layers, rows, hd] with random values (a view of a taller buffer when padded)."""
    extra = 5 if padded else 0
    k, v = (torch.randn((layers, rows + extra, hd), generator=gen).to(device, dtype) for _ in range(2))
    return (k[:, :rows], v[:, :rows]) if padded else (k, v)


CASES = [  # layers, blocks, block size, local kv heads, sequences, tokens each, heads leaving, head dim
    (3, 20, 4, 4, 3, 21, 2, 16),
    (2, 9, 4, 2, 2, 7, 1, 24),  # odd head dim: masked columns
    (1, 8, 16, 1, 1, BLOCK_R + 1, 1, 8),  # one layer, one row past a row block
    (4, 30, 4, 8, 5, 3, 8, 32),  # every head leaves, short sequences
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=[f"L{c[0]}-hd{c[7]}-n{c[4] * c[5] * c[6]}" for c in CASES])
@pytest.mark.parametrize("padded", [False, True], ids=["packed", "layer-padded"])
def test_gather_then_scatter_match_torch_bit_for_bit(dtype, case, padded):
    layers, blocks, block, heads, seqs, tokens, leaving, hd = case
    gen = torch.Generator().manual_seed(sum(case) + padded)
    idx = _rows(gen, blocks, block, heads, seqs, tokens, leaving)
    k, v = _pools(layers, blocks * block * heads, hd, dtype, "cpu", gen, padded)
    chunk = poison_(torch.empty((2, layers, idx.numel(), hd), dtype=dtype))
    move_kv_rows(k, v, idx, chunk, scatter=False)
    want = torch.empty_like(chunk)
    move_kv_rows_reference(k, v, idx, want, scatter=False)
    assert torch.equal(_bits(chunk), _bits(want)), "gather differs from k[:, idx] / v[:, idx]"
    assert torch.equal(want[0, :, 1], k[:, idx[1]]) and torch.equal(want[1, :, -1], v[:, idx[-1]])
    # scatter fresh values into a poisoned pool: the rows of idx get them, every other row stays NaN
    fresh = torch.randn(chunk.shape, generator=gen).to(dtype)
    tk, tv = (poison_(t.clone()) for t in (k, v))
    rk, rv = (poison_(t.clone()) for t in (k, v))
    move_kv_rows(tk, tv, idx, fresh, scatter=True)
    move_kv_rows_reference(rk, rv, idx, fresh, scatter=True)
    for got, ref in ((tk, rk), (tv, rv)):
        assert torch.equal(got.isnan(), ref.isnan()), "the scatter wrote rows outside idx (or missed some)"
        assert torch.equal(_bits(got[:, idx]), _bits(ref[:, idx]))


def _torch_path(k, v, idx, chunk, *, scatter):
    order = ("rows", idx.numel()) if chunk.dim() == 4 else ("blocks", chunk.shape[3])
    _move_torch(k, v, idx, chunk, order, scatter)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mover", [move_kv_rows, _torch_path], ids=["kernel", "torch-path"])
@pytest.mark.parametrize("block", [4, 16])
def test_block_order_with_missing_rows_matches_torch(dtype, mover, block):
    """Staging for the host tier: 3 pieces of 2, 3 and 1 blocks, each past its tokens padded with
    idx -1; chunk [blocks, layers, 2, block, hd]."""
    layers, hd, heads = 3, 24, 2
    gen = torch.Generator().manual_seed(block + (dtype == torch.bfloat16))
    rows = 40 * block * heads
    idx = torch.randperm(rows, generator=gen)[: 6 * block]
    for first, nblk, tokens in ((0, 2, 2 * block - 3), (2, 3, 2 * block + 1), (5, 1, 1)):
        idx[first * block + tokens:(first + nblk) * block] = -1
    k, v = _pools(layers, rows, hd, dtype, "cpu", gen, padded=True)
    chunk = poison_(torch.empty((6, layers, 2, block, hd), dtype=dtype))
    mover(k, v, idx, chunk, scatter=False)
    want = poison_(torch.empty_like(chunk))
    move_kv_rows_reference(k, v, idx, want, scatter=False)
    assert torch.equal(_bits(chunk), _bits(want)), "block-order gather differs from torch indexing"
    b, r = 2, 1  # an explicit element: block 2, row 1, layer 1, v
    assert torch.equal(want[b, 1, 1, r], v[1, idx[b * block + r]])
    assert not want.isnan().any()
    missing = (idx < 0).view(6, 1, 1, block, 1).expand_as(want)
    assert not want[missing].any() and int(missing.sum()) > 0, "rows without a pool row must gather zeros"
    fresh = torch.randn(chunk.shape, generator=gen).to(dtype)
    tk, tv, rk, rv = (poison_(t.clone()) for t in (k, v, k, v))
    mover(tk, tv, idx, fresh, scatter=True)
    move_kv_rows_reference(rk, rv, idx, fresh, scatter=True)
    has = idx[idx >= 0]
    for got, ref in ((tk, rk), (tv, rv)):
        assert torch.equal(got.isnan(), ref.isnan()), "the scatter wrote rows outside idx >= 0 (or missed some)"
        assert torch.equal(_bits(got[:, has]), _bits(ref[:, has]))
    assert torch.equal(rk[:, idx[b * block + r]], fresh[b, :, 0, r])


@pytest.mark.parametrize("path", ["kernel", "torch-path"])
@pytest.mark.parametrize("block_size,heads", [(16, 2), (4, 3)])
def test_paged_rows_match_token_by_token_rows(path, block_size, heads):
    """Rows from block tables: shuffled tables padded with junk past each sequence's blocks, pieces of
    0, 1, a block and a half, and more than BLOCK_T tokens, written at arbitrary starts; the other
    entries of the output keep their poison (-7)."""
    gen = torch.Generator().manual_seed(block_size + heads)
    lens = [1, 0, block_size + block_size // 2, BLOCK_T + 5, 7]
    width = max(-(-n // block_size) for n in lens) + 2
    table = torch.randint(0, 500, (len(lens), width), generator=gen)
    lines, start = [], 3
    for i, n in enumerate(lens):
        lines.append((len(lens) - 1 - i, (i * 5) % heads, n, start))  # table rows in another order
        start += n + 2  # gaps between pieces
    pieces = torch.tensor(lines, dtype=torch.int64)
    got = torch.full((start + 4,), -7, dtype=torch.int64)
    want = got.clone()
    if path == "kernel":
        paged_rows(table, pieces, got, block_size=block_size, heads=heads, max_tokens=max(lens))
    else:
        _paged_rows_torch(table, pieces, got, block_size, heads)
    paged_rows_reference(table, pieces, want, block_size=block_size, heads=heads)
    assert torch.equal(got, want)
    trow, head, n, first = lines[3]
    t = BLOCK_T + 1
    assert int(want[first + t]) == (int(table[trow, t // block_size]) * block_size + t % block_size) * heads + head
    assert int((want == -7).sum()) == got.numel() - sum(lens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("world", "counts", "hd"), [(2, (5, BLOCK_R + 3), 16), (3, (0, 7, 40), 24),
                                                     (4, (1, 0, BLOCK_R, 2 * BLOCK_R + 1), 8)])
def test_push_writes_each_row_at_its_destination_and_nothing_else(dtype, world, counts, hd):
    """Rows of a fragmented pool (a padded view, missing rows idx < 0 included) pushed to `world`
    destination buffers at raw addresses, each destination's rows at an offset into its buffer; the
    buffers are poisoned first, and every byte outside the pushed rows must stay poisoned."""
    gen = torch.Generator().manual_seed(sum(counts) + world)
    n = sum(counts)
    layers, rows = 3, n + 11
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    k, v = _pools(layers, rows, hd, dtype, device, gen, padded=True)
    idx = torch.randperm(rows, generator=gen)[:n]
    idx[n // 3] = -1  # a missing row: nothing moved
    bounds = [0, *torch.tensor(counts).cumsum(0).tolist()]
    offs = [int(torch.randint(0, 9, (1,), generator=gen)) for _ in range(world)]
    outs = [poison_(torch.empty((offs[p] + counts[p] + 4, layers, 2, 1, hd), dtype=dtype, device=device))
            for p in range(world)]
    want = [o.clone() for o in outs]
    meta = torch.tensor([o.data_ptr() for o in outs] + bounds + offs, dtype=torch.int64, device=device)
    push_kv_rows(k, v, idx.to(device), meta, world=world)
    push_kv_rows_reference(k, v, idx, want, bounds, offs)
    for p in range(world):
        assert torch.equal(_bits(outs[p]), _bits(want[p])), f"destination {p} of {world}"
    wrong = world + 1  # a meta of another world size names both sizes
    with pytest.raises(ValueError, match=rf"meta must be contiguous int64 \[{3 * wrong + 1}\].*got torch.int64 "
                                         rf"\({3 * world + 1},\)"):
        push_kv_rows(k, v, idx.to(device), meta, world=wrong)


def test_empty_index_is_a_no_op_and_bad_shapes_name_the_numbers():
    k = torch.randn(2, 8, 16)
    v = torch.randn(2, 8, 16)
    chunk = torch.empty(2, 2, 0, 16)
    move_kv_rows(k, v, torch.empty(0, dtype=torch.int64), chunk, scatter=False)
    with pytest.raises(ValueError, match=r"chunk must be contiguous \(2, 2, 3, 16\)"):
        move_kv_rows(k, v, torch.arange(3), torch.empty(2, 2, 3, 8), scatter=False)
    with pytest.raises(ValueError, match="idx must be int64"):
        move_kv_rows(k, v, torch.arange(3, dtype=torch.int32), torch.empty(2, 2, 3, 16), scatter=False)
    with pytest.raises(ValueError, match="pool rows must be contiguous"):
        move_kv_rows(k[:, :, :8], v[:, :, :8], torch.arange(3), torch.empty(2, 2, 3, 8), scatter=False)
    with pytest.raises(ValueError, match="dtypes differ"):
        move_kv_rows(k, v.half(), torch.arange(3), torch.empty(2, 2, 3, 16), scatter=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_llama8b_rows_bit_for_bit():
    """bf16, 32 layers, 8 kv heads of 128, 4 sequences x 2048 tokens, 4 heads leaving."""
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(5)
    blocks = 2 * 4 * 128
    idx = _rows(gen, blocks, 16, 8, 4, 2048, 4).to(dev)
    k, v = _pools(32, blocks * 16 * 8, 128, torch.bfloat16, dev, gen, padded=True)
    chunk = poison_(torch.empty((2, 32, idx.numel(), 128), dtype=torch.bfloat16, device=dev))
    move_kv_rows(k, v, idx, chunk, scatter=False)
    assert torch.equal(chunk[0], k[:, idx]) and torch.equal(chunk[1], v[:, idx])
    tk, tv = torch.zeros_like(k), torch.zeros_like(v)
    move_kv_rows(tk, tv, idx, chunk, scatter=True)
    assert torch.equal(tk[:, idx], k[:, idx]) and torch.equal(tv[:, idx], v[:, idx])
    others = torch.ones(k.shape[1], dtype=torch.bool, device=dev)
    others[idx] = False
    assert not tk[:, others].any() and not tv[:, others].any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_llama8b_block_order_bit_for_bit():
    """bf16, 32 layers, 2 local kv heads of 128, block 16: the host tier's staging of 4 sequences x 2000
    tokens (the last block of each padded with idx -1), gathered then scattered back."""
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(6)
    blocks, bs = 4 * 128, 16
    idx = _rows(gen, blocks, bs, 2, 4, 2048, 2).view(8, 128, bs)
    idx[:, -3:] = -1  # 2000 of 2048 tokens: 48 rows of padding per piece
    idx = idx.reshape(-1).to(dev)
    k, v = _pools(32, blocks * bs * 2, 128, torch.bfloat16, dev, gen, padded=True)
    chunk = poison_(torch.empty((idx.numel() // bs, 32, 2, bs, 128), dtype=torch.bfloat16, device=dev))
    move_kv_rows(k, v, idx, chunk, scatter=False)
    want = torch.empty_like(chunk)
    move_kv_rows_reference(k, v, idx, want, scatter=False)
    assert torch.equal(chunk, want)
    tk, tv = torch.zeros_like(k), torch.zeros_like(v)
    move_kv_rows(tk, tv, idx, chunk, scatter=True)
    has = idx[idx >= 0]
    assert torch.equal(tk[:, has], k[:, has]) and torch.equal(tv[:, has], v[:, has])
    others = torch.ones(k.shape[1], dtype=torch.bool, device=dev)
    others[has] = False
    assert not tk[:, others].any() and not tv[:, others].any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_paged_rows_of_a_migration_match_the_reference():
    """8 sequences x 2048 tokens, 8 kv heads, block 16, shuffled tables; table and pieces sliced out of
    one upload at odd offsets (as migrate_kv passes them)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(7)
    table = torch.randperm(8 * 128, generator=gen).view(8, 128)
    lines = [(s, h, 2048 - 3 * s, 0) for s in range(8) for h in range(8)]
    starts = torch.tensor([0] + [n for _, _, n, _ in lines[:-1]]).cumsum(0)
    pieces = torch.tensor(lines, dtype=torch.int64)
    pieces[:, 3] = starts
    flat = torch.cat([torch.tensor([-1]), table.view(-1), pieces.view(-1)]).to(dev)
    got = torch.full((int(pieces[:, 2].sum()),), -7, dtype=torch.int64, device=dev)
    paged_rows(flat[1:1 + table.numel()].view(8, 128), flat[1 + table.numel():].view(-1, 4), got, block_size=16,
               heads=8, max_tokens=2048)
    want = torch.full_like(got, -7).cpu()
    _paged_rows_torch(table, pieces, want, 16, 8)
    assert torch.equal(got.cpu(), want)
