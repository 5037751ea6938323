"""KVSpec: which KV policy a run uses and its parameters, in whole tokens (ratios are converted here, once)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from flexh2o.kv.policies import DEFAULT_DECAY, DEFAULT_HEAD_CAP, DEFAULT_PYRAMID_RATIO, POLICIES
from flexh2o.kv.policies.base import Budget, KVPolicy
from flexh2o.kv.policies.lanes import LanePolicy

LANES = "lanes"


@dataclass(frozen=True)
class KVSpec:
    """policy: a name in kv.policies.POLICIES; budget: tokens per sequence, layer and KV head (None = unbounded);
    num_sinks: attention sinks for the policies that protect them; seed: for policies that draw at random;
    hh_decay: the forgetting factor of a2sf's scores (1 = h2o's plain sum);
    pyramid_ratio: the pyramid policy's top-layer share of the extra tokens over the bottom layer's, in [0, 1];
    head_cap: the adakv policy's most tokens per KV head, in per-head budgets (>= 1).
    The per-layer budgets need the model's number of layers: slots, evicts and make take it (`num_layers`).
    lanes (policy "lanes"): ((rows, KVSpec), ...), each lane's spec for its own rows of one batch (see of_lanes)."""

    policy: str = "full"
    budget: Optional[Budget] = None
    num_sinks: int = 4
    seed: int = 0
    hh_decay: float = DEFAULT_DECAY
    lanes: tuple = ()
    pyramid_ratio: float = DEFAULT_PYRAMID_RATIO
    head_cap: float = DEFAULT_HEAD_CAP

    def __post_init__(self):
        if self.policy == LANES:
            if not self.lanes or self.budget is not None or any(rows < 1 for rows, _ in self.lanes):
                raise ValueError("a lanes spec needs one or more (rows, KVSpec) lanes and no budget of its own")
            return
        if self.lanes:
            raise ValueError(f"only the {LANES!r} spec has lanes")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown KV policy {self.policy!r}: choose one of {', '.join(POLICIES)}")
        if self.policy == "full" and self.budget is not None:
            raise ValueError("--kv-policy full keeps every token: drop --hh-ratio/--kv-budget or pick another policy")
        if self.policy != "full" and self.budget is None:
            raise ValueError(f"KV policy {self.policy} needs a budget: give --kv-budget N or --hh-ratio R")
        if self.num_sinks < 0:
            raise ValueError(f"--num-sinks must be 0 or more (got {self.num_sinks})")
        if self.policy == "streaming" and self.budget.total <= self.num_sinks:
            raise ValueError(f"--kv-budget {self.budget.total} must exceed --num-sinks {self.num_sinks} for the "
                             "streaming policy")
        cls = POLICIES[self.policy]
        if cls.uses_sinks and cls.windowed and self.num_sinks > self.budget.heavy:
            raise ValueError(f"--num-sinks {self.num_sinks} exceeds the {self.budget.heavy} heavy tokens of the "
                             f"{self.policy} policy: lower --num-sinks or raise the budget")
        if not 0.0 <= self.hh_decay <= 1.0:
            raise ValueError(f"--hh-decay must be between 0 and 1 (got {self.hh_decay})")
        if not 0.0 <= self.pyramid_ratio <= 1.0:
            raise ValueError(f"--pyramid-ratio must be between 0 and 1 (got {self.pyramid_ratio})")
        if not (math.isfinite(self.head_cap) and self.head_cap >= 1.0):
            raise ValueError(f"--head-cap must be a finite number >= 1 (got {self.head_cap})")
        if cls.layered and self.budget.recent + self.num_sinks < 1:
            raise ValueError(f"the {self.policy} policy needs a recent window or sinks (every layer keeps them): "
                             "raise --recent-ratio or --num-sinks")

    @staticmethod
    def from_flags(policy: Optional[str], prompt_len: int, hh_ratio: Optional[float] = None,
                   recent_ratio: Optional[float] = None, kv_budget: Optional[int] = None, num_sinks: int = 4,
                   seed: int = 0, hh_decay: float = DEFAULT_DECAY,
                   pyramid_ratio: float = DEFAULT_PYRAMID_RATIO, head_cap: float = DEFAULT_HEAD_CAP) -> "KVSpec":
        """The spec of --kv-policy/--hh-ratio/--recent-ratio/--kv-budget/--num-sinks/--seed/--hh-decay/
        --pyramid-ratio/--head-cap.

        No --kv-policy: h2o when a budget is given, else full. --hh-ratio r: heavy = int(r * prompt_len), recent =
        heavy (or int(recent_ratio * prompt_len)). --kv-budget N: total N, split evenly (heavy = N // 2) for
        policies with a recent window; all window otherwise."""
        budgeted = hh_ratio is not None or kv_budget is not None
        policy = policy or ("h2o" if budgeted else "full")
        if policy == "full":
            if budgeted:
                raise ValueError("--kv-policy full keeps every token: drop --hh-ratio/--kv-budget or pick another "
                                 "policy")
            return KVSpec("full", None, num_sinks, seed, hh_decay, pyramid_ratio=pyramid_ratio, head_cap=head_cap)
        return KVSpec(policy, resolve_budget(policy, prompt_len, hh_ratio, recent_ratio, kv_budget), num_sinks, seed,
                      hh_decay, pyramid_ratio=pyramid_ratio, head_cap=head_cap)

    @staticmethod
    def of_total(policy: str, tokens: Optional[int], num_sinks: int = 4, seed: int = 0,
                 hh_decay: float = DEFAULT_DECAY, pyramid_ratio: float = DEFAULT_PYRAMID_RATIO,
                 head_cap: float = DEFAULT_HEAD_CAP) -> "KVSpec":
        """A spec at a total budget of `tokens` (None or policy full: unbounded)."""
        if policy == "full":
            return KVSpec("full", None, num_sinks, seed, hh_decay, pyramid_ratio=pyramid_ratio, head_cap=head_cap)
        return KVSpec.from_flags(policy, 0, kv_budget=tokens, num_sinks=num_sinks, seed=seed, hh_decay=hh_decay,
                                 pyramid_ratio=pyramid_ratio, head_cap=head_cap)

    @staticmethod
    def of_lanes(lanes: list) -> "KVSpec":
        """Lanes (rows, KVSpec) of one batch, in row order: each row runs its lane's policy and budget exactly as a
        run of that spec alone would. The batch must be one GPU batch, prefilled in one piece."""
        return KVSpec(LANES, lanes=tuple(lanes))

    @property
    def needs_scores(self) -> bool:
        """The policy accumulates attention probabilities (prefill then materialises them in fp32)."""
        if self.lanes:
            return any(spec.needs_scores for _, spec in self.lanes)
        return POLICIES[self.policy].needs_scores

    def slots(self, prompt_len: int, gen_len: int, num_layers: Optional[int] = None) -> int:
        """Cache slots per sequence and KV head in every layer: the largest layer budget + 1 (the incoming token),
        or the whole sequence (the policy's `slots`: the one place that says it)."""
        return self.make(num_layers).slots(prompt_len, gen_len)

    def evicts(self, prompt_len: int, gen_len: int, num_layers: Optional[int] = None) -> bool:
        """Some layer of some lane evicts."""
        if self.lanes:
            return any(spec.evicts(prompt_len, gen_len, num_layers) for _, spec in self.lanes)
        return self.make(num_layers).evicts(prompt_len, gen_len)

    def make(self, num_layers: Optional[int] = None) -> KVPolicy:
        """The policy object (built once per engine); `num_layers`: the model's, for per-layer budgets."""
        if self.lanes:
            return LanePolicy([(rows, spec.make(num_layers)) for rows, spec in self.lanes])
        return POLICIES[self.policy](self.budget, self.num_sinks, self.seed, self.hh_decay, num_layers=num_layers,
                                     pyramid_ratio=self.pyramid_ratio, head_cap=self.head_cap)

    def kv_budget_flag(self) -> Optional[int]:
        """N such that --kv-budget N gives this spec back, or ValueError when none does; None for full."""
        if self.lanes:
            raise ValueError("a lanes spec has no single --kv-budget")
        if self.budget is None:
            return None
        n = self.budget.total
        if KVSpec.of_total(self.policy, n, self.num_sinks, self.seed, self.hh_decay, self.pyramid_ratio,
                           self.head_cap) != self:
            raise ValueError(f"KV budget heavy {self.budget.heavy} + recent {self.budget.recent} cannot be written "
                             f"as --kv-budget for policy {self.policy} (it splits a budget evenly)")
        return n

    def describe(self) -> str:
        if self.lanes:
            return "lanes: " + ", ".join(f"{rows} x {spec.describe()}" for rows, spec in self.lanes)
        if self.budget is None:
            return self.policy
        ratio = f", ratio {self.pyramid_ratio:g}" if POLICIES[self.policy].layered else ""
        ratio += f", head cap {self.head_cap:g}" if POLICIES[self.policy].shares_heads else ""
        return f"{self.policy} (heavy {self.budget.heavy}, recent {self.budget.recent}{ratio})"


