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


def test_request_rows_choose_as_the_sampler():
    """A request job's rows (batch/rows.py) take greedy rows' tokens from one call over the batch; they agree with
    each row's own Sampler (the path a sampled row takes) and with the teacher-forced scorer's greedy choice, on
    equal maxima across spans and in the short last span. Sampled rows keep their seeded samplers' draws."""
    from flexh2o.batch.rows import RowSampler
    from flexh2o.batch.stopping import StopRule
    from flexh2o.requests import Request
    from flexh2o.sampling import TeacherForcer

    vocab = 50272  # opt's: 98 spans and a short last one
    x = torch.randn(5, vocab, generator=torch.Generator().manual_seed(1))
    x[0, 3] = x[0, vocab - 2] = 9.0  # equal maxima in two spans
    x[1, -1] = 9.0  # the maximum in the short last span
    x[2, 700] = x[2, 701] = 9.0  # equal maxima in one span
    temps = [0.0, 0.0, 0.0, 0.7, 0.0]
    reqs = [Request(id=str(i), prompt_ids=(1,), max_new_tokens=4, temperature=t, seed=i) for i, t in enumerate(temps)]
    got = RowSampler(reqs, StopRule(), lambda result: None)(x, 0, slice(0, 5))
    want = [int(Sampler(t, seed=i)(x[i:i + 1])[0]) for i, t in enumerate(temps)]
    assert got.tolist() == want and want[:3] == [3, vocab - 1, 700]
    forced = TeacherForcer(got[:, None])
    forced(x)
    assert torch.equal(forced.correct[:, 0], got == x.argmax(-1)) and bool(forced.correct[[0, 1, 2, 4], 0].all())
