"""Numerical test helpers shared by kernel and layer tests.

- TOLERANCES / tolerance(dtype): default (atol, rtol) per output dtype.
- assert_close(actual, expected, *, dtype, name): elementwise |actual - expected| <= atol + rtol *
  |expected| in float64, with a message that names the worst element (index, values, error,
  allowance) and how many elements fail; NaN in `actual` always fails unless `expected` is NaN
  at the same place.
- poison_(t): fill an output buffer with NaN (or the integer maximum) before a kernel writes it,
  so elements the kernel forgot to write cannot pass by accident.

The defaults assume values of order 1 (scale test inputs so, e.g. weights by 1/sqrt(K)) and a
float64 reference: rtol is a few units of rounding of the output dtype, atol covers results
near zero that carry fp32-accumulation error. Pass atol/rtol to override for one check.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["TOLERANCES", "Tolerance", "assert_close", "poison_", "tolerance"]


class Tolerance(NamedTuple):
    atol: float
    rtol: float


TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(atol=1e-10, rtol=1e-8),
    torch.float32: Tolerance(atol=1e-5, rtol=1e-5),  # unit roundoff 6e-8; accumulation order
    torch.float16: Tolerance(atol=1e-3, rtol=2e-3),  # unit roundoff 4.9e-4
    torch.bfloat16: Tolerance(atol=1e-2, rtol=1.6e-2),  # unit roundoff 3.9e-3
}


def tolerance(dtype: torch.dtype) -> Tolerance:
    """Default tolerance for results stored in `dtype`."""
    try:
        return TOLERANCES[dtype]
    except KeyError:
        raise ValueError(f"no default tolerance for {dtype}; known: {sorted(map(str, TOLERANCES))}") from None


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    dtype: torch.dtype | None = None,
    name: str = "output",
    atol: float | None = None,
    rtol: float | None = None,
) -> None:
    """Raise AssertionError unless |actual - expected| <= atol + rtol * |expected| everywhere.

    dtype picks the default tolerance (default: actual.dtype); atol/rtol override it. Both
    tensors are compared in float64 on the CPU; shapes must match exactly (no broadcasting).
    """
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    tol = tolerance(dtype or actual.dtype)
    atol = tol.atol if atol is None else atol
    rtol = tol.rtol if rtol is None else rtol

    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    diff = (a - e).abs()
    allowed = atol + rtol * e.abs()
    # Equal values pass (covers matching infinities); NaN passes only against NaN.
    ok = (diff <= allowed) | (a == e) | (a.isnan() & e.isnan())
    if bool(ok.all()):
        return

    bad = ~ok
    # Rank failures by how far they exceed their allowance; NaN/inf errors rank first.
    excess = torch.where(bad, (diff - allowed).nan_to_num(nan=float("inf")), float("-inf"))
    flat = int(excess.argmax())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape)) if a.dim() else ()
    av, ev = a.reshape(-1)[flat].item(), e.reshape(-1)[flat].item()
    n_bad, n_nan = int(bad.sum()), int((a.isnan() & ~e.isnan()).sum())
    raise AssertionError(
        f"{name} ({dtype or actual.dtype}, shape {tuple(a.shape)}): {n_bad} of {a.numel()} elements "
        f"outside atol={atol:g} + rtol={rtol:g}*|expected| ({n_nan} NaN where a number was expected); "
        f"worst at index {idx}: actual={av!r}, expected={ev!r}, |diff|={abs(av - ev):.4g}, "
        f"allowed={atol + rtol * abs(ev):.4g}"
    )


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill t in place with NaN (floating/complex) or its dtype's maximum (integers); return t."""
    if t.is_floating_point() or t.is_complex():
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        raise TypeError("poison_: a bool tensor has no value that cannot occur; use a wider dtype")
    return t.fill_(torch.iinfo(t.dtype).max)
