"""Weight shard maps: what each rank holds of qkv, o, gate_up and down, and its shift view.

Weights use the Hugging Face / nn.Linear orientation [out_features, in_features]. A shard is
built by concatenating global row (dim "out") or column (dim "in") ranges of named source
weights; its shift view is one contiguous range of the shard along the same dim, so in torch
it is a `narrow` of the base tensor: zero extra bytes.

Column-parallel weights are laid out as SP blocks, block s = what SP peer s needs:
    qkv      block s = [q rows of chunk c | k rows of chunk c | v rows of chunk c], c = t*SP + s
    gate_up  block s = [gate rows of chunk c | up rows of chunk c]
so that base mode's single GEMM output [n/SP, SP blocks] is already chunked for the
all-to-all, and shift rank r = t*SP + s uses block s. Row-parallel weights (o, down) hold the
contiguous input columns of TP shard t; the shift view is sub-range s of them.

kv heads shared by several chunks (kv replication, SP*TP > h_kv) are duplicated in each
block that needs them ("duplicate_columns" plan): every block stays self-contained and the
shift view stays one contiguous range. The same plan covers a TP shard whose q heads straddle
kv groups (TP neither divides nor is a multiple of h_kv, e.g. 6 q / 2 kv heads on SP=2 x TP=3):
each SP block carries its own chunk's kv head, so the blocks of one shard hold different kv
heads. The alternative (unique kv columns, replication in the network, paper Algorithm 1)
would change only the qkv map; `kv_plan` names the plan in use.

Why duplicate_columns (per rank, base mode, n tokens, SP = SP_AA x SP_AG, SP_AA = h_kv/TP kv
heads per TP shard, r = SP_AG replicas of each kv head, kv row = 2*hd values):
  wire bytes: every rank must end with its one kv head for all n tokens and holds n/SP of them,
    so it receives (SP-1) * n/SP kv rows in either plan. Sent: duplicate_columns (SP-1) * n/SP;
    Algorithm 1 all-to-all (SP_AA-1) * n/SP plus all-gather (SP_AG-1) * n*SP_AA/SP = the same
    total. Equal bytes on the wire.
  collectives: duplicate_columns keeps ONE symmetric all-to-all for q, k and v, the one
    qkv_all_to_all fuses into the GEMM; Algorithm 1 needs a second (SP_AA) all-to-all and an
    SP_AG all-gather plus a reorder, which the paper itself notes breaks the fusion.
  cost: the GEMM computes (r-1) extra copies of each kv head: qkv FLOPs grow by
    (SP - h_kv/TP) * 2hd / ((h + 2 h_kv) hd / TP), e.g. +20% of the qkv GEMM (about 2% of a
    layer) for 32 q / 4 kv heads at SP=8 (Qwen3-30B-A3B attention).
So duplicate_columns moves the same bytes in one fused collective for a few % more GEMM work.
(Algorithm 1 is not implemented, so this is a bytes/collectives argument, not a timed
comparison; the GPU tests in tests/layers/test_fused_gpu.py cover the replicated layouts.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fusedpar.layouts._checks import StepMode, positive_int
from fusedpar.layouts.heads import head_count_problems

if TYPE_CHECKING:
    from fusedpar.layouts.grid import ParallelLayout

WEIGHT_NAMES = ("qkv", "o", "gate_up", "down")


@dataclass(frozen=True)
class ModelDims:
    """The sizes a shard map depends on (hidden size is never sharded)."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int


@dataclass(frozen=True)
class Segment:
    """Rows (or columns) [start, stop) of global weight `source` (q, k, v, o, gate, up, down)."""

    source: str
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class WeightShard:
    """One rank's piece of one fused weight.

    dim: "out" (rows of [out, in], column-parallel) or "in" (columns, row-parallel).
    base: global segments concatenated along `dim` to form the rank's base tensor.
    shift: (start, stop) along `dim` of the base tensor: the rank's shift-mode weight.
    """

    name: str
    dim: str
    base: tuple[Segment, ...]
    shift: tuple[int, int]

    @property
    def size(self) -> int:
        return sum(seg.size for seg in self.base)

    @property
    def torch_dim(self) -> int:
        return 0 if self.dim == "out" else 1

    def shift_segments(self) -> tuple[Segment, ...]:
        """The global segments the shift view covers (maps the local range back through base)."""
        lo, hi = self.shift
        out, pos = [], 0
        for seg in self.base:
            a, b = max(lo, pos), min(hi, pos + seg.size)
            if a < b:
                out.append(Segment(seg.source, seg.start + a - pos, seg.start + b - pos))
            pos += seg.size
        return merge_segments(out)


