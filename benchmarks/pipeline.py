"""Pipeline stages on this machine: a model that does not fit one process's memory cap runs across two capped
ranks, and 2 ranks pipelined vs 1 rank at equal total threads (the bubble cost).

Each rank runs in its own memory cgroup (memcap.py), started here with the environment torchrun gives its workers
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT on 127.0.0.1), since torchrun would put every rank in one group.
Configurations alternate within one invocation; medians are reported.

    python benchmarks/pipeline.py --model opt-350m --cap 1300MB --repeats 3 --out benchmarks/results/pipeline.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

from bench_common import REPO, bench_env, load_avg, median, mib, run_flexh2o, table
from memcap import MemCap

sys.path.insert(0, REPO)
from flexh2o.units import parse_bytes  # noqa: E402


def run_ranks(argv: list, world: int, threads: int, cap: int, timeout: float) -> dict:
    """One job on `world` ranks, each capped at `cap` bytes with `threads` threads: the head's JSON record, with
    every rank's cgroup figures under "mem_caps"."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fd, log = tempfile.mkstemp(prefix="flexh2o-pipe-", suffix=".jsonl")
    os.close(fd)
    caps = [MemCap(cap, f"{os.path.basename(log)}-{r}") for r in range(world)]
    procs = []
    try:
        for r in range(world):
            env = dict(bench_env(threads), RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                       LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       GLOO_SOCKET_IFNAME="lo")
            procs.append(subprocess.Popen([sys.executable, "-m", "flexh2o.cli"] + argv + ["--log-file", log],
                                          env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, preexec_fn=caps[r].preexec))
        outs = [p.communicate(timeout=timeout) for p in procs]
        lines = [ln for ln in open(log) if ln.strip()]
        if any(p.returncode for p in procs) or not lines:
            return {"status": "error", "message": [o[1].strip().splitlines()[-1:] for o in outs],
                    "mem_caps": [c.stats() for c in caps]}
        rec = json.loads(lines[-1])
        rec.update(status="ok", mem_caps=[c.stats() for c in caps])
        return rec
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for c in caps:
            c.close()
        os.unlink(log)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="opt-350m")
    ap.add_argument("--cap", default="1300MB", help="memory cap of each rank (and of the one-process attempt)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=8)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=None, help="append every record to this JSONL file")
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()
    cap = parse_bytes(args.cap)
    base = ["--model", args.model, "--percent", "0", "100", "100", "0", "--prompt-len", str(args.prompt_len),
            "--gen-len", str(args.gen_len), "--dtype", args.dtype, "--compute-dtype", args.dtype,
            "--offload-dir", os.path.join(tempfile.gettempdir(), "flexh2o-pipe-offload")]
    two = ["--gpu-batch-size", "2", "--num-gpu-batches", "2"]
    one_batch = ["--gpu-batch-size", "4", "--num-gpu-batches", "1"]
    print(f"load {load_avg()}  cap {mib(cap)} per process", flush=True)
    single = run_flexh2o(base + two, args.timeout, bench_env(2), mem_cap=cap)
    print(f"1 rank capped at {mib(cap)}, 2 threads: {single.status} {single.message}", flush=True)
    configs = {
        "1 rank, 2 threads, 2x2 (uncapped)": lambda: _one(run_flexh2o(base + two, args.timeout, bench_env(2))),
        "2 ranks capped, 1 thread each, 2x2 (pipelined)": lambda: run_ranks(base + two, 2, 1, cap, args.timeout),
        "2 ranks capped, 1 thread each, 4x1 (no pipelining)":
            lambda: run_ranks(base + one_batch, 2, 1, cap, args.timeout)}
    results = {name: [] for name in configs}
    for rep in range(args.repeats):
        for name, fn in configs.items():
            rec = fn()
            rec.update(config=name, repeat=rep, load=load_avg(), when=time.strftime("%H:%M:%S"))
            results[name].append(rec)
            print(f"{name} #{rep}: {rec.get('status')} {rec.get('total_throughput', 0):.2f} tok/s load "
                  f"{rec['load']} {rec.get('message', '')}", flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(rec) + "\n")
    print(_table(results))


def _one(outcome) -> dict:
    rec = outcome.record or {"message": outcome.message}
    rec["status"] = outcome.status
    return rec


def _table(results: dict) -> str:
    rows = []
    for name, recs in results.items():
        ok = [r for r in recs if r.get("status") == "ok"]
        if not ok:
            rows.append({"config": name, "tok/s": "failed"})
            continue
        row = {"config": name, "tok/s": f"{median([r['total_throughput'] for r in ok]):.2f}",
               "decode tok/s": f"{median([r['decode_throughput'] for r in ok]):.2f}",
               "prefill+decode s": f"{median([r['prefill_s'] + r['decode_s'] for r in ok]):.2f}"}
        for s in ok[0].get("stages", []):
            i = s["stage"]
            stage = [r["stages"][i] for r in ok]
            figures = [f"{median([x[k] for x in stage]):.2f}" for k in ("compute_s", "io_s", "wait_s")]
            row[f"stage {i} compute/io/wait s"] = "/".join(figures)
        caps = ok[0].get("mem_caps") or []
        row["cgroup peak MiB per rank"] = " ".join(mib(c["peak_charged"]) for c in caps) or "-"
        rows.append(row)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return table(rows, [(k, k) for k in keys])


if __name__ == "__main__":
    main()
