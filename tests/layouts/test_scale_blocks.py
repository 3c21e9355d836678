"""Block-scaled weights through the shard maps: which layouts cut on the scale tiles.

The oracle works on rows: a rank's base tensor is fit for block scales when each of its tiles (rows
[t*b, (t+1)*b), the last one possibly short) is one global tile of one source, row for row, so that its
scale is that tile's scale; the shift view must be a run of whole local tiles (its last may end the tensor).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusedpar.layouts import (
    WEIGHT_NAMES,
    ModelDims,
    ParallelLayout,
    WeightShardMap,
    check_scale_blocks,
    scale_block_problems,
)
from tests.layouts.test_shards import global_sizes, rows, shard_configs
from tests.profile import examples


def tiles_fit(local_rows: list[tuple[str, int]], b: int, sizes: dict[str, int]) -> bool:
    """Every local tile is the same-numbered rows of one global tile (a short tile only where that global
    tile is short too, at the end of its source)."""
    for t in range(0, len(local_rows), b):
        tile = local_rows[t:t + b]
        source, first = tile[0]
        if first % b:
            return False
        want = [(source, r) for r in range(first, min(first + b, sizes[source]))]
        if tile != want:
            return False
    return True


def layout_fits(layout: ParallelLayout, dims: ModelDims, block: tuple[int, int]) -> bool:
    smap, sizes = WeightShardMap(layout, dims), global_sizes(dims)
    for rank in range(layout.world_size):
        for name in WEIGHT_NAMES:
            shard = smap.shard(rank, name)
            b = block[0] if shard.dim == "out" else block[1]
            if not tiles_fit(rows(shard.base), b, sizes):
                return False
            lo, hi = shard.shift
            if lo % b or (hi % b and hi != shard.size):
                return False
    return True


@settings(max_examples=examples(200), deadline=None)
@given(shard_configs(), st.integers(1, 6), st.integers(1, 6))
def test_problems_are_empty_exactly_when_every_tile_is_a_global_tile(config, block_out, block_in):
    layout, dims = config
    problems = scale_block_problems(layout, dims, (block_out, block_in))
    assert (problems == []) == layout_fits(layout, dims, (block_out, block_in)), problems


@pytest.mark.parametrize("dims", [ModelDims(64, 8, 128, 25600), ModelDims(64, 8, 128, 28672)],
                         ids=["qwen3-32b", "llama-3-70b"])
@pytest.mark.parametrize("world,sp", [(2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 1), (8, 2), (8, 8)])
def test_fine_grained_fp8_checkpoints_shard_on_every_layout_of_one_node(dims, world, sp):
    check_scale_blocks(ParallelLayout(world, sp=sp, tp=world // sp), dims, (128, 128))


def test_an_mlp_cut_inside_a_tile_is_named_with_its_numbers():
    # 18944 / 8 = 2368 MLP columns per rank: 18.5 tiles of 128
    dims = ModelDims(32, 8, 128, 18944)
    check_scale_blocks(ParallelLayout(4, tp=4), dims, (128, 128))  # 4736 = 37 tiles
    with pytest.raises(ValueError) as err:
        check_scale_blocks(ParallelLayout(8, tp=8), dims, (128, 128))
    msg = str(err.value)
    assert "128x128 scales" in msg
    assert "gate_up: " in msg and "down: " in msg and "qkv" not in msg and "o:" not in msg
    assert "gate[0:2368]" in msg and "up[0:2368] at 2368" in msg and "128-wide" in msg


def test_half_tile_heads_are_named():
    dims = ModelDims(32, 8, 64, 8192)  # 64-wide heads: a rank holding one kv head holds half a tile
    assert scale_block_problems(ParallelLayout(4, tp=4), dims, (128, 128)) == []
    problems = scale_block_problems(ParallelLayout(8, tp=8), dims, (128, 128))
    assert len(problems) == 1 and problems[0].startswith("qkv: ") and "k[0:64]" in problems[0]


def test_block_sizes_must_be_positive():
    with pytest.raises(ValueError, match="block_in"):
        scale_block_problems(ParallelLayout(2, tp=2), ModelDims(4, 2, 8, 16), (8, 0))