def make_policy(name: str, budget: Optional[Budget], num_sinks: int = 4, seed: int = 0,
                hh_decay: float = DEFAULT_DECAY, num_layers: Optional[int] = None,
                pyramid_ratio: float = DEFAULT_PYRAMID_RATIO, head_cap: float = DEFAULT_HEAD_CAP) -> KVPolicy:
    """A policy object from its parts (validated as a KVSpec)."""
    return KVSpec(name, budget, num_sinks, seed, hh_decay, pyramid_ratio=pyramid_ratio,
                  head_cap=head_cap).make(num_layers)


def resolve_budget(policy: str, prompt_len: int, hh_ratio: Optional[float] = None,
                   recent_ratio: Optional[float] = None, kv_budget: Optional[int] = None) -> Optional[Budget]:
    """Ratios or a token budget -> whole token counts (None for full, or when no budget flag is given)."""
    if policy == "full":
        return None
    if kv_budget is not None:
        if kv_budget < 1:
            raise ValueError(f"--kv-budget must be a positive number of tokens (got {kv_budget})")
        if _windowed(policy):
            heavy = kv_budget // 2
            return Budget(heavy, kv_budget - heavy)
        return Budget(0, kv_budget)
    if hh_ratio is None:
        return None
    heavy = int(hh_ratio * prompt_len)
    recent = heavy if recent_ratio is None else int(recent_ratio * prompt_len)
    if heavy + recent < 1:
        raise ValueError(f"--hh-ratio {hh_ratio} of a {prompt_len}-token prompt keeps no tokens: raise the ratio")
    if _windowed(policy):
        return Budget(heavy, recent)
    return Budget(0, heavy + recent)


def _windowed(policy: str) -> bool:
    """The policy's budget is heavy + recent (a --kv-budget splits evenly); the others keep one window."""
    return policy in POLICIES and POLICIES[policy].windowed
