"""The reference's KV policies (tests/reference_kv.py): a History per (layer, KV head) and each policy's rule over
kept sets, a token's value computed from the History by the policy's definition, never from a running score; and
the merge events a merging policy logs (replayed into the values by reference_forward.merged_values).

Only `random_key` (the seeded hash that defines the `random` policy's choice) comes from the engine."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from functools import lru_cache
from typing import Callable, Optional

import torch

from flexh2o.kv.policies.random import random_key


# ---- policies ---------------------------------------------------------------------------------------------------
@dataclass
class History:
    """What a (layer, KV head) has seen: `probs[t]` lists (query position, probability the query gave token t,
    summed over the query heads of the KV head) for every query that attended to t; `vnorm[t]` is the L1 norm of
    token t's value vector; `keys[t]` its key vector (fp64), as the cache holds them."""

    probs: dict = field(default_factory=dict)
    vnorm: dict = field(default_factory=dict)
    keys: dict = field(default_factory=dict)

    def seen(self, query: int, token: int, p: float) -> None:
        self.probs.setdefault(token, []).append((query, p))


# heavy tokens + a protected recent window
WINDOWED = ("h2o", "random", "a2sf", "mean_attn", "vatp", "h2o_sinks", "mean_vnorm", "pyramid", "adakv", "merge",
            "mean_keydiff")
SINKS = ("streaming", "vatp", "h2o_sinks", "mean_vnorm", "pyramid", "adakv", "merge")  # first num_sinks protected
MEAN = ("mean_attn", "pyramid", "adakv", "merge")  # value: the mean attention a token received
HELD_SET = ("mean_keydiff",)  # value: ranks among the held tokens (`_held_value`)
MERGING = ("merge",)  # an evicted token's value goes into the kept token of the most similar key (`merge_events`)
SHARED_HEADS = ("adakv",)  # the KV heads of a layer share heads x budget tokens, each at most head_cap x budget
LAYERED = ("pyramid",)  # each layer has its own budget (`layer_total`)
# A wrapped name WRAPPER:BASE (pyramid:tova, adakv:vatp, merge:h2o) is the wrapper's rule (LAYERED, SHARED_HEADS or
# MERGING) over BASE's value and protection, with the first num_sinks tokens protected too; the plain wrapper names
# are the wrappers over mean_attn.
WRAPPERS = MERGING + SHARED_HEADS + LAYERED


