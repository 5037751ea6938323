"""KV policies on their own (no model): every policy through one parametrized suite, checked against the plain
set-based rules of tests/reference_kv.py. Hand-made cases (the exact H2O rules, the budget edge, budgets and
construction): tests/kv/test_policies_rules.py."""
from __future__ import annotations

import pytest
import torch

from flexh2o.kv.policies import POLICIES, Budget
from flexh2o.kv.policies.base import Observed
from flexh2o.kv.spec import make_policy
from reference_kv import History, RefPolicy

KV = 2  # KV heads per block in these tests
SINKS = 2
BUDGETS = {"full": None, "h2o": Budget(3, 2), "random": Budget(3, 2), "local": Budget(0, 5),
           "streaming": Budget(0, 5), "tova": Budget(0, 5), "a2sf": Budget(3, 2), "mean_attn": Budget(3, 2),
           "vatp": Budget(3, 2), "h2o_sinks": Budget(3, 2), "mean_vnorm": Budget(3, 2),
           "pyramid": Budget(3, 2), "adakv": Budget(3, 2),
           "merge": Budget(3, 2), "mean_keydiff": Budget(3, 2)}
NAMES = sorted(BUDGETS)
PER_HEAD = [n for n in NAMES if not POLICIES[n].shares_heads]  # Sim checks each head alone: adakv has its own file
LENS = [9, 4, 1, 7, 5]  # unequal prompts, left-padded to 9: shorter, equal and longer than the budget of 5
GEN = 14
DIM = 2  # head_dim of the simulated values


DECAY = 0.5  # a2sf's forgetting factor here: powers of two keep the quarter-step scores exact
LAYERS, RATIO = 4, 0.25  # pyramid: 4 layers of budgets 6, 5, 5, 4 (heavy 3 + recent 2 on average)


def _policy(name, budget="default", seed=3):
    return make_policy(name, BUDGETS[name] if budget == "default" else budget, SINKS, seed, DECAY, LAYERS, RATIO)


def _ref(name, budget="default", seed=3) -> RefPolicy:
    budget = BUDGETS[name] if budget == "default" else budget
    heavy, recent = (budget.heavy, budget.recent) if budget else (0, 0)
    return RefPolicy(name, heavy, recent, SINKS, seed, DECAY, LAYERS, RATIO)


def _prompt_pos(lens: list) -> torch.Tensor:
    """(b, KV, t) int64 positions of left-padded prompts, -1 on padding."""
    t = max(lens)
    pos = torch.full((len(lens), KV, t), -1, dtype=torch.long)
    for i, n in enumerate(lens):
        pos[i, :, t - n:] = torch.arange(n)
    return pos


def _tied_scores(shape, gen: torch.Generator) -> torch.Tensor:
    """Quarter-step scores: exactly representable, so ties are frequent and exact."""
    return torch.randint(0, 4, shape, generator=gen).float() / 4


