"""The FP8 reference (fusedpar.kernels.fp8.reference) against first principles: tile scales computed here
with Python loops, e4m3's rounding bound, exact values, and the linear layer in float64."""

from __future__ import annotations

import math

import pytest
import torch

from fusedpar.kernels.fp8 import E4M3, E4M3_MAX, FP8Scheme, dequantize, fp8_linear, quantize_activation, quantize_weight

SCHEMES = [FP8Scheme("tensor"), FP8Scheme("channel"), FP8Scheme("block", (128, 128)), FP8Scheme("block", (16, 32))]
IDS = ["tensor", "channel", "block128", "block16x32"]
SHAPES = [(1, 1), (7, 13), (200, 300), (256, 128)]


def loop_scales(w: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """max |w| / 448 per tile, tile by tile."""
    n, k = w.shape
    rows = []
    for i in range(0, n, tile[0]):
        rows.append([max(float(w[i:i + tile[0], j:j + tile[1]].abs().max()), 1e-12) / E4M3_MAX
                     for j in range(0, k, tile[1])])
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scheme", SCHEMES, ids=IDS)
def test_weight_scales_are_the_tiles_amax_over_448(scheme, shape):
    w = torch.randn(shape, dtype=torch.float64) * torch.rand(shape[0], 1, dtype=torch.float64) * 10
    q, scale = quantize_weight(w, scheme)
    tile = scheme.weight_tile(shape)
    assert q.dtype == E4M3 and q.shape == w.shape and scale.dtype == torch.float32
    want = loop_scales(w, tile)
    assert scale.shape == want.shape == (math.ceil(shape[0] / tile[0]), math.ceil(shape[1] / tile[1]))
    torch.testing.assert_close(scale.double(), want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scheme", SCHEMES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_within_e4m3_rounding(scheme, shape, dtype):
    w = (torch.randn(shape) * 3).to(dtype)
    q, scale = quantize_weight(w, scheme)
    tile = scheme.weight_tile(shape)
    back = dequantize(q, scale, tile, torch.float64)
    s = dequantize(torch.ones(shape, dtype=E4M3), scale, tile, torch.float64)  # each element's scale
    wd = w.double()
    # 3 mantissa bits: half a step is 2^-4 of the value for normals; subnormal steps are 2^-9 * scale
    bound = wd.abs() * 2.0**-4 + s * 2.0**-9 + wd.abs() * 1e-6  # (+ the fp32 division's rounding)
    assert ((back - wd).abs() <= bound).all(), float(((back - wd).abs() - bound).max())
    # every tile's largest magnitude maps to exactly +-448
    tiles_max = dequantize(q.to(torch.float64).abs().to(E4M3), torch.ones_like(scale), tile, torch.float64)
    for i in range(0, shape[0], tile[0]):
        for j in range(0, shape[1], tile[1]):
            blk = tiles_max[i:i + tile[0], j:j + tile[1]]
            if float(w[i:i + tile[0], j:j + tile[1]].abs().max()) > 0:
                assert float(blk.max()) == E4M3_MAX


def test_representable_values_are_exact_and_zero_tiles_stay_zero():
    scheme = FP8Scheme("block", (2, 2))
    w = torch.tensor([[448.0, -0.5, 0.0, 0.0], [3.5, 2.0**-6, 0.0, 0.0]], dtype=torch.float64) * 2.0**-3
    q, scale = quantize_weight(w, scheme)
    assert scale[0, 0].item() == 2.0**-3 and scale[0, 1].item() == torch.tensor(1e-12 / E4M3_MAX).item()
    back = dequantize(q, scale, (2, 2), torch.float64)
    assert torch.equal(back, w) and not back.isnan().any()


def test_one_tile_scaled_changes_only_its_own_scale():
    scheme = FP8Scheme("block", (4, 8))
    w = torch.randn(12, 24)
    _, s0 = quantize_weight(w, scheme)
    w2 = w.clone()
    w2[4:8, 8:16] *= 1000
    _, s1 = quantize_weight(w2, scheme)
    changed = (s0 != s1).nonzero().tolist()
    assert changed == [[1, 1]]


@pytest.mark.parametrize("scheme", SCHEMES, ids=IDS)
def test_activations_are_scaled_per_token_or_token_group(scheme):
    x = torch.randn(5, 300, dtype=torch.float64)
    x[2] *= 100  # one loud token does not change the others' scales
    q, scale = quantize_activation(x, scheme)
    group = scheme.block[1] if scheme.weight == "block" else 300
    assert q.dtype == E4M3 and q.shape == x.shape
    torch.testing.assert_close(scale.double(), loop_scales(x, (1, group)), rtol=1e-6, atol=0)


@pytest.mark.parametrize("scheme", SCHEMES, ids=IDS)
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (3, 17, 33), (9, 130, 300)])
def test_linear_is_the_dequantised_operands_product(scheme, m, n, k):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=gen, dtype=torch.float64)
    x = torch.randn(m, k, generator=gen, dtype=torch.float64)
    bias = torch.randn(n, generator=gen, dtype=torch.float64)
    qw, sw = quantize_weight(w, scheme)
    y = fp8_linear(x, qw, sw, scheme, bias)
    qx, sx = quantize_activation(x, scheme)
    # first principles: element products summed in float64, tile by tile
    xd = qx.double() * sx.double().repeat_interleave(scheme.activation_tile(k), 1)[:, :k]
    tile = scheme.weight_tile((n, k))
    wd = qw.double() * sw.double().repeat_interleave(tile[0], 0).repeat_interleave(tile[1], 1)[:n, :k]
    want = torch.einsum("mk,nk->mn", xd, wd) + bias
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    # and close to the unquantised layer: e4m3 on both operands, errors averaging over k
    exact = x @ w.T + bias
    assert (y - exact).abs().max() <= 0.15 * math.sqrt(k) * 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_linear_returns_the_input_dtype(dtype):
    scheme = FP8Scheme("block", (16, 16))
    qw, sw = quantize_weight(torch.randn(32, 48), scheme)
    x = torch.randn(4, 48).to(dtype)
    y = fp8_linear(x, qw, sw, scheme)
    assert y.dtype == dtype and y.shape == (4, 32)
    want = fp8_linear(x.float(), qw, sw, scheme)
    torch.testing.assert_close(y.float(), want, rtol=1e-2, atol=1e-2)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match=r"weight scheme 'int8'.*block \(0, 128\)"):
        FP8Scheme("int8", (0, 128))
    with pytest.raises(ValueError, match="2-D"):
        quantize_weight(torch.randn(2, 3, 4), FP8Scheme())
    qw, sw = quantize_weight(torch.randn(8, 8), FP8Scheme("block", (4, 4)))
    with pytest.raises(ValueError, match=r"scales \(2, 2\) do not match \(1, 1\)"):
        dequantize(qw, sw, (8, 8))
    with pytest.raises(ValueError, match=r"x \(2, 7\) and weight \(8, 8\)"):
        fp8_linear(torch.randn(2, 7), qw, sw, FP8Scheme("block", (4, 4)))
