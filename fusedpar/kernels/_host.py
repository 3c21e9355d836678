"""Integer helpers for the launchers' host code.

triton.cdiv and triton.next_power_of_2 are Triton constexpr functions: called from host code
they go through Triton's constexpr unwrapping, ~2 us per call on the lent GPU hosts' CPUs, and
an eager decode step makes a dozen such calls per layer. These are the plain-int versions.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, b > 0."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1): tl.arange needs power-of-two lengths."""
    return 1 << max(0, n - 1).bit_length()
