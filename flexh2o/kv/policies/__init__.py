"""KV eviction policies, one per file; `make_policy` builds one by name."""
from __future__ import annotations

from typing import Optional

from flexh2o.kv.policies.base import Budget, KVPolicy
from flexh2o.kv.policies.full import FullPolicy
from flexh2o.kv.policies.h2o import H2OPolicy
from flexh2o.kv.policies.local import LocalPolicy
from flexh2o.kv.policies.random import RandomPolicy
from flexh2o.kv.policies.streaming import StreamingPolicy

POLICIES = {p.name: p for p in (FullPolicy, H2OPolicy, LocalPolicy, StreamingPolicy, RandomPolicy)}


def make_policy(name: str, budget: Optional[Budget], num_sinks: int = 4, seed: int = 0) -> KVPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown KV policy {name!r}: choose one of {', '.join(POLICIES)}")
    if name != "full" and budget is None:
        raise ValueError(f"KV policy {name} needs a budget: give --kv-budget N or --hh-ratio R")
    if name == "streaming" and budget.total <= num_sinks:
        raise ValueError(f"--kv-budget {budget.total} must exceed --num-sinks {num_sinks} for the streaming policy")
    return POLICIES[name](budget, num_sinks, seed)


def resolve_budget(policy: str, prompt_len: int, hh_ratio: Optional[float] = None,
                   recent_ratio: Optional[float] = None, kv_budget: Optional[int] = None) -> Optional[Budget]:
    """Turn ratios or a token budget into whole token counts, once, at the edge.

    --hh-ratio r: heavy = int(r * prompt_len), recent = heavy (or int(recent_ratio * prompt_len)).
    --kv-budget N: total N, split evenly (heavy = N // 2) for policies with a recent window; all recent otherwise.
    """
    if policy == "full":
        return None
    if kv_budget is not None:
        if kv_budget < 1:
            raise ValueError(f"--kv-budget must be a positive number of tokens (got {kv_budget})")
        if policy in ("h2o", "random"):
            heavy = kv_budget // 2
            return Budget(heavy, kv_budget - heavy)
        return Budget(0, kv_budget)
    if hh_ratio is None:
        return None
    heavy = int(hh_ratio * prompt_len)
    recent = heavy if recent_ratio is None else int(recent_ratio * prompt_len)
    if heavy + recent < 1:
        raise ValueError(f"--hh-ratio {hh_ratio} of a {prompt_len}-token prompt keeps no tokens: raise the ratio")
    if policy in ("h2o", "random"):
        return Budget(heavy, recent)
    return Budget(0, heavy + recent)
