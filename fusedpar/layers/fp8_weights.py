"""FP8 weights with their scales through the shard maps: base shards and zero-copy shift views.

FP8Weight keeps an e4m3 weight [N, K] with its fp32 scales, one per `tile` (rows x columns): the whole
weight (per-tensor), one row (per-channel: tile (1, K)) or a block (fine-grained checkpoints). A narrow
along a dim takes the scales of the tiles it covers (a view of both tensors); it must cut between tiles
unless the dim has a single tile (a per-tensor scale, or a per-channel scale along K), which covers any
range. Concatenation, as the shard maps join segments of several sources (q, k and v rows into qkv),
keeps every piece's scales: pieces whose tiles span all their rows with different scales (per-tensor q,
k, v) become per-row scales first, which is exact. fusedpar.layouts.check_scale_blocks says beforehand
which layouts cut every weight between its blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fusedpar.kernels.fp8 import (
    E4M3,
    MIN_BLOCK_K,
    FP8Scheme,
    check_block_view,
    dequantize,
    fp8_linear_tiles,
    fp8_matmul_tiles,
    kernel_takes,
    mm_block_k,
    quantize_weight,
)
from fusedpar.layouts import WeightShard


@dataclass(frozen=True)
class FP8Weight:
    q: torch.Tensor  # e4m3 [N, K]
    scale: torch.Tensor  # fp32 [ceil(N / tile[0]), ceil(K / tile[1])]
    tile: tuple[int, int]

    def __post_init__(self):
        want = tuple(-(-s // t) for s, t in zip(self.q.shape, self.tile, strict=True)) if self.q.dim() == 2 else None
        if self.q.dtype != E4M3 or want is None or tuple(self.scale.shape) != want:
            raise ValueError(f"FP8Weight: want an e4m3 [N, K] weight and [ceil(N / {self.tile[0]}), "
                             f"ceil(K / {self.tile[1]})] scales, got {self.q.dtype} {tuple(self.q.shape)} and "
                             f"{tuple(self.scale.shape)}")

    @classmethod
    def quantize(cls, w: torch.Tensor, scheme: FP8Scheme) -> FP8Weight:
        q, scale = quantize_weight(w, scheme)
        return cls(q, scale, scheme.weight_tile(tuple(w.shape)))

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.q, self.scale, self.tile, dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] @ weight^T (+ bias), x quantised per token and group of tile[1] input columns (per
        token where a tile spans K), in x.dtype: the reference math (fusedpar.kernels.fp8.reference) on
        every device. `kernel_linear` is the same product on the FP8 Triton kernels; the layers take it
        once its GPU tests have passed on a GPU."""
        return self.reference_linear(x, bias)

    def kernel_linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """linear on the FP8 kernels (fusedpar.kernels.fp8: quantisation and the e4m3 GEMM in one op), for
        the tiles they take (kernel_takes; not a scale per input column: ValueError)."""
        if not kernel_takes(x, self.q, self.tile, self.tile[1]):
            raise ValueError(f"FP8Weight.kernel_linear: the FP8 kernels do not take {tuple(x.shape)} inputs with "
                             f"{self.tile} weight tiles")
        return fp8_matmul_tiles(x, self.q, self.scale, self.tile, self.tile[1], bias)

    def reference_linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """linear in the plain-PyTorch reference (fusedpar.kernels.fp8.reference): the CPU path and the
        oracle of the kernels."""
        return fp8_linear_tiles(x, self.q, self.scale, self.tile, self.tile[1], bias)

    def narrow(self, dim: int, start: int, length: int) -> FP8Weight:
        """Rows (dim 0) or columns (dim 1) [start, start + length): views of the weight and of its scales."""
        size, t = self.shape[dim], self.tile[dim]
        q = self.q.narrow(dim, start, length)
        if self.scale.shape[dim] == 1:  # one tile spans the dim: it covers any range
            tile = list(self.tile)
            tile[dim] = max(length, 1)
            return FP8Weight(q, self.scale, tuple(tile))
        if start % t or (length % t and start + length != size):
            raise ValueError(f"FP8Weight.narrow: [{start}:{start + length}] of dim {dim} (size {size}) cuts inside "
                             f"its {t}-wide scale tiles")
        return FP8Weight(q, self.scale.narrow(dim, start // t, -(-length // t)), self.tile)

    def unit_tiles(self, dim: int) -> FP8Weight:
        """The same weight with one scale per index along dim (each tile's scale repeated; exact)."""
        if self.tile[dim] == 1:
            return self
        scale = self.scale.repeat_interleave(self.tile[dim], dim=dim).narrow(dim, 0, self.shape[dim])
        tile = list(self.tile)
        tile[dim] = 1
        return FP8Weight(self.q, scale, tuple(tile))


def fused_fp8_problems(w: FP8Weight) -> list[str]:
    """Why the fused kernels' e4m3 GEMM cannot take w (empty: it can), each with its numbers: a scale tile
    narrower than K that is no multiple of the kernels' smallest K step (e.g. one scale per input column),
    and a block-scaled view that starts inside a scale block of the weight it is cut from."""
    k = w.shape[1]
    problems = []
    if k and mm_block_k(k, w.tile[1], w.tile[1], 128) is None:
        problems.append(f"one scale per {w.tile[1]} of its {k} input columns: the kernels take scales spanning K or "
                        f"a multiple of {MIN_BLOCK_K} columns")
    try:
        check_block_view(w.q, w.tile, w.scale.shape[0], w.scale.shape[1])
    except ValueError as e:
        problems.append(str(e).split(": ", 1)[-1])
    return problems


def cat_fp8(pieces: list[FP8Weight], dim: int) -> FP8Weight:
    """Concatenate along dim 0 or 1, scales with them (a copy, as torch.cat). Pieces whose tiles along dim
    differ (per-tensor q, k and v; a narrowed single tile) get one scale per index along dim first (exact);
    every piece but the last must end on a tile boundary, and all must share the tiles across the other dim."""
    total = sum(p.shape[dim] for p in pieces)
    if all(p.scale.shape[dim] == 1 and torch.equal(p.scale, pieces[0].scale) for p in pieces):
        tile = list(pieces[0].tile)  # one tile along dim with the same scales (pieces of one source): keep it one
        tile[dim] = max(total, 1)
        return FP8Weight(torch.cat([p.q for p in pieces], dim=dim), pieces[0].scale, tuple(tile))
    if len({p.tile[dim] for p in pieces}) > 1:
        pieces = [p.unit_tiles(dim) for p in pieces]
    other = 1 - dim
    across = {(p.tile[other], p.scale.shape[other]) for p in pieces}
    problems = [f"the pieces' scale tiles across dim {other} differ: {sorted(across)}"] if len(across) > 1 else []
    problems += [f"piece {i} ends inside a {p.tile[dim]}-wide scale tile ({p.shape[dim]} along dim {dim})"
                 for i, p in enumerate(pieces[:-1]) if p.shape[dim] % p.tile[dim]]
    if problems:
        raise ValueError("cat_fp8: " + "; ".join(problems))
    return FP8Weight(torch.cat([p.q for p in pieces], dim=dim), torch.cat([p.scale for p in pieces], dim=dim),
                     pieces[0].tile)


def build_fp8_shard(full: dict[str, FP8Weight], shard: WeightShard) -> FP8Weight:
    """The FP8 counterpart of fusedpar.layers.weights.build_shard: the shard's global segments, scales with
    them, concatenated along the shard's dim."""
    dim, pieces = shard.torch_dim, []
    for seg in shard.base:
        try:
            pieces.append(full[seg.source].narrow(dim, seg.start, seg.size))
        except ValueError as e:
            raise ValueError(f"the {shard.name} shard takes {seg.source}[{seg.start}:{seg.stop}]: {e}") from None
    return cat_fp8(pieces, dim)


def fp8_shift_view(base: FP8Weight, shard: WeightShard) -> FP8Weight:
    """The shard's shift-mode weight: a narrow of the base shard, scales included (no copy)."""
    lo, hi = shard.shift
    return base.narrow(shard.torch_dim, lo, hi - lo)


def linear(x: torch.Tensor, w: torch.Tensor | FP8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a plain weight, FP8Weight.linear for an FP8 one: the layers' plain path takes either."""
    return w.linear(x, bias) if isinstance(w, FP8Weight) else F.linear(x, w, bias)
