"""H2O vs full KV cache at the same memory: a scaled-down version of the paper's setting on this CPU.

The paper's regime: weights streamed to the compute device over a slow link every step (T4: PCIe from DRAM), the
KV cache on the fast tier with a fixed capacity (16 GB), so the batch is limited by the cache and decode by the
weight I/O. On a CPU-only machine the "gpu" tier is host memory, so moving weights cpu -> gpu costs nothing; the slow
link that exists is the disk tier (direct I/O). So by default the weights stream from disk every step
(`--percent 0 0 100 0 100 0`), the cache and activations stay in the gpu tier capped by `--gpu-mem`; --dtype and
--compute-dtype default to auto (flexh2o-run's choice for this machine).

For `full` and `h2o` (budget: 20% of prompt + gen tokens, the paper's convention, or --hh-ratio) the script asks
flexh2o for the largest batch that fits (--dry-run), runs both with `--gpu-batch-size auto` as flexh2o-run
subprocesses (records, with the cost model's predictions that flexh2o-run adds, appended to --log-file) and prints
them side by side: largest batch, throughput, peak memory per tier.

    python benchmarks/h2o_vs_full.py                          # opt-350m, 128+64, weights on disk, --gpu-mem 512MB
    python benchmarks/h2o_vs_full.py --percent "0 100 100 0 100 0"   # weights memory-resident (cpu tier)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from bench_common import (add_dtype_args, add_h2o_args, bench_env, disk_read_probe, dry_run_batches, flag_args, gbs,
                          h2o_flags,
                          hardware_args, load_avg, mib, regime, run_flexh2o, table)

HERE = os.path.dirname(os.path.abspath(__file__))


def base_point(args) -> dict:
    return {"model": args.model, "path": "_DUMMY_", "percent": args.percent, "prompt_len": args.prompt_len,
            "gen_len": args.gen_len, "dtype": args.dtype, "compute_dtype": args.compute_dtype, "gpu_mem": args.gpu_mem,
            "cpu_mem": args.cpu_mem,
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
    pred = r.get("predicted") or {}
    row.update(status="ok", ran=r["policy"]["gpu_batch_size"], slots=_slots(r), prefill=f"{r['prefill_s']:.2f}",
               decode=f"{r['decode_s']:.2f}", total=f"{r['total_throughput']:.1f}",
               dec=f"{r['decode_throughput']:.1f}", gpu=mib(peak["gpu"]),
               cache=mib(sum(r["plan_bytes"][t]["cache"] for t in ("gpu", "cpu", "disk"))),
               rss=mib(peak["cpu_rss"]), cpu_tier=mib(peak["cpu_tier"]), disk=mib(peak["disk"]),
               disk_step=mib((r.get("moved_bytes_per_step") or {}).get("disk")),
               pred_dec=f"{pred['decode_throughput']:.1f}" if pred.get("decode_throughput") else "-",
               dec_ratio=f"{r['decode_ratio_measured_to_predicted']:.2f}"
               if r.get("decode_ratio_measured_to_predicted") else "-",
               bottleneck=(pred.get("bottleneck") or {}).get("decode", "-"), tp=r["total_throughput"])
    return row


def _slots(rec: dict) -> str:
    p = rec["policy"]
    return str(rec["prompt_len"] + rec["gen_len"]) if p["kv_policy"] == "full" else f"{p['heavy']}+{p['recent']}+1"


COLUMNS = (("policy", "policy"), ("largest batch", "largest"), ("ran batch", "ran"), ("cache slots", "slots"),
           ("prefill s", "prefill"), ("decode s", "decode"), ("total tok/s", "total"), ("decode tok/s", "dec"),
           ("model decode tok/s", "pred_dec"), ("decode meas/model", "dec_ratio"), ("model bottleneck", "bottleneck"),
           ("plan cache MiB", "cache"), ("peak gpu MiB", "gpu"), ("peak cpu_tier MiB", "cpu_tier"),
           ("peak disk MiB", "disk"), ("disk read/step MiB", "disk_step"), ("peak rss MiB", "rss"),
           ("status", "status"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="H2O vs full at the same memory cap (flexh2o-run subprocesses).")
    ap.add_argument("--model", default="opt-350m")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--percent", default="0 0 100 0 100 0",
                    help="default: weights streamed from disk, cache and activations in the gpu tier")
    ap.add_argument("--cpu-cache-compute", action="store_true")
    ap.add_argument("--gpu-mem", default="512MB", help="the fixed gpu-tier cap (cache + working buffers)")
    ap.add_argument("--cpu-mem", default="1GB")
    add_h2o_args(ap)
    add_dtype_args(ap)
    ap.add_argument("--timeout", type=float, default=240, help="seconds per run")
    ap.add_argument("--threads", type=int, help="OMP_NUM_THREADS (default: torch's choice)")
    ap.add_argument("--hardware", help="hardware profile for flexh2o-run's predictions (default: flexh2o-run's)")
    ap.add_argument("--log-file", default=os.path.join(HERE, "results", "h2o-vs-full", "h2o_vs_full.jsonl"))
    args = ap.parse_args(argv)
    env = bench_env(args.threads)
    os.makedirs(os.path.dirname(os.path.abspath(args.log_file)), exist_ok=True)
    started, load0 = time.perf_counter(), load_avg()
    disk0 = disk_read_probe(env)  # the disk tier's read rate now (the cost model's profile was measured another time)
    largest = dry_run_batches(flag_args({**base_point(args), **policies(args)[1][1], "gpu_batch_size": 1}), env)
    rows = []
    for name, kv in policies(args):
        point = {**base_point(args), **kv, "gpu_batch_size": "auto"}
        argv_ = flag_args(point) + hardware_args(args.hardware)
        print("flexh2o-run " + " ".join(argv_), file=sys.stderr, flush=True)
        before = load_avg()
        out = run_flexh2o(argv_, args.timeout, env)
        if out.record:
            out.record["bench"] = {"script": "h2o_vs_full", "argv": out.argv, "loadavg_before": before,
                                   "loadavg_after": load_avg(), "disk_read_bw_probe": disk0,
                                   "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
            with open(args.log_file, "a") as f:
                f.write(json.dumps(out.record) + "\n")
        rows.append(column(name, largest[kv["kv_policy"]], out))
    print(f"\n{args.model}  prompt {args.prompt_len} + gen {args.gen_len}  --percent {args.percent}  "
          f"--gpu-mem {args.gpu_mem}  --cpu-mem {args.cpu_mem}  dtype {args.dtype}/{args.compute_dtype}  threads "
          f"{env.get('OMP_NUM_THREADS', 'default')}"
          f"  OMP_WAIT_POLICY={env['OMP_WAIT_POLICY']}"
          f"  [{regime({'policy': {'percent': args.percent}})}]")
    print(table(rows, COLUMNS))
    full, h2o = rows
    if full.get("largest"):
        line = f"h2o / full: largest batch {h2o['largest'] / full['largest']:.2f}x"
        if full.get("status") == "ok" and h2o.get("status") == "ok":
            line += f", total throughput {h2o['tp'] / full['tp']:.2f}x"
        print(line)
    print(f"disk tier read rate (direct I/O, median of 5 x 256 MiB): {gbs(disk0)} before, {gbs(disk_read_probe(env))} "
          f"after")
    print(f"({time.perf_counter() - started:.0f} s; load average {load0} before, {load_avg()} after; records appended "
          f"to {args.log_file})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
