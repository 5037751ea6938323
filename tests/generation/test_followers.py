"""generation/followers.py: lanes that have not evicted yet are not computed (the leader's rows stand in for them)
and are woken with the leader's cache rows when they first evict or are fed other tokens; the figures equal
separate runs of each lane."""
from __future__ import annotations

import pytest
import torch

from flexh2o.config import ModelConfig
from flexh2o.eval.common import EvalModel, _forced, forced_run, lanes_run, spec_of
from flexh2o.generation import followers
from flexh2o.generation.followers import Followers, follow_order
from flexh2o.kv.spec import KVSpec

CFG = ModelConfig("tiny-llama", "llama", hidden=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn=128, vocab=1000,
                  max_positions=256, tie_embeddings=False)
STEPS = 24
LANES = [("h2o", 40), ("a2sf", 12), ("tova", 10), ("pyramid", 16), ("full", None), ("merge", 14), ("adakv", 9),
         ("mean_vnorm", 20), ("streaming", 5)]

pytestmark = pytest.mark.usefixtures("one_thread")


def _model():
    return EvalModel("_DUMMY_", CFG, tokenizer=None, dtype=torch.float32, num_sinks=2, hh_decay=0.9,
                     pyramid_ratio=0.25, head_cap=1.5)


@pytest.fixture
def plans(monkeypatch):
    """Every step's (active rows, lanes woken) of the runs in the test."""
    seen = []
    advance = Followers.advance

    def spy(self, step, tokens, cur_pos):
        plan = advance(self, step, tokens, cur_pos)
        if not seen or seen[-1][0] != step:
            seen.append((step, self.policy.rows, plan[0], list(plan[1])))
        return plan
    monkeypatch.setattr(Followers, "advance", spy)
    return seen


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, 1000, (n,), generator=g).tolist() for n in (6, 8)]
    return prompts, torch.randint(4, 1000, (2, STEPS), generator=g)


def test_follow_order_puts_the_dormant_candidates_last():
    model = _model()
    policies = [spec_of(model, *lane).make(CFG.num_layers) for lane in LANES]
    order = follow_order(policies, CFG.num_layers)
    assert sorted(order) == list(range(len(LANES)))
    assert [LANES[i][0] for i in order[:3]] == ["a2sf", "tova", "full"]  # decay 0.9 and 0 cannot follow
    firsts = [followers.first_eviction(policies[i], CFG.num_layers) for i in order[3:]]
    assert firsts == sorted(firsts) and firsts[0] == 5 and firsts[-1] == 40


def test_followers_skip_rows_and_give_the_figures_of_separate_runs(data, plans):
    prompts, targets = data
    model = _model()
    together = lanes_run(model, LANES, prompts, targets)
    rows = 2 * len(LANES)
    assert any(active < rows for _, _, active, _ in plans), "some lanes must be dormant"
    assert plans[-1][2] < rows  # h2o at 40 tokens never evicts in 8 + 24: it stays dormant to the end
    assert sum(len(w) for *_, w in plans) >= 4  # lanes woke as they reached their budgets
    for (policy, tokens), (logprob, correct) in zip(LANES, together):
        alone = forced_run(model, policy, tokens, prompts, targets)
        torch.testing.assert_close(logprob, alone.logprob, atol=1e-6, rtol=0, msg=policy)
        assert torch.equal(correct, alone.correct), policy


def test_a_follower_fed_other_tokens_wakes_and_runs_as_alone(data, plans):
    """A lane whose tokens differ from the leader's (here: its targets change at step 7) wakes at that step."""
    prompts, targets = data
    model = _model()
    lanes = [("full", None), ("h2o", 40), ("mean_attn", 40)]
    specs = [spec_of(model, *lane) for lane in lanes]
    other = targets.clone()
    other[:, 7:] = torch.randint(4, 1000, (2, STEPS - 7), generator=torch.Generator().manual_seed(9))
    fed = torch.cat([targets, other, targets])
    got = _forced(model, KVSpec.of_lanes([(2, x) for x in specs]), prompts * 3, fed, None, 1, prefill_batch=6,
                  copies=3)
    woke = {step: w for step, _, _, w in plans if w}
    assert woke == {8: [1]}  # the token of step 7 is fed at step 8
    assert plans[-1][2] == 4  # mean_attn stays dormant
    for i, (policy, tokens) in enumerate(lanes):
        alone = forced_run(model, policy, tokens, prompts, fed[2 * i:2 * i + 2])
        torch.testing.assert_close(got.logprob[2 * i:2 * i + 2], alone.logprob, atol=1e-6, rtol=0, msg=policy)


def test_followers_of_a_leader_that_reads_no_scores_take_its_scores(data, plans):
    """Lanes whose only active row while they are dormant is the full cache's (it reads no scores): the leader
    still accumulates the attention its scoring followers take when they wake, so they give their separate figures
    (before, they woke with the prompt's scores alone and evicted by those)."""
    prompts, targets = data
    model = _model()
    lanes = [("full", None), ("mean_attn", 12), ("h2o", 16)]
    together = lanes_run(model, lanes, prompts, targets)
    assert any(active == 2 for _, _, active, _ in plans), "the full lane must run alone at some step"
    for (policy, tokens), (logprob, correct) in zip(lanes, together):
        alone = forced_run(model, policy, tokens, prompts, targets)
        torch.testing.assert_close(logprob, alone.logprob, atol=1e-6, rtol=0, msg=policy)
        assert torch.equal(correct, alone.correct), policy
