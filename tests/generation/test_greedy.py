"""The sampler's greedy choice (sampling.greedy) is torch's argmax, the first of equal maxima, over spans of logits."""
from __future__ import annotations

import pytest
import torch

from flexh2o import sampling
from flexh2o.sampling import Sampler, greedy


@pytest.mark.parametrize("vocab", [100, 4 * sampling.SPAN, 4 * sampling.SPAN + 1, 50272])
def test_greedy_is_argmax(vocab):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=g)
    x[1, -1] = 9.0  # the maximum in the short last span
    x[2, 3] = x[2, vocab - 2] = 9.0  # equal maxima in two spans: the first
    x[3, 5] = x[3, 6] = 9.0  # equal maxima in one span
    x[4] = float("-inf")  # a row of -inf: index 0, as argmax (the sampler refuses it before)
    x[5, :vocab // 2] = float("-inf")
    assert torch.equal(greedy(x), x.argmax(-1))
    assert torch.equal(greedy(x[:, :vocab - 1]), x[:, :vocab - 1].argmax(-1))  # strided rows
    assert torch.equal(Sampler()(x[:4]), x[:4].argmax(-1))  # finite rows, through the sampler
    assert greedy(x[:0]).shape == (0,)
