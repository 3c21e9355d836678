"""FP8 (e4m3) weights in the fused communication kernels, on the CPU emulation of their worlds.

Each kernel's FP8 variant runs on every emulated rank (EmulatedWorld, Triton interpreter) with e4m3
activations quantised by fusedpar.kernels.fp8.fp8_quantize and checked against the plain-PyTorch FP8
reference (fusedpar.kernels.fp8.reference: quantise, dequantise, multiply in float64) followed by the
collective's reference: fresh random inputs, shapes ragged against the 32x32x32 interpreter tiles and
the scale blocks (K not a multiple of the block), NaN-poisoned outputs, the scale schemes of real
checkpoints (per tensor and per output channel with per-token activation scales; blocks with 1 x
block_in activation groups, small (16, 32) blocks and 128 x 128 at one shape) and TP shard views
read in place with their scales. Views cut inside a scale block are refused with their numbers.
"""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

from fusedpar.collectives.symmetric import EmulatedWorld
from fusedpar.kernels._host import INTERPRETED
from fusedpar.kernels.fp8 import (
    E4M3,
    FP8Operands,
    FP8Scheme,
    dequantize,
    fp8_linear_tiles,
    fp8_quantize,
    quantize_activation,
)
from fusedpar.kernels.gemm import GemmConfig
from fusedpar.kernels.gemm_all_reduce import FusedConfig, GemmAllReduceOptions, gemm_all_reduce
from fusedpar.kernels.ulysses import (
    UlyssesOptions,
    all_to_all_o_proj,
    o_proj_workspace_bytes,
    o_scatter_target,
    qkv_all_to_all,
    qkv_workspace_bytes,
    scattered_o_proj,
)
from fusedpar.kernels.ulysses.config import o_proj_fp8_layout
from fusedpar.layers.fp8_weights import FP8Weight
from fusedpar.testing.gemm_all_reduce_emulation import gemm_all_reduce_emulated
from fusedpar.testing.numerics import assert_close, poison_
from fusedpar.testing.ulysses_emulation import all_to_all_o_proj_emulated, qkv_all_to_all_emulated
from tests.kernels.sm90_build import build_for_sm90
from tests.kernels.test_gemm_all_reduce import check_sum

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRETED),
                                reason="the FP8 fused kernels on CPU need TRITON_INTERPRET=1")

SCHEMES = {"tensor": FP8Scheme("tensor"), "channel": FP8Scheme("channel"), "block16x32": FP8Scheme("block", (16, 32)),
           "block128": FP8Scheme("block", (128, 128))}


