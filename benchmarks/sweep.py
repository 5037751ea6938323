"""Run a grid of flexh2o-run points described in a JSON file under configs/, one process per point.

    python benchmarks/sweep.py flexh2o/configs/cpu_scaled.json --out benchmarks/results/paper-sweep/cpu_scaled.jsonl \
        --timeout 300

Config file: {"description": ..., "defaults": {flag: value}, "groups": [{flag: value | [values] | [{flags}]}]}.
Keys are flexh2o-run flags with '_' for '-' (true = bare flag, null/false = left out, "percent" a string); "label"
and "note" are metadata. In a group, a list of values or of dicts is varied (Cartesian product, in key order); a
dict in such a list sets several flags together (e.g. prompt and gen length, or a KV policy with its budget).
Each point appends one record (flexh2o's JSON record plus "sweep": key, label, status, argv) to --out; points
already there are skipped, so an interrupted sweep resumes. Failed points are retried with --retry-failed.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

from bench_common import (bench_env, describe_policy, disk_read_probe, flag_args, gbs, hardware_args, load_avg, mib,
                          point_key, run_flexh2o, table)


def expand(config: dict) -> list:
    """All points of a sweep config, in file order: list of flat dicts of flags (plus label/note)."""
    points = []
    for group in config["groups"]:
        axes = []
        for key, value in group.items():
            if isinstance(value, list):
                axes.append([v if isinstance(v, dict) else {key: v} for v in value])
            else:
                axes.append([{key: value}])
        for combo in itertools.product(*axes):
            point = dict(config.get("defaults", {}))
            for part in combo:
                point.update(part)
            points.append(point)
    return points


def load_done(path: str) -> dict:
    """key -> last record already in the output file."""
    done = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    rec = json.loads(line)
                    if "sweep" in rec:
                        done[rec["sweep"]["key"]] = rec
    return done


def run_point(point: dict, timeout: float, env: dict, hw, disk_bw=None) -> dict:
    before = load_avg()
    out = run_flexh2o(flag_args(point) + hardware_args(hw), timeout, env)
    rec = out.record or {}
    rec["sweep"] = {"key": point_key(point), "label": point.get("label", ""), "status": out.status,
                    "argv": out.argv, "message": out.message, "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "loadavg_before": before, "loadavg_after": load_avg(), "disk_read_bw_probe_at_start": disk_bw}
    return rec


def summary_rows(points: list, done: dict) -> list:
    rows = []
    for point in points:
        rec = done.get(point_key(point))
        if rec is None:
            rows.append({"label": point.get("label", ""), "status": "not run"})
            continue
        s, p = rec["sweep"], rec.get("policy", {})
        row = {"label": s["label"], "status": s["status"] if s["status"] == "ok" else f"{s['status']}: {s['message']}"}
        if s["status"] == "ok":
            pred = rec.get("predicted") or {}
            row.update(model=rec["model"], len=f"{rec['prompt_len']}+{rec['gen_len']}", percent=p["percent"],
                       batch=f"{p['gpu_batch_size']}x{p['num_gpu_batches']}", kv=describe_policy(rec),
                       prefill=f"{rec['prefill_s']:.2f}", decode=f"{rec['decode_s']:.2f}",
                       total=f"{rec['total_throughput']:.1f}", dec_tp=f"{rec['decode_throughput']:.1f}",
                       gpu=mib(rec["peak_bytes"]["gpu"]), rss=mib(rec["peak_bytes"]["cpu_rss"]),
                       pred=f"{pred['total_throughput']:.1f}" if pred.get("total_throughput") else "-",
                       dec_ratio=f"{rec['decode_ratio_measured_to_predicted']:.2f}"
                       if rec.get("decode_ratio_measured_to_predicted") else "-",
                       bottleneck=(pred.get("bottleneck") or {}).get("decode", "-"),
                       disk=mib(rec["peak_bytes"].get("disk")),
                       load=f"{s.get('loadavg_before', ['-'])[0]}")
        rows.append(row)
    return rows


COLUMNS = (("label", "label"), ("model", "model"), ("len", "len"), ("percent", "percent"), ("batch", "batch"),
           ("kv", "kv"), ("prefill s", "prefill"), ("decode s", "decode"), ("total tok/s", "total"),
           ("decode tok/s", "dec_tp"), ("pred total", "pred"),
           ("decode meas/pred", "dec_ratio"), ("model bottleneck", "bottleneck"), ("peak gpu MiB", "gpu"),
           ("peak disk MiB", "disk"), ("rss MiB", "rss"), ("load 1m", "load"), ("status", "status"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Run a flexh2o sweep grid (resumable).")
    ap.add_argument("config", help="JSON sweep file (see flexh2o/configs/)")
    ap.add_argument("--out", help="results file (JSON lines); default "
                    "benchmarks/results/paper-sweep/<config name>.jsonl")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per point")
    ap.add_argument("--threads", type=int, help="OMP_NUM_THREADS for every point (default: torch's choice)")
    ap.add_argument("--retry-failed", action="store_true", help="rerun points recorded as timeout/error/refused")
    ap.add_argument("--only", help="run only points whose label contains this text")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a default flag for every point, e.g. --set gpu_mem=15GB (repeatable)")
    ap.add_argument("--hardware", help="hardware profile passed to flexh2o-run for its predictions (default: "
                    "flexh2o-run's --hardware auto: this machine's cached profile)")
    ap.add_argument("--dry-run", action="store_true", help="print the command lines, run nothing")
    args = ap.parse_args(argv)
    with open(args.config) as f:
        config = json.load(f)
    for item in args.set:
        key, _, value = item.partition("=")
        config.setdefault("defaults", {})[key.replace("-", "_")] = json.loads(value) if value in (
            "true", "false", "null") else value
    name = os.path.splitext(os.path.basename(args.config))[0]
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "paper-sweep",
                                    f"{name}.jsonl")
    points = [p for p in expand(config) if not args.only or args.only in p.get("label", "")]
    env = bench_env(args.threads)
    done = load_done(out)
    todo = [p for p in points if point_key(p) not in done
            or (args.retry_failed and done[point_key(p)]["sweep"]["status"] != "ok")]
    print(f"{name}: {len(points)} points, {len(points) - len(todo)} already in {out}, {len(todo)} to run",
          file=sys.stderr)
    if args.dry_run:
        for p in todo:
            print("flexh2o-run " + " ".join(flag_args(p) + hardware_args(args.hardware)))
        return 0
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    started = time.perf_counter()
    disk0 = disk_read_probe(env) if todo else None
    print(f"load average at start {load_avg()}; disk tier read rate {gbs(disk0)}", file=sys.stderr)
    for i, point in enumerate(todo, 1):
        print(f"[{i}/{len(todo)}] flexh2o-run {' '.join(flag_args(point))}", file=sys.stderr, flush=True)
        rec = run_point(point, args.timeout, env, args.hardware, disk0)
        with open(out, "a") as f:
            f.write(json.dumps(rec) + "\n")
        done[rec["sweep"]["key"]] = rec
        if rec["sweep"]["status"] != "ok":
            print(f"    {rec['sweep']['status']}: {rec['sweep']['message']}", file=sys.stderr)
    print(f"ran {len(todo)} points in {time.perf_counter() - started:.0f} s; load average at end {load_avg()}; disk "
          f"tier read rate {gbs(disk_read_probe(env)) if todo else '-'}", file=sys.stderr)
    print(table(summary_rows(points, done), COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
