"""Disk-streamed weights, full and h2o (20%), each with and without --compress-weight --compress-cache, each
configuration at its largest batch under the same caps, runs alternated (full plain, full compressed, h2o plain, h2o
compressed, then again), each flexh2o-run process in its own memory cgroup (benchmarks/memcap.py) so the page cache
cannot keep the weights: every decode step reads them from the disk. Prints tok/s, disk bytes read per step, the
ratios (medians over the repeats), and where a decode step's time went (compute, reading and expanding weights,
waiting for loads) and which phases ran the int4 kernel.

The defaults (opt-125m, prompt 16, gen 32, --gpu-mem 360MB: batches 17 / 177 full, 43 / 398 h2o) keep each run
under a minute on this 2-core machine when it is quiet, three rounds in about 6 minutes:

    flock /work/team/bench.lock env OMP_WAIT_POLICY=PASSIVE python benchmarks/compress_disk.py --repeats 3 \
        --out benchmarks/results/compression/compress_disk.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from bench_common import bench_env, load_avg, run_flexh2o
from flexh2o.units import parse_bytes

COMPRESS = {"weights+cache": ["--compress-weight", "--compress-cache"], "cache": ["--compress-cache"]}


def base_argv(args, policy: str) -> list:
    argv = ["--model", args.model, "--percent", "0", "0", "100", "0", "--dtype", args.dtype, "--compute-dtype",
            args.compute_dtype, "--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len),
            "--gpu-batch-size", "auto", "--gpu-mem", args.gpu_mem, "--cpu-mem", args.cpu_mem, "--offload-dir", args.offload_dir]
    if policy == "h2o":
        argv += ["--hh-ratio", str(args.hh_ratio)]
    return argv


def step_split(rec: dict) -> dict:
    """Seconds per decode step: compute, weights read / expanded (I/O threads), computes waiting for loads."""
    steps = max(rec["measured_steps"] - 1, 1)
    busy, w = rec.get("decode_busy_s", {}), rec.get("weight_seconds", {}).get("decode", {})
    return {"step_s": rec["decode_s"] / max(rec["gen_len"] - 1, 1), "compute_s": busy.get("compute", 0) / steps,
            "weights_read_s": w.get("read", 0) / steps, "weights_expand_s": w.get("expand", 0) / steps,
            "stall_s": busy.get("stall", 0) / steps}


def row(name: str, rec: dict) -> str:
    s = step_split(rec)
    disk = rec["moved_bytes_per_step"].get("disk", 0) / 2 ** 30
    return (f"| {name} | {rec['policy']['gpu_batch_size']} | {rec['prefill_s']:.1f} s | {rec['decode_s']:.1f} s | "
            f"{rec['decode_throughput']:.3f} | {rec['total_throughput']:.3f} | {disk:.3f} GiB | "
            f"{s['step_s']:.2f} / {s['compute_s']:.2f} / {s['weights_read_s']:.2f} / {s['weights_expand_s']:.2f} / "
            f"{s['stall_s']:.2f} s | {', '.join(f'{k} {v}' for k, v in rec.get('weight_kernel', {}).items())} |")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--policies", default="full,h2o", help="comma-separated: full, h2o (default both)")
    p.add_argument("--hh-ratio", type=float, default=0.2, help="h2o: heavy = recent = ratio * prompt (20%% total)")
    p.add_argument("--model", default="opt-125m")
    p.add_argument("--dtype", default="auto", help="storage dtype of every run (flexh2o-run's --dtype; default auto)")
    p.add_argument("--compute-dtype", default="auto", help="compute dtype of every run (default auto: this CPU's "
                   "fastest; RESULTS.md's figures of 1 December 2026, row 60, used --dtype bfloat16 "
                   "--compute-dtype float32)")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--gpu-mem", default="360MB")
    p.add_argument("--cpu-mem", default="2GB")
    p.add_argument("--mem-cap", default="3GB", help="memory cgroup of each run (its page cache included)")
    p.add_argument("--repeats", type=int, default=1, help="alternated rounds of every configuration")
    p.add_argument("--timeout", type=float, default=180, help="seconds a run may take")
    p.add_argument("--offload-dir", default="/tmp/flexh2o-cmp-bench")
    p.add_argument("--out", default=None, help="append one JSON line per run")
    p.add_argument("--compress", choices=sorted(COMPRESS), default="weights+cache",
                   help="what the compressed runs compress (cache: --compress-cache alone)")
    args = p.parse_args()
    args.policies = [x for x in args.policies.split(",") if x]
    if not args.policies or set(args.policies) - {"full", "h2o"}:
        p.error("--policies takes full and/or h2o")
    return args


def run_one(args, policy: str, name: str, env: dict, cap: int) -> dict:
    """One flexh2o-run; its record (None if it failed, said on stdout)."""
    out = run_flexh2o(base_argv(args, policy) + (COMPRESS[args.compress] if name == "compressed" else []),
                      args.timeout, env, cap)
    print(f"{policy} {name}: {out.status} {' '.join(out.argv)} {out.message}", flush=True)
    if out.status != "ok":
        return None
    rec = dict(out.record, bench_label=f"{policy} {name}", load=load_avg())
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(rec) + "\n")
    print(row(f"{policy} {name}", rec), f"load {rec['load']}", flush=True)
    return rec


def ratios(policy: str, runs: dict) -> str:
    """Medians of compressed / plain: total and decode tok/s, disk bytes read per step."""
    def med(name, key):
        return statistics.median(key(r) for r in runs[policy, name])
    keys = {"total": lambda r: r["total_throughput"], "decode": lambda r: r["decode_throughput"],
            "disk read/step": lambda r: r["moved_bytes_per_step"].get("disk", 0)}
    return f"{policy}: compressed / plain " + ", ".join(
        f"{k} {med('compressed', f) / med('plain', f):.2f}x" for k, f in keys.items())


def main() -> int:
    args = parse_args()
    env, cap = bench_env(), parse_bytes(args.mem_cap)
    lscpu = subprocess.run("lscpu | grep -E 'Model name|Flags' | cut -c1-300", shell=True, capture_output=True,
                           text=True).stdout.strip()
    print(f"machine: {lscpu}\nload before: {load_avg()}", flush=True)
    print("| run | batch | prefill | decode | decode tok/s | total tok/s | disk read/step | step / compute / read / "
          "expand / stall | weight matmuls |", flush=True)
    start, runs = time.perf_counter(), {}
    for _ in range(args.repeats):
        for policy in args.policies:
            for name in ("plain", "compressed"):
                rec = run_one(args, policy, name, env, cap)
                if rec is None:
                    return 1
                runs.setdefault((policy, name), []).append(rec)
    for policy in args.policies:
        print(ratios(policy, runs), flush=True)
    print(f"{time.perf_counter() - start:.0f} s in all; load after: {load_avg()}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    sys.exit(main())
