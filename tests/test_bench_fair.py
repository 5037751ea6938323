"""benchmarks/fair.py: Accelerate's largest completing batch is found by doubling then bisecting."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import fair  # noqa: E402


@pytest.mark.parametrize("largest", [0, 1, 2, 11, 64, 100])
def test_largest_completing_finds_the_boundary(largest):
    got, tries = fair.largest_completing(lambda b: b <= largest, limit=100)
    assert got == largest
    assert [b for b, _ in tries][:2] == ([1] if largest == 0 else [1, 2])
    assert len(tries) <= 2 * (largest.bit_length() + 1) + 1  # doubling, then bisection: logarithmic


def test_largest_completing_stops_at_the_limit():
    got, tries = fair.largest_completing(lambda b: True, limit=40)
    assert got == 40 and max(b for b, _ in tries) <= 40


def test_largest_completing_listed_batches_stop_at_the_first_failure():
    seen = []

    def completes(b):
        seen.append(b)
        return b <= 40
    got, tries = fair.largest_completing(completes, limit=100, batches=[64, 16, 32, 128])
    assert got == 32 and seen == [16, 32, 64] and tries == [(16, True), (32, True), (64, False)]
    assert fair.largest_completing(lambda b: False, limit=100, batches=[8])[0] == 0
    assert fair.largest_completing(lambda b: True, limit=50, batches=[8, 64])[0] == 8  # 64 is over the limit
