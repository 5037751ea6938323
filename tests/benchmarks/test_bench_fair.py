"""benchmarks/fair.py: Accelerate's largest completing batch is found by doubling then bisecting; flexh2o's process
overhead outside its tiers is measured on the plan that runs and its tiers sized so that both fit the cap
(fair_overhead.py)."""
from __future__ import annotations

import math
import os
import sys
import types

import pytest

sys.path.insert(0, os.path.join(os.path.abspath(os.path.join(__file__, "../../..")), "benchmarks"))
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
    got, tries = fair.largest_completing(lambda b: b <= 5, limit=100, batches=[8, 16])  # below the smallest listed
    assert got == 5 and tries[0] == (8, False) and (5, True) in tries and (6, False) in tries
    assert fair.largest_completing(lambda b: True, limit=50, batches=[8, 64])[0] == 8  # 64 is over the limit


MiB = 1 << 20
CAP = 2560 * MiB


def _args(**kw):
    base = dict(model="opt-1.3b", prompt_len=64, gen_len=32, dtype="float32", compute_dtype="float32", timeout=60,
                hardware=None, fair_overhead="measure", fair_max_batch=256, hh_ratio=None, budget_pct=20)
    return types.SimpleNamespace(**{**base, **kw})


def _plan(n, budget, k=1):
    """A searched plan's argv: n sequences as k GPU batches, the budget split 90/10 as flexh2o_best does."""
    return ["--model", "opt-1.3b", "--gen-len", "32", "--percent", "0", "0", "0", "0", "100", "0",
            "--gpu-batch-size", str(n // k), "--num-gpu-batches", str(k), "--gpu-mem", str(int(budget * 0.9)),
            "--cpu-mem", str(budget - int(budget * 0.9))]


def _rss_run(outside):
    """A fake run_flexh2o whose process holds outside(argv, cap) bytes beside its tiers, which hold their whole
    --gpu-mem and --cpu-mem (900 + 100 MiB when the argv gives none)."""
    seen = []

    def run(argv, timeout, env, cap):
        seen.append((argv, cap))
        gpu, cpu = ((int(argv[argv.index(f) + 1]) for f in ("--gpu-mem", "--cpu-mem")) if "--cpu-mem" in argv
                    else (900 * MiB, 100 * MiB))
        rss = gpu + cpu + outside(argv, cap)
        return Outcome("ok", {"peak_bytes": {"cpu_rss": rss, "gpu": gpu, "cpu_tier": cpu, "disk": 0}})
    return run, seen


def test_outside_tiers_is_peak_rss_minus_each_tiers_peak_or_plan_and_a_failure_is_named():
    run, _ = _rss_run(lambda argv, cap: 300 * MiB)
    lines = []
    assert fo.outside_tiers(run([], 1, {}, CAP), "full's overhead", lines.append) == 300 * MiB
    assert "300.0 MiB outside the tiers" in lines[0] and fo.need(300 * MiB) == math.ceil(1.15 * 300 * MiB)
    planned = {"gpu": {"weights": 800 * MiB, "buffers": 300 * MiB}, "cpu": {"buffers": 50 * MiB},
               "disk": {"weights": 5000 * MiB}}
    rec = {"peak_bytes": {"cpu_rss": 1500 * MiB, "gpu": 900 * MiB, "cpu_tier": 100 * MiB}, "plan_bytes": planned}
    # the gpu tier's plan (1,100 MiB: its transients in buffers) over its accounted 900; the cpu tier's peak over 50
    assert fo.outside_tiers(Outcome("ok", rec), "h2o's overhead", lines.append) == 300 * MiB
    assert "tiers 1200.0 MiB (accounted peaks 1000.0 MiB, planned 1150.0 MiB)" in lines[1]
    with pytest.raises(RuntimeError, match="measuring full's overhead at batch 1 failed: error killed at the cap"):
        fo.outside_tiers(Outcome("error", None, "killed at the cap"), "full's overhead at batch 1")


def test_probe_argvs_carry_the_system_and_the_plan():
    flags = {"kv_policy": "h2o", "kv_budget": 19, "compress_weight": True, "compress_cache": True}
    a = fo.first_probe_argv(_args(), flags, CAP)
    assert a[a.index("--gpu-batch-size") + 1] == "1" and a[a.index("--prompt-len") + 1] == "64"
    assert a[a.index("--gen-len") + 1] == "2" and a[a.index("--kv-budget") + 1] == "19"
    assert "--compress-weight" in a and "--compress-cache" in a and a[a.index("--percent") + 3] == "100"
    plan = _plan(256, 1000 * MiB, k=2)
    probe = fo.plan_probe_argv(plan)
    assert probe[probe.index("--gen-len") + 1] == "2" and plan[plan.index("--gen-len") + 1] == "32"
    i = plan.index("--gen-len") + 1
    assert probe[:i] + probe[i + 1:] == plan[:i] + plan[i + 1:]  # nothing else changed
    assert fo.plan_probe_argv(["--gpu-batch-size", "4"])[-2:] == ["--gen-len", "2"]


def test_plan_seqs_and_tiers_read_the_searched_argv():
    argv = _plan(256, 1000 * MiB, k=2)
    assert fo.plan_seqs(argv) == 256 and fo.plan_tiers(argv) == 1000 * MiB
    assert fo.plan_seqs(["--gpu-batch-size", "81", "--gpu-mem", "1GB", "--cpu-mem", "64MB"]) == 81
    assert fo.plan_tiers(["--gpu-mem", "1GB", "--cpu-mem", "64MB"]) == (1024 + 64) * MiB
    with pytest.raises(ValueError, match="no --gpu-batch-size"):
        fo.plan_seqs(["--gpu-mem", "1GB"])


def _search(budgets, seqs_per_mib=0.1, most=256):
    """A fake flexh2o search whose batch grows with its budget (seqs_per_mib sequences per MiB of tiers)."""
    def search(budget, seqs=most):
        budgets.append(budget)
        n = max(1, min(most, seqs, int(budget / MiB * seqs_per_mib)))
        return _plan(n, budget), float(n), [(budget, "tried")]
    return search


def test_a_plan_that_fits_beside_its_measured_overhead_is_kept_at_once():
    budgets, lines = [], []
    argv, pred, tried, budget = fo.sized_search(_search(budgets), CAP, 300 * MiB, lambda plan: (250 * MiB, None),
                                                "h2o", lines.append)
    assert budgets == [CAP - 300 * MiB] and budget == budgets[0] and fo.plan_seqs(argv) == 226 and pred == 226.0
    assert len(lines) == 1 and "fits the cap" in lines[0] and "250.0 MiB needed outside" in lines[0]


def test_a_plan_over_the_cap_is_searched_again_inside_what_it_measured():
    budgets, lines = [], []
    measured = {}

    def measure(plan):  # 3 MiB a sequence beyond 300 MiB: 225 sequences need 975 MiB, more than batch 1's 303
        measured[fo.plan_seqs(plan)] = 300 * MiB + 3 * MiB * fo.plan_seqs(plan)
        return measured[fo.plan_seqs(plan)], None
    argv, _, _, budget = fo.sized_search(_search(budgets), CAP, 303 * MiB, measure, "full", lines.append)
    assert budgets[0] == CAP - 303 * MiB  # the second: at most 112 sequences, inside the need interpolated there
    assert budgets[1] == CAP - (303 * MiB + (measured[225] - 303 * MiB) * 111 // 224)
    assert budget == budgets[-1] and measured[fo.plan_seqs(argv)] <= CAP - fo.plan_tiers(argv)
    assert fo.plan_seqs(argv) == 112 and "at most 112 sequences" in lines[1] and len(lines) == 2
    assert "over the cap" in lines[0] and "fits the cap" in lines[-1]


def test_a_plan_is_kept_when_its_need_fits_beside_what_its_tiers_hold_not_their_capacities():
    """256 sequences with 2,260 MiB of tier capacity, of which they hold 1,900 MiB: 350 MiB outside fits the
    2,560 MiB cap beside what they hold, though not beside the capacities (then 128 sequences would be searched)."""
    budgets, lines = [], []
    argv, _, _, _ = fo.sized_search(_search(budgets), CAP, 300 * MiB, lambda plan: (350 * MiB, 1900 * MiB), "full",
                                    lines.append)
    assert fo.plan_seqs(argv) == 226 and len(budgets) == 1 and "fits the cap" in lines[0]
    assert "holding 1900.0 MiB" in lines[0] and 350 * MiB > CAP - fo.plan_tiers(argv)
    for held in (None, 10 * CAP):  # not known: the capacities count; a tier never holds more than its capacity
        lines.clear()
        with pytest.raises(RuntimeError, match="in 1 searches"):
            fo.sized_search(_search([]), CAP, 300 * MiB, lambda plan: (350 * MiB, held), "full", lines.append,
                            rounds=1)
        assert "over the cap" in lines[0] and "holding 2260.0 MiB" in lines[0]


def test_tiers_held_is_each_tiers_peak_or_plan():
    planned = {"gpu": {"weights": 800 * MiB, "buffers": 300 * MiB}, "cpu": {"buffers": 50 * MiB}}
    rec = {"peak_bytes": {"cpu_rss": 1500 * MiB, "gpu": 900 * MiB, "cpu_tier": 100 * MiB}, "plan_bytes": planned}
    assert fo.tiers_held(rec) == 1200 * MiB  # gpu: its plan's 1,100 over its peak 900; cpu: its peak 100 over 50
    assert fo.tiers_held({"peak_bytes": {"cpu_rss": 1, "gpu": None, "cpu_tier": 7}}) == 7


def test_a_search_that_finds_nothing_after_a_plan_over_the_cap_halves_again():
    budgets, lines, seqs_asked = [], [], []

    def search(budget, seqs):  # nothing fits below 1,600 MiB of tiers; a plan's need is 8 MiB a sequence
        seqs_asked.append(seqs)
        if budget < 1600 * MiB:
            raise RuntimeError("no placement fits")
        return _search(budgets)(budget, seqs)
    argv, _, _, _ = fo.sized_search(search, CAP, 300 * MiB, lambda plan: (8 * MiB * fo.plan_seqs(plan), None),
                                    "h2o", lines.append)
    assert seqs_asked[:3] == [256, 113, 56] and "no placement fits" in lines[1]
    assert 8 * MiB * fo.plan_seqs(argv) <= CAP - fo.plan_tiers(argv) and "fits the cap" in lines[-1]
    with pytest.raises(RuntimeError, match="no placement fits"):  # the first search's failure is the answer
        fo.sized_search(lambda b, n: search(0, n), CAP, 300 * MiB, None, "h2o", lines.append)


def test_interpolated_need_lies_on_the_line_from_batch_1_to_the_plan():
    assert fo.interpolated(100, 1100, 101, 51) == 600 and fo.interpolated(100, 1100, 101, 1) == 100
    assert fo.interpolated(100, 700, 1, 1) == 700


def test_no_plan_fitting_in_the_rounds_is_an_error():
    with pytest.raises(RuntimeError, match="no searched plan left its measured overhead inside the 2560 MiB cap in "
                                           "5 searches"):
        fo.sized_search(_search([]), CAP, 300 * MiB, lambda plan: (CAP - fo.plan_tiers(plan) + MiB, None),
                        "full", lambda s: None)  # each plan needs 1 MiB more than its tiers leave
    with pytest.raises(RuntimeError, match="the whole 2560 MiB cap: lower --fair-max-batch"):
        fo.sized_search(_search([]), CAP, CAP, None, "full", lambda s: None)


def test_fixed_overhead_makes_no_probe_and_one_search():
    def no_run(*a):
        raise AssertionError("a probe ran although --fair-overhead was given")
    budgets, bases = [], []

    def search(base, budget, env):
        bases.append(base)
        return _search(budgets)(budget, int(base[base.index("--max-seqs") + 1]))
    argv = fair.flexh2o_plan(_args(fair_overhead="800MB"), {}, CAP, "full", {"kv_policy": "full"}, lambda s: None,
                             run=no_run, search=search)
    assert budgets == [CAP - 800 * MiB] and fo.plan_tiers(argv) == CAP - 800 * MiB
    assert bases[0][bases[0].index("--max-seqs") + 1] == "256" and "--kv-policy" in bases[0]


def test_flexh2o_plan_probes_batch_1_then_the_plan_both_without_the_cap():
    run, seen = _rss_run(lambda argv, cap: (200 + 2 * fo.plan_seqs(argv)) * MiB)
    budgets = []
    argv = fair.flexh2o_plan(_args(), {}, CAP, "h2o", {"kv_policy": "h2o", "kv_budget": 19}, lambda s: None, run=run,
                             search=lambda base, budget, env: _search(budgets)(
                                 budget, int(base[base.index("--max-seqs") + 1])))
    first, plans = seen[0], seen[1:]
    assert first[1] is None and first[0][first[0].index("--gpu-batch-size") + 1] == "1"
    assert budgets[0] == CAP - fo.need(202 * MiB)  # the batch-1 probe's 202 MiB, x1.15
    assert plans and all(cap is None and a[a.index("--gen-len") + 1] == "2" for a, cap in plans)
    n = fo.plan_seqs(argv)
    assert fo.need((200 + 2 * n) * MiB) <= CAP - fo.plan_tiers(argv)  # what runs fits beside its own overhead


def test_a_system_with_no_plan_inside_the_cap_is_left_out_and_the_others_kept(monkeypatch):
    def plan(args, env, mem_cap, system, flags, log):
        if system == "h2o-q4":
            raise RuntimeError("no searched plan left its measured overhead inside the cap")
        return [system]
    monkeypatch.setattr(fair, "flexh2o_plan", plan)
    lines = []
    cmds = {"full": (None, []), "h2o": (None, []), "h2o-q4": (None, [])}
    out = fair.fair_commands(_args(), {}, CAP, cmds, "ckpt", lines.append)
    assert sorted(out) == ["full", "h2o"] and out["h2o"][1] == ["h2o"]
    assert lines == ["fair: h2o-q4 dropped: no searched plan left its measured overhead inside the cap"]
