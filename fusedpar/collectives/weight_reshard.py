"""Carry out a weight reshard plan (fusedpar.layouts.reshard_plan.weight_plan) on real tensors.

Every rank holds, per fused weight, one tensor whose rows (dim "out") or columns (dim "in") are the
concatenation of known global segments. `reshard_weight` returns the rank's tensor for the target
shard: a `narrow` of the held tensor when the target is one contiguous range of it (no copy, no
bytes moved), else a new tensor filled from the rank's own rows and from point-to-point transfers
of the pieces peers provide. Every rank computes the same plan, so each knows what to send to whom
without talking first. Collective over `pg` (the world's ranks, global numbering): every rank calls
it for the same weight, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from fusedpar.layouts.reshard_plan import Piece, view_range
from fusedpar.layouts.shards import Segment, merge_segments


@dataclass(frozen=True)
class Held:
    """One rank's tensor of one fused weight: `segments` concatenated along `dim` (0: rows, 1: columns)."""

    tensor: torch.Tensor
    segments: tuple[Segment, ...]
    dim: int

    def __post_init__(self) -> None:
        size = sum(s.size for s in self.segments)
        if self.tensor.dim() != 2 or self.tensor.shape[self.dim] != size:
            raise ValueError(f"held tensor {tuple(self.tensor.shape)} has no {size} entries along dim {self.dim} "
                             f"for segments {self.segments}")

    def rows(self, source: str, start: int, stop: int) -> torch.Tensor:
        """The held entries of global `source`[start:stop): a narrow when one held segment has them all,
        else the parts joined (a copy)."""
        parts, row = [], start
        while row < stop:
            pos = 0
            for seg in self.segments:
                if seg.source == source and seg.start <= row < seg.stop:
                    take = min(stop, seg.stop) - row
                    parts.append(self.tensor.narrow(self.dim, pos + row - seg.start, take))
                    row += take
                    break
                pos += seg.size
            else:
                raise ValueError(f"{source}[{row}] is not held (segments {self.segments})")
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)


def reshard_weight(name: str, rank: int, held: Held, target: tuple[Segment, ...], plan: list[Piece],
                   pg: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, int]:
    """(this rank's tensor of weight `name` for `target`, bytes it received). `plan`: the whole
    weight_plan (every rank's pieces), from which this rank takes its sends and receives."""
    mine = [p for p in plan if p.name == name]
    span = view_range(held.segments, target)
    if span is not None and not any(p.rank == rank and p.moves for p in mine):
        out = held.tensor.narrow(held.dim, span[0], span[1] - span[0])
        _exchange(rank, held, mine, [], pg)  # peers may still need rows this rank holds
        return out, 0
    width = held.tensor.shape[1 - held.dim]
    size = sum(s.size for s in merge_segments(target))
    shape = (size, width) if held.dim == 0 else (width, size)
    out = torch.empty(shape, dtype=held.tensor.dtype, device=held.tensor.device)
    # the place in `out` of every piece of this rank, in plan order: weight_plan lists them target segment by
    # segment, each segment's pieces in order and covering it (a segment held twice has its own pieces)
    todo = iter([p for p in mine if p.rank == rank])
    places: list[tuple[Piece, torch.Tensor]] = []
    pos = 0
    for seg in merge_segments(target):
        covered = seg.start
        while covered < seg.stop:
            p = next(todo)
            if (p.source, p.start) != (seg.source, covered):
                raise RuntimeError(f"plan piece {p} does not continue {seg} at {covered}")
            places.append((p, out.narrow(held.dim, pos + p.start - seg.start, p.size)))
            covered = p.stop
        pos += seg.size
    for p, dst in places:
        if not p.moves:
            dst.copy_(held.rows(p.source, p.start, p.stop))
    received = _exchange(rank, held, mine, places, pg)
    return out, received


def _exchange(rank: int, held: Held, pieces: list[Piece], places: list[tuple[Piece, torch.Tensor]],
              pg: dist.ProcessGroup | None) -> int:
    """Send the pieces this rank provides to others, receive the ones it needs (in plan order on both
    sides, so the messages between two ranks pair up); bytes received."""
    ops, staged = [], []
    dests = iter(dst for p, dst in places if p.moves)
    for p in pieces:
        if not p.moves:
            continue
        if p.provider == rank:
            ops.append(dist.P2POp(dist.isend, held.rows(p.source, p.start, p.stop).contiguous(), p.rank, group=pg))
        elif p.rank == rank:
            dst = next(dests)
            buf = dst if dst.is_contiguous() else torch.empty_like(dst, memory_format=torch.contiguous_format)
            staged.append((dst, buf))
            ops.append(dist.P2POp(dist.irecv, buf, p.provider, group=pg))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    received = 0
    for dst, buf in staged:
        if buf is not dst:
            dst.copy_(buf)
        received += buf.numel() * buf.element_size()
    return received
