"""The one largest-batch search: started from an affine guess it returns exactly what the plain doubling-and-bisection
search returns (and what a linear scan returns), with fewer plans."""
from __future__ import annotations

import random

import pytest
import torch

from flexh2o.compress import CompressionSpec
from flexh2o.config import from_name
from flexh2o.kv.policies.base import Budget
from flexh2o.kv.spec import KVSpec
from flexh2o.placement import Percent
from flexh2o.planning.memory_plan import largest_batch, largest_passing, plan_memory
from flexh2o.run_config import RunConfig


def _scan(ok, limit: int) -> int:
    """The independent answer: the last b of 1..limit before ok first fails (ok is monotone)."""
    best = 0
    for b in range(1, limit + 1):
        if not ok(b):
            break
        best = b
    return best


def test_any_guess_gives_the_scans_answer():
    rng = random.Random(0)
    for _ in range(3000):
        t, limit = rng.randint(0, 300), rng.randint(0, 320)
        guess = rng.choice([None, 0, 1, t, t + 1, max(t - 1, 0), rng.randint(-5, 10 ** 6)])
        ok = (lambda t: lambda b: b <= t)(t)
        assert largest_passing(ok, limit, guess) == _scan(ok, limit), (t, limit, guess)


def _rc(model, percent, **kw) -> RunConfig:
    kw = {"gpu_mem": 16 << 30, "cpu_mem": 200 << 30, **kw}
    return RunConfig(model=from_name(model), percent=Percent.parse(list(percent)), gpu_batch_size=1, prompt_len=512,
                     gen_len=32, dtype=torch.float16, **kw)


CASES = [("opt-1.3b", (0, 100, 100, 0), {}), ("opt-6.7b", (0, 100, 0, 100), {}),
         ("opt-30b", (0, 100, 100, 0), {"kv": KVSpec("h2o", Budget(54, 54))}),
         ("opt-1.3b", (50, 50, 30, 70), {"compress_cache": CompressionSpec(4, 64, -1)}),
         ("opt-125m", (100, 0, 100, 0), {"gpu_mem": 1 << 30})]


@pytest.mark.parametrize("model, percent, kw", CASES)
def test_largest_batch_equals_the_unguided_search_with_fewer_plans(model, percent, kw):
    rc, counted = _rc(model, percent, **kw), []

    def plan_of(r):
        counted.append(r.gpu_batch_size)
        return plan_memory(r)

    unguided = []

    def fits(b: int) -> bool:
        unguided.append(b)
        return plan_memory(rc.with_(gpu_batch_size=b)).overflow() is None

    limit = 1 << 16
    assert largest_batch(rc, limit, plan_of=plan_of) == largest_passing(fits, limit) > 0
    assert len(counted) == len(set(counted)), counted  # no batch planned twice
    assert len(counted) < len(unguided), (counted, unguided)  # a bracket, not a sweep
