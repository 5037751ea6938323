"""benchmarks/fair.py: Accelerate's largest completing batch is found by doubling then bisecting; flexh2o's process
overhead outside its tiers is fitted per batch from two probes and its tiers sized for the batch it runs
(fair_overhead.py)."""
from __future__ import annotations

import math
import os
import sys
import types

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import fair  # noqa: E402
import fair_overhead as fo  # noqa: E402
from bench_common import Outcome  # noqa: E402


@pytest.mark.parametrize("largest", [0, 1, 2, 11, 64, 100])
def test_largest_completing_finds_the_boundary(largest):
    got, tries = fair.largest_completing(lambda b: b <= largest, limit=100)
    assert got == largest
    assert [b for b, _ in tries][:2] == ([1] if largest == 0 else [1, 2])
    assert len(tries) <= 2 * (largest.bit_length() + 1) + 1  # doubling, then bisection: logarithmic


def test_largest_completing_stops_at_the_limit():
    got, tries = fair.largest_completing(lambda b: True, limit=40)
    assert got == 40 and max(b for b, _ in tries) <= 40


def test_largest_completing_listed_batches_stop_at_the_first_failure():
    seen = []

    def completes(b):
        seen.append(b)
        return b <= 40
    got, tries = fair.largest_completing(completes, limit=100, batches=[64, 16, 32, 128])
    assert got == 32 and seen == [16, 32, 64] and tries == [(16, True), (32, True), (64, False)]
    assert fair.largest_completing(lambda b: False, limit=100, batches=[8])[0] == 0
    assert fair.largest_completing(lambda b: True, limit=50, batches=[8, 64])[0] == 8  # 64 is over the limit


MiB = 1 << 20
CAP = 2560 * MiB


def _args(**kw):
    base = dict(model="opt-1.3b", prompt_len=64, gen_len=32, dtype="float32", compute_dtype="float32", timeout=60,
                hardware=None, fair_overhead="measure", fair_probe_batch=8, fair_max_batch=256, hh_ratio=None,
                budget_pct=20)
    return types.SimpleNamespace(**{**base, **kw})


