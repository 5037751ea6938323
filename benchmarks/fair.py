"""The fair equal-memory protocol of compare.py --fair: every system at its best configuration under the same cap.

flexh2o: its own policy search (flexh2o-run --policy auto --dry-run) with the tiers sized inside the cap: the cap
minus the process overhead (--fair-overhead: torch, Python, the I/O buffers outside the tiers) split between the gpu
and cpu tiers in a few ways (on a CPU both are host memory), the best predicted split kept, per KV policy.
Accelerate: the largest batch that completes under the cap, found by doubling from 1 and then bisecting, each try a
whole run (same lengths) with a timeout; every try is logged. --fair-peer-batches B1,B2,... tries only those, in
increasing order up to the first that fails (each try of a large model streamed from disk takes minutes: the best
of the listed batches, not the exact boundary, which the log then shows). Both are held to at most --fair-max-batch
sequences at once (flexh2o's search through --max-seqs), so neither wins by a batch the other was not allowed to try.

The regime is checked first (regime_rows): the model's weights at the dtype each system stores them must exceed the
cap (the paper's setting: a model larger than memory), else the run is refused naming the smallest built-in model
that would; a compressed system's 4-bit weights are reported beside the cap but not refused. The process overhead
outside the tiers is measured (measured_overhead: one short flexh2o run of the same model under the cap, weights on
disk, peak RSS minus the tiers' peaks) unless --fair-overhead gives it.
"""
from __future__ import annotations

import re
import subprocess
import sys
from typing import Callable, Optional

from bench_common import REPO
from flexh2o.planning.memory_plan import largest_passing

SPLITS = (0.25, 0.5, 0.75, 0.9)  # gpu tier's share of the memory left inside the cap
OVERHEAD_MARGIN = 1.15  # on the measured overhead: the probe runs batch 1 and 8 tokens, the real runs more
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


def measured_overhead(args, env: dict, mem_cap: int, log=print) -> int:
    """Bytes a flexh2o process of this model holds outside its tiers, measured (see the module docstring)."""
    from bench_common import flag_args, run_flexh2o
    tiers = mem_cap - (64 << 20)  # the gpu tier holds two layers in flight at the compute dtype
    argv = flag_args({"model": args.model, "path": "_DUMMY_", "percent": "0 0 100 0 100 0", "prompt_len": 8,
                      "gen_len": 2, "gpu_batch_size": 1, "dtype": args.dtype, "compute_dtype": args.compute_dtype,
                      "gpu_mem": str(tiers - (32 << 20)), "cpu_mem": str(32 << 20)})
    got = run_flexh2o(argv, args.timeout, env, mem_cap)
    if got.status != "ok":
        raise RuntimeError(f"measuring the process overhead under the cap failed: {got.status} {got.message}")
    peak = got.record["peak_bytes"]
    raw = peak["cpu_rss"] - (peak.get("gpu") or 0) - (peak.get("cpu_tier") or 0)
    log(f"fair: measured process overhead {raw / 2**20:.0f} MiB (peak rss {peak['cpu_rss'] / 2**20:.0f} MiB "
        f"minus the tiers' peaks), x{OVERHEAD_MARGIN} margin")
    return int(raw * OVERHEAD_MARGIN)


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
    up to the first that fails (for a peer whose every try is a long run: the best among them, not the boundary)."""
    tries = []

    def ok(b: int) -> bool:
        tries.append((b, completes(b)))
        return tries[-1][1]
    if batches:
        best = 0
        for b in sorted(x for x in set(batches) if 1 <= x <= limit):
            if not ok(b):
                break
            best = b
        return best, tries
    return largest_passing(ok, limit), tries


def fair_commands(args, env: dict, mem_cap: int, cmds: dict, ckpt: str, log=print) -> dict:
    """cmds with flexh2o's full/h2o at their searched best inside the cap and Accelerate at its largest completing
    batch (see the module docstring); what was tried goes to `log`."""
    from bench_common import flag_args, h2o_flags, hardware_args, run_flexh2o, run_peer
    from memcap import drop_cached
    from flexh2o.units import parse_bytes
    overhead = (measured_overhead(args, env, mem_cap, log) if args.fair_overhead == "measure"
                else parse_bytes(args.fair_overhead))
    budget = mem_cap - overhead
    common = {"model": args.model, "prompt_len": args.prompt_len, "gen_len": args.gen_len, "dtype": args.dtype,
              "compute_dtype": args.compute_dtype}
    out = dict(cmds)
    h2o = h2o_flags(args.hh_ratio, args.budget_pct, args.prompt_len, args.gen_len)
    for system, kv in (("full", {"kv_policy": "full"}), ("h2o", h2o),
                       ("h2o-q4", {**h2o, "compress_weight": True, "compress_cache": True})):
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
        best, tries = largest_completing(completes, args.fair_max_batch, args.fair_peer_batches)
        if best == 0:
            raise RuntimeError(f"Accelerate completes no batch under the cap: {tries}")
        peer[i] = str(best)
        log(f"fair: accelerate largest completing batch {best} (tries {tries})")
        out["accelerate"] = (run_peer, peer)
    return out
