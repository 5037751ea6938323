"""KV eviction policies, one per file; build one through flexh2o.kv.spec.KVSpec.

POLICIES names every policy; `policy_class` also reads WRAPPER:POLICY names (kv/policies/wrappers.py), e.g.
`pyramid:tova`. A policy's parameters are declared on its class (`params`, kv/policies/params.py): `policy_params`
lists those of every policy."""
from __future__ import annotations

from flexh2o.kv.policies.a2sf import DEFAULT_DECAY, A2SFPolicy  # noqa: F401  (re-exported)
from flexh2o.kv.policies.adakv import DEFAULT_HEAD_CAP, AdaKVPolicy  # noqa: F401
from flexh2o.kv.policies.base import Budget, KVPolicy  # noqa: F401
from flexh2o.kv.policies.full import FullPolicy
from flexh2o.kv.policies.h2o import H2OPolicy
from flexh2o.kv.policies.h2o_sinks import H2OSinksPolicy
from flexh2o.kv.policies.local import LocalPolicy
from flexh2o.kv.policies.mean_attn import MeanAttentionPolicy
from flexh2o.kv.policies.mean_keydiff import MeanKeyDiffPolicy
from flexh2o.kv.policies.mean_vnorm import MeanVNormPolicy
from flexh2o.kv.policies.merge import MergePolicy
from flexh2o.kv.policies.params import all_params
from flexh2o.kv.policies.pyramid import DEFAULT_PYRAMID_RATIO, PyramidPolicy  # noqa: F401
from flexh2o.kv.policies.random import RandomPolicy
from flexh2o.kv.policies.streaming import StreamingPolicy
from flexh2o.kv.policies.tova import TOVAPolicy
from flexh2o.kv.policies.vatp import VATPPolicy
from flexh2o.kv.policies.wrappers import SEP, composed

POLICIES = {p.name: p for p in (FullPolicy, H2OPolicy, LocalPolicy, StreamingPolicy, RandomPolicy, TOVAPolicy,
                                A2SFPolicy, MeanAttentionPolicy, VATPPolicy, H2OSinksPolicy, MeanVNormPolicy,
                                PyramidPolicy, AdaKVPolicy, MergePolicy, MeanKeyDiffPolicy)}


def policy_class(name: str):
    """The class of policy `name`: one of POLICIES, or WRAPPER:POLICY; ValueError naming the choices otherwise."""
    if name in POLICIES:
        return POLICIES[name]
    if SEP in name:
        return composed(name, POLICIES)
    raise ValueError(f"unknown KV policy {name!r}: choose one of {', '.join(POLICIES)}")


def policy_params() -> tuple:
    """Every parameter any policy declares (its flag, default, help and range: kv/policies/params.Param)."""
    return all_params(POLICIES.values())
