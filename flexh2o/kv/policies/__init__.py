"""KV eviction policies, one per file; build one through flexh2o.kv.spec.KVSpec."""
from __future__ import annotations

from flexh2o.kv.policies.base import Budget, KVPolicy  # noqa: F401  (re-exported)
from flexh2o.kv.policies.full import FullPolicy
from flexh2o.kv.policies.h2o import H2OPolicy
from flexh2o.kv.policies.local import LocalPolicy
from flexh2o.kv.policies.random import RandomPolicy
from flexh2o.kv.policies.streaming import StreamingPolicy

POLICIES = {p.name: p for p in (FullPolicy, H2OPolicy, LocalPolicy, StreamingPolicy, RandomPolicy)}