@dataclass(frozen=True)
class RefPolicy:
    """name in full / local / streaming / tova: a budget of `heavy + recent` tokens (streaming: the first
    `num_sinks` of them are the attention sinks). The WINDOWED policies keep the `recent` newest tokens plus `heavy`
    others by their value (`_value`); those in SINKS also keep the first `num_sinks` tokens. pyramid: layer `layer`
    of `num_layers` has its own budget (`layer_total`). WRAPPER:BASE: see WRAPPERS."""

    name: str
    heavy: int = 0
    recent: int = 0
    num_sinks: int = 4
    seed: int = 0
    hh_decay: float = 0.98
    num_layers: int = 1
    pyramid_ratio: float = 0.5
    head_cap: float = 2.0
    keydiff_weight: float = 1.0

    @property
    def wrapper(self) -> Optional[str]:
        head = self.name.split(":")[0]
        return head if head in WRAPPERS else None

    @property
    def base(self) -> str:
        """The policy whose value and protection a wrapper keeps (the name itself when not wrapped)."""
        if ":" in self.name:
            return self.name.split(":", 1)[1]
        return "mean_attn" if self.name in WRAPPERS else self.name

    @property
    def shares_heads(self) -> bool:
        return self.wrapper in SHARED_HEADS

    @property
    def merging(self) -> bool:
        return self.wrapper in MERGING

    @property
    def budget(self) -> Optional[int]:
        return None if self.name == "full" else self.heavy + self.recent

    def budget_at(self, layer: int) -> Optional[int]:
        if self.wrapper in LAYERED:
            return self.layer_total(layer)
        return self.budget

    def most_per_head(self, layer: int) -> Optional[int]:
        """The most tokens one KV head of `layer` may hold."""
        if self.shares_heads:
            return math.floor(self.head_cap * self.budget)
        return self.budget_at(layer)

    def layer_heavy(self, layer: int) -> int:
        """pyramid over a windowed policy: layer's budget less the recent window."""
        return self.layer_total(layer) - self.recent

    def layer_total(self, layer: int) -> int:
        """pyramid: the P protected tokens (the window, when the base has one, and the sinks) + the layer's share of
        the L * (budget - P) free tokens, shares proportional to (L - 1) * b + (a - b) * layer for ratio a / b,
        rounded by largest remainder (ties to the lower layer)."""
        L, r = self.num_layers, Fraction(self.pyramid_ratio)
        a, b = r.numerator, r.denominator
        w = [max(1, L - 1) * b + (a - b) * i for i in range(L)]
        protected = (self.recent if self.base in WINDOWED else 0) + self.num_sinks
        free = L * (self.budget - protected)
        floor = [free * x // sum(w) for x in w]
        left = free - sum(floor)
        extra = sorted(range(L), key=lambda i: (-(free * w[i] % sum(w)), i))[:left]
        return protected + floor[layer] + (layer in extra)

    def prefill(self, n: int, hist: History, layer: int, head: int, first: int = 0) -> set:
        """Positions kept out of an n-token prompt whose positions below `first` are gone (a sliding window)."""
        everything = set(range(first, n))
        budget = self.budget_at(layer)
        if budget is None or len(everything) <= budget:
            return everything
        if self.name == "local":
            return set(range(n - self.budget, n))
        if self.name == "streaming":
            return (set(range(self.num_sinks)) & everything) | set(range(n - (self.budget - self.num_sinks), n))
        if self.name == "tova":
            return set(sorted(everything, key=lambda t: (self._value(t, n - 1, hist, layer, head), t),
                              reverse=True)[:self.budget])  # ties keep the newer
        protect = self._protected(everything, n - 1)
        value = lambda t: (self._value(t, n - 1, hist, layer, head, everything), t)  # noqa: E731
        heavy = sorted(everything - protect, key=value, reverse=True)[:budget - len(protect)]
        return protect | set(heavy)

    def layer_prefill(self, n: int, hists: list, layer: int) -> list:
        """SHARED_HEADS: the kept positions of every head (hists: one History per head) out of an n-token prompt:
        the protected ones, then greedily by value (ties: newer, then lower head) while the layer and the head
        have room."""
        heads, cap = len(hists), self.most_per_head(layer)
        kept = [self._protected(set(range(n)), n - 1) for _ in range(heads)]
        pool = [(self._value(t, n - 1, hists[h], layer, h, set(range(n))), t, -h) for h in range(heads)
                for t in set(range(n)) - kept[h]]
        for _, t, neg_head in sorted(pool, reverse=True):
            if sum(map(len, kept)) < heads * self.budget and len(kept[-neg_head]) < cap:
                kept[-neg_head].add(t)
        return kept

    def layer_evict(self, kept: list, cur: int, hists: list, layer: int) -> None:
        """SHARED_HEADS, in place: drop tokens while the layer holds more than heads x budget or a head more than
        its cap, each time the lowest value (ties: older, then lower head) of the over-cap heads, else of all."""
        heads, cap = len(kept), self.most_per_head(layer)
        while sum(map(len, kept)) > heads * self.budget or max(map(len, kept)) > cap:
            over = [h for h in range(heads) if len(kept[h]) > cap] or range(heads)
            pool = [(self._value(t, cur, hists[h], layer, h, kept[h]), t, h) for h in over
                    for t in kept[h] - self._protected(kept[h], cur)]
            _, t, h = min(pool)
            kept[h].remove(t)

    def evict(self, kept: set, cur: int, hist: History, layer: int, head: int) -> int:
        """The position to drop from `kept` (which holds one token too many; `cur` is the newest position)."""
        if self.name == "local":
            return min(kept)
        if self.name == "streaming":
            return min(t for t in kept if t >= self.num_sinks)
        outside = kept - self._protected(kept, cur)
        return min(outside, key=lambda t: (self._value(t, cur, hist, layer, head, kept), t))  # ties evict the older

    def _protected(self, kept: set, cur: int) -> set:
        window = {t for t in kept if t > cur - self.recent} if self.base in WINDOWED else set()  # R newest
        sinks = self.base in SINKS or self.wrapper is not None
        return window | ({t for t in kept if t < self.num_sinks} if sinks else set())

    def mass(self, t: int, cur: int, hist: History) -> float:
        """The attention token t has received by query cur as the base policy accumulates it (a merge's weight):
        tova only the newest query's, a2sf each query's weighted by hh_decay ** its age, the others the plain sum."""
        seen = hist.probs.get(t, [])
        if self.base == "tova":
            return sum(p for q, p in seen if q == cur)
        if self.base == "a2sf":
            return sum(self.hh_decay ** (cur - q) * p for q, p in seen)
        return sum(p for _, p in seen)

    def _value(self, t: int, cur: int, hist: History, layer: int, head: int, held: Optional[set] = None) -> float:
        """How much a policy wants to keep token t when the newest position is cur, from its history alone (and,
        for HELD_SET, the positions `held` with it)."""
        if self.base in HELD_SET:
            return self._held_value(t, hist, held)
        seen = hist.probs.get(t, [])
        total = sum(p for _, p in seen)
        base = self.base
        if base == "random":
            return ref_random_key(self.seed, layer, head, t)
        if base in ("tova", "a2sf"):
            return self.mass(t, cur, hist)
        if base in MEAN:
            return total / len(seen)
        if base == "vatp":
            return total * hist.vnorm[t]
        if base == "mean_vnorm":
            return total / len(seen) * hist.vnorm[t]
        return total  # h2o, h2o_sinks

    def _held_value(self, t: int, hist: History, held: set) -> float:
        """mean_keydiff: t's place among the held tokens by its mean received attention, plus keydiff_weight times
        its place by how unlike the held keys' mean its key is (minus the cosine); a place counts the held tokens
        below it, an equal value putting the older position below."""
        def mean(u):
            seen = hist.probs[u]
            return sum(p for _, p in seen) / len(seen)
        centre = sum(hist.keys[u] for u in held) / len(held)

        def unlike(u):
            k = hist.keys[u]
            norms = float(k.norm()) * float(centre.norm())
            return -float(k @ centre) / norms if norms else 0.0

        def place(f):
            return sum((f(u), u) < (f(t), t) for u in held)
        return place(mean) + self.keydiff_weight * place(unlike)


@lru_cache(maxsize=None)
def ref_random_key(seed: int, layer: int, head: int, pos: int) -> float:
    """The `random` policy's key of one token: random_key reads the KV head from dimension 1 of its input."""
    grid = torch.full((1, head + 1, 1), pos, dtype=torch.int64)
    return float(random_key(seed, layer, grid)[0, head, 0])



def merge_events(kept: set, evicted: set, cur: int, hist: History, keys: torch.Tensor,
                 weight: Optional[Callable] = None) -> list:
    """The merge events of tokens `evicted` after query `cur` (keys (T, d) of the head): each source goes into the
    kept token of highest key cosine (ties: the older), weighted by the attention each has received so far
    (`weight`(t): default the plain sum of its probabilities)."""
    def mass(t):
        return weight(t) if weight is not None else sum(p for _, p in hist.probs.get(t, []))

    def cos(a, b):
        return float(keys[a] @ keys[b]) / (max(float(keys[a].norm()), 1e-8) * max(float(keys[b].norm()), 1e-8))
    into = {}
    for e in sorted(evicted):
        t = max(kept, key=lambda t: (cos(e, t), -t))
        into.setdefault(t, []).append((e, mass(e)))
    return [(cur, t, sources, mass(t)) for t, sources in sorted(into.items())]

