"""The fair equal-memory protocol of compare.py --fair: every system at its best configuration under the same cap.

flexh2o: its own policy search (flexh2o-run --policy auto --dry-run) with the tiers sized inside the cap: a budget
(the cap minus the process memory outside the tiers that the searched batch needs) split between the gpu and cpu
tiers in a few ways (on a CPU both are host memory), the best predicted split kept, per system (full, h2o, h2o-q4).
The memory outside the tiers (torch, Python, I/O buffers, what the plan does not count) is measured per system on
the plan that runs: a batch-1 probe sizes the first search, the plan found is run for 2 tokens without the cap and
its peak RSS minus its tiers (each the larger of its accounted peak and its plan), x1.15, must fit beside its tiers,
else the search runs again with fewer sequences (fair_overhead.py). --fair-overhead BYTES bypasses the
measurement: that fixed figure for every plan, no probe.
Accelerate: the largest batch that completes under the cap, found by doubling from 1 and then bisecting, each try a
whole run (same lengths) with a timeout; every try is logged. --fair-peer-batches B1,B2,... tries only those, in
increasing order up to the first that fails (each try of a large model streamed from disk takes minutes: the best
of the listed batches, not the exact boundary, which the log then shows). Both are held to at most --fair-max-batch
sequences at once (flexh2o's search through --max-seqs), so neither wins by a batch the other was not allowed to try.

The regime is checked first (regime_rows): the model's weights at the dtype each system stores them must exceed the
cap (the paper's setting: a model larger than memory), else the run is refused naming the smallest built-in model
that would; a compressed system's 4-bit weights are reported beside the cap but not refused. Every probe, overhead
fit and search goes to the log, so the run's record shows how each system's tiers were sized.
"""
from __future__ import annotations

import re
import subprocess
import sys
from typing import Callable, Optional

from bench_common import REPO
from fair_overhead import MiB, first_probe_argv, need, outside_tiers, plan_probe_argv, plan_seqs, plan_tiers, \
    sized_search, tiers_held
from flexh2o.planning.memory_plan import largest_passing

SPLITS = (0.25, 0.5, 0.75, 0.9)  # gpu tier's share of the memory left inside the cap
DTYPE_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "int4": 0.5 + 2 * 2 / 64}  # int4: + fp16 scale/min


def weight_bytes(model: str, dtype: str) -> int:
    """Bytes of the model's weights stored at dtype (int4: FlexGen's 4-bit groups of 64 with their fp16 scales)."""
    from flexh2o.config import from_name
    from flexh2o.models import unique_specs
    return int(sum(s.numel for s in unique_specs(from_name(model)).values()) * DTYPE_BYTES[dtype])


def regime_rows(model: str, dtypes: dict, mem_cap: int) -> list:
    """[(system, dtype, weight bytes, bytes / cap)] for {system: storage dtype}."""
    return [(s, d, weight_bytes(model, d), weight_bytes(model, d) / mem_cap) for s, d in dtypes.items()]


def check_regime(model: str, dtypes: dict, mem_cap: int) -> list:
    """regime_rows, or ValueError when an uncompressed system's weights fit inside the cap (naming a model that
    does not)."""
    from flexh2o.config import OPT_SIZES
    rows = regime_rows(model, dtypes, mem_cap)
    small = [(s, d, b) for s, d, b, _ in rows if d != "int4" and b <= mem_cap]
    if small:
        s, d, b = small[0]
        need = [m for m in OPT_SIZES if all(weight_bytes(m, x) > mem_cap for x in dtypes.values() if x != "int4")]
        raise ValueError(f"{model}'s weights at {d} ({b / 2**30:.2f} GiB, {s}) fit inside the --mem-cap "
                         f"({mem_cap / 2**30:.2f} GiB), so nothing is offloaded: use a larger model"
                         + (f" (the smallest that does not fit: {need[0]})" if need else "") + " or a smaller cap")
    return rows


def flexh2o_best(base_argv: list, budget: int, env: dict, timeout: float = 600) -> tuple:
    """(argv of the best plan, predicted tok/s, tried [(gpu_mem, cpu_mem, predicted or message)]) for base_argv
    (model, lengths, policy, dtypes, no capacities) with gpu_mem + cpu_mem = budget bytes."""
    best, tried = (None, 0.0), []
    for share in SPLITS:
        gpu, cpu = int(budget * share), budget - int(budget * share)
        p = subprocess.run([sys.executable, "-m", "flexh2o.cli", *base_argv, "--gpu-mem", str(gpu), "--cpu-mem",
                            str(cpu), "--policy", "auto", "--dry-run"], env=env, capture_output=True, text=True,
                           cwd=REPO, timeout=timeout)
        m = re.search(r"--policy auto: flexh2o-run (.*?)  \(predicted ([\d.]+) tok/s\)", p.stderr)
        if p.returncode != 0 or not m:
            tried.append((gpu, cpu, (p.stderr.strip().splitlines() or ["?"])[-1]))
            continue
        tried.append((gpu, cpu, float(m.group(2))))
        if float(m.group(2)) > best[1]:
            best = (m.group(1).split(), float(m.group(2)))
    if best[0] is None:
        raise RuntimeError(f"flexh2o's search found nothing inside the cap: {tried}")
    return best[0], best[1], tried


