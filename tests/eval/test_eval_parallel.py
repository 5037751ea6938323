"""flexh2o-eval ppl --procs: the texts split between processes give the rows, in the same order and within fp32
noise, that one process gives."""
from __future__ import annotations

import pytest
import torch

from flexh2o.config import ModelConfig
from flexh2o.eval.common import EvalModel
from flexh2o.eval.parallel import lane_split
from flexh2o.eval.ppl import PplSettings, run_ppl

CFG = ModelConfig("tiny-llama", "llama", hidden=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn=128, vocab=1000,
                  max_positions=256, tie_embeddings=False)


class ByteTokens:
    """A stand-in tokenizer (module level: the spawned processes unpickle it): one id per byte."""

    def encode(self, text: str) -> list:
        return [4 + b for b in text.encode()]


@pytest.fixture
def texts(tmp_path):
    g = torch.Generator().manual_seed(3)
    paths = []
    for name in ("a", "b", "c"):
        path = tmp_path / f"{name}.txt"
        path.write_text(bytes(torch.randint(97, 123, (400,), generator=g).tolist()).decode())
        paths.append(str(path))
    return tuple(paths)


def test_procs_equal_one_process(texts):
    model = EvalModel("_DUMMY_", CFG, ByteTokens(), dtype=torch.float32, num_sinks=2)
    s = PplSettings(texts=texts, context=48, windows=2, prefix=4, budgets=("8", "25%"),
                    policies=("h2o", "tova", "streaming"))
    one = run_ppl(model, s, progress=False)
    split = run_ppl(model, s, progress=False, procs=2)
    key = [(r["policy"], r["budget"], r["text"]) for r in one.rows]
    assert key == [(r["policy"], r["budget"], r["text"]) for r in split.rows]
    assert len(key) == 3 * (1 + 3 * 2)
    assert split.machine["procs"] == 2 and "procs" not in one.machine  # the processes that ran
    assert [x["lanes"] for x in split.machine["split"]] == [len(g) for g in lane_split(model, s, 2)]
    assert sum(x["lanes"] for x in split.machine["split"]) == 1 + 3 * 2 and all(
        x["seconds"] > 0 for x in split.machine["split"])
    for a, b in zip(one.rows, split.rows):
        assert a["ppl"] == pytest.approx(b["ppl"], rel=1e-6) and a["ppl_late"] == pytest.approx(b["ppl_late"], rel=1e-6)
        assert a["tokens"] == b["tokens"]
    assert len({r["ppl"] for r in one.rows if r["text"] == texts[0]}) > 2  # the lanes really differ


def test_a_failing_process_is_named_in_one_line(texts):
    model = EvalModel("/nonexistent-checkpoint", CFG, ByteTokens(), dtype=torch.float32)
    s = PplSettings(texts=texts[:2], context=48, windows=1, prefix=4, budgets=("8",), policies=("h2o",))
    with pytest.raises(RuntimeError, match=r"ppl process [01] ") as err:
        run_ppl(model, s, progress=False, procs=2)
    assert "\n" not in str(err.value)


def test_lane_memory_defaults_to_a_share_of_the_available_memory(texts, monkeypatch):
    """No --lane-mem: each of the processes gets LANE_SHARE of the available memory over their count, and the result
    records the figure that ran; a given figure is kept."""
    import psutil
    from flexh2o.eval import common
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("Mem", (), {"available": 8e9})())
    model = EvalModel("_DUMMY_", CFG, ByteTokens(), dtype=torch.float32, num_sinks=2)
    s = PplSettings(texts=texts[:1], context=48, windows=1, prefix=4, budgets=("8",), policies=("h2o",))
    assert s.lane_mem is None
    assert run_ppl(model, s, progress=False).settings.lane_mem == common.LANE_SHARE * 8e9
    assert common.auto_lane_mem(2) == common.LANE_SHARE * 4e9
    given = PplSettings(texts=texts[:1], context=48, windows=1, prefix=4, budgets=("8",), policies=("h2o",),
                        lane_mem=1e6)
    assert run_ppl(model, given, progress=False).settings.lane_mem == 1e6


def test_lane_split_covers_every_lane_once_in_cache_size_order(texts):
    """--procs splits the lanes, not the texts: contiguous ranges in cache-size order that together hold every lane
    once; the small-budget process takes more lanes than the one with full and the large budgets."""
    from flexh2o.eval.parallel import lane_split
    from flexh2o.eval.ppl_rows import distinct_lanes as _lanes, table_jobs as _jobs
    from flexh2o.eval.common import spec_of
    model = EvalModel("_DUMMY_", CFG, ByteTokens(), dtype=torch.float32, num_sinks=2)
    s = PplSettings(texts=texts, context=200, windows=1, prefix=4, budgets=("8", "16", "100"),
                    policies=("h2o", "tova", "streaming", "a2sf"))
    groups = lane_split(model, s, 2)
    lanes = _lanes(_jobs(s))
    assert len(groups) == 2 and sorted(sum(groups, [])) == sorted(lanes)
    slots = lambda lane: spec_of(model, *lane).slots(4, 196, CFG.num_layers)  # noqa: E731
    assert max(map(slots, groups[0])) <= min(map(slots, groups[1]))
    assert len(groups[0]) > len(groups[1]) and ("full", None) in groups[1]
    assert len(lane_split(model, s, 100)) == len(lanes)


def test_lane_cost_counts_matmuls_held_tokens_and_evicting_steps_only():
    """lane_cost: weight per computed step, attention over the tokens held (up to the slots), the policy's slots only
    at steps past the budget, nothing in a follower's dormant steps."""
    from flexh2o.eval.parallel import POLICY_WEIGHT, lane_cost
    assert lane_cost(10, None, 2, 5, 1.0) == 5 + (3 + 4 + 5 + 6 + 7)  # full: held tokens grow, never evicts
    assert lane_cost(5, 4, 2, 5, 1.0) == 5 + (3 + 4 + 5 + 5 + 5) + POLICY_WEIGHT * 3 * 5  # evicts from step 2 on
    assert lane_cost(10, None, 2, 5, 1.0, dormant=2) == 3 + (5 + 6 + 7)
