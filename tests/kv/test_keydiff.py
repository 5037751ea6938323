"""mean_keydiff's two pieces on hand-made rows: the ranks among held slots (ties to the older, empty slots last) and
the key's distinctness (minus its cosine to the held keys' mean, empty slots out of the mean). Its decisions against
the reference: tests/kv/test_policies.py and tests/kv/test_kv_equivalence.py."""
from __future__ import annotations

import math

import pytest
import torch

from flexh2o.kv.policies import POLICIES, Budget
from flexh2o.kv.policies.base import Observed
from flexh2o.kv.policies.mean_keydiff import held_ranks, key_distinctness


def test_ranks_put_ties_older_first_and_empty_slots_last():
    pos = torch.tensor([[[3, 0, -1, 1, 2]]])
    x = torch.tensor([[[0.5, 0.5, -9.0, 0.1, 0.5]]])  # the empty slot's value is never read
    (rank,) = held_ranks(pos, x)
    assert rank.tolist() == [[[3.0, 1.0, 4.0, 0.0, 2.0]]]


def test_distinctness_is_minus_the_cosine_to_the_held_mean():
    pos = torch.tensor([[[0, 1, 2, 3, -1]]])
    k = torch.tensor([[[[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 0.0], [50.0, -50.0]]]])  # the last slot is empty
    got = key_distinctness(k, pos)[0, 0]
    mean = (0.5, 0.25)  # of the four held keys
    norm = math.hypot(*mean)
    assert got[:4].tolist() == pytest.approx([-mean[0] / norm, -mean[1] / norm, -mean[0] / norm, 0.0], abs=1e-6)


def test_priority_sums_the_ranks_with_the_weight():
    pos = torch.tensor([[[0, 1, 2]]])
    score = torch.tensor([[[3.0, 1.0, 0.5]]])  # means 1.0, 0.5, 0.5 at position 2: ranks 2, 0, 1
    k = torch.tensor([[[[1.0, 0.0], [0.9, 0.1], [0.0, 1.0]]]])  # cosines to the mean .865, .915, .501: ranks 1, 0, 2
    policy = POLICIES["mean_keydiff"](Budget(1, 1), keydiff_weight=0.5)
    prio = policy.scored(pos, score, 0, torch.tensor([2]), Observed(k))
    assert prio.tolist() == [[[2.5, 0.0, 2.0]]]
    with pytest.raises(ValueError, match="cached keys"):
        policy.priority(pos, score, 0, torch.tensor([2]), Observed())
