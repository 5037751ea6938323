"""KV eviction's memory: the plan's cache bytes shrink with the budget on every cache placement (OPT and grouped-KV
Llama, and opt-30b at the paper's scale), and each tier's measured peak shrinks exactly as planned. The runs and
their data are tests/kv/test_kv_equivalence.py's."""
from __future__ import annotations

import pytest

from flexh2o.config import from_name
from flexh2o.engine import Engine
from flexh2o.kv.spec import KVSpec, resolve_budget
from flexh2o.planning.memory_plan import plan_memory
from flexh2o.sampling import TeacherForcer
from flexh2o.placement import Percent
from flexh2o.run_config import RunConfig
from test_kv_equivalence import BUDGETS, GEN, LENS, MODELS, _rc, data  # noqa: F401 (data: a module fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def _block_bytes(rc: RunConfig, slots: int) -> int:
    cfg = rc.model
    per_token = cfg.kv_heads * (2 * cfg.head_dim * 4 + 8 + 4)  # fp32 K and V, int64 position, fp32 score
    return rc.gpu_batch_size * slots * per_token


@pytest.mark.parametrize("percent", [[100, 0, 100, 0], [0, 100, 0, 100], [0, 0, 0, 0], [30, 30, 30, 30]])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_plan_cache_shrinks_with_budget(model, percent, tmp_path):
    full = _rc(model, "full", str(tmp_path), percent)
    h2o = _rc(model, "h2o", str(tmp_path), percent)
    blocks = MODELS[model].num_layers * full.num_gpu_batches
    pf, ph = plan_memory(full), plan_memory(h2o)
    assert sum(pf.bytes[t]["cache"] for t in pf.bytes) == blocks * _block_bytes(full, max(LENS) + GEN)
    assert sum(ph.bytes[t]["cache"] for t in ph.bytes) == blocks * _block_bytes(h2o, BUDGETS["h2o"].total + 1)
    for tier in pf.bytes:
        assert ph.bytes[tier]["cache"] * (max(LENS) + GEN) == pf.bytes[tier]["cache"] * (BUDGETS["h2o"].total + 1)


def test_plan_at_paper_scale():
    """opt-30b, 512 + 32 tokens, --hh-ratio 0.2: 102 heavy + 102 recent + 1 incoming slot instead of 544."""
    cfg = from_name("opt-30b")
    common = dict(percent=Percent(0, 100, 100, 0), gpu_batch_size=8, prompt_len=512, gen_len=32)
    full = plan_memory(RunConfig(model=cfg, **common)).bytes["gpu"]["cache"]
    h2o = plan_memory(RunConfig(model=cfg, kv=KVSpec("h2o", resolve_budget("h2o", 512, 0.2)), **common))
    assert h2o.bytes["gpu"]["cache"] * 544 == full * 205


@pytest.mark.parametrize("percent, tier", [([100, 0, 100, 0], "gpu"), ([100, 0, 0, 0], "disk")])
def test_tier_peaks_shrink_as_planned(percent, tier, data, offload_dir):
    """Weights stay on the gpu tier (fp32, no copies), so each tier's peak is exactly the plan's bytes. Blocks are
    allocated up front, so a few steps show the peak: 12 + 4 tokens, against a budget of 8 + 1 slots."""
    prompts, forced = data
    peaks, plans = {}, {}
    for policy in ("full", "h2o"):
        rc = _rc("opt", policy, offload_dir, percent, overlap=False).with_(gen_len=4)
        plans[policy] = plan_memory(rc)
        with Engine(rc) as eng:
            eng.generate(prompts, rc.gen_len, sampler=TeacherForcer(forced[:, :rc.gen_len]))
            peaks[policy] = eng.tiers[tier].peak
        assert peaks[policy] == plans[policy].bytes[tier]["weights"] + plans[policy].bytes[tier]["cache"], policy
    saved = plans["full"].bytes[tier]["cache"] - plans["h2o"].bytes[tier]["cache"]
    assert saved > 0 and peaks["full"] - peaks["h2o"] == saved