class Sim:
    """Drives a policy the way the cache does: prefill_keep, then per step write the new token into a free slot,
    add probabilities, ask decode_evict. Checks every decision against the reference rules as it goes: the
    reference sees only each (row, head)'s History (who gave which token what probability, value norms)."""

    def __init__(self, name: str, lens: list = LENS, gen_len: int = GEN, layer: int = 1, seed: int = 0,
                 budget="default"):
        self.policy, self.ref, self.layer = _policy(name, budget), _ref(name, budget), layer
        self.gen = torch.Generator().manual_seed(seed)
        b = len(lens)
        self.hist = [[History() for _ in range(KV)] for _ in range(b)]
        pos = _prompt_pos(lens)
        v = _tied_scores((*pos.shape, DIM), self.gen)  # (b, KV, t, DIM)
        k = torch.randn((*pos.shape, DIM), generator=self.gen)  # keys: no two alike (mean_keydiff's cosines)
        probs = self._prefill_probs(pos)  # (b, KV, query, key)
        score = torch.einsum("bhqk,bq->bhk", probs, self.policy.query_weights(pos[:, 0]))
        self.cur = torch.tensor(lens) - 1  # (b,) newest position
        self._record(pos, v, k)
        keep = self.policy.prefill_keep(pos, score, layer, self.cur, obs=Observed(k, v))
        self._check_prefill(pos, keep)
        self.slots = self.policy.slots(max(lens), gen_len)
        self.pos = torch.full((b, KV, self.slots), -1, dtype=torch.long)
        self.score = torch.zeros(b, KV, self.slots)
        self.v = torch.zeros(b, KV, self.slots, DIM)
        self.k = torch.zeros(b, KV, self.slots, DIM)
        for i in range(b):
            for h in range(KV):
                m = int(keep[i, h].sum())
                assert m <= self.slots
                self.pos[i, h, :m], self.score[i, h, :m] = pos[i, h][keep[i, h]], score[i, h][keep[i, h]]
                self.v[i, h, :m], self.k[i, h, :m] = v[i, h][keep[i, h]], k[i, h][keep[i, h]]
        self.evicted = []  # per step, the evicted positions (or None) per (row, head)

    def _prefill_probs(self, pos) -> torch.Tensor:
        """Random probabilities of every prompt query for every earlier (or the same) prompt token."""
        t = pos.shape[-1]
        probs = _tied_scores((pos.shape[0], KV, t, t), self.gen)
        seen = (pos[:, :, :, None] >= pos[:, :, None, :]) & (pos[:, :, None, :] >= 0)  # (b, KV, query, key)
        probs = torch.where(seen, probs, 0.0)
        for i, j, q, k in seen.nonzero().tolist():
            self.hist[i][j].seen(int(pos[i, j, q]), int(pos[i, j, k]), float(probs[i, j, q, k]))
        return probs

    def _record(self, pos, v, k) -> None:
        for i, j, s in (pos >= 0).nonzero().tolist():
            self.hist[i][j].vnorm[int(pos[i, j, s])] = float(v[i, j, s].abs().sum())
            self.hist[i][j].keys[int(pos[i, j, s])] = k[i, j, s].double()

    def _check_prefill(self, pos, keep):
        assert not (keep & (pos < 0)).any(), "padding kept"
        for i in range(pos.shape[0]):
            for h in range(KV):
                n = int((pos[i, h] >= 0).sum())
                want = self.ref.prefill(n, self.hist[i][h], self.layer, h)
                assert set(pos[i, h][keep[i, h]].tolist()) == want, (i, h)

    def step(self) -> None:
        self.cur += 1
        b = self.pos.shape[0]
        for i in range(b):
            for h in range(KV):
                free = (self.pos[i, h] < 0).nonzero()
                assert len(free), "no free slot for the new token"
                slot = free[0, 0]
                self.pos[i, h, slot], self.score[i, h, slot] = self.cur[i], 0.0
                self.v[i, h, slot] = _tied_scores((DIM,), self.gen)
                self.k[i, h, slot] = torch.randn(DIM, generator=self.gen)
        self._record(self.pos, self.v, self.k)
        probs = torch.where(self.pos >= 0, _tied_scores(self.pos.shape, self.gen), 0.0)
        for i, j, s in (self.pos >= 0).nonzero().tolist():
            self.hist[i][j].seen(int(self.cur[i]), int(self.pos[i, j, s]), float(probs[i, j, s]))
        self.policy.accumulate(self.score, probs)
        evict = self.policy.decode_evict(self.pos, self.score, self.layer, self.cur,
                                         obs=Observed(self.k, self.v))
        self.evicted.append(self._check_evict(evict))
        if evict is not None:
            self.pos.masked_fill_(evict, -1)
            self.score.masked_fill_(evict, 0.0)

    def _check_evict(self, evict) -> list:
        out = []
        for i in range(self.pos.shape[0]):
            for h in range(KV):
                valid = self.pos[i, h] >= 0
                kept = set(self.pos[i, h][valid].tolist())
                over = self.ref.budget is not None and len(kept) > self.ref.budget_at(self.layer)
                want = self.ref.evict(kept, int(self.cur[i]), self.hist[i][h], self.layer, h) if over else None
                got = [] if evict is None else self.pos[i, h][evict[i, h]].tolist()
                assert evict is None or not (evict[i, h] & ~valid).any(), "an empty slot marked for eviction"
                assert got == ([want] if over else []), (i, h, got, want)
                out.append(want)
        return out

    def kept(self, i: int, h: int) -> set:
        return set(self.pos[i, h][self.pos[i, h] >= 0].tolist())


