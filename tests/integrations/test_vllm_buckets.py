"""Row buckets of the vLLM plugin's base-step graphs (pure Python: no vLLM needed)."""

from __future__ import annotations

import pytest

from fusedpar.integrations.vllm.base_runner import bucket_for, row_buckets


@pytest.mark.parametrize("lo,hi,step", [(897, 2048, 64), (1, 5, 64), (9, 32, 64), (3, 700, 7), (64, 64, 64)])
def test_every_row_count_gets_the_smallest_covering_bucket(lo, hi, step):
    buckets = row_buckets(lo, hi, step)
    assert buckets == tuple(sorted(set(buckets))) and buckets[-1] == hi
    assert all(b % step == 0 for b in buckets[:-1])
    for m in range(lo, hi + 1):
        b = bucket_for(m, buckets)
        assert m <= b and b - m < step  # less than one step of padding rows
        assert all(c < m for c in buckets if c < b)


def test_bad_ranges_and_oversized_steps_name_the_numbers():
    with pytest.raises(ValueError, match="min_rows=5, max_rows=4"):
        row_buckets(5, 4)
    with pytest.raises(ValueError, match="2049 rows per rank exceeds the largest bucket 2048"):
        bucket_for(2049, row_buckets(897, 2048))
