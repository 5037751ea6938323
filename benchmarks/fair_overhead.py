"""The memory a flexh2o process holds outside its tiers, and the tier budget inside a memory cap that leaves
(compare.py --fair, through fair.py).

The overhead (torch, Python, the I/O buffers, prefill activations and logits outside the tiers) is measured on the
plan that will run, not extrapolated: a first probe (batch 1, the real prompt length, gen_len 2, the weights on disk;
run without the cap, like every probe, so that what it needs is measured rather than killed: h2o-q4's was killed at
1.25 GiB) gives the least any plan holds, and flexh2o's search gets the cap minus that (x OVERHEAD_MARGIN) for
its tiers. The plan it picks is then run itself with gen_len 2 (its prefill, the peak of its transients, and a
decode step), without the cap so that a plan over it is measured rather than killed; its peak RSS minus its tiers
(each the larger of its accounted peak and its planned bytes), x OVERHEAD_MARGIN, must fit in the cap beside what
its tiers hold (a tier's unused capacity is never touched: counting the capacities --gpu-mem + --cpu-mem instead cut
opt-1.3b's full plan from 256 sequences to 64 once the peak became the process's VmHWM, the plan's probe peaking at
1,143 MiB of the 1,280 MiB cap). If it does not, the search runs again with at most half its sequences, inside the
cap minus the need interpolated at that count on the line between the batch-1 probe and the plan's own figure, up to
SEARCH_ROUNDS searches, each searched plan measured again (on opt-1.3b in bf16 at prompt 64, 252 sequences held
1,094 MiB outside the tiers against 471 MiB at batch 1: searched again inside what 252 sequences need, nothing
fitted). Extrapolating a line over two small probes does not work: on opt-1.3b (prompt 64) batch 1 and 8 held 475
and 566 MiB, a slope of 13 MiB a sequence (the 8 x 64-token prefill's transients) that extrapolates to 4.4 GiB at
256 sequences, whose prefill the plan splits into sub-batches. A --fair-overhead figure replaces every measurement (no probe, no margin).
"""
from __future__ import annotations

import math
from typing import Callable, Optional

OVERHEAD_MARGIN = 1.15  # on a measured overhead: a probe decodes 2 tokens, the real run more
PROBE_GEN_LEN = 2
PROBE_PERCENT = "0 0 100 0 100 0"  # the first probe: weights on disk, cache and activations in the gpu tier
SEARCH_ROUNDS = 5
MiB = 1 << 20


def need(raw: float, margin: float = OVERHEAD_MARGIN) -> int:
    """Bytes allowed outside the tiers for a measured overhead `raw`: margin x raw, rounded up."""
    return int(math.ceil(margin * raw))


def outside_tiers(got, what: str, log=print) -> int:
    """Peak RSS minus what the tiers hold of it, for a finished flexh2o-run (bench_common.Outcome); RuntimeError
    naming `what` when it did not finish. A tier holds the larger of its measured peak and its planned bytes: the
    plan counts in the gpu tier the transients of a layer's compute (prefill attention and MLP, logits) and in the
    cpu tier the host's per-sequence lists, which no tier's accounted peak sees, and the search already sized the
    tiers to hold them; subtracting only the accounted peaks counted them twice (on opt-1.3b bf16 at 252 sequences
    the plan's tiers held 338 MiB more than their accounted peaks)."""
    if got.status != "ok":
        raise RuntimeError(f"measuring {what} failed: {got.status} {got.message}")
    peak, planned = got.record["peak_bytes"], _planned(got.record)
    tiers = tiers_held(got.record)
    raw = peak["cpu_rss"] - tiers
    log(f"fair: {what}: peak rss {peak['cpu_rss'] / MiB:.1f} MiB - tiers {tiers / MiB:.1f} MiB (accounted peaks "
        f"{((peak.get('gpu') or 0) + (peak.get('cpu_tier') or 0)) / MiB:.1f} MiB, planned "
        f"{(planned['gpu'] + planned['cpu']) / MiB:.1f} MiB) = {raw / MiB:.1f} MiB outside the tiers")
    return raw


def tiers_held(record: dict) -> int:
    """Bytes a finished flexh2o-run's tiers hold: per tier the larger of its accounted peak and its planned bytes."""
    peak, planned = record["peak_bytes"], _planned(record)
    return max(peak.get("gpu") or 0, planned["gpu"]) + max(peak.get("cpu_tier") or 0, planned["cpu"])


