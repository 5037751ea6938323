"""H2O vs full KV cache at the same memory: a scaled-down version of the paper's setting on this CPU.

The KV cache lives in the gpu tier, capped by --gpu-mem (the paper's 16 GB T4); the weights are offloaded to the cpu
tier. For `full` and `h2o` (budget: 20% of prompt + gen tokens, the paper's convention, or --hh-ratio) the
script asks flexh2o for the largest batch that fits (--dry-run), runs both with `--gpu-batch-size auto` as
flexh2o-run subprocesses (records appended to --log-file) and prints them side by side.

    python benchmarks/h2o_vs_full.py                   # opt-350m, 256+32, --percent 0 100 100 0, --gpu-mem 768MB
    python benchmarks/h2o_vs_full.py --model opt-125m --prompt-len 512 --gen-len 32 --gpu-mem 1GB
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from bench_common import (add_h2o_args, add_prediction, bench_env, default_hw_profile, dry_run_batches, flag_args,
                          h2o_flags, mib, run_flexh2o, table)

HERE = os.path.dirname(os.path.abspath(__file__))


def base_point(args) -> dict:
    return {"model": args.model, "path": "_DUMMY_", "percent": args.percent, "prompt_len": args.prompt_len,
            "gen_len": args.gen_len, "dtype": "bfloat16", "gpu_mem": args.gpu_mem, "cpu_mem": args.cpu_mem,
            "cpu_cache_compute": args.cpu_cache_compute, "num_gpu_batches": 1}


def policies(args) -> list:
    h2o = h2o_flags(args.hh_ratio, args.budget_pct, args.prompt_len, args.gen_len)
    return [("full", {"kv_policy": "full"}), ("h2o " + " ".join(flag_args(h2o)[2:]), h2o)]


def column(name: str, largest: int, out) -> dict:
    row = {"policy": name, "largest": largest}
    if out.status != "ok":
        row["status"] = f"{out.status}: {out.message}"
        return row
    r, peak = out.record, out.record["peak_bytes"]
    plan_gpu = sum(out.record["plan_bytes"]["gpu"].values())
    row.update(status="ok", ran=r["policy"]["gpu_batch_size"], slots=_slots(r), prefill=f"{r['prefill_s']:.2f}",
               decode=f"{r['decode_s']:.2f}", total=f"{r['total_throughput']:.1f}",
               dec=f"{r['decode_throughput']:.1f}", gpu=mib(peak["gpu"]), plan_gpu=mib(plan_gpu),
               cache=mib(r["plan_bytes"]["gpu"]["cache"] + r["plan_bytes"]["cpu"]["cache"]),
               rss=mib(peak["cpu_rss"]), cpu_tier=mib(peak["cpu_tier"]), disk=mib(peak["disk"]),
               tp=r["total_throughput"])
    return row


def _slots(rec: dict) -> str:
    p = rec["policy"]
    return str(rec["prompt_len"] + rec["gen_len"]) if p["kv_policy"] == "full" else f"{p['heavy']}+{p['recent']}+1"


COLUMNS = (("policy", "policy"), ("largest batch", "largest"), ("ran batch", "ran"), ("cache slots", "slots"),
           ("prefill s", "prefill"), ("decode s", "decode"), ("total tok/s", "total"), ("decode tok/s", "dec"),
           ("plan cache MiB", "cache"), ("plan gpu MiB", "plan_gpu"), ("peak gpu MiB", "gpu"),
           ("peak cpu_tier MiB", "cpu_tier"), ("peak rss MiB", "rss"), ("peak disk MiB", "disk"),
           ("status", "status"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="H2O vs full at the same memory cap (flexh2o-run subprocesses).")
    ap.add_argument("--model", default="opt-350m")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--percent", default="0 100 100 0", help="weights on cpu, cache on gpu (the paper's regime)")
    ap.add_argument("--cpu-cache-compute", action="store_true")
    ap.add_argument("--gpu-mem", default="768MB", help="the fixed gpu-tier cap")
    ap.add_argument("--cpu-mem", default="4GB")
    add_h2o_args(ap)
    ap.add_argument("--timeout", type=float, default=240, help="seconds per run")
    ap.add_argument("--threads", type=int, help="OMP_NUM_THREADS (default: torch's choice)")
    ap.add_argument("--log-file", default=os.path.join(HERE, "results", "h2o_vs_full.jsonl"))
    args = ap.parse_args(argv)
    env = bench_env(args.threads)
    os.makedirs(os.path.dirname(os.path.abspath(args.log_file)), exist_ok=True)
    started = time.perf_counter()
    largest = dry_run_batches(flag_args({**base_point(args), **policies(args)[1][1], "gpu_batch_size": 1}), env)
    rows = []
    for name, kv in policies(args):
        point = {**base_point(args), **kv, "gpu_batch_size": "auto"}
        print("flexh2o-run " + " ".join(flag_args(point)), file=sys.stderr, flush=True)
        out = run_flexh2o(flag_args(point), args.timeout, env)
        if out.record:
            add_prediction(out.record, flag_args(point), default_hw_profile())
            with open(args.log_file, "a") as f:
                f.write(json.dumps(out.record) + "\n")
        rows.append(column(name, largest[kv["kv_policy"]], out))
    print(f"\n{args.model}  prompt {args.prompt_len} + gen {args.gen_len}  --percent {args.percent}  "
          f"--gpu-mem {args.gpu_mem}  --cpu-mem {args.cpu_mem}  bf16  threads {env.get('OMP_NUM_THREADS', 'default')}")
    print(table(rows, COLUMNS))
    full, h2o = rows
    if full.get("status") == "ok" and h2o.get("status") == "ok":
        print(f"h2o / full: largest batch {h2o['largest'] / max(full['largest'], 1):.2f}x, "
              f"total throughput {h2o['tp'] / full['tp']:.2f}x")
    print(f"({time.perf_counter() - started:.0f} s; records appended to {args.log_file})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
