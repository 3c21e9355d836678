"""The plain-PyTorch reference of FP8 (e4m3) linear layers, in the scale schemes checkpoints use.

A scale is the dequantisation multiplier: value ~= fp8 value * scale (what vLLM calls weight_scale, and
the fine-grained checkpoints store as weight_scale_inv). Schemes (FP8Scheme.weight):
  "tensor"   one weight scale;                         activations: one dynamic scale per token
  "channel"  one weight scale per output row [N, 1];   activations: one dynamic scale per token
  "block"    one weight scale per block_out x block_in tile [ceil(N / bo), ceil(K / bi)] (a short last
             tile where the size is not a multiple); activations: one dynamic scale per token and group
             of block_in input columns [M, ceil(K / bi)]
Quantising divides by the scale amax / E4M3_MAX of its tile (so the tile's largest magnitude maps to
+-448), clamps and rounds to nearest (torch's cast). fp8_linear dequantises both operands and
multiplies in fp32 (float64 inputs stay float64, for the tests' oracles).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)
_MIN_AMAX = 1e-12  # an all-zero tile gets a tiny scale instead of a division by zero (its values stay 0)
WEIGHT_SCHEMES = ("tensor", "channel", "block")


@dataclass(frozen=True)
class FP8Scheme:
    weight: str = "channel"
    block: tuple[int, int] = (128, 128)  # (block_out, block_in) of the "block" scheme

    def __post_init__(self):
        problems = []
        if self.weight not in WEIGHT_SCHEMES:
            problems.append(f"weight scheme {self.weight!r} is not one of {WEIGHT_SCHEMES}")
        if (len(self.block) != 2 or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in self.block)):
            problems.append(f"block {self.block!r} must be two ints >= 1 (block_out, block_in)")
        if problems:
            raise ValueError("FP8Scheme: " + "; ".join(problems))

    def weight_tile(self, shape: tuple[int, int]) -> tuple[int, int]:
        """The tile one weight scale covers, for a weight of `shape` [N, K]."""
        n, k = shape
        return {"tensor": (n, k), "channel": (1, k), "block": self.block}[self.weight]

    def activation_tile(self, k: int) -> int:
        """Input columns one activation scale covers, per token."""
        return self.block[1] if self.weight == "block" else k


def _compute(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _tile_amax(x: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """max |x| per tile of x [R, C] -> [ceil(R / tr), ceil(C / tc)] (short last tiles included)."""
    r, c = x.shape
    tr, tc = tile
    gr, gc = -(-r // tr), -(-c // tc)
    padded = x.new_zeros((gr * tr, gc * tc))
    padded[:r, :c] = x.abs()
    return padded.view(gr, tr, gc, tc).amax(dim=(1, 3))


def _expand(scale: torch.Tensor, tile: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """Per-tile scales [gr, gc] -> one per element of `shape`."""
    return scale.repeat_interleave(tile[0], dim=0).repeat_interleave(tile[1], dim=1)[: shape[0], : shape[1]]


def _quantize(x: torch.Tensor, tile: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() != 2 or min(x.shape) < 1:
        raise ValueError(f"FP8 quantisation takes a non-empty 2-D tensor, got shape {tuple(x.shape)}")
    xc = x.to(_compute(x.dtype))
    scale = _tile_amax(xc, tile).clamp_min(_MIN_AMAX) / E4M3_MAX
    q = (xc / _expand(scale, tile, xc.shape)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale.float()


def quantize_weight(w: torch.Tensor, scheme: FP8Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], fp32 scales: [1, 1] / [N, 1] / [ceil(N / bo), ceil(K / bi)])."""
    if w.dim() != 2:
        raise ValueError(f"FP8 weights are 2-D [out, in], got shape {tuple(w.shape)}")
    return _quantize(w, scheme.weight_tile(tuple(w.shape)))


def quantize_activation(x: torch.Tensor, scheme: FP8Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 dynamic scales [M, 1] or [M, ceil(K / bi)] for "block")."""
    if x.dim() != 2:
        raise ValueError(f"FP8 activations are 2-D [tokens, in], got shape {tuple(x.shape)}")
    return _quantize(x, (1, scheme.activation_tile(x.shape[1])))


def dequantize(q: torch.Tensor, scale: torch.Tensor, tile: tuple[int, int],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """e4m3 q [R, C] and its per-tile scales -> q * scale in `dtype`."""
    want = (-(-q.shape[0] // tile[0]), -(-q.shape[1] // tile[1]))
    if q.dim() != 2 or tuple(scale.shape) != want:
        raise ValueError(f"dequantize: scales {tuple(scale.shape)} do not match {want} tiles of {tile} over "
                         f"{tuple(q.shape)}")
    return q.to(dtype) * _expand(scale.to(dtype), tile, tuple(q.shape))


def fp8_linear(x: torch.Tensor, qw: torch.Tensor, w_scale: torch.Tensor, scheme: FP8Scheme,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ (qw * w_scale)^T (+ bias) with x quantised per token (group) as the scheme says,
    both operands dequantised and multiplied in fp32 (float64 for float64 x); the result in x.dtype."""
    if qw.dim() != 2:
        raise ValueError(f"fp8_linear: x {tuple(x.shape)} and weight {tuple(qw.shape)} need [M, K] and [N, K]")
    return fp8_linear_tiles(x, qw, w_scale, scheme.weight_tile(tuple(qw.shape)), scheme.activation_tile(qw.shape[1]),
                            bias)


def fp8_linear_tiles(x: torch.Tensor, qw: torch.Tensor, w_scale: torch.Tensor, w_tile: tuple[int, int],
                     x_group: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp8_linear with the weight's scale tile and the activations' group (input columns per dynamic
    scale and token) given directly: x [..., K] -> [..., N]."""
    if x.dim() < 1 or qw.dim() != 2 or x.shape[-1] != qw.shape[1]:
        raise ValueError(f"fp8_linear: x {tuple(x.shape)} and weight {tuple(qw.shape)} need [M, K] and [N, K]")
    cd = _compute(x.dtype)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] == 0:
        y = x2.new_zeros((0, qw.shape[0]), dtype=cd)
    else:
        qx, x_scale = _quantize(x2, (1, x_group))
        y = dequantize(qx, x_scale, (1, x_group), cd) @ dequantize(qw, w_scale, w_tile, cd).T
    if bias is not None:
        y = y + bias.to(cd)
    return y.to(x.dtype).reshape(*x.shape[:-1], qw.shape[0])
