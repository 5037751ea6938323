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
