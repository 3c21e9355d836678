"""FP8 weights through the shard maps: every rank's base shard and shift view, scales included, dequantise
to exactly the shard of the dequantised global weights (fusedpar.layers.weights.build_shard, the path the
unquantised weights take), and the shift view is a view."""

from __future__ import annotations

import pytest
import torch

from fusedpar.kernels.fp8 import FP8Scheme
from fusedpar.layers.fp8_weights import FP8Weight, build_fp8_shard, cat_fp8, fp8_shift_view
from fusedpar.layers.weights import build_shard
from fusedpar.layouts import WEIGHT_NAMES, ModelDims, ParallelLayout, WeightShardMap, scale_block_problems

D = 8  # hidden size
DIMS = ModelDims(num_q_heads=8, num_kv_heads=4, head_dim=4, intermediate_size=32)
LAYOUTS = [ParallelLayout(2, tp=2), ParallelLayout(2, sp=2), ParallelLayout(4, tp=4), ParallelLayout(4, sp=2, tp=2),
           ParallelLayout(4, sp=4), ParallelLayout(4, tp=2), ParallelLayout(8, sp=2, tp=4)]
SCHEMES = [FP8Scheme("tensor"), FP8Scheme("channel"), FP8Scheme("block", (4, 4)), FP8Scheme("block", (4, 8))]
IDS = ["tensor", "channel", "block4x4", "block4x8"]


def global_fp8(dims: ModelDims, scheme: FP8Scheme, seed: int) -> dict[str, FP8Weight]:
    gen = torch.Generator().manual_seed(seed)
    q, kv, inter = dims.num_q_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim, dims.intermediate_size
    shapes = {"q": (q, D), "k": (kv, D), "v": (kv, D), "o": (D, q), "gate": (inter, D), "up": (inter, D),
              "down": (D, inter)}
    # each source its own magnitude, so per-tensor scales differ between q, k and v
    return {name: FP8Weight.quantize(torch.randn(shape, generator=gen, dtype=torch.float64) * (i + 1), scheme)
            for i, (name, shape) in enumerate(shapes.items())}


@pytest.mark.parametrize("scheme", SCHEMES, ids=IDS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=repr)
def test_shards_and_shift_views_dequantise_to_the_shards_of_the_global_weights(layout, scheme):
    full = global_fp8(DIMS, scheme, seed=layout.world_size * 10 + layout.sp)
    plain = {name: w.dequantize(torch.float64) for name, w in full.items()}
    smap = WeightShardMap(layout, DIMS)
    aligned = not scale_block_problems(layout, DIMS, scheme.block)
    for rank in range(layout.world_size):
        for name in WEIGHT_NAMES:
            shard = smap.shard(rank, name)
            base = build_fp8_shard(full, shard)
            want = build_shard(plain, shard)
            assert torch.equal(base.dequantize(torch.float64), want), (rank, name)
            if scheme.weight == "block" and aligned:
                assert base.tile == scheme.block, (rank, name, base.tile)  # the kernels' tiles, not per-row scales
            view = fp8_shift_view(base, shard)
            lo, hi = shard.shift
            assert torch.equal(view.dequantize(torch.float64), want.narrow(shard.torch_dim, lo, hi - lo))
            assert view.q.untyped_storage().data_ptr() == base.q.untyped_storage().data_ptr()
            assert view.scale.untyped_storage().data_ptr() == base.scale.untyped_storage().data_ptr()


def test_a_layout_cutting_inside_scale_blocks_is_refused_naming_the_cut():
    layout, scheme = ParallelLayout(4, tp=4), FP8Scheme("block", (8, 8))  # 4-row heads, 8-row tiles
    assert scale_block_problems(layout, DIMS, scheme.block)
    full = global_fp8(DIMS, scheme, seed=1)
    shard = WeightShardMap(layout, DIMS).shard(1, "qkv")
    cut = r"qkv shard takes k\[4:8\]: .* dim 0 \(size 16\) cuts inside its 8-wide scale tiles"
    with pytest.raises(ValueError, match=cut):
        build_fp8_shard(full, shard)


def test_cat_names_every_problem():
    a = FP8Weight.quantize(torch.randn(6, 8), FP8Scheme("block", (4, 4)))
    b = FP8Weight.quantize(torch.randn(4, 8), FP8Scheme("block", (4, 2)))
    with pytest.raises(ValueError, match=r"across dim 1 differ.*piece 0 ends inside a 4-wide scale tile \(6"):
        cat_fp8([a, b], 0)


def test_the_weight_checks_its_scales():
    with pytest.raises(ValueError, match=r"\[ceil\(N / 4\), ceil\(K / 4\)\] scales, got torch.float8_e4m3fn \(8, 8\)"):
        FP8Weight(torch.zeros(8, 8).to(torch.float8_e4m3fn), torch.ones(3, 2), (4, 4))


def test_pieces_of_one_tile_with_one_scale_stay_one_tile():
    # per-channel columns of one source, joined: activations stay scaled per token over all of them
    w = FP8Weight.quantize(torch.randn(6, 16), FP8Scheme("channel"))
    joined = cat_fp8([w.narrow(1, 8, 8), w.narrow(1, 0, 4)], 1)
    assert joined.tile == (1, 12) and joined.scale.shape == (6, 1)
    assert torch.equal(joined.dequantize(), torch.cat([w.dequantize()[:, 8:], w.dequantize()[:, :4]], 1))
    # per-tensor q and k of different scales: a tile each where their rows agree, else one scale per row
    q, k, v = (FP8Weight.quantize(torch.randn(n, 8) * s, FP8Scheme("tensor")) for n, s in ((4, 1), (4, 10), (2, 3)))
    qk, qkv = cat_fp8([q, k], 0), cat_fp8([q, k, v], 0)
    assert qk.tile == (4, 8) and qk.scale.shape == (2, 1) and qkv.tile == (1, 8) and qkv.scale.shape == (10, 1)
    assert torch.equal(qkv.dequantize(), torch.cat([q.dequantize(), k.dequantize(), v.dequantize()]))
