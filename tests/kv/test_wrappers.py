"""Wrappers over a scoring policy (kv/policies/wrappers.py): per-layer budgets over tova (pyramid:tova), per-head
budgets over vatp (adakv:vatp) and merging over h2o (merge:h2o) equal the reference (tests/reference_policy.py, where a
wrapper is its own rule over the base policy's value and protection), in memory and on disk, on OPT and on
grouped-KV Llama; they differ from the plain wrappers (over mean_attn) and from the base policy alone; names that
wrap nothing valid are one line and exit 2."""
from __future__ import annotations

import pytest

import reference_kv as ref
from flexh2o.engine import Engine
from flexh2o.kv.policies import Budget, policy_class
from flexh2o.kv.spec import KVSpec
from flexh2o.sampling import TeacherForcer
from test_kv_equivalence import (ATOL, COMBOS, DECAY, GEN, HEAD_CAP, MODELS, RATIO, SEED, SINKS, _assert_matches,
                                 _engine, _rc, data, weights)  # noqa: F401  (module fixtures)
from test_validation import _fails

WRAPPED = {"pyramid:tova": Budget(0, 8), "adakv:vatp": Budget(5, 3), "merge:h2o": Budget(5, 3)}
PLACES = [c for c in COMBOS if c[0] in ("gpu-overlap", "disk-overlap")]  # memory and disk tiers


def _ref_policy(model: str, policy: str, budget: Budget) -> ref.RefPolicy:
    return ref.RefPolicy(policy, budget.heavy, budget.recent, SINKS, SEED, DECAY, MODELS[model].num_layers, RATIO,
                         HEAD_CAP)


@pytest.fixture(scope="module")
def reference(weights, data):  # noqa: F811
    """(model, policy) -> one teacher-forced RefGeneration per prompt, computed once per module."""
    cache = {}
    prompts, forced = data

    def get(model: str, policy: str, budget: Budget) -> list:
        if (model, policy) not in cache:
            pol = _ref_policy(model, policy, budget)
            cache[(model, policy)] = [ref.generate(MODELS[model], weights(model), p, GEN, pol, forced[i].tolist())
                                      for i, p in enumerate(prompts)]
        return cache[(model, policy)]
    return get


@pytest.mark.parametrize("combo", PLACES, ids=[c[0] for c in PLACES])
@pytest.mark.parametrize("policy", sorted(WRAPPED))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_wrapped_policy_matches_reference(model, policy, combo, data, reference, offload_dir):  # noqa: F811
    prompts, forced = data
    _, percent, overlap, ccc, batching, chunk = combo
    budget = WRAPPED[policy]
    rc = _rc(model, "h2o", offload_dir, percent, overlap, ccc, batching, chunk)
    rc = rc.with_(kv=KVSpec(policy, budget, SINKS, SEED, DECAY, pyramid_ratio=RATIO, head_cap=HEAD_CAP))
    with _engine(rc) as eng:
        gen = eng.generate(prompts, GEN, sampler=TeacherForcer(forced), record_logits=True, kept_stats=True)
    _assert_matches(gen, reference(model, policy, budget), budget, _ref_policy(model, policy, budget))


def test_wrappers_change_the_base_and_the_plain_wrapper(weights, data):  # noqa: F811
    """Each wrapped policy's logits differ from its base alone and from the wrapper over mean_attn (the plain name)
    by far more than the tolerance: the wrapper and the base both matter."""
    prompts, forced = data
    cfg, w = MODELS["llama"], weights("llama")

    def run(name: str, budget: Budget) -> list:
        return ref.generate(cfg, w, prompts[0], GEN, _ref_policy("llama", name, budget), forced[0].tolist()).step_logits

    def gap(a: list, b: list) -> float:
        return max(float((x - y).abs().max()) for x, y in zip(a, b))
    for name, budget in WRAPPED.items():
        wrapper, base = name.split(":")
        mine = run(name, budget)
        assert gap(mine, run(base, budget)) > 100 * ATOL, name
        assert gap(mine, run(wrapper, Budget(5, 3))) > 100 * ATOL, name


def test_wrapped_classes_keep_the_base_rule_and_add_their_own():
    tova, adakv_vatp, merge_h2o = (policy_class(n) for n in ("pyramid:tova", "adakv:vatp", "merge:h2o"))
    assert tova.layered and tova.uses_sinks and not tova.windowed and tova.decay == 0.0 and tova.priority_is_score
    assert adakv_vatp.shares_heads and adakv_vatp.needs_values and adakv_vatp.windowed
    assert merge_h2o.merges and merge_h2o.priority_is_score and not merge_h2o.layered
    assert policy_class("pyramid:tova") is tova  # one class per pair
    # pyramid over a policy without a window: P = the sinks in every layer, the rest shared out (mean 8)
    assert [b.total for b in KVSpec("pyramid:tova", Budget(0, 8), SINKS, pyramid_ratio=RATIO).make(2)
            .layer_budgets()] == [10, 6]
    assert KVSpec("adakv:vatp", Budget(5, 3)).describe() == "adakv:vatp (heavy 5, recent 3, head cap 2)"


@pytest.mark.parametrize("name, needle", [("pyramid:full", "scoring policy"), ("pyramid:pyramid", "scoring policy"),
                                          ("merge:vatp", "scoring policy"), ("stack:h2o", "WRAPPER:POLICY"),
                                          ("local:h2o", "WRAPPER:POLICY")])
def test_bad_wrapped_names_are_one_line(name, needle, capsys):
    from flexh2o.cli import run as cli
    with pytest.raises(ValueError, match=needle):
        KVSpec(name, Budget(5, 3))
    _fails(capsys, cli.main, ["--model", "opt-125m", "--prompt-len", "8", "--gen-len", "2", "--dry-run",
                              "--kv-policy", name, "--kv-budget", "16"], "--kv-policy")


def test_wrapped_policy_runs_from_the_command_line(capsys):
    from flexh2o.cli import run as cli
    assert cli.main(["--model", "opt-125m", "--prompt-len", "64", "--gen-len", "32", "--dry-run", "--kv-policy",
                     "pyramid:tova", "--kv-budget", "32", "--pyramid-ratio", "0", "--gpu-mem", "2GB",
                     "--cpu-mem", "4GB"]) == 0
    assert "kv policy pyramid:tova (heavy 0, recent 32, ratio 0)" in capsys.readouterr().out