def largest_completing(completes: Callable[[int], bool], limit: int = 1024, batches: Optional[list] = None) -> tuple:
    """(largest batch b <= limit with completes(b), [(b, ok)...]): doubling from 1, then bisection between the
    last success and the first failure. 0 when batch 1 fails. batches: only these are tried, in increasing order,
    up to the first that fails (for a peer whose every try is a long run: the best among them, not the boundary);
    when the smallest of them fails, the batches below it are searched as without a list (Accelerate at bf16 under
    1.25 GiB completed no batch of 8)."""
    tries = []

    def ok(b: int) -> bool:
        tries.append((b, completes(b)))
        return tries[-1][1]
    if batches:
        best, listed = 0, sorted(x for x in set(batches) if 1 <= x <= limit)
        for b in listed:
            if not ok(b):
                break
            best = b
        if best == 0 and listed and listed[0] > 1:
            best = largest_passing(ok, listed[0] - 1)
        return best, tries
    return largest_passing(ok, limit), tries


def flexh2o_plan(args, env: dict, mem_cap: int, label: str, flags: dict, log=print, run: Optional[Callable] = None,
                 search: Optional[Callable] = None) -> list:
    """argv of flexh2o system `label` (flags: its KV and compression flags) at its searched best inside the cap,
    its tiers sized by the overhead measured on the plan itself (fair_overhead.py; run: default
    bench_common.run_flexh2o; search: default flexh2o_best), or by --fair-overhead's fixed figure."""
    from bench_common import flag_args, hardware_args
    base = flag_args({"model": args.model, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
                      "dtype": args.dtype, "compute_dtype": args.compute_dtype, **flags,
                      "max_seqs": args.fair_max_batch}) + hardware_args(args.hardware)
    search = search or flexh2o_best
    if args.fair_overhead != "measure":
        from flexh2o.units import parse_bytes
        first, measure = parse_bytes(args.fair_overhead), None
        log(f"fair: {label} overhead fixed by --fair-overhead (not measured): {first / MiB:.1f} MiB")
    else:
        if run is None:
            from bench_common import run_flexh2o as run
        first = need(outside_tiers(run(first_probe_argv(args, flags, mem_cap), args.timeout, env, None),
                                   f"{label}'s overhead at batch 1", log))

        def measure(plan: list) -> tuple:  # the plan itself, gen 2, without the cap (measured, not killed)
            got = run(plan_probe_argv(plan), args.timeout, env, None)
            raw = outside_tiers(got, f"{label}'s overhead on its searched plan ({plan_seqs(plan)} sequences)", log)
            return need(raw), tiers_held(got.record)

    def limited(budget: int, seqs: int) -> tuple:
        at_most = list(base)
        at_most[at_most.index("--max-seqs") + 1] = str(seqs)
        return search(at_most, budget, env)
    argv, pred, _, budget = sized_search(limited, mem_cap, first, measure, label, log, most=args.fair_max_batch)
    log(f"fair: flexh2o {label} runs {plan_seqs(argv)} sequences, tiers {plan_tiers(argv)} B of the {mem_cap} B cap "
        f"(searched inside {budget} B; predicted {pred})")
    return argv


def fair_commands(args, env: dict, mem_cap: int, cmds: dict, ckpt: str, log=print) -> dict:
    """cmds with flexh2o's full/h2o/h2o-q4 at their searched best inside the cap and Accelerate at its largest
    completing batch (see the module docstring); what was measured and tried goes to `log`. A flexh2o system with
    no plan inside the cap is left out (logged with why), so the others still run."""
    from bench_common import h2o_flags, run_flexh2o, run_peer
    from memcap import drop_cached
    out = dict(cmds)
    h2o = h2o_flags(args.hh_ratio, args.budget_pct, args.prompt_len, args.gen_len)
    for system, flags in (("full", {"kv_policy": "full"}), ("h2o", h2o),
                          ("h2o-q4", {**h2o, "compress_weight": True, "compress_cache": True})):
        if system in cmds:
            try:
                out[system] = (run_flexh2o, flexh2o_plan(args, env, mem_cap, system, flags, log))
            except RuntimeError as e:  # this system has no plan inside the cap: the others still run
                log(f"fair: {system} dropped: {e}")
                del out[system]
    if "accelerate" in cmds:
        peer = list(cmds["accelerate"][1])
        i = peer.index("--batch-size") + 1

        def completes(b: int) -> bool:
            peer[i] = str(b)
            drop_cached(ckpt)
            got = run_peer(peer, args.timeout, env, mem_cap)
            log(f"fair: accelerate batch {b}: {got.status} {got.message}")
            return got.status == "ok"
        best, tries = largest_completing(completes, args.fair_max_batch, args.fair_peer_batches)
        if best == 0:
            raise RuntimeError(f"Accelerate completes no batch under the cap: {tries}")
        peer[i] = str(best)
        log(f"fair: accelerate largest completing batch {best} (tries {tries})")
        out["accelerate"] = (run_peer, peer)
    return out
