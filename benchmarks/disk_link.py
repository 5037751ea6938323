"""Disk-streamed decode against the link (issue 28 item 4): with every weight on disk and nothing else to wait for
(cache and activations on the gpu tier, one small batch), a decode step reads the whole model once; its time is
compared with the time to read those bytes at the disk tier's measured direct-I/O rate.

Each round measures the rate first (bench_common.disk_read_probe: the disk tier's own reads of 256 MiB in 4 and
16 MiB files, direct I/O, so the page cache never answers), then one flexh2o-run process; rounds alternate the two,
so a drifting disk is measured beside the step it bounds. Prints per round: the rate, the bytes a decode step read
(the run's own count), the link bound (bytes / rate), the measured step, their ratio (target <= 1.1), and where
the step went (compute, weight reads summed over I/O threads, computes waiting for loads); then the medians.

    flock /tmp/bench.lock env OMP_WAIT_POLICY=PASSIVE python benchmarks/disk_link.py --repeats 3
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

from bench_common import bench_env, disk_read_probe, load_avg, run_flexh2o


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="opt-125m")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--gen-len", type=int, default=6)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--compute-dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--offload-dir", default=os.path.join(os.path.expanduser("~"), "flexh2o_offload"))
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--extra", default="", help="more flexh2o-run flags, one string (e.g. '--overlap false')")
    return p.parse_args()


def argv(args) -> list:
    return ["--model", args.model, "--percent", "0", "0", "100", "0", "100", "0", "--gpu-batch-size",
            str(args.batch), "--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len), "--dtype",
            args.dtype, "--compute-dtype", args.compute_dtype, "--offload-dir", args.offload_dir,
            "--gpu-mem", "4GB", "--hardware", "cpu_measured"] + args.extra.split()


def one_round(args, env: dict) -> dict:
    rate = disk_read_probe(env, args.offload_dir)
    out = run_flexh2o(argv(args), args.timeout, env)
    if out.record is None or rate is None:
        raise SystemExit(f"disk_link: {out.status}: {out.message}" if out.record is None else
                         "disk_link: the direct-I/O rate could not be measured")
    rec = out.record
    steps = max(rec["gen_len"] - 1, 1)
    busy, read = rec.get("decode_busy_s", {}), rec.get("weight_seconds", {}).get("decode", {})
    step_bytes = rec["moved_bytes_per_step"]["disk"]
    step_s = rec["decode_s"] / steps
    bound = step_bytes / rate
    return {"rate": rate, "bytes": step_bytes, "bound_s": bound, "step_s": step_s, "ratio": step_s / bound,
            "compute_s": busy.get("compute", 0) / steps, "read_s": read.get("read", 0) / steps,
            "stall_s": busy.get("stall", 0) / steps, "load": load_avg()}


def show(r: dict, name: str) -> str:
    return (f"{name}: rate {r['rate'] / 1e9:.3f} GB/s, step reads {r['bytes'] / 2 ** 20:.1f} MiB, bound "
            f"{r['bound_s']:.3f} s, step {r['step_s']:.3f} s, ratio {r['ratio']:.2f} (compute {r['compute_s']:.3f} s, "
            f"weight reads {r['read_s']:.3f} s, stall {r['stall_s']:.3f} s) load {r['load']}")


def main() -> int:
    args = parse_args()
    env = bench_env(args.threads)
    print("flexh2o-run " + " ".join(argv(args)), flush=True)
    rounds = []
    for i in range(args.repeats):
        rounds.append(one_round(args, env))
        print(show(rounds[-1], f"round {i + 1}"), flush=True)
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0] if k != "load"}
    print(show({**med, "load": load_avg()}, "median"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
