"""KV policy interface. A policy only answers which cached tokens to keep; kv/cache.py moves the data.

Tensors a policy sees, per cache block (one layer, one GPU batch), all shaped (b, kv_heads, slots):
  pos    int64, position of the token in each slot (index among the sequence's real tokens); -1 = empty slot
  score  float32, accumulated attention probability (filled only when `needs_scores`)
  obs    an Observed: the cached keys and values (b, kv_heads, slots, head_dim) for the policies that read them
         (`needs_keys`, `needs_values`: Observed.only keeps what a policy reads)
cur_pos (b,) int64 is the position of the newest token of each sequence.

A policy is a `priority` (higher = keep) plus a `protected` set (never evicted): the `budget.recent` newest
positions when it is `windowed`, the first `num_sinks` positions when it `uses_sinks`. Eviction removes the
lowest-priority unprotected token, ties going to the older position; prefill keeps the protected tokens and
then the highest priorities, ties going to the newer position. The budget of layer l is `layer_budget(l)`, the same
`budget` in every layer unless the policy is `layered` (pyramid); `slots` is then the largest layer's + 1.

Scores: with a `decay` d, a token's score after query c is the sum over the queries q that attended to it of
d ** (c - q) times the probability q gave it (summed over the query heads of the KV head), in fp32. d = 1 (the
default) is H2O's plain sum; d = 0 keeps only the newest query's probability; 0 < d < 1 forgets old attention.
Prefill weights query q by `query_weights`; each decode step computes score <- d * score + probability.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

from flexh2o.kv.policies.params import Param, declared

if TYPE_CHECKING:  # torch is imported where a tensor is made: the flags' parser reads the policies without it
    import torch

DEFAULT_SINKS = 4
NUM_SINKS = Param("num_sinks", int, DEFAULT_SINKS, "attention sinks kept by the policies that protect them "
                  f"(streaming, vatp, h2o_sinks, mean_vnorm; default {DEFAULT_SINKS})", lo=0,
                  fix="the number of first tokens always kept",
                  shown=lambda cls, value: cls.uses_sinks and value != DEFAULT_SINKS)
DEFAULT_RECENT_SHARE = 0.5  # H2O's even split of a budget into heavy hitters and the recent window
RECENT_SHARE = Param("recent_share", float, DEFAULT_RECENT_SHARE, "the share of a --kv-budget (and of "
                     "flexh2o-eval's budgets) kept as the recent window by the windowed policies (h2o, mean_attn, "
                     f"vatp, ...; the rest are heavy hitters); default {DEFAULT_RECENT_SHARE}: H2O's even split",
                     lo=0.0, hi=1.0, fix="the share of the budget that is the recent window, e.g. 0.25",
                     shown=lambda cls, value: cls.windowed and value != DEFAULT_RECENT_SHARE)


@dataclass(frozen=True)
class Budget:
    """Token budget per sequence, layer and KV head: `heavy` + `recent` = total. None total = unbounded."""

    heavy: int
    recent: int

    def __post_init__(self):
        if self.heavy < 0 or self.recent < 0 or self.heavy + self.recent < 1:
            raise ValueError(f"KV budget must be at least 1 token (got heavy {self.heavy}, recent {self.recent})")

    @property
    def total(self) -> int:
        return self.heavy + self.recent


@dataclass(frozen=True)
class Observed:
    """What a block holds that some policies read besides positions and scores, None unless a policy of the block
    reads it: keys and values (b, h, s, d), as the cache holds them (dequantized; at prefill the prompt's exact
    ones), keys in fp32. Observed() (the default everywhere): nothing."""

    keys: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None

    def map(self, fn: Callable) -> "Observed":
        """The same with fn applied to each tensor present (a slice of rows or slots)."""
        return Observed(*(None if x is None else fn(x) for x in (self.keys, self.values)))

    def only(self, policy: "KVPolicy") -> "Observed":
        """What `policy` reads of it (needs_keys, needs_values), the rest dropped."""
        return Observed(self.keys if policy.needs_keys else None, self.values if policy.needs_values else None)


class KVPolicy:
    """Base class: subclasses set `name` and the flags below and implement `priority`. A class declares the
    parameters it reads in `params` (Param, kv/policies/params.py): the constructor takes each as a keyword (its
    default when not given) and sets it as an attribute; the flags, the KVSpec and the printed command line follow."""

    name = "base"
    params = (NUM_SINKS, RECENT_SHARE)
    needs_scores = False
    windowed = False  # a --kv-budget is split into heavy tokens and a protected recent window (--recent-share)
    uses_sinks = False  # protects the first --num-sinks positions
    needs_values = False  # priority reads the cached values (obs.values)
    needs_keys = False  # priority reads the cached keys (obs.keys)
    layered = False  # the budget differs from layer to layer (layer_budget)
    shares_heads = False  # the KV heads of a layer share one budget (adakv): decisions couple the heads
    merges = False  # evicted values are merged into kept tokens: merge_plan says where, kv/cache.py writes them
    priority_is_score = False  # priority returns the score itself (a class that defines priority again is not)
    decay = 1.0

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "priority" in vars(cls) and "priority_is_score" not in vars(cls):
            cls.priority_is_score = False  # an inherited True never covers a new rule

    def __init__(self, budget: Optional[Budget], num_sinks: int = DEFAULT_SINKS, seed: int = 0, *,
                 num_layers: Optional[int] = None, **params):
        self.budget = budget
        self.num_sinks = num_sinks
        self.seed = seed
        self.num_layers = num_layers
        for p in declared(type(self)):
            if p.name != NUM_SINKS.name:
                setattr(self, p.name, params.pop(p.name, p.default))
        if params:
            raise TypeError(f"the {self.name} policy has no parameter {', '.join(sorted(params))}")

    def options(self) -> dict:
        """The constructor's keywords besides the budget: a policy of the same class built with them is the same."""
        return {"num_sinks": self.num_sinks, "seed": self.seed, "num_layers": self.num_layers,
                **{p.name: getattr(self, p.name) for p in declared(type(self))}}

    def layer_budget(self, layer: int) -> Optional[Budget]:
        """The budget of one layer (the same for every layer here; see pyramid)."""
        return self.budget

    def layer_total(self, layer: int) -> Optional[int]:
        """The total budget of one layer (None: unbounded)."""
        budget = self.layer_budget(layer)
        return None if budget is None else budget.total

    def slots(self, prompt_len: int, gen_len: int) -> int:
        return cache_slots(self.budget, prompt_len, gen_len)

    def evicts(self, prompt_len: int, gen_len: int) -> bool:
        """Some layer evicts: its budget holds fewer tokens than the sequence."""
        return cache_slots(self.budget, prompt_len, gen_len) < prompt_len + gen_len

    def priority(self, pos: torch.Tensor, score: torch.Tensor, layer: int, cur_pos: torch.Tensor,
                 obs: Observed) -> torch.Tensor:
        raise NotImplementedError

    def scored(self, pos: torch.Tensor, score: torch.Tensor, layer: int, cur_pos: torch.Tensor,
               obs: Observed = Observed()) -> torch.Tensor:
        """priority in fp32."""
        return self.priority(pos, score, layer, cur_pos, obs).float()

    def merge_plan(self, pos, score, keys, evict, extents: Optional[list] = None) -> tuple:
        """When `merges`: (target (b, h, s) int64, the slot that absorbs each evicted slot's value, -1 elsewhere;
        mass (b, h, s) fp32, each slot's weight in the mean). kv/cache.merged_values computes the new values.
        extents: as in decode_evict."""
        raise NotImplementedError

    def protected(self, pos: torch.Tensor, cur_pos: torch.Tensor) -> torch.Tensor:
        """Bool (b, h, s): the recent window (when windowed) and the sinks (when the policy uses them)."""
        return protected_rows(pos, cur_pos, self.budget.recent if self.windowed else 0,
                              self.num_sinks if self.uses_sinks else 0)

    def query_weights(self, qpos: torch.Tensor) -> torch.Tensor:
        """qpos (b, t) prompt positions (-1 = padding) -> fp32 (b, t) weight of each query's probabilities in the
        prefill score: decay ** (newest - q), 0 on padding (decay 0: only the newest query counts)."""
        import torch
        valid = qpos >= 0
        if self.decay == 1.0:
            return valid.float()
        age = (qpos.max(-1, keepdim=True).values - qpos).clamp(min=0).float()  # (b, t)
        return torch.where(valid, torch.tensor(self.decay, dtype=torch.float32).pow(age), 0.0)

    def accumulate(self, score: torch.Tensor, att: torch.Tensor) -> None:
        """One decode step, in place: score <- decay * score + att (fp32, both (b, h, s))."""
        if self.decay != 1.0:
            score.mul_(self.decay)
        score.add_(att)

    def prefill_keep(self, pos: torch.Tensor, score: torch.Tensor, layer: int, cur_pos: torch.Tensor,
                     obs: Observed = Observed()) -> torch.Tensor:
        """Bool (b, h, t): which prompt tokens to keep (at most budget.total per row, never an empty slot)."""
        import torch
        valid = pos >= 0
        if self.budget is None:
            return valid
        prio = self.scored(pos, score, layer, cur_pos, obs)
        prot = self.protected(pos, cur_pos) & valid
        # lexicographic descending sort on (valid, protected, priority, pos) via stable sorts, last key first
        order = torch.argsort(pos, dim=-1, descending=True, stable=True)
        for key in (prio, prot, valid):
            k = torch.gather(key, -1, order)
            order = torch.gather(order, -1, torch.argsort(k.float(), dim=-1, descending=True, stable=True))
        rank = torch.empty_like(order)
        rank.scatter_(-1, order, torch.arange(order.shape[-1], device=pos.device).expand_as(order))
        return valid & (rank < self.layer_budget(layer).total)

    def decode_evict(self, pos: torch.Tensor, score: torch.Tensor, layer: int, cur_pos: torch.Tensor,
                     extents: Optional[list] = None, obs: Observed = Observed()):
        """Bool (b, h, s) marking the one slot per row to evict, rows within budget marking none; or None.
        extents: per row, its slots up to the last one used (kv/cache.row_extents of pos), when the caller has
        them (a policy reading only the used slots then need not compute them again)."""
        if self.budget is None:
            return None
        prio = self.scored(pos, score, layer, cur_pos, obs)
        return lowest_unprotected(pos, prio, self.protected(pos, cur_pos), self.layer_budget(layer).total)