# ---- every policy, against the reference rules ------------------------------------------------------------------
@pytest.mark.parametrize("name", PER_HEAD)
@pytest.mark.parametrize("layer", [0, 2])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decisions_match_reference(name, layer, seed):
    sim = Sim(name, layer=layer, seed=seed)
    for _ in range(GEN - 1):
        sim.step()


@pytest.mark.parametrize("name", PER_HEAD)
def test_kept_count_never_exceeds_budget(name):
    sim = Sim(name)
    budget = sim.ref.budget_at(sim.layer)
    for step in range(GEN):
        for i, n in enumerate(LENS):
            for h in range(KV):
                seen = n + step
                assert len(sim.kept(i, h)) == (seen if budget is None else min(seen, budget))
        if step < GEN - 1:
            sim.step()


@pytest.mark.parametrize("name", [n for n in PER_HEAD if POLICIES[n].windowed])
def test_exactly_heavy_plus_recent_after_each_step(name):
    """Once more than B tokens were seen: the R newest positions are all kept, plus exactly H older ones."""
    sim = Sim(name)
    recent = BUDGETS[name].recent
    heavy = sim.ref.budget_at(sim.layer) - recent
    for step in range(GEN):
        for i, n in enumerate(LENS):
            cur = n - 1 + step
            if cur + 1 <= heavy + recent:
                continue
            for h in range(KV):
                kept = sim.kept(i, h)
                window = set(range(cur - recent + 1, cur + 1))
                assert window <= kept and len(kept - window) == heavy, (step, i, h, sorted(kept))
        if step < GEN - 1:
            sim.step()


@pytest.mark.parametrize("name", [n for n in PER_HEAD if POLICIES[n].uses_sinks])
def test_streaming_never_evicts_sinks(name):
    sim = Sim(name)
    for _ in range(GEN - 1):
        sim.step()
        for i, n in enumerate(LENS):
            for h in range(KV):
                assert set(range(SINKS)) <= sim.kept(i, h)


@pytest.mark.parametrize("name", PER_HEAD)
def test_budget_covering_everything_equals_full(name):
    """B >= prompt + gen: same slots as full, nothing dropped at prefill, nothing evicted while decoding."""
    total = max(LENS) + GEN
    budget = None if name == "full" else (Budget(total // 2, total - total // 2) if POLICIES[name].windowed
                                          else Budget(0, total))
    policy = _policy(name, budget)
    assert policy.slots(max(LENS), GEN) == make_policy("full", None).slots(max(LENS), GEN) == total
    sim = Sim(name, budget=budget)
    for _ in range(GEN - 1):
        sim.step()
    assert all(e is None for step in sim.evicted for e in step)
    for i, n in enumerate(LENS):
        for h in range(KV):
            assert sim.kept(i, h) == set(range(n + GEN - 1))


@pytest.mark.parametrize("name", [n for n in PER_HEAD if n != "full"])
def test_slots_are_budget_plus_one(name):
    largest = max(_ref(name).budget_at(layer) for layer in range(LAYERS))  # the bottom layer's, for pyramid
    assert _policy(name).slots(9, GEN) == largest + 1
    assert largest == BUDGETS[name].total or POLICIES[name].layered
