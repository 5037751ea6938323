"""The GPU check, ready for the first machine with a CUDA device (under 8 minutes on one GPU):

1. the CUDA-marked tests (tests/generation/test_cuda.py: engine on CUDA equals the CPU run, every placement) and the
   engine-vs-transformers equivalence on CUDA for two placements (tests/generation/test_gpu_equivalence.py);
2. OPT-6.7B (dummy weights) 512+32 with the paper's T4 settings (flexh2o/configs/paper/h2o_t4_throughput.json:
   FlexGen --percent 100 0 100 0 100 0 batch 2, H2O 20% batch 4 with heavy = recent = 0.1 x 512) under
   --gpu-mem 16GB: flexh2o full, flexh2o h2o, and FlexGen 0.1.8 itself with the same flags where
   `pip install flexgen==0.1.8` works on that machine (it needs the facebook/opt-30b tokenizer in the HF cache);
3. a JSONL request job through flexh2o-run (opt-125m dummy weights, fp32, refill, ragged lengths) on CUDA and on the
   CPU: the same token ids for every id;
4. one JSON record per system in OUT/gpu_check.jsonl and the ratios printed.

`--dry-run` (run in CI) builds every command and checks that it parses: flexh2o-run's own parser, pytest's
collection of the CUDA tests, and FlexGen's flag set (0.1.8's flex_opt add_parser_arguments, copied below).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT, GEN, GPU_MEM = 512, 32, "16GB"
T4 = {"full": {"percent": "100 0 100 0 100 0", "batch": 2}, "h2o": {"percent": "100 0 100 0 100 0", "batch": 4,
                                                                    "hh_ratio": 0.1}}
FLEXGEN_FLAGS = {"--model", "--path", "--offload-dir", "--prompt-len", "--gen-len", "--cut-gen-len", "--debug-mode",
                 "--gpu-batch-size", "--num-gpu-batches", "--percent", "--sep-layer", "--pin-weight",
                 "--cpu-cache-compute", "--attn-sparsity", "--compress-weight", "--compress-cache", "--log-file",
                 "--no-log", "--verbose", "--overlap"}
TESTS = ["tests/generation/test_cuda.py", "tests/generation/test_gpu_equivalence.py", "tests/generation/test_cuda_jobs.py"]


def flexh2o_argv(system: str, out: str) -> list:
    s = T4[system]
    argv = ["--model", "opt-6.7b", "--percent", *s["percent"].split(), "--gpu-batch-size", str(s["batch"]),
            "--prompt-len", str(PROMPT), "--gen-len", str(GEN), "--gpu-mem", GPU_MEM, "--overlap", "false",
            "--device", "cuda", "--dtype", "float16", "--compute-dtype", "auto", "--hardware", "t4_paper",
            "--log-file", os.path.join(out, f"flexh2o_{system}.jsonl"), "--offload-dir", os.path.join(out, "offload")]
    if "hh_ratio" in s:
        argv += ["--hh-ratio", str(s["hh_ratio"])]
    return argv


def flexgen_argv(out: str) -> list:
    s = T4["full"]
    return ["--model", "facebook/opt-6.7b", "--path", "_DUMMY_", "--percent", *s["percent"].split(),
            "--gpu-batch-size", str(s["batch"]), "--prompt-len", str(PROMPT), "--gen-len", str(GEN),
            "--overlap", "false", "--offload-dir", os.path.join(out, "flexgen_offload"),
            "--log-file", os.path.join(out, "flexgen.log")]


def check_parses(out: str) -> list:
    """Every command of the check, parsed without running it; returns the problems (empty: all parse)."""
    from flexh2o.cli.run import build_parser
    from flexh2o.placement import Percent
    problems = []
    for system in T4:
        try:
            Percent.parse(build_parser().parse_args(flexh2o_argv(system, out)).percent)
        except Exception as e:  # noqa: BLE001 - report any parse failure as a problem
            problems.append(f"flexh2o {system}: {e}")
    unknown = [a for a in flexgen_argv(out) if a.startswith("--") and a not in FLEXGEN_FLAGS]
    if unknown:
        problems.append(f"flexgen: unknown flags {unknown}")
    try:
        build_parser().parse_args(job_argv("cuda", out))
    except Exception as e:  # noqa: BLE001 - report any parse failure as a problem
        problems.append(f"request job: {e}")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", "cuda", *TESTS], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    if r.returncode not in (0, 5):  # 5: nothing collected (no test matched), still parsed
        problems.append(f"pytest collection failed: {r.stdout[-500:]} {r.stderr[-500:]}")
    return problems


def _run(cmd: list, timeout: int, log) -> tuple:
    start = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        status, tail = ("ok" if r.returncode == 0 else f"exit {r.returncode}"), (r.stdout + r.stderr)[-2000:]
    except subprocess.TimeoutExpired:
        status, tail = f"timeout {timeout}s", ""
    log.write(f"$ {' '.join(cmd)}\n{tail}\n[{status}, {time.perf_counter() - start:.0f} s]\n")
    log.flush()
    return status, tail


def job_argv(device: str, out: str) -> list:
    """A request job of 16 ids with ragged answer lengths (refill), fp32 so that CUDA and the CPU agree."""
    return ["--model", "opt-125m", "--device", device, "--dtype", "float32", "--gpu-batch-size", "4",
            "--prompt-len", "8", "--gen-len", "24", "--prompt-file", os.path.join(out, "requests.jsonl"),
            "--output-file", os.path.join(out, f"answers_{device}.jsonl"), "--verbose", "0",
            "--offload-dir", os.path.join(out, "offload")]


def _job(out: str, log) -> dict:
    with open(os.path.join(out, "requests.jsonl"), "w") as f:
        for i in range(16):
            f.write(json.dumps({"id": f"r{i}", "prompt_ids": [5 + i, 9, 200 + i, 17], "max_new_tokens": 4 + i}) + "\n")
    answers = {}
    for device in ("cuda", "cpu"):
        status, _ = _run([sys.executable, "-m", "flexh2o.cli", *job_argv(device, out)], 120, log)
        if status != "ok":
            return {"system": "request_job", "status": f"{device}: {status}"}
        with open(os.path.join(out, f"answers_{device}.jsonl")) as f:
            answers[device] = {r["id"]: r["token_ids"] for r in map(json.loads, f)}
    same = answers["cuda"] == answers["cpu"] and len(answers["cuda"]) == 16
    return {"system": "request_job", "status": "ok" if same else "cuda answers differ from the cpu's"}


def run_check(out: str, flexgen: bool = True) -> int:
    import torch
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (run --dry-run on a CPU machine)", file=sys.stderr)
        return 2
    os.makedirs(out, exist_ok=True)
    records = []
    with open(os.path.join(out, "gpu_check.log"), "a") as log:
        status, _ = _run([sys.executable, "-m", "pytest", "-q", "-n", "4", "-m", "cuda", *TESTS], 240, log)
        records.append({"system": "cuda_tests", "status": status})
        for system in T4:
            status, _ = _run([sys.executable, "-m", "flexh2o.cli", *flexh2o_argv(system, out)], 150, log)
            rec = _last_json(os.path.join(out, f"flexh2o_{system}.jsonl"))
            records.append({"system": f"flexh2o_{system}", "status": status, **_figures(rec)})
        records.append(_job(out, log))
        if flexgen:
            records.append(_flexgen(out, log))
    with open(os.path.join(out, "gpu_check.jsonl"), "a") as f:
        for rec in records:
            f.write(json.dumps({**rec, "gpu": torch.cuda.get_device_name(0)}) + "\n")
    by = {r["system"]: r.get("total_throughput") for r in records}
    for a, b in (("flexh2o_h2o", "flexh2o_full"), ("flexh2o_full", "flexgen"), ("flexh2o_h2o", "flexgen")):
        if by.get(a) and by.get(b):
            print(f"{a} / {b}: {by[a] / by[b]:.2f}x")
    for rec in records:
        print(json.dumps(rec))
    return 0 if all(r["status"] == "ok" for r in records if r["system"] != "flexgen") else 1


def _flexgen(out: str, log) -> dict:
    status, _ = _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "flexgen==0.1.8"], 120, log)
    if status != "ok":
        return {"system": "flexgen", "status": f"pip install flexgen==0.1.8 failed ({status})"}
    status, tail = _run([sys.executable, "-m", "flexgen.flex_opt", *flexgen_argv(out)], 200, log)
    text = tail
    if os.path.exists(os.path.join(out, "flexgen.log")):
        with open(os.path.join(out, "flexgen.log")) as f:
            text = f.read()
    found = re.findall(r"([a-z ]+throughput): ([\d.]+)", text)
    figures = {k.strip().replace(" ", "_"): float(v) for k, v in found}
    return {"system": "flexgen", "status": status, **figures}


def _last_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        lines = [ln for ln in f if ln.strip()]
    return json.loads(lines[-1]) if lines else {}


def _figures(rec: dict) -> dict:
    keys = ("total_throughput", "prefill_throughput", "decode_throughput", "dtype_reason")
    return {k: rec[k] for k in keys if k in rec} | ({"gpu_batch_size": rec["policy"]["gpu_batch_size"]}
                                                    if "policy" in rec else {})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="check that every command parses; run nothing")
    p.add_argument("--no-flexgen", action="store_true", help="skip FlexGen 0.1.8 (its pip install needs a network)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "gpu-check", "latest"))
    args = p.parse_args(argv)
    if args.dry_run:
        problems = check_parses(args.out)
        for line in problems:
            print(f"gpu_check: {line}", file=sys.stderr)
        print("gpu_check --dry-run: " + ("every command parses" if not problems else f"{len(problems)} problems"))
        return 1 if problems else 0
    return run_check(args.out, not args.no_flexgen)


if __name__ == "__main__":
    sys.exit(main())
