"""Reshard plans: what each rank must get, and from whom, to move from one layout to another.

Both layouts cover the same world. A rank holds, per weight (qkv, o, gate_up, down), the global
segments of its shard in the source layout (or of several layouts: a rank keeping weights for a
declared set holds their union); the target layout asks for the segments of its own shard.
`weight_plan` cuts every target segment into pieces, each provided exactly once: by the rank
itself (it holds those rows / columns already) or by one peer that holds them. `view_range`
says whether the whole target shard is one contiguous range of what the rank holds, i.e. a
`narrow` of its tensor: zero copies, as the shift view is of the base shard.

KV: a sequence lives on one replica; in every layout each rank of that replica caches the kv
heads its placement names (the same in base and shift mode), for every token and layer of the
sequence. `kv_plan` lists, per sequence and kv head, which rank sends its cache to which rank
when the layout changes (and the sequence possibly moves to another replica). A rank that
already caches the head for the sequence keeps it: nothing moves. With the canonical rank order,
layouts that differ only in how a replica of P ranks splits into SP x TP place every kv head on
the same ranks, so switching between them moves no KV.

Pure Python and integers: nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from fusedpar.layouts._checks import StepMode
from fusedpar.layouts.grid import ParallelLayout
from fusedpar.layouts.shards import WEIGHT_NAMES, ModelDims, Segment, merge_segments


@dataclass(frozen=True)
class Piece:
    """Global rows / columns [start, stop) of weight `source` that `rank` needs in the target layout,
    provided by `provider` (== rank: already held, nothing moves)."""

    name: str  # the fused weight: qkv, o, gate_up, down
    source: str  # q, k, v, o, gate, up, down
    start: int
    stop: int
    rank: int
    provider: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def moves(self) -> bool:
        return self.provider != self.rank


@dataclass(frozen=True)
class KVMove:
    """The cache of kv head `head` of sequence `seq` (every layer, every token) goes src -> dst."""

    seq: int
    head: int
    src: int
    dst: int


def _check_same_world(src: ParallelLayout, dst: ParallelLayout) -> None:
    if src.world_size != dst.world_size:
        raise ValueError(f"a reshard stays within one world: {src!r} has {src.world_size} ranks, {dst!r} has "
                         f"{dst.world_size}")


def holdings(layouts: Iterable[ParallelLayout], dims: ModelDims) -> dict[int, dict[str, tuple[Segment, ...]]]:
    """rank -> weight name -> the global segments it holds when it keeps the shards of every layout
    in `layouts` (their union, merged; one layout: its base shard)."""
    layouts = list(layouts)
    if not layouts:
        raise ValueError("holdings needs at least one layout")
    for other in layouts[1:]:
        _check_same_world(layouts[0], other)
    maps = [lay.weight_shards(dims) for lay in layouts]
    out: dict[int, dict[str, tuple[Segment, ...]]] = {}
    for rank in range(layouts[0].world_size):
        out[rank] = {name: union([seg for m in maps for seg in m.shard(rank, name).base]) for name in WEIGHT_NAMES}
    return out


def union(segments: Iterable[Segment]) -> tuple[Segment, ...]:
    """The segments' union, sorted by source then start, overlaps and neighbours merged."""
    by_source: dict[str, list[tuple[int, int]]] = {}
    for seg in segments:
        by_source.setdefault(seg.source, []).append((seg.start, seg.stop))
    out = []
    for source in sorted(by_source):
        for start, stop in sorted(by_source[source]):
            if out and out[-1].source == source and start <= out[-1].stop:
                if stop > out[-1].stop:
                    out[-1] = Segment(source, out[-1].start, stop)
            else:
                out.append(Segment(source, start, stop))
    return tuple(out)


def _covered(want: Segment, have: tuple[Segment, ...]) -> list[tuple[int, int]]:
    """The sub-ranges of `want` that `have` (a union) covers, in order."""
    return [(max(want.start, h.start), min(want.stop, h.stop)) for h in have
            if h.source == want.source and h.start < want.stop and want.start < h.stop]


