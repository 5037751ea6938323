"""Per-layer budgets (the pyramid policy): the layer budgets against the reference's own rounding, their sum and
shape; the slots every layer allocates (the largest layer's) in the policy, the spec, the memory plan and
--dry-run; bad --pyramid-ratio values are one line and exit 2. Engine-vs-reference: tests/kv/test_kv_equivalence.py,
decisions: tests/kv/test_policies.py, lanes: tests/eval/test_eval_lanes.py."""
from __future__ import annotations

import pytest

from flexh2o.cli import run as cli
from flexh2o.config import from_name
from flexh2o.kv.policies import Budget
from flexh2o.kv.policies.pyramid import pyramid_budgets
from flexh2o.kv.spec import KVSpec
from flexh2o.placement import Percent
from flexh2o.planning.memory_plan import plan_memory
from flexh2o.run_config import RunConfig
from reference_kv import RefPolicy
from test_validation import _fails, policy_flag_entries

GRID = [(Budget(h, r), layers, ratio, sinks) for h, r in ((3, 2), (32, 32), (60, 4), (4, 0), (0, 7))
        for layers in (1, 2, 3, 30) for ratio in (0.0, 0.25, 0.5, 1 / 3, 1.0) for sinks in (0, 2, 4)
        if sinks <= h and r + sinks >= 1]


@pytest.mark.parametrize("budget, layers, ratio, sinks", GRID)
def test_layer_budgets_match_reference_and_keep_the_mean(budget, layers, ratio, sinks):
    got = pyramid_budgets(budget, layers, ratio, sinks)
    ref = RefPolicy("pyramid", budget.heavy, budget.recent, sinks, num_layers=layers, pyramid_ratio=ratio)
    assert [b.total for b in got] == [ref.budget_at(layer) for layer in range(layers)]
    assert sum(b.total for b in got) == layers * budget.total  # the mean is the given budget, exactly
    assert all(b.recent == budget.recent and b.heavy >= sinks for b in got)  # every layer keeps its protected ones
    assert all(a.total >= b.total for a, b in zip(got, got[1:]))  # never more in an upper layer
    if ratio == 1.0:
        assert {b.total for b in got} == {budget.total}


def test_layer_budgets_by_hand():
    # 2 layers, P = 3 + 4 = 7, X = 2 * 1 extra: shares 1.6 and 0.4 -> floors 1, 0, the left-over token to layer 0
    assert [b.total for b in pyramid_budgets(Budget(5, 3), 2, 0.25, 4)] == [9, 7]
    # 3 layers, ratio 0: weights 1, 1/2, 0 of 3 * 4 extra tokens: 8, 4, 0
    assert [b.total for b in pyramid_budgets(Budget(6, 2), 3, 0.0, 2)] == [12, 8, 4]


def test_slots_are_the_largest_layer_everywhere():
    cfg = from_name("opt-125m")  # 12 layers
    spec = KVSpec("pyramid", Budget(32, 32), num_sinks=4, pyramid_ratio=0.25)
    layers = pyramid_budgets(spec.budget, cfg.num_layers, 0.25, 4)
    assert layers[0].total > spec.budget.total > layers[-1].total
    assert spec.slots(64, 960, cfg.num_layers) == layers[0].total + 1
    assert spec.evicts(64, 960, cfg.num_layers)
    with pytest.raises(ValueError, match="number of layers"):
        spec.slots(64, 960)
    rc = RunConfig(model=cfg, percent=Percent(100, 0, 100, 0), gpu_batch_size=2, prompt_len=64, gen_len=960, kv=spec)
    uniform = rc.with_(kv=KVSpec("h2o_sinks", Budget(32, 32)))
    assert rc.cache_slots() == layers[0].total + 1 and uniform.cache_slots() == 65
    cache = plan_memory(rc).bytes["gpu"]["cache"]
    assert cache * 65 == plan_memory(uniform).bytes["gpu"]["cache"] * (layers[0].total + 1)


def test_dry_run_shows_the_largest_layer_slots(capsys):
    argv = ["--model", "opt-125m", "--prompt-len", "64", "--gen-len", "32", "--dry-run", "--kv-policy", "pyramid",
            "--kv-budget", "32", "--pyramid-ratio", "0"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    largest = pyramid_budgets(Budget(16, 16), 12, 0.0, 4)[0].total
    assert f"cache slots {largest + 1}" in out, out


@pytest.mark.parametrize("main, argv, prog", policy_flag_entries("pyramid", "ppl"))
@pytest.mark.parametrize("ratio", ["1.5", "-0.1", "nan"])
def test_bad_pyramid_ratio_is_one_line(main, argv, prog, ratio, capsys):
    err = _fails(capsys, main, argv + ["--pyramid-ratio", ratio], prog=prog)
    assert err.startswith(f"{prog}: error: --pyramid-ratio {ratio}"), err
