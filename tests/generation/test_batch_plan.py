"""generation/batch_plan.py: the plain plan computes every row; a LanePlan is checked against its run before it
runs (the figures of prompt copies and followers: tests/eval/test_eval_lanes.py, tests/generation/test_followers.py)."""
from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from flexh2o import engine
from flexh2o.generation.batch_plan import BatchPlan, LanePlan
from flexh2o.generation.sequences import Sequences


def _seqs(prompts, b):
    return Sequences(prompts, b, 1, 2, 0, 100)


def test_the_plain_plan_passes_every_row_through():
    plan = BatchPlan()
    ids, pos = torch.arange(6).view(3, 2), torch.arange(6).view(3, 2)
    assert plan.start(None, None, None, None) is plan
    got = plan.rows(0, ids, pos)
    assert got[0] is ids and got[1] is pos
    logits = torch.randn(3, 5)
    assert plan.logits(1, logits) is logits


def test_one_copy_is_the_plain_plan():
    assert type(LanePlan(1).start(None, SimpleNamespace(gpu_batch_size=3), None, None)) is BatchPlan


@pytest.mark.parametrize("copies, b, pipe, prompts, match", [
    (0, 4, None, None, "at least 1"),
    (2, 3, None, None, "must divide the GPU batch of 3"),
    (2, 4, object(), None, "whole model in one process"),
    (2, 4, None, [[5, 6], [7], [5, 6], [8]], "not 2 copies of the same prompts"),
])
def test_a_lane_plan_that_does_not_fit_its_run_is_refused_in_one_line(copies, b, pipe, prompts, match):
    rc = SimpleNamespace(gpu_batch_size=b, num_gpu_batches=1)
    seqs = _seqs(prompts, b) if prompts else None
    with pytest.raises(ValueError, match=match):
        LanePlan(copies).start(None, rc, seqs, pipe)


def test_copies_prefill_and_logits_cover_every_row():
    rc = SimpleNamespace(gpu_batch_size=4, num_gpu_batches=1, compress_cache=None)
    plan = LanePlan(2).start(None, rc, _seqs([[5, 6], [7], [5, 6], [7]], 4), None)
    ids, pos = torch.arange(8).view(4, 2), torch.arange(8).view(4, 2)
    assert torch.equal(plan.rows(0, ids, pos)[0], ids[:2])  # prefill: one copy
    assert torch.equal(plan.rows(1, ids, pos)[0], ids)  # decode without followers: every row
    logits = torch.randn(2, 5)
    assert torch.equal(plan.logits(0, logits), torch.cat([logits, logits]))


def test_the_engine_compute_has_no_eval_only_branch():
    src = inspect.getsource(engine._Run.compute)
    assert not any(word in src for word in ("follower", "copies", "alias", "woken")), src
