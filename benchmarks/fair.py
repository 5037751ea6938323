"""The fair equal-memory protocol of compare.py --fair: every system at its best configuration under the same cap.

flexh2o: its own policy search (flexh2o-run --policy auto --dry-run) with the tiers sized inside the cap: the cap
minus the process overhead (--fair-overhead: torch, Python, the I/O buffers outside the tiers) split between the gpu
and cpu tiers in a few ways (on a CPU both are host memory), the best predicted split kept, per KV policy.
Accelerate: the largest batch that completes under the cap, found by doubling from 1 and then bisecting, each try a
whole run (same lengths) with a timeout; every try is logged. Both are held to at most --fair-max-batch sequences at
once (flexh2o's search through --max-seqs), so neither wins by a batch the other was not allowed to try.
"""
from __future__ import annotations

import re
import subprocess
import sys
from typing import Callable

from bench_common import REPO
from flexh2o.planning.memory_plan import largest_passing

SPLITS = (0.25, 0.5, 0.75)  # gpu tier's share of the memory left inside the cap


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


def largest_completing(completes: Callable[[int], bool], limit: int = 1024) -> tuple:
    """(largest batch b <= limit with completes(b), [(b, ok)...]): doubling from 1, then bisection between the
    last success and the first failure. 0 when batch 1 fails."""
    tries = []

    def ok(b: int) -> bool:
        tries.append((b, completes(b)))
        return tries[-1][1]
    return largest_passing(ok, limit), tries


def fair_commands(args, env: dict, mem_cap: int, cmds: dict, ckpt: str, log=print) -> dict:
    """cmds with flexh2o's full/h2o at their searched best inside the cap and Accelerate at its largest completing
    batch (see the module docstring); what was tried goes to `log`."""
    from bench_common import flag_args, h2o_flags, hardware_args, run_flexh2o, run_peer
    from memcap import drop_cached
    from flexh2o.units import parse_bytes
    budget = mem_cap - parse_bytes(args.fair_overhead)
    common = {"model": args.model, "prompt_len": args.prompt_len, "gen_len": args.gen_len, "dtype": args.dtype,
              "compute_dtype": args.compute_dtype}
    out = dict(cmds)
    for system, kv in (("full", {"kv_policy": "full"}),
                       ("h2o", h2o_flags(args.hh_ratio, args.budget_pct, args.prompt_len, args.gen_len))):
        if system not in cmds:
            continue
        argv, pred, tried = flexh2o_best(flag_args({**common, **kv, "max_seqs": args.fair_max_batch})
                                         + hardware_args(args.hardware), budget, env)
        log(f"fair: flexh2o {system} inside {budget} B: tried {tried}; best {' '.join(argv)} (predicted {pred})")
        out[system] = (run_flexh2o, argv)
    if "accelerate" in cmds:
        peer = list(cmds["accelerate"][1])
        i = peer.index("--batch-size") + 1

        def completes(b: int) -> bool:
            peer[i] = str(b)
            drop_cached(ckpt)
            got = run_peer(peer, args.timeout, env, mem_cap)
            log(f"fair: accelerate batch {b}: {got.status} {got.message}")
            return got.status == "ok"
        best, tries = largest_completing(completes, args.fair_max_batch)
        if best == 0:
            raise RuntimeError(f"Accelerate completes no batch under the cap: {tries}")
        peer[i] = str(best)
        log(f"fair: accelerate largest completing batch {best} (tries {tries})")
        out["accelerate"] = (run_peer, peer)
    return out