def lowest_unprotected(pos: torch.Tensor, prio: torch.Tensor, prot: torch.Tensor, total) -> torch.Tensor:
    """Bool (b, h, s): per row holding more than `total` tokens (an int, or a (b, 1, 1) tensor of per-row totals),
    its lowest-priority unprotected token, ties going to the older position; rows within budget mark none."""
    import torch
    valid = pos >= 0
    over = valid.sum(-1, keepdim=True) > total  # (b, h, 1)
    cand = valid & ~prot & over
    low = torch.where(cand, prio, torch.inf).amin(-1, keepdim=True)
    tie = cand & (prio == low)
    oldest = torch.where(tie, pos, torch.iinfo(pos.dtype).max).amin(-1, keepdim=True)
    return tie & (pos == oldest)


def cache_slots(budget: Optional[Budget], prompt_len: int, gen_len: int) -> int:
    """Cache slots to allocate for one sequence: budget + 1 (the incoming token), or the whole sequence."""
    total = prompt_len + gen_len
    if budget is None or budget.total >= total:
        return total
    return budget.total + 1


def protected_rows(pos: torch.Tensor, cur_pos: torch.Tensor, recent, num_sinks) -> torch.Tensor:
    """Bool (b, h, s): the `recent` newest positions and the first `num_sinks` positions of each row (ints, or
    (b, 1, 1) tensors of per-row counts; 0 protects none of them)."""
    return recent_window(pos, cur_pos, recent) | sinks(pos, num_sinks)


def recent_window(pos: torch.Tensor, cur_pos: torch.Tensor, recent: int) -> torch.Tensor:
    """Bool: the `recent` most recent positions of each sequence (the newest token included)."""
    return pos > (cur_pos.view(-1, 1, 1) - recent)


def sinks(pos: torch.Tensor, num_sinks: int) -> torch.Tensor:
    """Bool: the first `num_sinks` positions of each sequence (StreamingLLM's attention sinks)."""
    return (pos >= 0) & (pos < num_sinks)
