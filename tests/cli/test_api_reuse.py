"""api.LLM keeps its engine: a second generate() call loads no weights again and answers as the first did (and as a
fresh LLM does); a call the kept plan cannot serve builds a new engine; close() frees it."""
from __future__ import annotations

import pytest

from flexh2o import LLM, SamplingParams
from flexh2o.weights.store import WeightStore
from tiny_models import write_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("reuse") / "ckpt"))


def test_second_generate_reuses_the_engine(ckpt, offload_dir, monkeypatch):
    loads = []
    fill = WeightStore.fill_from
    monkeypatch.setattr(WeightStore, "fill_from", lambda self, *a, **k: (loads.append(1), fill(self, *a, **k))[1])
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [40, 41, 42, 43, 44]]
    opts = {"gpu_batch_size": 2, "kv_policy": "h2o", "kv_budget": 3, "offload_dir": offload_dir, "no_warmup": True,
            "verbose": 0, "percent": (0, 100, 0, 100)}
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    with LLM(ckpt, **opts) as llm:
        first = [o.record() for o in llm.generate(prompts, params)]
        eng = llm.engine
        second = [o.record() for o in llm.generate(prompts, params)]
        assert llm.engine is eng and len(loads) == 1  # weights loaded once
        shorter = [o.record() for o in llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True))]
        assert llm.engine is eng and len(loads) == 1  # within the kept plan: the same engine
        llm.generate(prompts, SamplingParams(max_tokens=9, ignore_eos=True))
        assert llm.engine is not eng and len(loads) == 2  # past the kept plan's gen_len: built again
    assert llm.engine is None
    assert second == first and len(first) == 4 and all(len(r["token_ids"]) == 6 for r in first)
    assert [r["token_ids"] for r in shorter] == [r["token_ids"][:3] for r in first]
    with LLM(ckpt, **opts) as fresh:
        assert [o.record() for o in fresh.generate(prompts, params)] == first


def test_fewer_prompts_reuse_the_engine(ckpt, offload_dir, monkeypatch):
    """The default GPU batch follows the number of prompts, so every call with another number of prompts loaded
    the weights again (opt-350m: 4, 2, 4, 1 prompts = four engines), though a call with fewer prompts fits the kept
    plan (the README: reused while prompts and answers are no longer); its spare rows now idle."""
    loads = []
    fill = WeightStore.fill_from
    monkeypatch.setattr(WeightStore, "fill_from", lambda self, *a, **k: (loads.append(1), fill(self, *a, **k))[1])
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [40, 41, 42, 43, 44]]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    opts = {"offload_dir": offload_dir, "no_warmup": True, "verbose": 0}
    with LLM(ckpt, **opts) as llm:
        first = [o.record() for o in llm.generate(prompts, params)]
        eng = llm.engine
        fewer = [o.record() for o in llm.generate(prompts[1:3], params)]
        assert llm.engine is eng and len(loads) == 1
    with LLM(ckpt, **opts) as fresh:
        assert [o.record() for o in fresh.generate(prompts[1:3], params)] == fewer
    assert [r["token_ids"] for r in fewer] == [r["token_ids"] for r in first[1:3]]
