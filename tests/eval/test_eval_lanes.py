"""flexh2o-eval's lanes: several (policy, budget) lanes in one engine pass give the figures of separate runs of each
lane (the same log-probabilities within fp32 noise, 1e-6; the same argmax hits), and the lane policy refuses a block
that does not cover its rows."""
from __future__ import annotations

import pytest
import torch

from flexh2o.config import ModelConfig
from flexh2o.eval.common import EvalModel, forced_run, lanes_run, spec_of
from flexh2o.eval.common import lane_passes
from flexh2o.kv.policies import Budget
from flexh2o.kv.spec import KVSpec, make_policy
from flexh2o.kv.policies.lanes import LanePolicy

CFG = ModelConfig("tiny-llama", "llama", hidden=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn=128, vocab=1000,
                  max_positions=256, tie_embeddings=False)
LENS = [5, 9, 3]
STEPS = 30
LANES = [("h2o", 8), ("tova", 8), ("a2sf", 10), ("mean_attn", 6), ("vatp", 12), ("h2o_sinks", 10),
         ("streaming", 7), ("local", 6), ("random", 8), ("h2o", 5), ("vatp", 7), ("random", 11),
         ("mean_vnorm", 9), ("pyramid", 9), ("adakv", 8), ("merge", 8), ("pyramid", 12), ("adakv", 11),
         ("merge", 13), ("full", None)]
# the same policy at several budgets, in rows apart: the lanes batch one policy's rows with per-row budgets

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(4, 1000, (n,), generator=g).tolist() for n in LENS]
    return prompts, torch.randint(4, 1000, (len(LENS), STEPS), generator=g)


def test_lanes_equal_separate_runs(data):
    prompts, targets = data
    model = EvalModel("_DUMMY_", CFG, tokenizer=None, dtype=torch.float32, num_sinks=2, hh_decay=0.9,
                      pyramid_ratio=0.25, head_cap=1.5)
    together = lanes_run(model, LANES, prompts, targets)
    gaps = []
    for (policy, tokens), (logprob, correct) in zip(LANES, together):
        alone = forced_run(model, policy, tokens, prompts, targets)
        torch.testing.assert_close(logprob, alone.logprob, atol=1e-6, rtol=0, msg=policy)  # measured: <= 1.5e-7
        assert torch.equal(correct, alone.correct), policy
        gaps.append(float((logprob - together[-1][0]).abs().max()))  # against the full lane
    assert min(gaps[:-1]) > 1e-3, "the lanes must really evict differently from full"


def test_lane_passes_group_by_cache_size():
    model = EvalModel("_DUMMY_", CFG, tokenizer=None, dtype=torch.float32)
    lanes = [("h2o", 64), ("tova", 512), ("h2o", 512), ("full", None), ("local", 64)]
    per_lane = 2 * CFG.num_layers * CFG.kv_heads * (2 * CFG.head_dim * 4 + 12)  # 2 rows per lane
    passes = lane_passes(model, lanes, 64, 960, 2, mem=2 * 513 * per_lane)
    assert passes == [[("h2o", 64), ("local", 64)], [("tova", 512), ("h2o", 512)], [("full", None)]]
    assert lane_passes(model, lanes, 64, 960, 2, mem=1e12) == [sorted(lanes, key=lambda x: x[1] or 2000)]
    assert lane_passes(model, lanes, 64, 960, 2, mem=1e12, separate=True) == [[lane] for lane in lanes]


def test_lane_policy_needs_its_whole_batch():
    lanes = LanePolicy([(2, make_policy("h2o", Budget(2, 2))), (1, make_policy("tova", Budget(0, 4)))])
    pos = torch.arange(6).expand(2, 1, 6)  # 2 rows, not 3
    with pytest.raises(ValueError, match="3 rows"):
        lanes.decode_evict(pos, torch.rand(2, 1, 6), 0, torch.tensor([5, 5]))


def test_lanes_within_budget_are_skipped_and_the_others_decide_as_alone():
    """decode_evict runs the policies only over the lanes up to the last one holding more tokens than its budget
    (cur_pos + 1 > total), up to their last used slot: each row's eviction is still its own policy's alone, and a
    step at which no lane is over budget evicts nothing."""
    g = torch.Generator().manual_seed(7)
    lanes = [(2, make_policy("h2o", Budget(2, 2))), (1, make_policy("adakv", Budget(2, 1), num_sinks=1)),
             (2, make_policy("tova", Budget(0, 9))), (1, make_policy("full", None))]  # tova: 9 > the 6 tokens held
    policy = LanePolicy(lanes)
    pos = torch.full((6, 2, 12), -1)
    pos[:, :, :6] = torch.stack([torch.randperm(6, generator=g) for _ in range(12)]).view(6, 2, 6)
    score, cur = torch.rand(6, 2, 12, generator=g), torch.full((6,), 5)
    assert policy._evicting(cur, 0) == 2
    evict = policy.decode_evict(pos, score, 0, cur)
    start = 0
    for rows, p in lanes:
        sl = slice(start, start + rows)
        alone = p.decode_evict(pos[sl], score[sl], 0, cur[sl])
        assert torch.equal(evict[sl], alone if alone is not None else torch.zeros_like(evict[sl])), p.name
        start += rows
    assert evict[:3].any() and not evict[3:].any()
    first3 = torch.where(pos < 3, pos, -1)  # the step after the prompt's 3 tokens: every lane within budget
    assert policy.decode_evict(first3, score, 0, torch.full((6,), 2)) is None


