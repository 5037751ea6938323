"""Wrappers over a scoring policy: per-layer budgets (`pyramid`, kv/policies/pyramid.py), per-head budgets (`adakv`,
kv/policies/adakv.py) and merging (`merge`, kv/policies/merge.py). A wrapper is a class that changes how many tokens
a layer or head keeps, or what happens to an evicted token, and leaves the priority and the scores to the policy
it wraps; `wrap` puts it in front of a scoring policy's class, so `pyramid:tova` is TOVA's priority under pyramid
budgets (with the sinks protected, as every wrapper does). The plain names are the wrappers over mean_attn.

A scoring policy is one that accumulates attention scores (`needs_scores`) and is not itself wrapped. Merging
changes the cached values, so it wraps only policies that do not read them (`needs_values`).
"""
from __future__ import annotations

import functools

from flexh2o.kv.policies.adakv import HeadBudgets
from flexh2o.kv.policies.merge import Merging
from flexh2o.kv.policies.pyramid import LayerBudgets

WRAPPERS = (LayerBudgets, HeadBudgets, Merging)
SEP = ":"


def wrapper_named(name: str):
    """The wrapper class called `name` (pyramid, adakv, merge), or None."""
    return next((w for w in WRAPPERS if w.wrapper == name), None)


def is_wrapped(cls) -> bool:
    return issubclass(cls, WRAPPERS)


def can_wrap(wrapper, base) -> bool:
    """`wrapper` may wrap policy class `base`: a scoring policy (a merging wrapper: one that reads no values)."""
    return base.needs_scores and not is_wrapped(base) and not (wrapper.merges and base.needs_values)


@functools.lru_cache(maxsize=None)
def wrap(wrapper, base):
    """The policy class `wrapper` over `base` (one class per pair), named WRAPPER:BASE."""
    name = f"{wrapper.wrapper}{SEP}{base.name}"
    return type(name, (wrapper, base), {"name": name, "__module__": __name__,
                                        "__doc__": f"{wrapper.wrapper} over {base.name} (see {__name__})."})


def composed(name: str, registry: dict):
    """The class of a WRAPPER:POLICY name over the policies of `registry`, or ValueError saying what is wrong."""
    head, _, base = name.partition(SEP)
    wrapper = wrapper_named(head)
    scoring = [n for n, c in registry.items() if wrapper is not None and can_wrap(wrapper, c)]
    if wrapper is None or base not in scoring:
        raise ValueError(f"unknown KV policy {name!r}: a wrapped policy is WRAPPER{SEP}POLICY, WRAPPER one of "
                         f"{', '.join(w.wrapper for w in WRAPPERS)} and POLICY a scoring policy"
                         + (f" ({', '.join(scoring)})" if scoring else ""))
    return wrap(wrapper, registry[base])