def weight_plan(src: ParallelLayout | Iterable[ParallelLayout], dst: ParallelLayout, dims: ModelDims
                ) -> list[Piece]:
    """Every piece every rank needs for `dst`'s base shards, each with one provider.

    src: the layout the ranks hold now, or the declared set whose union they hold. A piece a rank
    holds itself is its own; the rest comes from the lowest peer that holds it, preferring a peer
    in the same target replica (NVLink-near in the canonical order), so each byte has one sender."""
    held = holdings([src] if isinstance(src, ParallelLayout) else src, dims)
    _check_same_world(ParallelLayout(len(held), sp=1, tp=1), dst)
    target = dst.weight_shards(dims)
    P = dst.replica_size
    pieces: list[Piece] = []
    for rank in range(dst.world_size):
        replica = rank // P
        peers = sorted(range(dst.world_size), key=lambda p: (p // P != replica, p))
        for name in WEIGHT_NAMES:
            for want in merge_segments(target.shard(rank, name).base):
                pieces += _provide(name, want, rank, [rank] + [p for p in peers if p != rank], held)
    return pieces


def _provide(name: str, want: Segment, rank: int, order: list[int], held) -> list[Piece]:
    """Cut `want` by the first rank in `order` holding each part."""
    todo = [(want.start, want.stop)]
    out = []
    for provider in order:
        rest = []
        for lo, hi in todo:
            pos = lo
            for a, b in _covered(Segment(want.source, lo, hi), held[provider][name]):
                if a > pos:
                    rest.append((pos, a))
                out.append(Piece(name, want.source, a, b, rank, provider))
                pos = b
            if pos < hi:
                rest.append((pos, hi))
        todo = rest
        if not todo:
            return sorted(out, key=lambda p: p.start)
    raise ValueError(f"no rank holds {want.source}[{todo[0][0]}:{todo[0][1]}] of {name}, which rank {rank} needs")


def view_range(held: tuple[Segment, ...], want: tuple[Segment, ...]) -> tuple[int, int] | None:
    """(lo, hi) if `want` (its segments concatenated in order) is the contiguous range [lo, hi) of the
    tensor that concatenates `held` in order, else None: then the target is no view of that tensor.
    Rows held more than once (duplicated kv columns) are tried at each place."""
    held, want = merge_segments(held), merge_segments(want)
    if not want:
        return None
    offsets, total = [], 0
    for seg in held:
        offsets.append(total)
        total += seg.size

    def row_at(offset: int) -> tuple[str, int, int]:  # (source, row, rows left in its segment)
        for seg, off in zip(held, offsets, strict=True):
            if off <= offset < off + seg.size:
                return seg.source, seg.start + offset - off, off + seg.size - offset
        raise AssertionError("offset inside the tensor")

    head = want[0]
    for seg, off in zip(held, offsets, strict=True):
        if not (seg.source == head.source and seg.start <= head.start < seg.stop):
            continue
        lo = cursor = off + head.start - seg.start
        ok = True
        for w in want:
            row = w.start
            while ok and row < w.stop:
                source, at, left = row_at(cursor) if cursor < total else ("", -1, 0)
                ok = source == w.source and at == row
                take = min(w.stop - row, left)
                row, cursor = row + take, cursor + take
            if not ok:
                break
        if ok:
            return lo, cursor
    return None


def kv_plan(src: ParallelLayout, dst: ParallelLayout, dims: ModelDims,
            replicas: Mapping[int, tuple[int, int]]) -> list[KVMove]:
    """The KV moves of a switch src -> dst for live sequences `replicas`: seq -> (its replica in src,
    its replica in dst). Each rank of the target replica that needs a kv head it does not already
    cache for the sequence gets it from one source holder: the one at the same place of its replica
    if that one holds the head, else the lowest."""
    _check_same_world(src, dst)
    sp_, dp_ = src.head_placement(dims.num_q_heads, dims.num_kv_heads), dst.head_placement(dims.num_q_heads,
                                                                                             dims.num_kv_heads)
    moves = []
    for seq, (d_src, d_dst) in sorted(replicas.items()):
        if not (0 <= d_src < src.dp and 0 <= d_dst < dst.dp):
            raise ValueError(f"sequence {seq}: replicas ({d_src}, {d_dst}) outside dp={src.dp} -> dp={dst.dp}")
        src_ranks = range(d_src * src.replica_size, (d_src + 1) * src.replica_size)
        holders: dict[int, list[int]] = {}
        for r in src_ranks:
            for h in sp_.kv_heads(r, StepMode.BASE):
                holders.setdefault(h, []).append(r)
        for r in range(d_dst * dst.replica_size, (d_dst + 1) * dst.replica_size):
            for h in dp_.kv_heads(r, StepMode.BASE):
                if r in holders[h]:
                    continue
                same_place = d_src * src.replica_size + (r - d_dst * dst.replica_size)
                donor = same_place if same_place in holders[h] else holders[h][0]
                moves.append(KVMove(seq, h, donor, r))
    return moves