def test_prompt_copies_prefill_once_and_match_a_full_prefill(data):
    """A LanePlan of prompt copies: the batch's prompts prefilled once for every copy give the figures of prefilling
    every row (each copy under its own lane); a batch that is not copies is refused in one line."""
    from flexh2o.eval.common import _forced
    prompts, targets = data
    model = EvalModel("_DUMMY_", CFG, tokenizer=None, dtype=torch.float32, num_sinks=2, hh_decay=0.9)
    lanes = [("a2sf", 6), ("h2o", 6), ("merge", 7)]
    spec = KVSpec.of_lanes([(len(prompts), spec_of(model, p, b)) for p, b in lanes])
    args = (model, spec, prompts * 3, targets.repeat(3, 1), None, 1)
    once = _forced(*args, prefill_batch=3 * len(prompts), copies=3)
    every = _forced(*args, prefill_batch=3 * len(prompts), copies=1)
    torch.testing.assert_close(once.logprob, every.logprob, atol=1e-6, rtol=0)
    assert torch.equal(once.correct, every.correct)
    with pytest.raises(ValueError, match="not 3 copies of the same prompts"):
        _forced(model, spec, prompts[::-1] + prompts * 2, targets.repeat(3, 1), None, 1,
                prefill_batch=3 * len(prompts), copies=3)


def test_lanes_one_stride_apart_read_as_views_equal_separate_runs(data):
    """One row per lane, budget-major (lane_passes' order): each policy's rows are evenly spaced, so LanePolicy
    reads them as strided views; the figures still equal separate runs."""
    prompts, targets = data
    model = EvalModel("_DUMMY_", CFG, tokenizer=None, dtype=torch.float32, num_sinks=2, hh_decay=0.9,
                      pyramid_ratio=0.25, head_cap=1.5)
    pols = ("h2o", "tova", "a2sf", "vatp", "mean_vnorm", "pyramid", "adakv", "merge", "streaming")
    lanes = [(p, b) for b in (6, 9, 13) for p in pols] + [("full", None)]
    assert lane_passes(model, lanes, 9, STEPS, 1, mem=1e12) == [lanes]
    spec = KVSpec.of_lanes([(1, spec_of(model, p, b)) for p, b in lanes])
    policy = spec.make(CFG.num_layers)
    groups = policy._state("cpu").groups
    assert all(g.view is not None and g.view.step == len(pols) for g in groups)
    together = lanes_run(model, lanes, prompts[:1], targets[:1])
    for (policy_name, tokens), (logprob, correct) in zip(lanes, together):
        alone = forced_run(model, policy_name, tokens, prompts[:1], targets[:1])
        # fp32 log-probabilities near -7 (vocab 1000) are a few ulps apart when the batch's shape changes the matmul
        # kernels' summation order: 1.4e-6 for mean_vnorm at 6 tokens on an Intel Xeon with AVX-512 and AMX
        torch.testing.assert_close(logprob, alone.logprob, atol=4e-6, rtol=0, msg=policy_name)
        assert torch.equal(correct, alone.correct), policy_name


def test_wrapped_policies_run_as_lanes_and_are_checked_by_name(data):
    """flexh2o-eval takes WRAPPER:POLICY names as flexh2o-run does (pyramid over tova, adakv over vatp): as lanes they
    give the figures of separate runs; a name that is no evicting policy is refused with the choices."""
    from flexh2o.eval.ppl_rows import PplSettings
    from flexh2o.eval.recall import RecallSettings
    prompts, targets = data
    model = EvalModel("_DUMMY_", CFG, tokenizer=None, dtype=torch.float32, num_sinks=2, hh_decay=0.9,
                      pyramid_ratio=0.25, head_cap=1.5)
    lanes = [("pyramid:tova", 9), ("adakv:vatp", 8), ("merge:h2o", 8), ("vatp", 8), ("full", None)]
    together = lanes_run(model, lanes, prompts, targets)
    for (policy_name, tokens), (logprob, correct) in zip(lanes, together):
        alone = forced_run(model, policy_name, tokens, prompts, targets)
        torch.testing.assert_close(logprob, alone.logprob, atol=1e-6, rtol=0, msg=policy_name)
        assert torch.equal(correct, alone.correct), policy_name
    assert not torch.equal(together[1][0], together[3][0])  # adakv's per-head budgets change vatp's figures
    PplSettings(policies=("pyramid:tova", "adakv:vatp"))
    RecallSettings(policies=("merge:h2o",))
    for bad, needle in (("merge:vatp", "scoring policy"), ("full", "always runs"), ("h2o2", "choose one of")):
        with pytest.raises(ValueError, match=needle):
            PplSettings(policies=(bad,))
        with pytest.raises(ValueError, match=needle):
            RecallSettings(policies=(bad,))