def merge_segments(segments) -> tuple[Segment, ...]:
    """Join neighbours that continue the same source range."""
    out: list[Segment] = []
    for seg in segments:
        if out and out[-1].source == seg.source and out[-1].stop == seg.start:
            out[-1] = Segment(seg.source, out[-1].start, seg.stop)
        else:
            out.append(seg)
    return tuple(out)


def head_segments(source: str, heads: tuple[int, ...], head_dim: int) -> tuple[Segment, ...]:
    return merge_segments(Segment(source, h * head_dim, (h + 1) * head_dim) for h in heads)


def shard_problems(layout: ParallelLayout, dims: ModelDims) -> list[str]:
    """Every reason `layout` cannot shard a model of `dims`, one message each (empty: it can), so a
    caller can name them all at once. Non-positive sizes raise ValueError at once."""
    for field in ("head_dim", "intermediate_size"):
        positive_int(field, getattr(dims, field))
    P = layout.replica_size
    problems = []
    if dims.intermediate_size % P:
        problems.append(
            f"intermediate_size={dims.intermediate_size} is not divisible by sp*tp={layout.sp}*{layout.tp}={P}: "
            "every rank of a replica holds an equal chunk of the MLP columns"
        )
    return problems + head_count_problems(dims.num_q_heads, dims.num_kv_heads, layout.sp, layout.tp)


class WeightShardMap:
    """shard(rank, name) -> WeightShard for name in WEIGHT_NAMES."""

    kv_plan = "duplicate_columns"

    def __init__(self, layout: ParallelLayout, dims: ModelDims):
        problems = shard_problems(layout, dims)
        if problems:
            raise ValueError("; ".join(problems))
        self.layout = layout
        self.dims = dims
        self.placement = layout.head_placement(dims.num_q_heads, dims.num_kv_heads)

    def _chunk_ranks(self, rank: int) -> list[int]:
        """The SP peers of rank, in SP order: base block s is what peer s computes."""
        return self.layout.sp_group_of(rank)

    def shard(self, rank: int, name: str) -> WeightShard:
        if name not in WEIGHT_NAMES:
            raise ValueError(f"weight name must be one of {WEIGHT_NAMES}, got {name!r}")
        s = self.layout.coords(rank).sp
        d, place = self.dims.head_dim, self.placement
        P, I = self.layout.replica_size, self.dims.intermediate_size
        peers = self._chunk_ranks(rank)
        if name == "qkv":
            blocks = []
            for peer in peers:
                q, kv = place.q_heads(peer, StepMode.BASE), place.kv_heads(peer, StepMode.BASE)
                blocks.append(head_segments("q", q, d) + head_segments("k", kv, d) + head_segments("v", kv, d))
            blk = sum(seg.size for seg in blocks[0])
            return WeightShard("qkv", "out", tuple(x for b in blocks for x in b), (s * blk, (s + 1) * blk))
        if name == "gate_up":
            per = I // P
            base = []
            for peer in peers:
                c = self.layout.coords(peer).local
                base += [Segment("gate", c * per, (c + 1) * per), Segment("up", c * per, (c + 1) * per)]
            return WeightShard("gate_up", "out", tuple(base), (s * 2 * per, (s + 1) * 2 * per))
        if name == "o":
            # o's input columns follow the head order attention hands back after the return
            # all-to-all: the SP peers' q heads, in SP order.
            heads = tuple(h for peer in peers for h in place.q_heads(peer, StepMode.BASE))
            per = place.q_heads_per_rank * d
            return WeightShard("o", "in", head_segments("o", heads, d), (s * per, (s + 1) * per))
        per = I // P
        cols = merge_segments(
            Segment("down", self.layout.coords(p).local * per, (self.layout.coords(p).local + 1) * per)
            for p in peers
        )
        return WeightShard("down", "in", cols, (s * per, (s + 1) * per))

    def base_bytes(self, rank: int, hidden_size: int, bytes_per_element: int = 2) -> int:
        """Bytes of the four sharded weights on `rank` (the shift views add none)."""
        return sum(self.shard(rank, n).size for n in WEIGHT_NAMES) * hidden_size * bytes_per_element
