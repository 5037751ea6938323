"""flexh2o-serve against an offline request job on the same requests: N requests (text prompts cut from a play, seeded
lengths; answers of seeded max_tokens, EOS ignored so both do the same work) sent by C concurrent streaming clients
(the official openai client) to a server on 127.0.0.1, and the same requests as a .jsonl job of flexh2o-run on the
same engine flags (same rows, the server's plan sized to the job's longest prompt and answer). Rounds alternate job
and server, each in a fresh process.

Server throughput: completion tokens / seconds from the first request sent to the last answer received (the engine
was built and warmed up before). The job's: its own summary (generated tokens / seconds of the requests, engine build
and warm-up excluded). Latencies: time to first token (send -> first text chunk), per-token latency per request
((last chunk - first chunk) / (tokens - 1)), both as p50 / p90 / p99 over the requests. Every server answer is
checked against the job's (greedy: the same text).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/serve_bench.py --model smollm2 --rounds 2

Prints one JSON line per round and a summary line (medians, and the server / job throughput ratio per round).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_common import bench_env, median  # noqa: E402

TEXT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "flexh2o", "eval", "texts",
                    "hamlet.txt")
SUMMARY = re.compile(r"\((\d+) steps\): (\d+) generated tokens in ([\d.]+) s = ([\d.]+) useful tok/s")


def make_requests(n: int, min_words: int, max_words: int, min_len: int, max_len: int, seed: int) -> list:
    """[{"id", "prompt", "max_new_tokens"}]: prompts of seeded word counts from the play, seeded answer lengths."""
    words = open(TEXT, encoding="utf-8").read().split()
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        k = int(torch.randint(min_words, max_words + 1, (1,), generator=g))
        at = int(torch.randint(0, len(words) - k, (1,), generator=g))
        m = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        out.append({"id": f"r{i}", "prompt": " ".join(words[at:at + k]), "max_new_tokens": m})
    return out


def run_job(reqs: list, engine_flags: list, tmp: str, timeout: float) -> dict:
    """The requests as a .jsonl job: its throughput and answers (id -> (text, prompt tokens))."""
    src, out = os.path.join(tmp, "reqs.jsonl"), os.path.join(tmp, f"out-{time.monotonic_ns()}.jsonl")
    with open(src, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in reqs)
    argv = [sys.executable, "-m", "flexh2o.cli.run", *engine_flags, "--prompt-file", src, "--output-file", out,
            "--verbose", "1"]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=bench_env())
    m = SUMMARY.search(p.stdout)
    if p.returncode != 0 or m is None:
        raise SystemExit(f"the job failed ({p.returncode}): {p.stderr.strip()[-2000:]}")
    with open(out) as f:
        answers = {r["id"]: (r["text"], r["prompt_tokens"]) for r in map(json.loads, f)}
    return {"steps": int(m.group(1)), "tokens": int(m.group(2)), "seconds": float(m.group(3)),
            "tok_s": float(m.group(4)), "answers": answers}


def start_server(engine_flags: list, prompt_len: int, gen_len: int, timeout: float):
    """(process, base url) of flexh2o-serve on a free port of 127.0.0.1, ready (/health answers)."""
    import httpx
    argv = [sys.executable, "-m", "flexh2o.cli.serve", *engine_flags, "--prompt-len", str(prompt_len),
            "--gen-len", str(gen_len), "--port", "0", "--stats-interval", "0", "--max-queue", "1024"]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=bench_env())
    url = None
    for line in proc.stderr:
        m = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line)
        if m:
            url = m.group(1)
            break
    if url is None:
        raise SystemExit(f"the server did not start (exit {proc.wait()})")
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep its stderr pipe drained
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("the server's /health did not answer")


def ask(url: str, model: str, req: dict, timeout: float) -> dict:
    """One streamed completion: its text, tokens and chunk times."""
    from openai import OpenAI
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=timeout)
    sent, times, parts, tokens = time.perf_counter(), [], [], 0
    stream = client.completions.create(model=model, prompt=req["prompt"], max_tokens=req["max_new_tokens"],
                                       stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        for ch in chunk.choices:
            if ch.text:
                times.append(time.perf_counter())
                parts.append(ch.text)
    return {"id": req["id"], "text": "".join(parts), "tokens": tokens, "sent": sent, "times": times}


def run_server(reqs: list, engine_flags: list, model: str, lens: tuple, clients: int, timeout: float) -> dict:
    proc, url = start_server(engine_flags, *lens, timeout)
    try:
        with ThreadPoolExecutor(clients) as pool:
            start = time.perf_counter()
            got = list(pool.map(lambda r: ask(url, model, r, timeout), reqs))
            wall = time.perf_counter() - start
        engine = {k: metric(url, f"flexh2o_{k}_total") for k in ("steps", "runs")}
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=timeout)
    ttft = [g["times"][0] - g["sent"] for g in got if g["times"]]
    tpot = [(g["times"][-1] - g["times"][0]) / (g["tokens"] - 1) for g in got if g["tokens"] > 1 and g["times"]]
    tokens = sum(g["tokens"] for g in got)
    return {"tokens": tokens, "seconds": wall, "tok_s": tokens / wall, "exit": code, **engine,
            "ttft": percentiles(ttft), "tpot": percentiles(tpot), "answers": {g["id"]: g["text"] for g in got}}


def metric(url: str, name: str) -> int:
    import httpx
    text = httpx.get(url + "/metrics", timeout=30).text
    return int(float(re.search(rf"^{name} (\S+)$", text, re.M).group(1)))


def percentiles(xs: list) -> dict:
    qs = statistics.quantiles(xs, n=100, method="inclusive")
    return {"p50": round(qs[49], 4), "p90": round(qs[89], 4), "p99": round(qs[98], 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--gpu-batch-size", type=int, default=8)
    ap.add_argument("--words", type=int, nargs=2, default=(20, 120), help="prompt length range, in words")
    ap.add_argument("--lens", type=int, nargs=2, default=(16, 128), help="max_tokens range")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--flags", default="", help="more engine flags for both, e.g. '--percent 0 100 100 0'")
    a = ap.parse_args()
    reqs = make_requests(a.requests, *a.words, *a.lens, a.seed)
    engine = ["--model", a.model, "--gpu-batch-size", str(a.gpu_batch_size), "--ignore-eos", *a.flags.split()]
    ratios, rounds = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            job = run_job(reqs, engine, tmp, a.timeout)
            lens = (max(p for _, p in job["answers"].values()), max(q["max_new_tokens"] for q in reqs))
            srv = run_server(reqs, engine, a.model, lens, a.clients, a.timeout)
            same = sum(srv["answers"][i] == text for i, (text, _) in job["answers"].items())
            ratios.append(srv["tok_s"] / job["tok_s"])
            rec = {"round": r, "job_tok_s": round(job["tok_s"], 2), "server_tok_s": round(srv["tok_s"], 2),
                   "ratio": round(ratios[-1], 3), "tokens": [job["tokens"], srv["tokens"]],
                   "seconds": [round(job["seconds"], 2), round(srv["seconds"], 2)], "ttft_s": srv["ttft"],
                   "per_token_s": srv["tpot"], "answers_equal": f"{same}/{len(reqs)}", "server_exit": srv["exit"],
                   "steps": [job["steps"], srv["steps"]], "server_runs": srv["runs"],
                   "load": [round(x, 2) for x in os.getloadavg()]}
            rounds.append(rec)
            print(json.dumps(rec), flush=True)
    print(json.dumps({"median_ratio": round(median(ratios), 3), "ratios": [round(x, 3) for x in ratios],
                      "median_job_tok_s": round(median([x["job_tok_s"] for x in rounds]), 2),
                      "median_server_tok_s": round(median([x["server_tok_s"] for x in rounds]), 2)}))


if __name__ == "__main__":
    main()
