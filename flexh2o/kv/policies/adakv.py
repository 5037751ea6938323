"""Per-head budgets (after Ada-KV, Feng et al. 2024): the wrapper `HeadBudgets` lets the KV heads of a layer share
one budget under any scoring policy, so a head whose attention is concentrated gives tokens to a head whose
attention is spread. `adakv` is it over mean_attn (`adakv:POLICY` over another scoring policy, e.g. `adakv:vatp`).

Budget: B = `heavy` + `recent` tokens per sequence, layer and KV head on average: the kv heads of a layer hold at
most kv * B tokens per sequence together. Floor: each head keeps its protected tokens, the wrapped policy's (its
`recent` newest positions, when it has a window) and the first `num_sinks` positions (--num-sinks; num_sinks <= heavy
with a window). Cap: no head holds more than C = floor(head_cap * B) tokens (--head-cap >= 1, default 2), so the
cache allocates C + 1 slots per head. Priority of the unprotected tokens: the wrapped policy's; `adakv`'s is
mean_attn's (comparable across heads: every query gives each KV head a total probability of the group size): the
attention the token received (summed over the query heads of the KV head, fp32) divided by c - p + 1, the queries
that saw position p when the newest is c.

Prefill, per sequence: every head keeps its protected tokens; the other tokens of all heads, in descending priority
(ties: the newer position, then the lower head), are kept one by one while the layer holds fewer than kv * B and
the token's head fewer than C (a token whose head is full is skipped). Decode, per sequence: each head appends its
token; then, while the layer holds more than kv * B tokens or a head more than C, one token is evicted: among the
unprotected tokens of the heads holding more than C if there are any, else of every head, the lowest priority
(ties: the older position, then the lower head). At most kv tokens go per step (one was added per head).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from flexh2o.kv.policies.base import Budget, KVPolicy, Observed, cache_slots
from flexh2o.kv.policies.mean_attn import MeanAttentionPolicy
from flexh2o.kv.policies.params import Param

if TYPE_CHECKING:  # torch is imported where a tensor is made: the flags' parser reads the policies without it
    import torch

DEFAULT_HEAD_CAP = 2.0  # the most a KV head holds, in per-head budgets
HEAD_CAP = Param("head_cap", float, DEFAULT_HEAD_CAP, "adakv policy: the most tokens one KV head may hold, in "
                 f"per-head budgets, >= 1 (default {DEFAULT_HEAD_CAP})", lo=1.0,
                 fix="the most one KV head holds, in budgets", label="head cap")


class HeadBudgets(KVPolicy):
    """The wrapper: put it before a scoring policy's class (kv/policies/wrappers.py composes them)."""

    wrapper = "adakv"
    uses_sinks = True
    shares_heads = True
    params = (HEAD_CAP,)

    def _limits(self, heads: int) -> tuple:
        """(tokens per sequence of the layer, tokens per head): ints, or (rows, 1, 1) tensors for lane budgets."""
        import torch
        total = self.budget.total
        if isinstance(total, torch.Tensor):
            return heads * total, (self.head_cap * total.double()).floor().long()
        return heads * total, math.floor(self.head_cap * total)

    def slots(self, prompt_len: int, gen_len: int) -> int:
        return cache_slots(Budget(0, math.floor(self.head_cap * self.budget.total)), prompt_len, gen_len)

    def prefill_keep(self, pos, score, layer, cur_pos, obs=Observed()):
        import torch
        valid = pos >= 0  # (b, h, t)
        b, h, t = pos.shape
        total, cap = self._limits(h)
        prio = self.scored(pos, score, layer, cur_pos, obs)
        prot = self.protected(pos, cur_pos) & valid
        cand = valid & ~prot
        head = torch.arange(h, device=pos.device).view(1, h, 1).expand(b, h, t)
        in_head = _desc_rank([cand, prio, pos])  # (b, h, t) order among the head's candidates
        fits = cand & (in_head < cap - prot.sum(-1, keepdim=True))  # the head still has room for it
        flat = [x.reshape(b, h * t) for x in (fits, prio, pos, -head)]
        in_layer = _desc_rank(flat).view(b, h, t)
        room = total - prot.sum((1, 2), keepdim=True)  # (b, 1, 1)
        return prot | (fits & (in_layer < room))

    def decode_evict(self, pos, score, layer, cur_pos, extents=None, obs=Observed()):
        import torch
        b, h, s = pos.shape
        total, cap = self._limits(h)
        prio = self.scored(pos, score, layer, cur_pos, obs)
        prot = self.protected(pos, cur_pos)
        head = torch.arange(h, device=pos.device).view(1, h, 1).expand(b, h, s)
        held = pos >= 0
        evict = torch.zeros_like(held)
        for _ in range(h):  # each step added one token per head
            count = held.sum(-1, keepdim=True)  # (b, h, 1)
            over_cap = count > cap
            capped = over_cap.any(1, keepdim=True)  # (b, 1, 1)
            need = capped | (count.sum(1, keepdim=True) > total)
            pick = _lowest(held & ~prot & need & (over_cap | ~capped), prio, pos, head)
            evict |= pick
            held &= ~pick
        return evict


class AdaKVPolicy(HeadBudgets, MeanAttentionPolicy):
    name = "adakv"


def _lowest(cand, prio, pos, head) -> torch.Tensor:
    """Bool (b, h, s): per sequence, the candidate of lowest priority over all heads (ties: the older position, then
    the lower head); none where a sequence has no candidate."""
    import torch

    def least(mask, key, fill):
        m = torch.where(mask, key, fill).amin(-1, keepdim=True).amin(1, keepdim=True)  # (b, 1, 1)
        return mask & (key == m)
    tie = least(cand, prio, torch.inf)
    tie = least(tie, pos, torch.iinfo(pos.dtype).max)
    return least(tie, head, torch.iinfo(head.dtype).max)


def _desc_rank(keys: list) -> torch.Tensor:
    """Rank (0 = first) of each element along the last dimension in the descending lexicographic order of `keys`
    (most significant first, all of one shape)."""
    import torch
    order = torch.argsort(keys[-1].float(), dim=-1, descending=True, stable=True)
    for key in reversed(keys[:-1]):
        k = torch.gather(key.float(), -1, order)
        order = torch.gather(order, -1, torch.argsort(k, dim=-1, descending=True, stable=True))
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return rank
