"""KV policies on their own (no model), by hand: the exact H2O rules, the budget edge (a prompt within the budget,
nothing to evict), budgets and construction (resolve_budget, make_policy), random's key and priority_is_score.
Every policy against the reference rules: tests/kv/test_policies.py."""
from __future__ import annotations

import pytest
import torch

from flexh2o.kv.policies import POLICIES, Budget
from flexh2o.kv.policies.base import Observed
from flexh2o.kv.spec import make_policy, resolve_budget
from flexh2o.kv.policies.random import random_key
from test_policies import BUDGETS, DIM, NAMES, SINKS, _policy


# ---- the exact H2O rules, by hand ---------------------------------------------------------------------------------
def _one_row(values: list) -> torch.Tensor:
    return torch.tensor(values).view(1, 1, -1)


def _values(pos: torch.Tensor) -> torch.Tensor:
    return torch.rand(*pos.shape, DIM)


def test_h2o_evicts_lowest_score_outside_recent_window():
    policy = make_policy("h2o", Budget(2, 2))
    pos = _one_row([0, 1, 2, 3, 4])
    score = _one_row([5.0, 1.0, 3.0, 0.5, 0.0])  # the window {3, 4} holds the two lowest scores
    evict = policy.decode_evict(pos, score, 0, torch.tensor([4]))
    assert pos[evict].tolist() == [1]


def test_h2o_ties_evict_the_older_position():
    policy = make_policy("h2o", Budget(2, 1))
    pos = _one_row([3, 0, 2, 1])  # slots are unordered
    score = _one_row([1.0, 2.0, 1.0, 1.0])
    evict = policy.decode_evict(pos, score, 0, torch.tensor([3]))
    assert pos[evict].tolist() == [1]


def test_h2o_prefill_ties_keep_the_newer_position():
    policy = make_policy("h2o", Budget(2, 2))
    pos = _one_row([-1, 0, 1, 2, 3, 4, 5])
    score = _one_row([9.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0])  # padding scores highest: must still not be kept
    keep = policy.prefill_keep(pos, score, 0, torch.tensor([5]))
    assert pos[keep].tolist() == [2, 3, 4, 5]


def test_prompt_within_budget_keeps_everything_but_padding():
    pos = _one_row([-1, -1, 0, 1, 2])
    for name in NAMES:
        keep = _policy(name).prefill_keep(pos, torch.rand(pos.shape), 0, torch.tensor([2]),
                                          obs=Observed(_values(pos), _values(pos)))
        assert pos[keep].tolist() == [0, 1, 2], name


def test_nothing_evicted_within_budget():
    pos = _one_row([0, 1, 2, -1, -1, -1])
    for name in NAMES:
        evict = _policy(name).decode_evict(pos, torch.rand(pos.shape), 0, torch.tensor([2]),
                                           obs=Observed(_values(pos), _values(pos)))
        assert evict is None or not evict.any(), name


# ---- budgets and construction -------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, want", [
    (("h2o", 512, 0.2), Budget(102, 102)),
    (("h2o", 512, 0.2, 0.1), Budget(102, 51)),
    (("random", 100, 0.1), Budget(10, 10)),
    (("local", 512, 0.2), Budget(0, 204)),
    (("streaming", 512, 0.2), Budget(0, 204)),
    (("h2o", 512, None, None, 9), Budget(4, 5)),
    (("random", 512, None, None, 8), Budget(4, 4)),
    (("local", 512, None, None, 9), Budget(0, 9)),
    (("streaming", 512, None, None, 9), Budget(0, 9)),
    (("full", 512, 0.2), None),
    (("h2o", 512), None),
])
def test_resolve_budget(args, want):
    assert resolve_budget(*args) == want


@pytest.mark.parametrize("bad", [dict(policy="h2o", prompt_len=10, kv_budget=0),
                                 dict(policy="h2o", prompt_len=10, hh_ratio=0.01)])
def test_resolve_budget_rejects_empty(bad):
    with pytest.raises(ValueError):
        resolve_budget(**bad)


def test_make_policy_validates():
    assert set(POLICIES) == set(NAMES)
    for name in NAMES:
        assert make_policy(name, BUDGETS[name], SINKS).name == name
    with pytest.raises(ValueError, match="unknown"):
        make_policy("lru", Budget(1, 1))
    with pytest.raises(ValueError, match="budget"):
        make_policy("h2o", None)
    with pytest.raises(ValueError, match="sinks"):
        make_policy("streaming", Budget(0, 4), num_sinks=4)
    with pytest.raises(ValueError):
        Budget(0, 0)


def test_random_key_is_a_pure_function_of_seed_layer_head_position():
    pos = torch.arange(40).view(1, 1, 40).expand(3, 4, 40)  # (b, kv, s)
    key = random_key(7, 2, pos)
    assert ((key >= 0) & (key < 1)).all()
    assert torch.equal(key[0], key[2])  # the same for every sequence of the batch
    assert not torch.equal(key[0, 0], key[0, 1])  # a fresh draw per KV head
    shuffled = pos[..., torch.randperm(40)]
    assert torch.equal(random_key(7, 2, shuffled), key.gather(-1, shuffled))  # independent of the slot
    assert not torch.equal(random_key(8, 2, pos), key) and not torch.equal(random_key(7, 3, pos), key)


def test_priority_is_score_only_for_the_rules_that_return_the_score():
    """LanePolicy skips the priority of the classes marked priority_is_score (their rows keep their score): the mark
    holds exactly where priority returns its score argument, and a subclass with a rule of its own loses it."""
    from flexh2o.kv.policies import POLICIES
    from flexh2o.kv.policies.base import Budget
    from flexh2o.kv.policies.h2o import H2OPolicy
    pos = torch.arange(6).view(1, 1, 6)
    score = torch.rand(1, 1, 6)
    v = torch.rand(1, 1, 6, 4)
    for name, cls in POLICIES.items():
        p = cls(Budget(2, 2), num_layers=2)
        if cls.priority_is_score:
            assert p.priority(pos, score, 0, torch.tensor([5]), Observed(values=v)) is score, name
    assert {n for n, c in POLICIES.items() if c.priority_is_score} == {"h2o", "tova", "a2sf", "h2o_sinks"}

    class Halved(H2OPolicy):
        def priority(self, pos, score, layer, cur_pos, v):
            return score / 2
    assert H2OPolicy.priority_is_score and not Halved.priority_is_score
