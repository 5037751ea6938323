"""The README's first command under each dtype choice, alternating within one invocation, medians and ratios.

    python benchmarks/readme_dtypes.py --rounds 3
Variants: no dtype flag (auto), --dtype bfloat16 (compute auto), and the explicit pairs float32/float32,
bfloat16/bfloat16, float16/float32 (the old default) and float16/float16. Prints total tok/s per variant (median,
min-max), each variant's ratio to the fastest explicit pair, the compute dtype auto picked and why, and the load.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from bench_common import bench_env, load_avg, median

README = ["--model", "opt-125m", "--percent", "0", "100", "100", "0", "--gpu-batch-size", "4", "--prompt-len", "64",
          "--gen-len", "16"]
VARIANTS = {"auto (no flag)": [], "--dtype bfloat16": ["--dtype", "bfloat16"],
            "float32/float32": ["--dtype", "float32", "--compute-dtype", "float32"],
            "bfloat16/bfloat16": ["--dtype", "bfloat16", "--compute-dtype", "bfloat16"],
            "float16/float32": ["--dtype", "float16", "--compute-dtype", "float32"],
            "float16/float16": ["--dtype", "float16", "--compute-dtype", "float16"]}
EXPLICIT = ("float32/float32", "bfloat16/bfloat16", "float16/float32", "float16/float16")


def run_once(extra: list, env: dict, log: str) -> dict:
    p = subprocess.run([sys.executable, "-m", "flexh2o.cli", *README, *extra, "--log-file", log], env=env,
                       capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(p.stderr.strip().splitlines()[-1:])
    with open(log) as f:
        return json.loads(f.readlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, help="OMP_NUM_THREADS (default: torch's choice)")
    ap.add_argument("--log-file", default=os.path.join(os.path.dirname(__file__), "results", "dtype-choice",
                                                        "readme_dtypes.jsonl"))
    args = ap.parse_args(argv)
    env = bench_env(args.threads)
    got = {v: [] for v in VARIANTS}
    why = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, extra in VARIANTS.items():
                before = load_avg()
                rec = run_once(extra, env, os.path.join(tmp, "log.jsonl"))
                rec["readme_dtypes"] = {"variant": name, "round": r, "load_before": before, "load_after": load_avg()}
                with open(args.log_file, "a") as f:
                    f.write(json.dumps(rec) + "\n")
                got[name].append(rec["total_throughput"])
                pol = rec["policy"]
                dec = pol.get("decode_dtype", pol["compute_dtype"])
                why[name] = f"{pol['dtype']}/{pol['compute_dtype']}" + (f"+{dec}" if dec != pol["compute_dtype"] else "")
    best = max(median(got[v]) for v in EXPLICIT)
    print(f"{'variant':<20} {'ran (storage/compute[+decode])':<18} {'median tok/s':>12} {'min-max':>12} {'vs fastest explicit':>20}")
    for name, tps in got.items():
        print(f"{name:<20} {why[name]:<18} {median(tps):>12.1f} {f'{min(tps):.1f}-{max(tps):.1f}':>12} "
              f"{median(tps) / best:>19.2f}x")
    print(f"load (1/5/15 min) at the end: {load_avg()}  threads {env.get('OMP_NUM_THREADS', 'default')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
