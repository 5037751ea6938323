"""Pipeline stages on this machine: a model that does not fit one process's memory cap runs across two capped
ranks; 2 ranks pipelined vs 1 rank at equal total threads (the bubble cost); the hidden-state bytes per link.

Each rank runs in its own memory cgroup (memcap.py), started here with the environment torchrun gives its workers
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT on 127.0.0.1), since torchrun would put every rank in one group.
First one process capped like one rank tries the whole model (it should be killed at the cap); then the
configurations alternate within each round, and medians over the rounds are reported. Weights are flexh2o's
seeded dummy weights (--path _DUMMY_): nothing is downloaded.

    flock /work/team/bench.lock python benchmarks/pipeline.py --model opt-350m --cap 1300MB --repeats 3 \
        --out benchmarks/results/pipeline-stages/pipeline.jsonl
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

from bench_common import REPO, bench_env, load_avg, median, mib, run_flexh2o
from memcap import MemCap

sys.path.insert(0, REPO)
from flexh2o import config as model_configs  # noqa: E402
from flexh2o.dtypes import parse_dtype  # noqa: E402
from flexh2o.units import parse_bytes  # noqa: E402

TOKEN_BYTES = 8  # the next tokens go back to the first stage as int64


def run_ranks(argv: list, world: int, threads: int, cap: int, timeout: float) -> dict:
    """One job on `world` ranks, each capped at `cap` bytes with `threads` threads: the head's JSON record, with
    every rank's cgroup figures under "mem_caps"; on failure every rank's exit status and last stderr lines."""
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
        outs = _communicate(procs, timeout)
        lines = [ln for ln in open(log) if ln.strip()]
        stats = [c.stats() for c in caps]
        if any(p.returncode for p in procs) or not lines:
            return {"status": "error", "mem_caps": stats, "message": "; ".join(
                _rank_failure(r, p.returncode, err, stats[r]) for r, (p, (_, err)) in enumerate(zip(procs, outs)))}
        rec = json.loads(lines[-1])
        rec.update(status="ok", mem_caps=stats)
        return rec
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for c in caps:
            c.close()
        os.unlink(log)


def _communicate(procs: list, timeout: float) -> list:
    deadline, outs = time.monotonic() + timeout, []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            outs.append((out, f"{err}\nover {timeout:.0f} s: killed by the benchmark"))
    return outs


def _rank_failure(rank: int, code: int, stderr: str, stats: dict) -> str:
    """'rank 1 exit -9 (OOM-killed at the cap ...)' or 'rank 0 exit 1: <last stderr lines>'."""
    if code == -9 and stats.get("oom_kills"):
        return f"rank {rank} exit -9 (OOM-killed at the memory cap, peak {mib(stats['peak_charged'])} MiB)"
    tail = " | ".join(line.strip() for line in (stderr or "").strip().splitlines()[-3:]) or "no output"
    return f"rank {rank} exit {code}: {tail}"


def single(argv: list, threads: int, timeout: float, cap=None) -> dict:
    """One process (uncapped, or capped at `cap` bytes): its record, or status and message."""
    outcome = run_flexh2o(argv, timeout, bench_env(threads), mem_cap=cap)
    rec = dict(outcome.record or {}, status=outcome.status)
    if outcome.message:
        rec["message"] = outcome.message
    return rec


def link_bytes(rec: dict, model: str) -> list:
    """Bytes each stage sent, from the transport's counters, beside the formula (GPU batches x batch x prompt x
    hidden x compute dtype bytes for the prefill; x 1 token per decode step; int64 tokens on the way back)."""
    cfg, p = model_configs.from_name(model), rec["policy"]
    seqs, itemsize = rec["num_seqs"], parse_dtype(p["compute_dtype"]).itemsize
    stages, rows = rec["stages"], []
    for s in stages:
        last = s["stage"] == len(stages) - 1
        per_token = TOKEN_BYTES if last else cfg.hidden * itemsize
        prefill_rows = seqs if last else seqs * rec["prompt_len"]  # the head sends one token per sequence
        expect = (prefill_rows * per_token, seqs * per_token)
        rows.append({"link": f"stage {s['stage']} -> {0 if last else s['stage'] + 1}",
                     "what": "tokens" if last else "hidden states",
                     "prefill": s["sent_bytes_prefill"], "per_decode_step": s["sent_bytes_per_decode_step"],
                     "formula_prefill": expect[0], "formula_per_decode_step": expect[1]})
    return rows


def configs(base: list, cap: int, timeout: float) -> dict:
    """Name -> one run; the same 4 sequences each time (4x1 or 2x2 GPU batches), 2 threads in total."""
    b41 = ["--gpu-batch-size", "4", "--num-gpu-batches", "1"]
    b22 = ["--gpu-batch-size", "2", "--num-gpu-batches", "2"]
    return {"1 rank, 2 threads, 4x1 (uncapped)": lambda: single(base + b41, 2, timeout),
            "1 rank, 2 threads, 2x2 (uncapped)": lambda: single(base + b22, 2, timeout),
            "2 ranks capped, 1 thread each, 2x2 (pipelined)": lambda: run_ranks(base + b22, 2, 1, cap, timeout),
            "2 ranks capped, 1 thread each, 4x1 (stages take turns)":
                lambda: run_ranks(base + b41, 2, 1, cap, timeout)}


# the bubble cost: (2-rank config, 1-rank config at equal total threads and the same GPU batches)
PAIRS = (("2 ranks capped, 1 thread each, 2x2 (pipelined)", "1 rank, 2 threads, 2x2 (uncapped)"),
         ("2 ranks capped, 1 thread each, 4x1 (stages take turns)", "1 rank, 2 threads, 4x1 (uncapped)"),
         ("2 ranks capped, 1 thread each, 2x2 (pipelined)", "2 ranks capped, 1 thread each, 4x1 (stages take turns)"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="opt-350m")
    ap.add_argument("--cap", default="1300MB", help="memory cap of each rank (and of the one-process attempt)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=None, help="append every record to this JSONL file")
    ap.add_argument("--timeout", type=float, default=300)
    args = ap.parse_args()
    cap = parse_bytes(args.cap)
    base = ["--model", args.model, "--percent", "0", "100", "100", "0", "--prompt-len", str(args.prompt_len),
            "--gen-len", str(args.gen_len), "--dtype", args.dtype, "--compute-dtype", args.dtype,
            "--offload-dir", os.path.join(tempfile.gettempdir(), "flexh2o-pipe-offload")]
    print(f"{time.strftime('%H:%M:%S')} load {load_avg()}  cap {mib(cap)} MiB per process  model {args.model}  "
          f"{args.dtype}  4 sequences  prompt {args.prompt_len}  gen {args.gen_len}", flush=True)
    alone = single(base + ["--gpu-batch-size", "4"], 2, args.timeout, cap)
    _log(args.out, dict(alone, config="1 rank capped, 2 threads, 4x1", load=load_avg()))
    print(f"1 rank capped at {mib(cap)} MiB, 2 threads, 4x1: {alone['status']} {alone.get('message', '')}",
          flush=True)
    runs = configs(base, cap, args.timeout)
    results = {name: [] for name in runs}
    for rep in range(args.repeats):
        for name, fn in runs.items():
            rec = fn()
            rec.update(config=name, repeat=rep, load=load_avg(), when=time.strftime("%H:%M:%S"))
            results[name].append(rec)
            _log(args.out, rec)
            print(f"{name} #{rep}: {rec['status']} {rec.get('total_throughput', 0):.2f} tok/s  load {rec['load']}  "
                  f"{rec.get('message', '')}", flush=True)
    report(results, args.model)
    print(f"{time.strftime('%H:%M:%S')} load {load_avg()}")


def report(results: dict, model: str) -> None:
    for name, recs in results.items():
        ok = [r for r in recs if r["status"] == "ok"]
        print(f"\n{name}: {len(ok)}/{len(recs)} ok")
        if ok:
            print("  " + _figures(ok))
            for line in _stage_lines(ok):
                print("  " + line)
    print("\nbubble cost (median over rounds of the per-round tok/s ratio):")
    for a, b in PAIRS:
        ratios = [x["total_throughput"] / y["total_throughput"] for x, y in zip(results[a], results[b])
                  if x["status"] == y["status"] == "ok"]
        print(f"  {a} / {b}: {median(ratios):.2f}  ({len(ratios)} rounds)")
    piped = [r for r in results[PAIRS[0][0]] if r["status"] == "ok"]
    if piped:
        print("\nbytes per link (transport counters of one pipelined run; formula beside):")
        for row in link_bytes(piped[0], model):
            print(f"  {row['link']} ({row['what']}): prefill {row['prefill']} B (formula {row['formula_prefill']}),"
                  f" per decode step {row['per_decode_step']} B (formula {row['formula_per_decode_step']})")


def _figures(ok: list) -> str:
    wall = median([r["prefill_s"] + r["decode_s"] for r in ok])
    med = {k: median([r[k] for r in ok]) for k in ("total_throughput", "decode_throughput", "prefill_s", "decode_s")}
    return (f"total {med['total_throughput']:.2f} tok/s  decode {med['decode_throughput']:.2f} tok/s  prefill "
            f"{med['prefill_s']:.2f} s  decode {med['decode_s']:.2f} s  prefill+decode {wall:.2f} s")


def _stage_lines(ok: list) -> list:
    """Per stage: medians of compute, I/O and waiting seconds; bubble = waiting / (prefill + decode)."""
    lines = []
    for i, s in enumerate(ok[0].get("stages") or []):
        med = {k: median([r["stages"][i][k] for r in ok]) for k in ("compute_s", "io_s", "wait_s")}
        bubble = median([r["stages"][i]["wait_s"] / (r["prefill_s"] + r["decode_s"]) for r in ok])
        peak = median([r["mem_caps"][i]["peak_charged"] for r in ok])
        lines.append(f"{s['layers']}: compute {med['compute_s']:.2f} s  io {med['io_s']:.2f} s  wait "
                     f"{med['wait_s']:.2f} s  bubble {bubble:.0%}  cgroup peak {mib(peak)} MiB")
    return lines


def _log(path, rec: dict) -> None:
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
