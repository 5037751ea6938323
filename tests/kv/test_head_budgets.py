"""Per-head budgets (the adakv policy): the KV heads of a layer share heads x B tokens per sequence, each head keeping
its protected tokens and at most floor(head_cap x B). The engine's policy is driven as the cache drives it and every
decision is checked against the reference's greedy, set-based rules (tests/reference_policy.py: layer_prefill,
layer_evict); engine-vs-reference on every placement: tests/kv/test_kv_equivalence.py; lanes: tests/eval/test_eval_lanes.py."""
from __future__ import annotations

import pytest
import torch

from flexh2o.kv.policies import Budget
from flexh2o.kv.spec import KVSpec, make_policy
from reference_kv import History, RefPolicy
from test_validation import _fails, policy_flag_entries

KV, SINKS, BUDGET = 3, 2, Budget(6, 3)  # 9 per head on average, 5 of them protected (3 recent, 2 sinks)
LENS = [9, 4, 1, 7, 5, 12]  # left-padded prompts, shorter and longer than the budget
GEN = 16


def _tied(shape, gen) -> torch.Tensor:
    """Quarter-step probabilities: exact, so ties (across heads too) are frequent."""
    return torch.randint(0, 4, shape, generator=gen).float() / 4


class HeadSim:
    """The engine policy and the reference side by side on random attention; `check` compares the kept sets."""

    def __init__(self, cap: float, seed: int, layer: int = 1):
        self.policy = make_policy("adakv", BUDGET, SINKS, head_cap=cap)
        self.ref = RefPolicy("adakv", BUDGET.heavy, BUDGET.recent, SINKS, head_cap=cap)
        self.gen, self.layer = torch.Generator().manual_seed(seed), layer
        b, t = len(LENS), max(LENS)
        pos = torch.full((b, KV, t), -1, dtype=torch.long)
        for i, n in enumerate(LENS):
            pos[i, :, t - n:] = torch.arange(n)
        self.hist = [[History() for _ in range(KV)] for _ in range(b)]
        seen = (pos[..., :, None] >= pos[..., None, :]) & (pos[..., None, :] >= 0)  # (b, KV, query, key)
        probs = torch.where(seen, _tied((b, KV, t, t), self.gen), 0.0)
        for i, h, q, k in seen.nonzero().tolist():
            self.hist[i][h].seen(int(pos[i, h, q]), int(pos[i, h, k]), float(probs[i, h, q, k]))
        score = probs.sum(2)  # (b, KV, t): every prompt query counts (decay 1)
        self.cur = torch.tensor(LENS) - 1
        keep = self.policy.prefill_keep(pos, score, layer, self.cur)
        self.kept = [self.ref.layer_prefill(n, self.hist[i], layer) for i, n in enumerate(LENS)]
        self.slots = self.policy.slots(t, GEN)
        self.pos = torch.full((b, KV, self.slots), -1, dtype=torch.long)
        self.score = torch.zeros(b, KV, self.slots)
        for i in range(b):
            for h in range(KV):
                m = int(keep[i, h].sum())
                assert m <= self.slots, "more kept than slots"
                self.pos[i, h, :m], self.score[i, h, :m] = pos[i, h][keep[i, h]], score[i, h][keep[i, h]]
        self.check()

    def step(self) -> None:
        self.cur += 1
        for i in range(len(LENS)):
            for h in range(KV):
                free = (self.pos[i, h] < 0).nonzero()
                assert len(free), "no free slot for the new token"
                self.pos[i, h, free[0, 0]], self.score[i, h, free[0, 0]] = self.cur[i], 0.0
                self.kept[i][h].add(int(self.cur[i]))
        probs = torch.where(self.pos >= 0, _tied(self.pos.shape, self.gen), 0.0)
        for i, h, s in (self.pos >= 0).nonzero().tolist():
            self.hist[i][h].seen(int(self.cur[i]), int(self.pos[i, h, s]), float(probs[i, h, s]))
        self.policy.accumulate(self.score, probs)
        evict = self.policy.decode_evict(self.pos, self.score, self.layer, self.cur)
        assert not (evict & (self.pos < 0)).any(), "an empty slot marked for eviction"
        self.pos.masked_fill_(evict, -1)
        self.score.masked_fill_(evict, 0.0)
        for i in range(len(LENS)):
            self.ref.layer_evict(self.kept[i], int(self.cur[i]), self.hist[i], self.layer)
        self.check()

    def check(self) -> None:
        for i in range(len(LENS)):
            for h in range(KV):
                got = set(self.pos[i, h][self.pos[i, h] >= 0].tolist())
                assert got == self.kept[i][h], (i, h, sorted(got), sorted(self.kept[i][h]))

    def counts(self) -> torch.Tensor:
        return (self.pos >= 0).sum(-1)  # (b, KV)


@pytest.mark.parametrize("cap", [1.0, 1.3, 2.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decisions_match_reference(cap, seed):
    sim = HeadSim(cap, seed)
    limit = int(cap * BUDGET.total)
    uneven = False
    for _ in range(GEN - 1):
        sim.step()
        counts = sim.counts()
        assert (counts.sum(-1) <= KV * BUDGET.total).all() and (counts <= limit).all()
        uneven |= bool((counts.amax(-1) > counts.amin(-1)).any())
    assert uneven == (cap > 1.0), "heads share the layer's budget only when the cap lets them"
    assert sim.slots == limit + 1


def test_cap_one_is_a_per_head_budget():
    """head_cap 1: every head holds exactly B once B tokens were seen (mean_attn with sinks, per head)."""
    sim = HeadSim(1.0, 3)
    for _ in range(GEN - 1):
        sim.step()
    for i, n in enumerate(LENS):
        assert sim.counts()[i].tolist() == [min(BUDGET.total, n + GEN - 1)] * KV


def test_protected_tokens_stay():
    sim = HeadSim(2.0, 4)
    for _ in range(GEN - 1):
        sim.step()
        for i in range(len(LENS)):
            cur = int(sim.cur[i])
            must = set(range(min(SINKS, cur + 1))) | set(range(max(0, cur - BUDGET.recent + 1), cur + 1))
            assert all(must <= sim.kept[i][h] for h in range(KV))


def test_spec_slots_and_bad_cap():
    assert KVSpec("adakv", BUDGET, SINKS, head_cap=1.5).slots(12, 40) == 13 + 1
    with pytest.raises(ValueError, match="--head-cap"):
        KVSpec("adakv", BUDGET, SINKS, head_cap=0.5)


@pytest.mark.parametrize("main, argv, prog", policy_flag_entries("adakv", "recall"))
@pytest.mark.parametrize("cap", ["0.5", "inf", "nan"])
def test_bad_head_cap_is_one_line(main, argv, prog, cap, capsys):
    err = _fails(capsys, main, argv + ["--head-cap", cap], prog=prog)
    assert err.startswith(f"{prog}: error: --head-cap {cap}"), err