def _planned(record: dict) -> dict:
    """{"gpu": bytes, "cpu": bytes} the run's plan put in each memory tier (0 where it names none)."""
    plan = record.get("plan_bytes") or {}
    return {t: sum((plan.get(t) or {}).values()) for t in ("gpu", "cpu")}


def first_probe_argv(args, flags: dict, mem_cap: int) -> list:
    """flexh2o-run argv of the first probe: the system's flags, the real prompt length, gen_len 2, one sequence,
    the weights on disk and the tiers' capacities up to the cap."""
    from bench_common import flag_args
    tiers = mem_cap - (64 << 20)  # the gpu tier holds two layers in flight at the compute dtype
    return flag_args({"model": args.model, "path": "_DUMMY_", "percent": PROBE_PERCENT, "prompt_len": args.prompt_len,
                      "gen_len": PROBE_GEN_LEN, "gpu_batch_size": 1, "num_gpu_batches": 1, "dtype": args.dtype,
                      "compute_dtype": args.compute_dtype, **flags, "gpu_mem": str(tiers - (32 << 20)),
                      "cpu_mem": str(32 << 20)})


def plan_probe_argv(plan: list) -> list:
    """A searched plan's argv with gen_len 2: its prefill and a decode step, as the real run does them."""
    argv = list(plan)
    if "--gen-len" in argv:
        argv[argv.index("--gen-len") + 1] = str(PROBE_GEN_LEN)
    else:
        argv += ["--gen-len", str(PROBE_GEN_LEN)]
    return argv


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


def interpolated(first: int, got: int, n: int, seqs: int) -> int:
    """Need at `seqs` sequences on the line from (1, first) to (n, got): an overhead that grows more slowly per
    sequence as batches grow (prefill transients split into sub-batches) lies below it, so the estimate is safe."""
    return got if n <= 1 else int(first + (got - first) * (seqs - 1) / (n - 1))


def sized_search(search: Callable, mem_cap: int, first: int, measure: Optional[Callable], label: str, log=print,
                 rounds: int = SEARCH_ROUNDS, most: int = 256) -> tuple:
    """(argv, predicted tok/s, tried, budget): search(budget, max_seqs) -> (argv, predicted, tried) inside
    mem_cap - first bytes, at most `most` sequences; measure(argv) -> (bytes the plan needs outside its tiers, margin
    included; bytes its tiers hold, tiers_held, or None: their capacities --gpu-mem + --cpu-mem count); measure
    None: `first` is a fixed figure, which the plan fits by construction. A plan of n sequences
    whose measured need does not fit beside its tiers is searched again with at most n // 2 sequences, inside mem_cap
    minus the need interpolated there between the batch-1 figure and the plan's (a search that then finds nothing
    halves again), at most `rounds` searches; RuntimeError when none fits."""
    allowed, seqs = first, most
    for i in range(1, rounds + 1):
        budget = mem_cap - allowed
        if budget <= 0:
            raise RuntimeError(f"flexh2o {label} needs {allowed / MiB:.0f} MiB outside its tiers, the whole "
                               f"{mem_cap / MiB:.0f} MiB cap: lower --fair-max-batch or raise --mem-cap")
        try:
            argv, pred, tried = search(budget, seqs)
        except RuntimeError as e:  # nothing fits this budget: fewer sequences need less outside the tiers
            if i == 1 or seqs <= 1:
                raise
            log(f"fair: flexh2o {label} search {i}/{rounds} inside {budget} B, at most {seqs} sequences: {e}")
            allowed, seqs = interpolated(first, last[1], last[0], seqs // 2), seqs // 2
            continue
        used, n = plan_tiers(argv), plan_seqs(argv)
        got, held = (allowed, None) if measure is None else measure(argv)
        held = used if held is None else min(held, used)
        fits = got <= mem_cap - held
        log(f"fair: flexh2o {label} search {i}/{rounds} inside {budget} B, at most {seqs} sequences: tried {tried}; "
            f"best {' '.join(argv)} (predicted {pred}): {n} sequences, tiers {used / MiB:.1f} MiB holding "
            f"{held / MiB:.1f} MiB, {got / MiB:.1f} MiB needed outside them: "
            + ("fits the cap" if fits else "over the cap"))
        if fits:
            return argv, pred, tried, budget
        last = (n, got)
        seqs = max(1, n // 2)
        allowed = interpolated(first, got, n, seqs)
    raise RuntimeError(f"flexh2o {label}: no searched plan left its measured overhead inside the "
                       f"{mem_cap / MiB:.0f} MiB cap in {rounds} searches: lower --fair-max-batch or raise --mem-cap")