def _plan(n, budget, k=1):
    """A searched plan's argv: n sequences as k GPU batches, the budget split 90/10 as flexh2o_best does."""
    return ["--model", "opt-1.3b", "--percent", "0", "0", "0", "0", "100", "0", "--gpu-batch-size", str(n // k),
            "--num-gpu-batches", str(k), "--gpu-mem", str(int(budget * 0.9)), "--cpu-mem",
            str(budget - int(budget * 0.9))]


def test_fit_is_the_line_through_both_probes():
    fit = fo.fit_overhead({1: 300 * MiB, 8: 335 * MiB})
    assert fit.per_seq == 5 * MiB and fit.base == 295 * MiB
    assert fit.need(1) == math.ceil(1.15 * 300 * MiB) and fit.need(81) == math.ceil(1.15 * 700 * MiB)
    assert fo.OverheadFit(800 * MiB, 0.0, margin=1.0).need(256) == 800 * MiB  # a fixed figure: no margin


def test_fit_clamps_a_shrinking_overhead_at_the_larger_probe():
    fit = fo.fit_overhead({8: 290 * MiB, 1: 300 * MiB})  # the larger batch measured less (RSS noise)
    assert fit.per_seq == 0 and fit.base == 300 * MiB  # never below a probe
    assert fo.fit_overhead({1: 280 * MiB}) == fo.OverheadFit(280 * MiB, 0.0)
    with pytest.raises(ValueError, match="one or two batches"):
        fo.fit_overhead({})


def test_plan_seqs_and_tiers_read_the_searched_argv():
    argv = _plan(256, 1000 * MiB, k=2)
    assert fo.plan_seqs(argv) == 256 and fo.plan_tiers(argv) == 1000 * MiB
    assert fo.plan_seqs(["--gpu-batch-size", "81", "--gpu-mem", "1GB", "--cpu-mem", "64MB"]) == 81
    assert fo.plan_tiers(["--gpu-mem", "1GB", "--cpu-mem", "64MB"]) == (1024 + 64) * MiB
    with pytest.raises(ValueError, match="no --gpu-batch-size"):
        fo.plan_seqs(["--gpu-mem", "1GB"])


def test_measured_fit_probes_each_batch_with_the_system_flags():
    seen = []

    def run(argv, timeout, env, cap):
        seen.append(argv)
        b = int(argv[argv.index("--gpu-batch-size") + 1])
        peak = {"cpu_rss": (1000 + 300 + 4 * b) * MiB, "gpu": 900 * MiB, "cpu_tier": 100 * MiB, "disk": 0}
        return Outcome("ok", {"peak_bytes": peak})
    flags = {"kv_policy": "h2o", "kv_budget": 19, "compress_weight": True, "compress_cache": True}
    lines = []
    fit = fo.measured_fit(_args(), {}, CAP, flags, run, "h2o-q4", lines.append)
    assert fit.per_seq == 4 * MiB and fit.base == 300 * MiB
    assert [a[a.index("--gpu-batch-size") + 1] for a in seen] == ["1", "8"]
    for a in seen:
        assert a[a.index("--prompt-len") + 1] == "64" and a[a.index("--gen-len") + 1] == "2"
        assert a[a.index("--num-gpu-batches") + 1] == "1" and a[a.index("--kv-budget") + 1] == "19"
        assert "--compress-weight" in a and "--compress-cache" in a and a[a.index("--percent") + 3] == "100"
    assert len(lines) == 3 and "304.0 MiB" in lines[0] and "332.0 MiB" in lines[1] and "per sequence" in lines[2]
    seen.clear()
    fo.measured_fit(_args(fair_max_batch=1), {}, CAP, flags, run, "h2o-q4", lines.append)
    assert len(seen) == 1  # no batch larger than 1 runs: one probe


def test_a_failed_probe_is_a_clear_error():
    with pytest.raises(RuntimeError, match="full's process overhead at batch 1 .*error killed at the memory cap"):
        fo.probe_overhead(_args(), {}, CAP, {}, 1, lambda *a: Outcome("error", None, "killed at the memory cap"),
                          "full", lambda line: None)


def _growing_search(budgets, seqs_per_mib=0.1, most=256):
    """A fake flexh2o search whose batch grows with its budget (seqs_per_mib sequences per MiB of tiers)."""
    def search(budget):
        budgets.append(budget)
        n = max(1, min(most, int(budget / MiB * seqs_per_mib)))
        return _plan(n, budget), float(n), [(budget, "tried")]
    return search


def _budget_fits(fit, argv):
    return fit.need(fo.plan_seqs(argv)) <= CAP - fo.plan_tiers(argv)


def test_sized_search_iterates_to_the_batch_it_runs():
    fit = fo.OverheadFit(280 * MiB, 3 * MiB)  # at 256 sequences: 1.15 x 1048 MiB outside the tiers
    budgets, lines = [], []

    def search(budget):  # more tiers, fewer sequences (the weights move into memory): 200, 190, 180, 170...
        budgets.append(budget)
        n = 210 - 10 * len(budgets)
        return _plan(n, budget), float(n), [(budget, "tried")]
    argv, pred, tried, budget = fo.sized_search(search, CAP, fit, 256, "h2o", lines.append)
    assert budgets == [CAP - fit.need(256), CAP - fit.need(200), CAP - fit.need(190)]  # at most 3 searches
    assert fo.plan_seqs(argv) == 180 and pred == 180.0 and budget == budgets[-1] and tried == [(budget, "tried")]
    assert _budget_fits(fit, argv) and budget > budgets[0]  # the tiers got what 256 sequences would have needed
    assert len(lines) == 3 and all("fits the cap" in ln and "sequences need" in ln for ln in lines)


def test_sized_search_stops_when_the_plan_repeats():
    fit = fo.OverheadFit(280 * MiB, 3 * MiB)
    budgets = []
    argv, _, _, budget = fo.sized_search(_growing_search(budgets, most=40), CAP, fit, 256, "full", lambda s: None)
    assert fo.plan_seqs(argv) == 40 and budgets == [CAP - fit.need(256), CAP - fit.need(40)]  # 40 twice: stop
    assert budget == CAP - fit.need(40) and _budget_fits(fit, argv)


def test_sized_search_keeps_the_previous_plan_when_the_last_violates():
    fit = fo.OverheadFit(200 * MiB, 4 * MiB)
    budgets, lines = [], []

    def search(budget):  # 100 sequences at the first budget, then 250: more than the larger budget leaves room for
        budgets.append(budget)
        n = 100 if len(budgets) == 1 else 250
        return _plan(n, budget), float(n), []
    argv, pred, _, budget = fo.sized_search(search, CAP, fit, 256, "h2o", lines.append)
    assert len(budgets) == 2 and not _budget_fits(fit, _plan(250, budgets[1]))
    assert fo.plan_seqs(argv) == 100 and budget == budgets[0] and pred == 100.0 and _budget_fits(fit, argv)
    assert "previous plan kept" in lines[1] and "fits the cap" in lines[0]


def test_sized_search_refuses_an_overhead_larger_than_the_cap():
    with pytest.raises(RuntimeError, match="lower --fair-max-batch"):
        fo.sized_search(_growing_search([]), CAP, fo.OverheadFit(300 * MiB, 10 * MiB), 256, "full", print)


def test_fixed_overhead_makes_no_probe_and_one_search(monkeypatch):
    def no_run(*a):
        raise AssertionError("a probe ran although --fair-overhead was given")
    monkeypatch.setattr("bench_common.run_flexh2o", no_run)
    budgets, bases = [], []

    def search(base, budget, env):
        bases.append(base)
        return _growing_search(budgets)(budget)
    args = _args(fair_overhead="800MB")
    argv = fair.flexh2o_plan(args, {}, CAP, "full", {"kv_policy": "full"}, lambda s: None, search=search)
    assert budgets == [CAP - 800 * MiB] and fo.plan_tiers(argv) == CAP - 800 * MiB  # constant at every batch
    assert bases[0][bases[0].index("--max-seqs") + 1] == "256" and "--kv-policy" in bases[0]


def test_flexh2o_plan_sizes_from_the_systems_own_probes():
    probed = []

    def run(argv, timeout, env, cap):
        probed.append(argv)
        b = int(argv[argv.index("--gpu-batch-size") + 1])
        return Outcome("ok", {"peak_bytes": {"cpu_rss": (600 + 2 * b) * MiB, "gpu": 300 * MiB, "cpu_tier": 0}})
    budgets = []
    argv = fair.flexh2o_plan(_args(), {}, CAP, "h2o", {"kv_policy": "h2o", "kv_budget": 19}, lambda s: None, run=run,
                             search=lambda base, budget, env: _growing_search(budgets)(budget))
    fit = fo.OverheadFit(300 * MiB, 2 * MiB)
    assert len(probed) == 2 and all("--kv-budget" in a for a in probed)
    assert budgets[0] == CAP - fit.need(256) and _budget_fits(fit, argv)
