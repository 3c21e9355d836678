"""Which layouts can shard a block-scaled weight: every cut on the scale blocks.

A block-scaled FP8 weight [out, in] (the "fine-grained" FP8 checkpoints: one fp32 scale per
block_out x block_in tile, scale tensor [ceil(out / block_out), ceil(in / block_in)]) keeps its
scales with it only where the shard map cuts between tiles. Along the sharded dim of every weight
(rows of qkv and gate_up, columns of o and down), each rank's base tensor must be made of whole
tiles: every segment starts on a tile boundary of its source and sits at a tile boundary of the
rank's tensor, and ends on one too, except at the end of its source when it is the tensor's last
segment (a partial last tile, as in the checkpoint). The shift view, a `narrow` of the base tensor,
must start on a tile boundary and end on one or at the tensor's end. Then a rank's scales are the
rows (columns) of the global scales its segments cover, concatenated the same way, and the shift
view's scales are one contiguous range of them: zero copies, as for the weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fusedpar.layouts._checks import positive_int
from fusedpar.layouts.shards import WEIGHT_NAMES, ModelDims, WeightShardMap

if TYPE_CHECKING:
    from fusedpar.layouts.grid import ParallelLayout

_SHOWN = 3  # offending offsets quoted per weight


def source_sizes(dims: ModelDims) -> dict[str, int]:
    """Length of each global source along the dim the shard maps cut."""
    q, kv, inter = dims.num_q_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim, dims.intermediate_size
    return {"q": q, "k": kv, "v": kv, "o": q, "gate": inter, "up": inter, "down": inter}


def scale_block_problems(layout: ParallelLayout, dims: ModelDims, block: tuple[int, int]) -> list[str]:
    """Every reason `layout` cannot shard a model of `dims` whose weights carry block_out x block_in
    scales (empty: it can), one message per weight with the first offending cuts and the numbers."""
    block_out, block_in = (positive_int(n, v) for n, v in zip(("block_out", "block_in"), block, strict=True))
    smap = WeightShardMap(layout, dims)
    sizes = source_sizes(dims)
    problems = []
    for name in WEIGHT_NAMES:
        bad: list[str] = []
        for rank in range(layout.world_size):
            shard = smap.shard(rank, name)
            b = block_out if shard.dim == "out" else block_in
            pos = 0
            for i, seg in enumerate(shard.base):
                last = i == len(shard.base) - 1
                ends_ok = seg.stop % b == 0 or (seg.stop == sizes[seg.source] and last)
                if seg.start % b or pos % b or not ends_ok:
                    bad.append(f"rank {rank} {seg.source}[{seg.start}:{seg.stop}] at {pos}")
                pos += seg.size
            lo, hi = shard.shift
            if lo % b or (hi % b and hi != shard.size):
                bad.append(f"rank {rank} shift view [{lo}:{hi}] of {shard.size}")
        if bad:
            dim = "rows" if smap.shard(0, name).dim == "out" else "columns"
            b = block_out if dim == "rows" else block_in
            more = f" and {len(bad) - _SHOWN} more" if len(bad) > _SHOWN else ""
            problems.append(f"{name}: the {layout} shards cut {dim} inside the {b}-wide scale blocks "
                            f"({'; '.join(bad[:_SHOWN])}{more})")
    return problems


def check_scale_blocks(layout: ParallelLayout, dims: ModelDims, block: tuple[int, int]) -> None:
    """ValueError naming every problem scale_block_problems finds."""
    problems = scale_block_problems(layout, dims, block)
    if problems:
        raise ValueError(f"block-scaled weights ({block[0]}x{block[1]} scales) cannot be sharded this way: "
                         + "; ".join(problems))
