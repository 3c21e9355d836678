"""Probe: the gathers and scatters around a KV migration's exchange (fusedpar.layers.reshard.migrate_kv).

migrate_kv reads each peer's pieces out of the paged pool, seen as [layers, rows, head_dim] for k and
for v, with one row index shared by every layer, and writes what it receives the same way. On one GPU
this times, on the pool and row pattern of a DP -> TP migration (Llama-3-8B shape by default: 32
layers, 8 kv heads of 128 per DP rank, half of them leaving, block size 16, fragmented block tables),
k and v together:
    index_select dim 1   torch.index_select along the row dim, once for k, once for v
    index_select flat    index_select along dim 0 of the pool seen as [layers * rows, head_dim]
                         (layer offsets folded into the index: L x n indices)
    move_kv_rows         fusedpar.kernels.kv_rows, what migrate_kv runs: one Triton launch for k and v
and the same three for the scatter (index_copy_ dim 1, index_copy_ flat, move_kv_rows). The floor
beside them: a plain device copy of the same bytes (read + write), so % = copy time / variant time.
Every variant's output is compared with the dim-1 one's (bit-exact). Prints a table; no records.

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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # perf/: the shared bench modules
import _bench

_bench.add_repo_to_path()
from fusedpar.kernels.kv_rows import move_kv_rows  # noqa: E402  (after the repo is on the path)


def gather_variants(k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor) -> tuple[dict, dict]:
    """name -> fn() gathering rows idx of k and v [layers, rows, hd] into a [2, layers, n, hd] output."""
    layers, rows, hd = k.shape
    n = idx.numel()
    out = {key: torch.empty((2, layers, n, hd), dtype=k.dtype, device=k.device) for key in ("dim1", "flat", "triton")}
    idx_all = (torch.arange(layers, device=idx.device).view(-1, 1) * rows + idx.view(1, -1)).view(-1)

    def dim1():
        for i, t in enumerate((k, v)):
            torch.index_select(t, 1, idx, out=out["dim1"][i])

    def flat():
        for i, t in enumerate((k, v)):
            torch.index_select(t.view(layers * rows, hd), 0, idx_all, out=out["flat"][i].view(-1, hd))

    return {"index_select dim 1": dim1, "index_select flat": flat,
            "move_kv_rows": lambda: move_kv_rows(k, v, idx, out["triton"], scatter=False)}, out


def scatter_variants(pools: dict, chunk: torch.Tensor, idx: torch.Tensor) -> dict:
    """name -> fn() writing chunk [2, layers, n, hd] into rows idx of pools[name] (k, v [layers, rows, hd])."""
    _, layers, _, hd = chunk.shape
    rows = pools["dim1"][0].shape[1]
    idx_all = (torch.arange(layers, device=idx.device).view(-1, 1) * rows + idx.view(1, -1)).view(-1)

    def dim1():
        for i, t in enumerate(pools["dim1"]):
            t.index_copy_(1, idx, chunk[i])

    def flat():
        for i, t in enumerate(pools["flat"]):
            t.view(layers * rows, hd).index_copy_(0, idx_all, chunk[i].reshape(-1, hd))

    return {"index_copy_ dim 1": dim1, "index_copy_ flat": flat,
            "move_kv_rows": lambda: move_kv_rows(*pools["triton"], idx, chunk, scatter=True)}


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
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="tiny shapes; on CPU run with TRITON_INTERPRET=1")
    a = p.parse_args(argv)
    if a.smoke:
        a.layers, a.kv_heads, a.leaving, a.head_dim, a.seqs, a.tokens, a.block, a.iters = 3, 4, 2, 16, 3, 21, 4, 1
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
    k, v = (torch.randn((a.layers, rows, a.head_dim), generator=gen).to(dev, dtype) for _ in range(2))
    nbytes = 2 * a.layers * idx.numel() * a.head_dim * k.element_size()
    print(f"probe_kv_gather: {torch.cuda.get_device_name() if cuda else 'cpu'}, {a.layers} layers, {idx.numel()} rows "
          f"of {a.head_dim} per layer ({a.seqs} x {a.tokens} tokens x {a.leaving} of {a.kv_heads} heads), "
          f"{nbytes / 2**20:.1f} MiB of k and v, {dtype}")
    src_copy = torch.empty(nbytes // k.element_size(), dtype=dtype, device=dev)
    dst_copy = torch.empty_like(src_copy)
    floor = time_ms(lambda: dst_copy.copy_(src_copy), a.iters, cuda)
    gathers, outs = gather_variants(k, v, idx)
    chunk = outs["dim1"]
    bad, table = [], []
    for name, fn in gathers.items():
        ms = time_ms(fn, a.iters, cuda)
        table.append(("gather", name, ms))
    for key in ("flat", "triton"):
        if not torch.equal(outs[key], outs["dim1"]):
            bad.append(f"gather {key} differs from index_select dim 1")
    targets = {key: (torch.zeros_like(k), torch.zeros_like(v)) for key in ("dim1", "flat", "triton")}
    for name, fn in scatter_variants(targets, chunk, idx).items():
        ms = time_ms(fn, a.iters, cuda)
        table.append(("scatter", name, ms))
    for key in ("flat", "triton"):
        if not all(torch.equal(a, b) for a, b in zip(targets[key], targets["dim1"], strict=True)):
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
