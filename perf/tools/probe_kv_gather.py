"""Probe: the gathers and scatters around a KV migration's exchange (fusedpar.layers.reshard.migrate_kv).

migrate_kv reads each peer's pieces out of the paged pool with torch.index_select along the token-row
dim of a [layers, rows, head_dim] view (one call for k, one for v), and writes what it receives with
index_copy_ along the same dim. Every layer uses the same row index. On one GPU this times, on the
pool and row pattern of a DP -> TP migration (Llama-3-8B shape by default: 32 layers, 8 kv heads of
128 per DP rank, half of them leaving, block size 16, fragmented block tables):
    index_select dim 1   what migrate_kv does
    index_select flat    one index_select along dim 0 of the pool seen as [layers * rows, head_dim]
                         rows (layer offsets folded into the index: L x n indices)
    triton               one Triton program per (block of rows, layer): loads the row indices once,
                         copies head_dim-wide rows (below, _move_rows_kernel)
and the same three for the scatter (index_copy_ dim 1, index_copy_ flat, triton). The floor beside
them: a plain device copy of the same bytes (read + write), so % = copy time / variant time. Every
variant's output is compared with the dim-1 one's (bit-exact). Prints a table; no records.

Usage: python perf/tools/probe_kv_gather.py [--layers 32 --kv-heads 8 --tokens 16384 --iters 20]
       TRITON_INTERPRET=1 python perf/tools/probe_kv_gather.py --smoke   # CPU: tiny shapes, checks only
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # perf/: the shared bench modules
import _bench

_bench.add_repo_to_path()


@triton.jit
def _move_rows_kernel(pool_ptr, idx_ptr, chunk_ptr, n, pool_layer_stride, SCATTER: tl.constexpr, HD: tl.constexpr,
                      BLOCK_R: tl.constexpr):
    """Gather: chunk[layer, i, :] = pool[layer, idx[i], :]; SCATTER: pool[layer, idx[i], :] = chunk[layer, i, :]
    (idx without repeats), for i in one block of rows; pool rows HD-contiguous, chunk [layers, n, HD]."""
    pid = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    mask = rows < n
    idx = tl.load(idx_ptr + rows, mask=mask, other=0).to(tl.int64)
    cols = tl.arange(0, HD)
    pool = pool_ptr + layer * pool_layer_stride + idx[:, None] * HD + cols[None, :]
    chunk = chunk_ptr + (layer * n + rows[:, None].to(tl.int64)) * HD + cols[None, :]
    if SCATTER:
        tl.store(pool, tl.load(chunk, mask=mask[:, None]), mask=mask[:, None])
    else:
        tl.store(chunk, tl.load(pool, mask=mask[:, None]), mask=mask[:, None])


def _grid(n: int, layers: int, block_r: int) -> tuple[int, int]:
    return (triton.cdiv(n, block_r), layers)


def gather_variants(flat: torch.Tensor, idx: torch.Tensor, block_r: int) -> dict:
    """name -> fn() returning the [layers, n, hd] gather of rows idx from flat [layers, rows, hd]."""
    layers, rows, hd = flat.shape
    n = idx.numel()
    out = {k: torch.empty((layers, n, hd), dtype=flat.dtype, device=flat.device) for k in ("dim1", "flat", "triton")}
    idx_all = (torch.arange(layers, device=idx.device).view(-1, 1) * rows + idx.view(1, -1)).view(-1)
    flat2 = flat.view(layers * rows, hd)
    def triton_gather():
        _move_rows_kernel[_grid(n, layers, block_r)](flat, idx, out["triton"], n, rows * hd, SCATTER=False, HD=hd,
                                                     BLOCK_R=block_r)

    return {
        "index_select dim 1": lambda: torch.index_select(flat, 1, idx, out=out["dim1"]),
        "index_select flat": lambda: torch.index_select(flat2, 0, idx_all, out=out["flat"].view(-1, hd)),
        "triton": triton_gather,
    }, out


def scatter_variants(flat_by: dict, chunk: torch.Tensor, idx: torch.Tensor, block_r: int) -> dict:
    """name -> fn() writing chunk [layers, n, hd] into rows idx of flat_by[name] [layers, rows, hd]."""
    layers, n, hd = chunk.shape
    rows = flat_by["dim1"].shape[1]
    idx_all = (torch.arange(layers, device=idx.device).view(-1, 1) * rows + idx.view(1, -1)).view(-1)
    def triton_scatter():
        _move_rows_kernel[_grid(n, layers, block_r)](flat_by["triton"], idx, chunk, n, rows * hd, SCATTER=True, HD=hd,
                                                     BLOCK_R=block_r)

    return {
        "index_copy_ dim 1": lambda: flat_by["dim1"].index_copy_(1, idx, chunk),
        "index_copy_ flat": lambda: flat_by["flat"].view(layers * rows, hd).index_copy_(0, idx_all, chunk.view(-1, hd)),
        "triton": triton_scatter,
    }


def token_rows(seqs: int, tokens: int, heads: int, leaving: int, block: int, blocks: int, gen) -> torch.Tensor:
    """Rows of a [layers, blocks * block * heads, hd] pool view that a DP rank sends to one peer: per
    sequence (fragmented block table) and per leaving head, its token rows (slot * heads + head)."""
    per_seq = -(-tokens // block)
    table = torch.randperm(blocks, generator=gen)[: seqs * per_seq].view(seqs, per_seq)
    parts = []
    for s in range(seqs):
        slots = (table[s].view(-1, 1) * block + torch.arange(block)).view(-1)[:tokens]
        for h in range(heads - leaving, heads):
            parts.append(slots * heads + h)
    return torch.cat(parts)


def time_ms(fn, iters: int, cuda: bool) -> float:
    times = []
    for _ in range(iters + 2):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[2:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8, help="kv heads a DP rank caches (every head)")
    p.add_argument("--leaving", type=int, default=4, help="kv heads that go to the peer")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seqs", type=int, default=4)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--block-rows", type=int, default=32, help="rows per Triton program")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="tiny shapes; on CPU run with TRITON_INTERPRET=1")
    a = p.parse_args(argv)
    if a.smoke:
        a.layers, a.kv_heads, a.leaving, a.head_dim, a.seqs, a.tokens, a.block, a.block_rows, a.iters = \
            3, 4, 2, 16, 3, 21, 4, 8, 1
    cuda = torch.cuda.is_available()
    if not cuda and not a.smoke:
        print("probe_kv_gather: needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1); skipped")
        return 0
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    gen = torch.Generator().manual_seed(0)
    per_seq = -(-a.tokens // a.block)
    blocks = 2 * a.seqs * per_seq  # half the pool holds the sequences
    idx = token_rows(a.seqs, a.tokens, a.kv_heads, a.leaving, a.block, blocks, gen).to(dev)
    rows = blocks * a.block * a.kv_heads
    flat = torch.randn((a.layers, rows, a.head_dim), generator=gen).to(dev, dtype)
    nbytes = a.layers * idx.numel() * a.head_dim * flat.element_size()
    print(f"probe_kv_gather: {torch.cuda.get_device_name() if cuda else 'cpu'}, {a.layers} layers, {idx.numel()} rows "
          f"of {a.head_dim} per layer ({a.seqs} x {a.tokens} tokens x {a.leaving} of {a.kv_heads} heads), "
          f"{nbytes / 2**20:.1f} MiB per k or v, {dtype}")
    src_copy = torch.empty(nbytes // flat.element_size(), dtype=dtype, device=dev)
    dst_copy = torch.empty_like(src_copy)
    floor = time_ms(lambda: dst_copy.copy_(src_copy), a.iters, cuda)
    gathers, outs = gather_variants(flat, idx, a.block_rows)
    chunk = outs["dim1"]
    bad, table = [], []
    for name, fn in gathers.items():
        ms = time_ms(fn, a.iters, cuda)
        table.append(("gather", name, ms))
    for key in ("flat", "triton"):
        if not torch.equal(outs[key], outs["dim1"]):
            bad.append(f"gather {key} differs from index_select dim 1")
    targets = {k: torch.zeros_like(flat) for k in ("dim1", "flat", "triton")}
    for name, fn in scatter_variants(targets, chunk, idx, a.block_rows).items():
        ms = time_ms(fn, a.iters, cuda)
        table.append(("scatter", name, ms))
    for key in ("flat", "triton"):
        if not torch.equal(targets[key], targets["dim1"]):
            bad.append(f"scatter {key} differs from index_copy_ dim 1")
    print(f"{'op':8} {'variant':20} {'ms':>9} {'GB/s':>8} {'% of copy':>10}")
    print(f"{'copy':8} {'plain device copy':20} {floor:9.3f} {2 * nbytes / floor / 1e6:8.0f} {100:>9}%")
    for op, name, ms in table:
        print(f"{op:8} {name:20} {ms:9.3f} {2 * nbytes / ms / 1e6:8.0f} {100 * floor / ms:>9.0f}%")
    for line in bad:
        print("MISMATCH:", line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