def _activations(m: int, k: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Rows of different magnitudes (per-token scales matter), columns too (per-group scales matter)."""
    x = torch.randn((m, k), generator=gen) * torch.exp(torch.randn(m, 1, generator=gen) * 0.5)
    return (x * torch.exp(torch.randn(1, k, generator=gen) * 0.5)).to(dtype)


def _column_shard(n: int, k: int, scheme: FP8Scheme, gen: torch.Generator) -> FP8Weight:
    """The row-parallel shard of a TP rank: columns [off, off + k) of a quantised [n, off + k] weight, read in
    place (off: one scale block in, a block boundary; the shard runs to the weight's end, so k may end inside
    a block)."""
    off = scheme.block[1] if scheme.weight == "block" else 24
    w = torch.randn((n, off + k), generator=gen) / math.sqrt(k) * torch.exp(torch.randn(n, 1, generator=gen))
    return FP8Weight.quantize(w, scheme).narrow(1, off, k)


def _quantized(x: torch.Tensor, w: FP8Weight, scheme: FP8Scheme, out_dtype: torch.dtype):
    """(e4m3 x by the kernel quantiser, its FP8Operands, float64 dequantised x and w of the reference)."""
    group = w.tile[1]
    qx, sx = fp8_quantize(x, group)
    ref_q, ref_s = quantize_activation(x, scheme)
    assert scheme.activation_tile(x.shape[1]) == group
    assert torch.equal(qx.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(sx, ref_s)
    return (qx, FP8Operands(sx, w.scale, w.tile, group, out_dtype),
            dequantize(ref_q, ref_s, (1, group), torch.float64), w.dequantize(torch.float64))


# ------------------------------------------------------------------------------ GEMM + all-reduce


def _gar_world(world_size, m, n, k, scheme, out_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    ranks = []
    for _ in range(world_size):
        w = _column_shard(n, k, scheme, gen)
        ranks.append((w, *_quantized(_activations(m, k, gen, torch.float32), w, scheme, out_dtype)))
    return ranks


@pytest.mark.parametrize(("path", "world_size", "out_dtype", "m", "n", "k"), [
    ("one_shot", 2, torch.float16, 7, 100, 72),
    ("two_shot", 2, torch.float32, 33, 72, 40),
    ("one_shot", 4, torch.float16, 1, 130, 40),
    ("two_shot", 4, torch.float16, 20, 130, 72),
], ids=str)
@pytest.mark.parametrize("scheme", ["tensor", "channel", "block16x32"])
def test_gemm_all_reduce_fp8_sums_the_reference_over_ranks(path, world_size, out_dtype, m, n, k, scheme):
    ranks = _gar_world(world_size, m, n, k, SCHEMES[scheme], out_dtype, seed=m * 1000 + n + k + world_size)
    outs = [poison_(torch.empty((m, n), dtype=out_dtype)) for _ in ranks]
    gemm_all_reduce_emulated(EmulatedWorld(world_size, 1 << 20, max_blocks=64), [r[1] for r in ranks],
                             [r[0].q for r in ranks], path=path, outs=outs, fp8=[r[2] for r in ranks])
    check_sum(outs, [r[3] for r in ranks], [r[4] for r in ranks], out_dtype=out_dtype,
              name=f"fp8 {scheme} {path} W={world_size} [{m},{n}] K={k}")


def test_gemm_all_reduce_fp8_128_blocks_split_k_and_residual():
    """128 x 128 blocks (K = 200: two groups, the second short); then split-K over a K range that runs past K
    (its steps load zeros, their scale index stays inside K) with a residual and fp32 partials."""
    ranks = _gar_world(2, 5, 130, 200, SCHEMES["block128"], torch.float16, seed=3)
    outs = [poison_(torch.empty((5, 130), dtype=torch.float16)) for _ in ranks]
    gemm_all_reduce_emulated(EmulatedWorld(2, 1 << 20, max_blocks=64), [r[1] for r in ranks], [r[0].q for r in ranks],
                             path="one_shot", outs=outs, fp8=[r[2] for r in ranks])
    check_sum(outs, [r[3] for r in ranks], [r[4] for r in ranks], out_dtype=torch.float16, name="block128")

    ranks = _gar_world(2, 9, 70, 72, SCHEMES["block16x32"], torch.float16, seed=4)
    res = torch.randn((9, 70), generator=torch.Generator().manual_seed(5)).to(torch.float16)
    outs = [poison_(torch.empty((9, 70), dtype=torch.float16)) for _ in ranks]
    split = FusedConfig(GemmConfig(32, 32, 32, group_m=2), num_sms=4, comm_rows=8, split_k=2)
    gemm_all_reduce_emulated(EmulatedWorld(2, 1 << 20, max_blocks=64), [r[1] for r in ranks], [r[0].q for r in ranks],
                             path="one_shot", outs=outs, fp8=[r[2] for r in ranks], config=split,
                             partial_dtype=torch.float32, residuals=[res, res])
    want = sum(r[3] @ r[4].T for r in ranks).to(torch.float16).double() + res.double()
    for out in outs:
        assert torch.equal(out, outs[0])
        assert_close(out, want, dtype=torch.float16, name="split-K + residual")


def test_gemm_all_reduce_router_quantises_once_for_every_path():
    """The router with an e4m3 weight: x quantised per token (group), the fused one-shot on a world of one and
    the local path, each against the reference's fp8_linear_tiles; a residual on the fused path."""
    gen = torch.Generator().manual_seed(8)
    w = _column_shard(70, 72, SCHEMES["block16x32"], gen)
    x = _activations(9, 72, gen, torch.float16)
    res = torch.randn((9, 70), generator=gen).to(torch.float16)
    want = fp8_linear_tiles(x, w.q, w.scale, w.tile, w.tile[1])
    world = EmulatedWorld(1, 1 << 20, max_blocks=64)
    for path in ("one_shot", "local"):
        y = gemm_all_reduce(x, w.q, None, world[0], options=GemmAllReduceOptions(path=path), w_scale=w.scale,
                            w_tile=w.tile)
        assert y.dtype == torch.float16
        assert_close(y, want, dtype=torch.float16, name=path)
    y = gemm_all_reduce(x, w.q, None, world[0], options=GemmAllReduceOptions(path="one_shot"), w_scale=w.scale,
                        w_tile=w.tile, residual=res)
    assert_close(y, want.double() + res.double(), dtype=torch.float16, name="residual")
    with pytest.raises(ValueError, match=r"gemm_all_reduce: an e4m3 weight needs 2-D x and w and both w_scale"):
        gemm_all_reduce(x, w.q, None, world[0], options=GemmAllReduceOptions(path="local"))


def test_gemm_all_reduce_fp8_refuses_views_inside_blocks_and_bad_scales_with_numbers():
    gen = torch.Generator().manual_seed(9)
    base = FP8Weight.quantize(torch.randn((64, 128), generator=gen), SCHEMES["block16x32"])
    x = _activations(5, 48, gen, torch.float32)
    cut = base.q.narrow(1, 40, 48)  # starts inside a 32-column block
    sx = torch.ones((5, 2))
    fp8 = FP8Operands(sx, base.scale.narrow(1, 1, 2), (16, 32), 32, torch.float16)
    world = EmulatedWorld(2, 1 << 20, max_blocks=64)
    with pytest.raises(ValueError, match=r"starts at column 40, inside a 32-column scale block \(column % 32 = 8\)"):
        gemm_all_reduce_emulated(world, [x.to(E4M3)] * 2, [cut] * 2, path="one_shot", fp8=[fp8] * 2)
    bad = FP8Operands(torch.ones((4, 3)), torch.ones((1, 1)), (16, 32), 32, torch.float16)
    with pytest.raises(ValueError) as err:  # every problem in one error
        gemm_all_reduce_emulated(world, [x.to(E4M3)] * 2, [base.q.narrow(1, 32, 48)] * 2, path="one_shot",
                                 fp8=[bad] * 2)
    assert str(err.value).startswith("gemm_all_reduce: "), err.value
    assert "x_scale (4, 3) must be [M, ceil(K / 32)] = (5, 2)" in str(err.value)
    assert "w_scale (1, 1) must be [ceil(N / 16), ceil(K / 32)] = (4, 2)" in str(err.value)
    with pytest.raises(ValueError) as err:  # a bad x_scale and a view cut inside a block, together
        gemm_all_reduce_emulated(world, [x.to(E4M3)] * 2, [cut] * 2, path="one_shot",
                                 fp8=[FP8Operands(torch.ones((4, 3)), fp8.w_scale, (16, 32), 32, torch.float16)] * 2)
    assert "x_scale (4, 3) must be [M, ceil(K / 32)] = (5, 2)" in str(err.value)
    assert "starts at column 40, inside a 32-column scale block" in str(err.value)


# ------------------------------------------------------------------------------ qkv GEMM + all-to-all


def _row_shard(rows: int, k: int, scheme: FP8Scheme, gen: torch.Generator) -> FP8Weight:
    """A TP rank's base qkv shard: rows [off, off + rows) of a quantised [off + rows, k] weight, read in place
    (off: one scale block down, a block boundary; the shard runs to the weight's end, so rows may end inside
    a block)."""
    off = scheme.block[0] if scheme.weight == "block" else 8
    w = torch.randn((off + rows, k), generator=gen) / math.sqrt(k)
    return FP8Weight.quantize(w, scheme).narrow(0, off, rows)


@pytest.mark.parametrize(("W", "out_dtype", "m", "d", "blk", "schedule"), [
    (2, torch.float16, 5, 72, 40, "phased"),
    (4, torch.float32, 3, 40, 24, "phased"),
    (2, torch.float32, 9, 40, 56, "staggered"),
], ids=str)
@pytest.mark.parametrize("scheme", ["tensor", "channel", "block16x32"])
def test_qkv_all_to_all_fp8_is_the_reference_exchanged(W, out_dtype, m, d, blk, schedule, scheme):
    from tests.kernels.test_ulysses import check_qkv, qkv_world

    gen = torch.Generator().manual_seed(W * 100 + m + d + blk)
    ranks = []
    for _ in range(W):
        w = _row_shard(W * blk, d, SCHEMES[scheme], gen)
        ranks.append((w, *_quantized(_activations(m, d, gen, torch.float32), w, SCHEMES[scheme], out_dtype)))
    world = qkv_world(W, m, blk, out_dtype)
    recvs = qkv_all_to_all_emulated(world, [r[1] for r in ranks], [r[0].q for r in ranks], schedule=schedule,
                                    fp8=[r[2] for r in ranks])
    check_qkv(world, [r[3] for r in ranks], [r[4] for r in ranks], recvs, dtype=out_dtype)


def test_qkv_all_to_all_fp8_128_blocks_and_the_router():
    """128 x 128 blocks on a world of 2 (K = 200: a short second group); the router on a world of one, fused
    and plain (its NCCL all-to-all over a group of one is the identity), against fp8_linear_tiles."""
    from tests.kernels.test_ulysses import check_qkv, qkv_world

    gen = torch.Generator().manual_seed(12)
    scheme = SCHEMES["block128"]
    ranks = []
    for _ in range(2):
        w = _row_shard(2 * 40, 200, scheme, gen)
        ranks.append((w, *_quantized(_activations(5, 200, gen, torch.float32), w, scheme, torch.float16)))
    world = qkv_world(2, 5, 40, torch.float16)
    recvs = qkv_all_to_all_emulated(world, [r[1] for r in ranks], [r[0].q for r in ranks], fp8=[r[2] for r in ranks])
    check_qkv(world, [r[3] for r in ranks], [r[4] for r in ranks], recvs, dtype=torch.float16)

    w = _row_shard(48, 72, SCHEMES["channel"], gen)
    x = _activations(7, 72, gen, torch.float16)
    want = fp8_linear_tiles(x, w.q, w.scale, w.tile, w.tile[1])
    one = EmulatedWorld(1, qkv_workspace_bytes(7, 48, 1, torch.float16))
    got = qkv_all_to_all(x, w.q, one[0], options=UlyssesOptions(path="fused"), w_scale=w.scale, w_tile=w.tile)
    assert got.dtype == torch.float16
    assert_close(got, want, dtype=torch.float16, name="fused")
    with pytest.raises(ValueError, match="needs 2-D x and w and both w_scale and w_tile"):
        qkv_all_to_all(x, w.q, one[0], options=UlyssesOptions(path="fused"))


# ------------------------------------------------------------------------------ all-to-all + o-projection


def _o_world_fp8(W, m, c, n, scheme, out_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    ranks = []
    for _ in range(W):
        w = _column_shard(n, W * c, scheme, gen)
        attn = _activations(W * m, c, gen, torch.float32)
        group = min(w.tile[1], c)
        qa, sa = fp8_quantize(attn, group)
        ref_q, ref_s = quantize_activation(attn, scheme)  # per row of one peer's c columns, or per group
        assert torch.equal(qa.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(sa, ref_s)
        ranks.append((w, qa, FP8Operands(sa, w.scale, w.tile, group, out_dtype),
                      dequantize(ref_q, ref_s, (1, group), torch.float64), w.dequantize(torch.float64)))
    return ranks


@pytest.mark.parametrize(("W", "out_dtype", "m", "c", "schedule"), [
    (2, torch.float16, 5, 40, "phased"),
    (4, torch.float32, 3, 64, "staggered"),
], ids=str)
@pytest.mark.parametrize("scheme", ["tensor", "channel", "block16x32"])
def test_all_to_all_o_proj_fp8_is_the_exchanged_reference(W, out_dtype, m, c, schedule, scheme):
    """e4m3 rows pushed with their activation scales (per token of each peer's C columns, or per 1 x 32
    group), the K loop scaled per step, against the reference's product of the exchanged rows."""
    from tests.kernels.test_ulysses import o_proj_reference

    if scheme == "block16x32" and c % 32:
        c = 64
    ranks = _o_world_fp8(W, m, c, 70, SCHEMES[scheme], out_dtype, seed=W * 10 + m + c)
    _, nbytes = o_proj_fp8_layout(m, c, W, ranks[0][2].x_group)
    outs = [poison_(torch.empty((m, 70), dtype=out_dtype)) for _ in ranks]
    all_to_all_o_proj_emulated(EmulatedWorld(W, nbytes), [r[1] for r in ranks], [r[0].q for r in ranks], outs=outs,
                               schedule=schedule, fp8=[r[2] for r in ranks])
    for r, (got, want) in enumerate(zip(outs, o_proj_reference([r[3] for r in ranks], [r[4] for r in ranks]),
                                        strict=True)):
        assert_close(got, want, dtype=out_dtype, name=f"rank {r} {scheme}")


def test_all_to_all_o_proj_fp8_router_and_refusals():
    """The router on a world of one, fused and plain (the plain all-to-all over a group of one is the identity):
    the same codes and scales either way; groups that cut a peer's columns are refused with their numbers."""
    from types import SimpleNamespace

    gen = torch.Generator().manual_seed(21)
    w = _column_shard(40, 64, SCHEMES["block16x32"], gen)
    attn = _activations(6, 64, gen, torch.float16)
    want = fp8_linear_tiles(attn, w.q, w.scale, w.tile, w.tile[1])
    one = EmulatedWorld(1, o_proj_fp8_layout(6, 64, 1, 32)[1])
    for path in ("fused", "plain"):
        got = all_to_all_o_proj(attn, w.q, one[0], SimpleNamespace(size=1, pg=None),
                                options=UlyssesOptions(path=path), w_scale=w.scale, w_tile=w.tile)
        assert got.dtype == torch.float16
        assert_close(got, want, dtype=torch.float16, name=path)
    ranks = _o_world_fp8(2, 3, 48, 40, SCHEMES["channel"], torch.float16, seed=2)
    bad = FP8Operands(ranks[0][2].x_scale, ranks[0][2].w_scale, ranks[0][2].w_tile, 32, torch.float16)
    with pytest.raises(ValueError, match=r"the activation group of 32 columns must divide C = 48"):
        all_to_all_o_proj_emulated(EmulatedWorld(2, 1 << 16), [r[1] for r in ranks], [r[0].q for r in ranks],
                                   fp8=[bad, bad])
    base = FP8Weight.quantize(torch.randn((40, 160), generator=gen), SCHEMES["block16x32"])
    cut = base.q.narrow(1, 16, 128)  # starts inside a 32-column block
    f8 = FP8Operands(torch.ones((6, 2)), base.scale.narrow(1, 0, 4), (16, 32), 32, torch.float16)
    with pytest.raises(ValueError, match=r"starts at column 16, inside a 32-column scale block"):
        all_to_all_o_proj_emulated(EmulatedWorld(2, 1 << 16), [attn.to(E4M3)[:6]] * 2, [cut] * 2, fp8=[f8, f8])


def test_scattered_o_proj_fp8_on_the_staged_rows():
    """scattered_o_proj with an e4m3 w_o on a world of one: the staged attention rows (padding rows zeroed)
    quantised once and multiplied on the scaled GEMM, against fp8_linear_tiles."""
    gen = torch.Generator().manual_seed(13)
    m, c, n = 6, 48, 40
    w = _column_shard(n, c, SCHEMES["block16x32"], gen)
    table = EmulatedWorld(1, o_proj_workspace_bytes(m, c, 1, torch.float16))[0]
    staged = o_scatter_target(table, m, c, torch.float16).local
    staged.copy_(_activations(m, c, gen, torch.float16))
    got = scattered_o_proj(w.q, table, tokens=m, num_tokens=m - 2, c=c, w_scale=w.scale, w_tile=w.tile,
                           dtype=torch.float16)
    rows = staged.clone()
    assert (rows[m - 2:] == 0).all()
    assert_close(got, fp8_linear_tiles(rows, w.q, w.scale, w.tile, w.tile[1]), dtype=torch.float16, name="o")
    with pytest.raises(ValueError, match="needs the staging's dtype"):
        scattered_o_proj(w.q, table, tokens=m, num_tokens=m, c=c, w_scale=w.scale, w_tile=w.tile)


# ------------------------------------------------------------------------------ sm_90 builds

# (N, K) of one TP=4 rank of Llama-3-70B and Qwen3-32B: qkv, o, down
TP4_QKV = ((2560, 8192), (2560, 5120))
TP4_ROW_PARALLEL = ((8192, 2048), (8192, 7168), (5120, 2048), (5120, 6400))

_COMPILE = textwrap.dedent(
    """
    import dataclasses, json, sys
    import torch
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from fusedpar.kernels import gemm_all_reduce as gar, ulysses
    from fusedpar.kernels.fp8 import mm_block_k

    def build(fn, types, consts, opts):
        names = list(fn.arg_names)
        missing = [n for n in names if n not in consts and n not in types]
        assert not missing, f"{fn.__name__}: no type given for {missing}"
        sig = {n: "constexpr" if n in consts else types[n] for n in names}
        src = ASTSource(fn, sig, constexprs={(names.index(n),): v for n, v in consts.items()})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
        ptx = k.asm["ptx"].splitlines()
        return {"shared": k.metadata.shared, "cubin_bytes": len(k.asm["cubin"]),
                "tma_loads": sum("cp.async.bulk.tensor" in line for line in ptx),
                "wgmma_e4m3": sum("wgmma" in line and "e4m3" in line for line in ptx)}

    scale_types = {"fp8_scales": ("*fp32", "*fp32") + ("i32",) * 7}  # the scale arguments' tuple
    spec = json.loads(sys.argv[1])
    out = {"gar": [], "qkv": [], "o": []}
    seen = set()
    for m, n, k in spec["row_parallel"]:
        for path in ("one_shot", "two_shot"):
            if path == "one_shot" and m > 64:
                continue
            cfg = gar.default_config(path, m, n, k, torch.bfloat16, torch.bfloat16, 132, interpret=False)
            for in_loop in (False, True):
                g = cfg.gemm
                bk = mm_block_k(k, 128, 128, g.block_k) if in_loop else g.block_k
                key = (path, g.block_m, g.block_n, bk, g.num_warps, g.num_stages, cfg.split_k, in_loop)
                if key in seen:
                    continue
                seen.add(key)
                types = {"a_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "out_ptr": "*bf16", "res_ptr": "*bf16",
                         "buffer_ptrs": "*i64", "signal_ptrs": "*i64", "counters_ptr": "*i64", **scale_types,
                         **{n_: "i32" for n_ in ("M", "N", "K", "stride_am", "stride_wn", "stride_om", "stride_rm",
                                                 "rank", "slot_bytes", "result_off", "own_cap")}}
                consts = {"stride_ak": 1, "stride_wk": 1, "stride_on": 1, "stride_rn": 1, "WORLD": 4, "WORLD_P2": 4,
                          "BLOCK_M": g.block_m, "BLOCK_N": g.block_n, "BLOCK_K": bk, "GROUP_M": g.group_m,
                          "NUM_SMS": 132, "EVEN_K": True, "INPUT_PRECISION": "tf32", "PARTIAL_FP32": False,
                          "COMM_ROWS": cfg.comm_rows, "SPLIT_K": cfg.split_k,
                          "SPLIT_WORLD_P2": triton.next_power_of_2(4 * cfg.split_k), "TWO_SHOT": path == "two_shot",
                          "DO_GEMM": True, "DO_REDUCE": True, "DO_COPY": path == "two_shot", "RETIRE": True,
                          "USE_FLAGS": True, "HAS_RESIDUAL": True, "SPIN_LIMIT": 1 << 25, "FP8": True,
                          "SCALE_IN_LOOP": in_loop}
                r = build(gar.kernels._gemm_all_reduce_kernel, types, consts,
                          {"num_warps": g.num_warps, "num_stages": g.num_stages})
                out["gar"].append(dict(r, key=key, block_m=g.block_m))
    for m, n, k in spec["qkv"]:
        cfg = ulysses.config.pick_qkv_fp8_config(m, n, k, n // 4, torch.bfloat16, 132, tma_ok=True)
        for in_loop in (False, True):
            bk = mm_block_k(k, 128, 128, cfg.block_k) if in_loop else cfg.block_k
            key = (repr(cfg), bk, in_loop)
            if key in seen:
                continue
            seen.add(key)
            types = {"x_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "buffer_ptrs": "*i64", "signal_ptrs": "*i64",
                     "counters_ptr": "*i64", "timeline_ptr": "*i64", **scale_types,
                     **{n_: "i32" for n_ in ("rank", "M", "BLK", "K", "stride_xm", "stride_wn")},
                     "x_desc": f"tensordesc<fp8e4nv[{cfg.block_m}, {bk}]>",
                     "w_desc": f"tensordesc<fp8e4nv[{cfg.block_n}, {bk}]>"}
            consts = {"stride_xk": 1, "stride_wk": 1, "w2_desc": None, "WORLD": 4, "WORLD_P2": 4,
                      "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": bk, "GROUP_M": cfg.group_m,
                      "NUM_SMS": 132, "EVEN_K": True, "INPUT_PRECISION": "tf32", "EPOCH_AHEAD": 1,
                      "SEND_READY": True, "PRODUCE": True, "WAIT": True, "USE_FLAGS": True, "SPIN_LIMIT": 1 << 25,
                      "TIMELINE": False, "TMA": cfg.tma, "FLATTEN": cfg.flatten, "BLOCK_N2": 0, "ROTATE": False,
                      "FP8": True, "SCALE_IN_LOOP": in_loop, "OUT_DTYPE": tl.bfloat16}
            if not cfg.tma:
                consts.update(x_desc=None, w_desc=None)
            r = build(ulysses.kernels._qkv_all_to_all_kernel, types, consts,
                      {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
            out["qkv"].append(dict(r, key=key, block_m=cfg.block_m, tma=cfg.tma))
    for m, n, k in spec["o"]:  # W = 4 peers of C = k / 4 columns
        c = k // 4
        shape = ulysses.config.o_launch_shape(m, n, c, 4, torch.bfloat16, torch.bfloat16, 64,
                                              ulysses.config.GPU_O_CONFIG, 132)
        g = shape.gemm
        key = ("o", g.block_m, g.block_n, g.block_k, g.num_warps, g.num_stages)
        if key in seen:
            continue
        seen.add(key)
        cfg = ulysses.config.GPU_O_CONFIG
        types = {"attn_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "out_ptr": "*bf16", "stage_ptr": "*fp8e4nv",
                 "buffer_ptrs": "*i64", "signal_ptrs": "*i64", "counters_ptr": "*i64", "stage_s_ptr": "*fp32",
                 **scale_types, **{n_: "i32" for n_ in ("rank", "M", "N", "C", "stride_am", "stride_wn", "stride_om",
                                                        "band_rows", "num_bands", "scale_off", "G")}}
        consts = {"stride_ak": 1, "stride_wk": 1, "stride_on": 1, "WORLD": 4, "WORLD_P2": 4, "BLOCK_M": g.block_m,
                  "BLOCK_N": g.block_n, "BLOCK_K": g.block_k, "GROUP_M": g.group_m, "EVEN_C": True,
                  "INPUT_PRECISION": "tf32", "COMM_PROGRAMS": cfg.comm_programs, "COPY_ROWS": cfg.copy_rows,
                  "COPY_COLS": cfg.copy_cols, "SEND_READY": True, "PUSH": True, "GEMM": True, "USE_FLAGS": True,
                  "SPIN_LIMIT": 1 << 25, "FP8": True, "G_P2": triton.next_power_of_2(c // 128)}
        r = build(ulysses.kernels._all_to_all_o_proj_kernel, types, consts,
                  {"num_warps": g.num_warps, "num_stages": g.num_stages})
        out["o"].append(dict(r, key=key, block_m=g.block_m))
    print(json.dumps(out))
    """
)


def _check_sm90_builds(spec, tmp_path, gar_builds: int, qkv_builds: int, o_builds: int) -> None:
    built = build_for_sm90(_COMPILE, spec, tmp_path, timeout=900)
    assert (len(built["gar"]), len(built["qkv"]), len(built["o"])) >= (gar_builds, qkv_builds, o_builds), built
    for b in built["gar"] + built["qkv"] + built["o"]:
        assert b["cubin_bytes"] > 10_000 and b["shared"] <= 227 * 1024, b
        if b["block_m"] >= 64:  # a warpgroup's tile: e4m3 wgmma
            assert b["wgmma_e4m3"] > 0, b
    for b in built["qkv"]:
        assert (b["tma_loads"] > 0) == b["tma"], b


def test_gpu_builds_for_sm90_within_shared_memory(tmp_path):
    """The FP8 variants of the fused GEMM + all-reduce (a one-shot decode and a two-shot prefill tiling of
    default_config), of the qkv GEMM + all-to-all (a decode and a TMA prefill tiling of pick_qkv_fp8_config)
    and of the all-to-all + o-projection (its prefill tiling), scales in the epilogue and per K step, build
    for sm_90 within Hopper's 227 KiB of shared memory (tiles of 64 rows and more multiplying on e4m3 wgmma;
    TMA loads where the tiling says so).
    Every tiling of the TP=4 rank shapes: test_gpu_builds_every_tiling_for_sm90 (deep profile)."""
    spec = {"row_parallel": [(32, 8192, 7168), (1024, 8192, 7168)], "qkv": [(1, 2560, 8192), (1024, 2560, 8192)],
            "o": [(1024, 8192, 2048)]}
    _check_sm90_builds(spec, tmp_path, 4, 4, 1)


@pytest.mark.deep
def test_gpu_builds_every_tiling_for_sm90(tmp_path):
    """Every tiling default_config (one-shot and two-shot, split-K included), pick_qkv_fp8_config and
    o_launch_shape give on the TP=4 rank shapes, as test_gpu_builds_for_sm90_within_shared_memory."""
    rows = (1, 2, 16, 32, 64, 128, 1024, 4096)
    spec = {"row_parallel": [(m, n, k) for m in rows for n, k in TP4_ROW_PARALLEL],
            "qkv": [(m, n, k) for m in rows for n, k in TP4_QKV],
            "o": [(m, n, k) for m in rows for n, k in TP4_ROW_PARALLEL if k == 2048]}
    _check_sm90_builds(spec, tmp_path, 6, 4, 2)


# ------------------------------------------------------------------------------ GPU (torchrun, any world size)


@pytest.fixture(scope="module")
def world(nccl_world):
    import torch.distributed as dist

    return dist.group.WORLD, nccl_world[1]


def _rank_gen(salt: int) -> torch.Generator:
    import torch.distributed as dist

    return torch.Generator().manual_seed(7919 * dist.get_rank() + salt)


def _gpu_shard(n: int, k: int, scheme: FP8Scheme, gen: torch.Generator, dim: int) -> FP8Weight:
    """A bf16-sized weight quantised on the GPU, as a TP shard view (rows or columns one block in)."""
    off = scheme.block[dim] if scheme.weight == "block" else 64
    shape = (n + off, k) if dim == 0 else (n, k + off)
    w = torch.randn(shape, generator=gen) / math.sqrt(k)
    return FP8Weight.quantize(w.cuda(), scheme).narrow(dim, off, n if dim == 0 else k)


GPU_SCHEMES = ["channel", "tensor", "block128"]


def _gpu_activations(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 rows of different magnitudes on the GPU."""
    return (torch.randn((rows, cols), generator=gen) * torch.exp(torch.randn(rows, 1, generator=gen))).cuda().bfloat16()


def _gpu_compare(errors: list[str], got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    """Collect, not raise: every rank must reach the final all_ranks_ok together."""
    try:
        assert not got.isnan().any(), f"{name}: NaN in the output"
        assert_close(got, want, dtype=torch.bfloat16, name=name)
    except AssertionError as e:
        errors.append(str(e))


def _gpu_assert_ok(errors: list[str], ws) -> None:
    from fusedpar.testing.gpu import all_ranks_ok

    if ws.table.status() != 0:
        errors.append("a flag wait timed out")
    assert all_ranks_ok(not errors), "\n".join(errors)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", GPU_SCHEMES)
@pytest.mark.parametrize(("n", "k"), TP4_ROW_PARALLEL)
def test_gpu_gemm_all_reduce_fp8_tp4_shapes(world, n, k, scheme):
    """The o and down GEMMs of one TP=4 rank of Llama-3-70B / Qwen3-32B (column shard views) through the
    fused one-shot (decode rows) and two-shot (prefill rows) paths in bf16, against the sum over the group of
    the reference's fp8_linear_tiles."""
    import torch.distributed as dist

    from fusedpar.collectives.symmetric import SymmetricWorkspace
    from fusedpar.kernels.gemm_all_reduce import required_workspace

    group, size = world
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    cases = [("one_shot", 1), ("one_shot", 16), ("two_shot", 300), ("two_shot", 2048)]
    need = [required_workspace(p, m, n, k, torch.bfloat16, size, num_sms=num_sms) for p, m in cases]
    ws = SymmetricWorkspace(group, max(b for b, _ in need), max_blocks=max(f for _, f in need))
    errors = []
    for path, m in cases:
        gen = _rank_gen(m + n + k)
        w = _gpu_shard(n, k, SCHEMES[scheme], gen, dim=1)
        x = _gpu_activations(m, k, gen)
        got = gemm_all_reduce(x, w.q, group, ws, options=GemmAllReduceOptions(path=path), w_scale=w.scale,
                              w_tile=w.tile)
        want = fp8_linear_tiles(x.float(), w.q, w.scale, w.tile, w.tile[1])
        dist.all_reduce(want, group=group)
        _gpu_compare(errors, got, want, f"{path} m={m} [{n}, {k}] {scheme}")
    _gpu_assert_ok(errors, ws)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", GPU_SCHEMES)
@pytest.mark.parametrize(("n", "k"), TP4_QKV)
def test_gpu_qkv_all_to_all_fp8_tp4_shapes(world, n, k, scheme):
    """The qkv GEMM of one TP=4 rank of Llama-3-70B / Qwen3-32B (a row shard view) through the fused
    qkv + all-to-all at decode and prefill row counts, against the reference's fp8_linear_tiles exchanged
    by the plain all-to-all."""
    from types import SimpleNamespace

    from fusedpar.collectives.comm import seq_to_head_all_to_all
    from fusedpar.collectives.symmetric import SymmetricWorkspace

    group, size = world
    rows = (1, 16, 300, 2048)
    ws = SymmetricWorkspace(group, qkv_workspace_bytes(max(rows), n // size, size, torch.bfloat16))
    comm_group = SimpleNamespace(size=size, pg=group) if size > 1 else None
    errors = []
    for m in rows:
        gen = _rank_gen(m + n + k)
        w = _gpu_shard(n - n % size, k, SCHEMES[scheme], gen, dim=0)
        x = _gpu_activations(m, k, gen)
        ws.table.buffer.fill_(0xFF)
        torch.cuda.synchronize()
        got = qkv_all_to_all(x, w.q, ws, options=UlyssesOptions(path="fused"), w_scale=w.scale, w_tile=w.tile)
        torch.cuda.synchronize()
        want = fp8_linear_tiles(x.float(), w.q, w.scale, w.tile, w.tile[1])
        if comm_group is not None:
            want = seq_to_head_all_to_all(want, comm_group)
        _gpu_compare(errors, got, want, f"qkv m={m} [{n}, {k}] {scheme}")
    _gpu_assert_ok(errors, ws)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", GPU_SCHEMES)
@pytest.mark.parametrize(("n", "k"), [nk for nk in TP4_ROW_PARALLEL if nk[1] == 2048])
def test_gpu_all_to_all_o_proj_fp8_tp4_shapes(world, n, k, scheme):
    """The o GEMM of one TP=4 rank of Llama-3-70B / Qwen3-32B (a column shard view) through the fused
    all-to-all + o-projection at decode and prefill row counts, against the plain path (the exchange, then
    the reference's fp8_linear_tiles with the same activation groups)."""
    from types import SimpleNamespace

    from fusedpar.collectives.comm import head_to_seq_all_to_all
    from fusedpar.collectives.symmetric import SymmetricWorkspace

    group, size = world
    c = k // size
    rows = (1, 16, 300, 2048)
    ws = SymmetricWorkspace(group, o_proj_workspace_bytes(max(rows), c, size, torch.bfloat16))
    comm_group = SimpleNamespace(size=size, pg=group)
    errors = []
    for m in rows:
        gen = _rank_gen(m + n + k)
        w = _gpu_shard(n, k, SCHEMES[scheme], gen, dim=1)
        attn = _gpu_activations(size * m, c, gen)
        got = all_to_all_o_proj(attn, w.q, ws, options=UlyssesOptions(path="fused"), w_scale=w.scale, w_tile=w.tile)
        torch.cuda.synchronize()
        exchanged = head_to_seq_all_to_all(attn, comm_group) if size > 1 else attn
        want = fp8_linear_tiles(exchanged.float(), w.q, w.scale, w.tile, min(w.tile[1], c))
        _gpu_compare(errors, got, want, f"o m={m} [{n}, {k}] {scheme}")
    _gpu_assert_ok(errors, ws)
