"""Disk-streamed weights with and without --compress-weight --compress-cache, one policy per invocation (full, or
h2o at a budget), each configuration at its largest batch under the same caps, runs alternated (plain, compressed,
plain, ...), each flexh2o-run process in its own memory cgroup (benchmarks/memcap.py) so the page cache cannot keep
the weights: every decode step reads them from the disk. Prints tok/s, disk bytes read per step, the ratios, and
where a decode step's time went (compute, reading and expanding weights, waiting for loads).

    flock /work/team/bench.lock env OMP_WAIT_POLICY=PASSIVE python benchmarks/compress_disk.py --policy full \\
        --out benchmarks/results/compress_disk.jsonl
    flock /work/team/bench.lock env OMP_WAIT_POLICY=PASSIVE python benchmarks/compress_disk.py --policy h2o \\
        --out benchmarks/results/compress_disk.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from bench_common import bench_env, load_avg, run_flexh2o
from flexh2o.units import parse_bytes

COMPRESS = ["--compress-weight", "--compress-cache"]


def base_argv(args) -> list:
    argv = ["--model", args.model, "--percent", "0", "0", "100", "0", "--dtype", "bfloat16", "--compute-dtype",
            "float32", "--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len), "--gpu-batch-size",
            "auto", "--gpu-mem", args.gpu_mem, "--cpu-mem", args.cpu_mem, "--offload-dir", args.offload_dir]
    if args.policy == "h2o":
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


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--policy", choices=["full", "h2o"], default="full")
    p.add_argument("--hh-ratio", type=float, default=0.2, help="h2o: heavy = recent = ratio * prompt (20%% total)")
    p.add_argument("--model", default="opt-350m")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--gpu-mem", default="400MB")
    p.add_argument("--cpu-mem", default="2GB")
    p.add_argument("--mem-cap", default="3GB", help="memory cgroup of each run (its page cache included)")
    p.add_argument("--repeats", type=int, default=1, help="alternated pairs (plain, compressed)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--offload-dir", default="/tmp/flexh2o-cmp-bench")
    p.add_argument("--out", default=None, help="append one JSON line per run")
    args = p.parse_args()
    env, cap = bench_env(), parse_bytes(args.mem_cap)
    lscpu = subprocess.run("lscpu | grep -E 'Model name|Flags' | cut -c1-300", shell=True, capture_output=True,
                           text=True).stdout.strip()
    print(f"machine: {lscpu}\nload before: {load_avg()}", flush=True)
    runs: dict = {"plain": [], "compressed": []}
    for _ in range(args.repeats):
        for name, extra in (("plain", []), ("compressed", COMPRESS)):
            argv = base_argv(args) + extra
            out = run_flexh2o(argv, args.timeout, env, cap)
            print(f"{name}: {out.status} {' '.join(out.argv)} {out.message}", flush=True)
            if out.status != "ok":
                return 1
            rec = dict(out.record, bench_label=f"{args.policy} {name}", load=load_avg())
            runs[name].append(rec)
            if args.out:
                os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
                with open(args.out, "a") as f:
                    f.write(json.dumps(rec) + "\n")
            print(row(f"{args.policy} {name}", rec), f"load {rec['load']}", flush=True)
    med = {n: {k: statistics.median(r[k] for r in rs) for k in ("total_throughput", "decode_throughput")}
           for n, rs in runs.items()}
    total, decode = (med["compressed"][k] / med["plain"][k] for k in ("total_throughput", "decode_throughput"))
    print(f"{args.policy}: compressed / plain total {total:.2f}x, decode {decode:.2f}x  (load after: {load_avg()})")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    sys.exit(main())
