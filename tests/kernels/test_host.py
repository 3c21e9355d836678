"""The launchers' host-side integer helpers equal the Triton functions (or workspace rules) they replace."""

from __future__ import annotations

import triton
from hypothesis import given
from hypothesis import strategies as st

from fusedpar.collectives.symmetric import ALIGN_BYTES
from fusedpar.kernels._host import cdiv, next_pow2
from fusedpar.kernels._sync import align_up


@given(st.integers(0, 1 << 40), st.integers(1, 1 << 20))
def test_cdiv_matches_triton(a, b):
    assert cdiv(a, b) == triton.cdiv(a, b)


@given(st.integers(1, 1 << 40))
def test_next_pow2_matches_triton(n):
    assert next_pow2(n) == triton.next_power_of_2(n)


def test_next_pow2_small_values():
    # 0 and 1 both give 1: a tl.arange length is never 0 (triton.next_power_of_2(0) would be 0)
    assert [next_pow2(n) for n in (0, 1, 2, 3, 4, 5, 16, 17)] == [1, 1, 2, 4, 4, 8, 16, 32]


@given(st.integers(0, 1 << 40))
def test_align_up_is_the_next_multiple_of_the_workspace_alignment(n):
    got = align_up(n)
    assert got % ALIGN_BYTES == 0 and n <= got < n + ALIGN_BYTES
