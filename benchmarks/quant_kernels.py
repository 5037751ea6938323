"""Per-matmul cost of compressed weights on this CPU: the generic path (expand, then a dense matmul) against torch's
weight-only quantized kernels (aten._weight_int4pack_mm_for_cpu, aten._weight_int8pack_mm), per phase (decode:
few rows; prefill: hundreds), one thread, methods alternated in rounds, medians.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/quant_kernels.py --out benchmarks/results/compression/quant_kernels.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from flexh2o.compress import CompressionSpec, dequantize, quantize  # noqa: E402
from flexh2o.compress.kernels import int4pack_from  # noqa: E402


def _methods(n: int, k: int) -> dict:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) * 0.02
    dim0 = quantize(w.bfloat16(), CompressionSpec(4, 64, 0))  # FlexGen's grouping (the engine's generic path)
    dim1 = quantize(w.bfloat16(), CompressionSpec(4, 64, 1))  # the int4 kernel's grouping (along K)
    packed, sz = int4pack_from(dim1)
    w8 = (w / w.abs().amax(1, keepdim=True) * 127).round().to(torch.int8)
    s8 = (w.abs().amax(1) / 127).bfloat16()
    w32, w16 = w.clone(), w.bfloat16()
    return {
        "dense fp32": lambda x: x.float() @ w32.T,
        "dense bf16": lambda x: x @ w16.T,
        "expand+matmul fp32": lambda x: x.float() @ dequantize(dim0, torch.float32).T,
        "expand+matmul bf16": lambda x: x @ dequantize(dim0, torch.bfloat16).T,
        "int4pack kernel bf16": lambda x: torch._weight_int4pack_mm_for_cpu(x, packed, 64, sz),
        "int8pack kernel bf16": lambda x: torch._weight_int8pack_mm(x, w8, s8),
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", type=int, nargs=2, default=[8192, 2048], help="weight (out, in); default opt-1.3b fc1")
    p.add_argument("--rows", type=int, nargs="+", default=[4, 16, 64, 256, 512])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    n, k = args.shape
    methods = _methods(n, k)
    rows = {}
    for m in args.rows:
        x = torch.randn(m, k).bfloat16()
        times = {name: [] for name in methods}
        for _ in range(args.rounds):  # alternate the methods within each round
            for name, fn in methods.items():
                start = time.perf_counter()
                fn(x)
                times[name].append(time.perf_counter() - start)
        rows[m] = {name: statistics.median(ts[1:]) for name, ts in times.items()}  # the first round warms up
        flops = 2 * m * n * k
        cells = [f"{name} {t * 1e3:7.2f} ms ({flops / t / 1e9:5.1f} GF/s)" for name, t in rows[m].items()]
        print(f"rows {m:4d}: " + "  ".join(cells), flush=True)
    record = {"shape": [n, k], "rows": rows, "threads": 1, "uptime": _sh("uptime"),
              "cpu": _sh("lscpu | grep -E 'Model name|Flags' | cut -c1-400"), "torch": torch.__version__}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0


def _sh(cmd: str) -> str:
    return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
