"""Disk-streamed decode against the link: with every weight on disk and nothing else to wait for
(cache and activations on the gpu tier, one small batch), a decode step reads the whole model once; its time is
compared with the time to read those bytes at the disk tier's measured direct-I/O rate.

Each round measures the rate first (link_rate: the disk tier's direct-I/O reads of 256 MiB in 16 MiB files into
reused buffers, 1, 4 and 8 at a time, the fastest; the page cache never answers), then one flexh2o-run process
(and, with --baseline, the same run of another checkout); rounds alternate them, so a drifting disk is measured
beside the steps it bounds. Prints per round: the rate, the bytes a decode step read
(the run's own count), the link bound (bytes / rate), the measured step, their ratio (target <= 1.1), and where
the step went (compute, weight reads summed over I/O threads, computes waiting for loads); then the medians.

    flock /tmp/bench.lock env OMP_WAIT_POLICY=PASSIVE python benchmarks/disk_link.py --repeats 3 [--baseline ../main]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from bench_common import REPO, bench_env, load_avg
from flexh2o.storage.disk import DiskTier, aligned_empty
from flexh2o.storage.offload_dir import make_run_dir

LINK_FILES, LINK_FILE = 16, 16 << 20


def link_rate(offload_dir: str, repeats: int = 3) -> float:
    """Bytes/s of direct-I/O reads of LINK_FILES files of LINK_FILE bytes, into reused aligned buffers, 1, 4 and 8
    reads in flight (the weight store's depth): the fastest median of `repeats`."""
    tier = DiskTier(make_run_dir(offload_dir), LINK_FILES * LINK_FILE)
    try:
        handles = [tier.alloc((LINK_FILE,), torch.uint8) for _ in range(LINK_FILES)]
        for h in handles:
            tier.store(h, torch.ones(LINK_FILE, dtype=torch.uint8))
        bufs = [aligned_empty(LINK_FILE) for _ in range(8)]
        cpu = torch.device("cpu")
        best = 0.0
        for depth in (1, 4, 8):
            with ThreadPoolExecutor(depth) as pool:
                def read():
                    start = time.perf_counter()
                    list(pool.map(lambda i: tier.load(handles[i], cpu, None, bufs[i % depth]), range(LINK_FILES)))
                    return time.perf_counter() - start
                read()  # warm-up (buffers touched)
                best = max(best, LINK_FILES * LINK_FILE / statistics.median(read() for _ in range(repeats)))
        return best
    finally:
        tier.close()


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
    p.add_argument("--baseline", help="another checkout (e.g. /work/main): its flexh2o-run alternated with this one")
    return p.parse_args()


def argv(args) -> list:
    return ["--model", args.model, "--percent", "0", "0", "100", "0", "100", "0", "--gpu-batch-size",
            str(args.batch), "--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len), "--dtype",
            args.dtype, "--compute-dtype", args.compute_dtype, "--offload-dir", args.offload_dir,
            "--gpu-mem", "4GB", "--hardware", "cpu_measured"] + args.extra.split()


def run_checkout(checkout: str, flags: list, timeout: float, env: dict) -> dict:
    """The JSON record of one flexh2o-run of the package in `checkout` (run from there, so that one is imported)."""
    fd, log = tempfile.mkstemp(prefix="disk-link-", suffix=".jsonl")
    os.close(fd)
    try:
        p = subprocess.run([sys.executable, "-m", "flexh2o.cli"] + flags + ["--log-file", log], cwd=checkout,
                           env={**env, "PYTHONPATH": checkout}, capture_output=True, text=True, timeout=timeout)
        lines = [ln for ln in open(log) if ln.strip()]
        if p.returncode != 0 or not lines:
            raise SystemExit(f"disk_link: {checkout}: {(p.stderr.strip().splitlines() or ['no record'])[-1]}")
        return json.loads(lines[-1])
    finally:
        os.unlink(log)


def one_round(args, checkout: str, env: dict, rate: float) -> dict:
    rec = run_checkout(checkout, argv(args), args.timeout, env)
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
    runs = {"this": REPO}
    if args.baseline:
        runs["baseline"] = os.path.abspath(args.baseline)
    print("flexh2o-run " + " ".join(argv(args)), flush=True)
    rounds: dict = {name: [] for name in runs}
    for i in range(args.repeats):
        rate = link_rate(args.offload_dir)
        for name, checkout in (list(runs.items()) if i % 2 == 0 else list(reversed(runs.items()))):
            rounds[name].append(one_round(args, checkout, env, rate))
            print(show(rounds[name][-1], f"round {i + 1} {name}"), flush=True)
    for name, got in rounds.items():
        med = {k: statistics.median(r[k] for r in got) for k in got[0] if k != "load"}
        print(show({**med, "load": load_avg()}, f"median {name}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
