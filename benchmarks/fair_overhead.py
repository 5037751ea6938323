"""The memory a flexh2o process holds outside its tiers, as a function of its batch, and the tier budget inside a
memory cap that this leaves (compare.py --fair, through fair.py).

Each flexh2o system (full, h2o, h2o-q4: its own KV, compression and dtype flags) is probed by two short runs under
the cap at the real prompt length and gen_len 2, the weights on disk (so the tiers stay small), at batch 1 and at
--fair-probe-batch b (gpu_batch_size b, one GPU batch). A probe's overhead is its peak RSS minus its tiers' peaks
(torch, Python, the I/O buffers, activations and logits outside the tiers). The two points give a line,
overhead(n) = base + per_seq * n (per_seq clamped at 0), and margin * overhead(n) is what a run of n sequences is
allowed outside its tiers (margin: OVERHEAD_MARGIN on a measured fit, 1 on a --fair-overhead figure).

sized_search then picks the tiers: flexh2o's search gets budget = cap - margin * overhead(max_seqs) (the most
conservative), chooses n sequences (gpu batch x GPU batches), gets cap - margin * overhead(n) and searches again,
until the plan no longer changes or SEARCH_ROUNDS searches were made; a plan whose own n needs more than the cap
minus its tiers is dropped for the previous one. So a later search's plan is kept only when it runs no more
sequences than the one before (its budget is exactly what that batch leaves): the iteration gives the tiers what
max_seqs' overhead would have taken when the searched batch is smaller, and never a batch the cap cannot hold.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

OVERHEAD_MARGIN = 1.15  # safety factor on a measured fit: the probes decode 2 tokens, the real runs more
PROBE_GEN_LEN = 2
PROBE_PERCENT = "0 0 100 0 100 0"  # weights on disk, cache and activations in the gpu tier
SEARCH_ROUNDS = 3
MiB = 1 << 20


@dataclass(frozen=True)
class OverheadFit:
    """overhead(n) = base + per_seq * n bytes outside the tiers; need(n) adds the safety margin."""
    base: float
    per_seq: float
    margin: float = OVERHEAD_MARGIN

    def need(self, n: int) -> int:
        """Bytes a run of n sequences is allowed outside its tiers: margin * (base + per_seq * n), rounded up."""
        return int(math.ceil(self.margin * (self.base + self.per_seq * n)))

    def __str__(self) -> str:
        return (f"{self.base / MiB:.1f} MiB + {self.per_seq / MiB:.2f} MiB per sequence, x{self.margin:g} margin")


def fit_overhead(probes: dict) -> OverheadFit:
    """{batch: overhead bytes} of one or two probes -> the line through them, per_seq clamped at 0 (then the
    line is flat at the smaller batch's overhead, the larger of the two: the fit is never below a probe)."""
    if not probes or len(probes) > 2 or min(probes) < 1:
        raise ValueError(f"the overhead fit needs probes at one or two batches >= 1, got {sorted(probes)}")
    lo, hi = min(probes), max(probes)
    per_seq = max(0.0, (probes[hi] - probes[lo]) / (hi - lo)) if hi > lo else 0.0
    return OverheadFit(probes[lo] - per_seq * lo, per_seq)


def probe_argv(args, flags: dict, batch: int, mem_cap: int) -> list:
    """flexh2o-run argv of one overhead probe: the system's flags, the real prompt length, gen_len 2, `batch`
    sequences in one GPU batch, the weights on disk and the tiers' capacities up to the cap."""
    from bench_common import flag_args
    tiers = mem_cap - (64 << 20)  # the gpu tier holds two layers in flight at the compute dtype
    return flag_args({"model": args.model, "path": "_DUMMY_", "percent": PROBE_PERCENT, "prompt_len": args.prompt_len,
                      "gen_len": PROBE_GEN_LEN, "gpu_batch_size": batch, "num_gpu_batches": 1, "dtype": args.dtype,
                      "compute_dtype": args.compute_dtype, **flags, "gpu_mem": str(tiers - (32 << 20)),
                      "cpu_mem": str(32 << 20)})


def probe_overhead(args, env: dict, mem_cap: int, flags: dict, batch: int, run: Callable, label: str,
                   log=print) -> int:
    """Bytes one probe run (probe_argv) held outside its tiers: peak RSS minus the tiers' peaks."""
    got = run(probe_argv(args, flags, batch, mem_cap), args.timeout, env, mem_cap)
    if got.status != "ok":
        raise RuntimeError(f"measuring {label}'s process overhead at batch {batch} under the cap failed: "
                           f"{got.status} {got.message}")
    peak = got.record["peak_bytes"]
    tiers = (peak.get("gpu") or 0) + (peak.get("cpu_tier") or 0)
    raw = peak["cpu_rss"] - tiers
    log(f"fair: {label} overhead probe, batch {batch}, prompt {args.prompt_len}, gen {PROBE_GEN_LEN}: peak rss "
        f"{peak['cpu_rss'] / MiB:.1f} MiB - tiers' peaks {tiers / MiB:.1f} MiB = {raw / MiB:.1f} MiB")
    return raw


def measured_fit(args, env: dict, mem_cap: int, flags: dict, run: Callable, label: str, log=print) -> OverheadFit:
    """fit_overhead of probes at batch 1 and at min(--fair-probe-batch, --fair-max-batch) (one probe when that
    is 1: no larger batch runs)."""
    batches = sorted({1, max(1, min(args.fair_probe_batch, args.fair_max_batch))})
    fit = fit_overhead({b: probe_overhead(args, env, mem_cap, flags, b, run, label, log) for b in batches})
    log(f"fair: {label} overhead fit from batches {batches}: {fit}")
    return fit


def plan_value(argv: list, flag: str) -> str:
    """The value after `flag` in a flexh2o-run argv; ValueError naming it when absent."""
    if flag not in argv or argv.index(flag) + 1 >= len(argv):
        raise ValueError(f"flexh2o's searched plan has no {flag}: {' '.join(argv)}")
    return argv[argv.index(flag) + 1]


def plan_seqs(argv: list) -> int:
    """Sequences at once of a searched plan: --gpu-batch-size x --num-gpu-batches (1 when not given)."""
    k = int(plan_value(argv, "--num-gpu-batches")) if "--num-gpu-batches" in argv else 1
    return int(plan_value(argv, "--gpu-batch-size")) * k


def plan_tiers(argv: list) -> int:
    """Bytes of a searched plan's tiers inside the cap: --gpu-mem + --cpu-mem."""
    from flexh2o.units import parse_bytes
    return parse_bytes(plan_value(argv, "--gpu-mem")) + parse_bytes(plan_value(argv, "--cpu-mem"))


def sized_search(search: Callable, mem_cap: int, fit: OverheadFit, max_seqs: int, label: str, log=print,
                 rounds: int = SEARCH_ROUNDS) -> tuple:
    """(argv, predicted tok/s, tried, budget) of search(budget) -> (argv, predicted, tried) at the budget the
    chosen plan's own overhead leaves (see the module docstring); every search is logged."""
    budget = mem_cap - fit.need(max_seqs)
    if budget <= 0:
        raise RuntimeError(f"{label}'s overhead at {max_seqs} sequences ({fit}: {fit.need(max_seqs) / MiB:.0f} MiB) "
                           f"leaves nothing of the {mem_cap / MiB:.0f} MiB cap for its tiers: lower --fair-max-batch")
    kept = None
    for i in range(1, rounds + 1):
        argv, pred, tried = search(budget)
        n, used = plan_seqs(argv), plan_tiers(argv)
        fits = fit.need(n) <= mem_cap - used
        log(f"fair: flexh2o {label} search {i}/{rounds} inside {budget} B (cap - overhead allowed): tried {tried}; "
            f"best {' '.join(argv)} (predicted {pred}): {n} sequences need {fit.need(n) / MiB:.1f} MiB outside "
            f"tiers of {used / MiB:.1f} MiB, " + ("fits the cap" if fits else "over the cap: the previous plan kept"))
        if not fits:
            break
        kept = (argv, pred, tried, budget)
        if mem_cap - fit.need(n) == budget:
            break  # the same budget again: the same plan
        budget = mem_cap - fit.need(n)
    if kept is None:
        raise RuntimeError(f"flexh2o {label}'s searched plan does not leave its own overhead inside the cap ({fit})")
    return kept
