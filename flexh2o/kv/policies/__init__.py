"""KV eviction policies, one per file; build one through flexh2o.kv.spec.KVSpec."""
from __future__ import annotations

from flexh2o.kv.policies.a2sf import DEFAULT_DECAY, A2SFPolicy  # noqa: F401  (re-exported)
from flexh2o.kv.policies.adakv import AdaKVPolicy
from flexh2o.kv.policies.base import DEFAULT_HEAD_CAP, DEFAULT_PYRAMID_RATIO, Budget, KVPolicy  # noqa: F401
from flexh2o.kv.policies.full import FullPolicy
from flexh2o.kv.policies.h2o import H2OPolicy
from flexh2o.kv.policies.h2o_sinks import H2OSinksPolicy
from flexh2o.kv.policies.local import LocalPolicy
from flexh2o.kv.policies.mean_attn import MeanAttentionPolicy
from flexh2o.kv.policies.mean_vnorm import MeanVNormPolicy
from flexh2o.kv.policies.merge import MergePolicy
from flexh2o.kv.policies.pyramid import PyramidPolicy
from flexh2o.kv.policies.random import RandomPolicy
from flexh2o.kv.policies.streaming import StreamingPolicy
from flexh2o.kv.policies.tova import TOVAPolicy
from flexh2o.kv.policies.vatp import VATPPolicy

POLICIES = {p.name: p for p in (FullPolicy, H2OPolicy, LocalPolicy, StreamingPolicy, RandomPolicy, TOVAPolicy,
                                A2SFPolicy, MeanAttentionPolicy, VATPPolicy, H2OSinksPolicy, MeanVNormPolicy,
                                PyramidPolicy, AdaKVPolicy, MergePolicy)}
