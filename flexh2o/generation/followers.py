"""Lanes whose rows are not computed while they equal another lane's: `Followers`, for a LanePolicy batch whose
lanes are copies of the same prompts (a LanePlan, generation/batch_plan.py, runs them).

Until a lane first evicts, its rows hold every token in the same slots, with the same scores when its decay is 1,
as any other such lane fed the same tokens: the lane of the largest first eviction (`leader`; full, when the batch
has it) computes them for all. A follower lane is *dormant* at a decode step while (a) it has evicted nothing in any
layer and will not at this step (the newest position + 1 is at most its smallest layer budget), (b) its decay is 1
and (c) every token fed to it so far equals the leader's (teacher forcing of one text; a sampler's draws may
differ). A step computes the rows up to the last lane that is not dormant (`active`); the dormant lanes after it
take the leader's logits. The step at which a lane stops being dormant it is *woken*: before its attention in each
layer, the leader's rows of the block (keys, values, positions, scores: the state after the previous step) are
copied into its rows, and from then on it runs as in any batch. Dormant lanes inside the computed rows are woken
at once, so the rows computed are always the lanes' own. The rows' figures are those of a run without followers
(tests/generation/test_followers.py): the same tokens in the same slots, up to the rounding a different batch gives.
"""
from __future__ import annotations

import math

import torch

from flexh2o.kv.policies.lanes import LanePolicy


def first_eviction(policy, num_layers: int) -> float:
    """The most tokens a row of `policy` holds before it first evicts in some layer (its smallest layer budget;
    inf without a budget)."""
    totals = (policy.layer_total(layer) for layer in range(num_layers))
    return min(math.inf if total is None else total for total in totals)


def can_follow(policy) -> bool:
    """Whether a lane of `policy` equals the leader until it first evicts: its scores are the plain sum (decay 1),
    as the leader's are; tova (decay 0) and a2sf (another decay) weigh the same attention otherwise."""
    return policy.decay == 1.0


def follow_order(policies: list, num_layers: int) -> list:
    """Row order of lanes (their policies) that lets followers be dormant: the lanes that cannot follow (decay not
    1), then the leader (the largest first eviction), then the followers by first eviction (the dormant ones are
    then the last lanes, and the first to wake leaves them first). -> indices into `policies`."""
    able = [i for i, p in enumerate(policies) if can_follow(p)]
    first = [first_eviction(p, num_layers) for p in policies]
    leader = max(able, key=lambda i: first[i], default=None)
    rest = sorted((i for i in able if i != leader), key=lambda i: first[i])
    return [i for i in range(len(policies)) if i not in able] + ([leader] if able else []) + rest


class Followers:
    """Which lanes of one GPU batch are dormant at each decode step, and which wake."""

    def __init__(self, policy: LanePolicy, num_layers: int, copies: int):
        self.policy = policy
        self.slices = policy.slices
        rows = policy.rows // copies  # each lane is one copy of the prompts
        self.first = [first_eviction(p, num_layers) for p in policy.lanes]
        able = [i for i, (p, sl) in enumerate(zip(policy.lanes, self.slices))
                if can_follow(p) and sl.stop - sl.start == rows]
        self.leader = max(able, key=lambda i: self.first[i], default=None)
        self.able = [i for i in able if i != self.leader]
        self.dormant: set = set()  # after the last planned step
        self.step = 0
        self.plan = (policy.rows, [])  # (active rows, lanes woken) of the current step

    def advance(self, step: int, tokens: torch.Tensor, cur_pos: torch.Tensor) -> tuple:
        """The plan of decode step `step` (once per step): tokens (rows,) fed this step, cur_pos (rows,) their
        positions -> (active rows, [lanes woken at this step])."""
        if step == self.step:
            return self.plan
        lead = self.slices[self.leader]
        seen = cur_pos.tolist()
        now = set()
        for i in self.able:
            sl = self.slices[i]
            if ((step == 1 or i in self.dormant) and max(seen[sl]) + 1 <= self.first[i]
                    and torch.equal(tokens[sl], tokens[lead])):
                now.add(i)
        active = len(self.slices)  # lanes [0, active) run; the dormant lanes after them do not
        while active > 0 and active - 1 in now:
            active -= 1
        now = {i for i in now if i >= active}
        woken = sorted(i for i in self.dormant if i not in now)
        self.dormant, self.step = now, step
        rows = self.slices[active - 1].stop if active else 0
        self.plan = (rows, woken)
        return self.plan

    def wake(self, blk, woken: list) -> None:
        """Copy the leader's rows of a block (its state after the previous step) into the woken lanes' rows."""
        lead = self.slices[self.leader]
        for i in woken:
            dst = self.slices[i]
            for name in ("k", "v", "pos", "score"):
                getattr(blk, name)[dst] = getattr(blk, name)[lead]

    def alias(self, device):
        """(policy.rows,) int64: each row's row among the computed ones (a dormant row: the leader's); None when
        no lane is dormant (every row is its own)."""
        if not self.dormant:
            return None
        index = torch.arange(self.policy.rows, device=device)
        lead = self.slices[self.leader]
        for i in self.dormant:
            sl = self.slices[i]
            index[sl] = torch.arange(lead.start, lead.stop, device=device)
        return index
