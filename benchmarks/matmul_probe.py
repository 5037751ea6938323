"""How fast this machine is right now, for comparing timed runs taken hours apart: one decode step's matmuls of a
model (every 2-D weight of its decoder layers and head, `F.linear` in the model's dtype) at a few row counts, one
thread, median of repeats. Run it beside a long benchmark (before and after) and quote it with the timing.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/matmul_probe.py [--model smollm2] [--dtype float32] [--rows 50,84,134]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from flexh2o.dtypes import parse_dtype  # noqa: E402
from flexh2o.eval.common import load_model  # noqa: E402
from flexh2o.models import layer_specs  # noqa: E402


def step_seconds(shapes: list, rows: int, dtype: torch.dtype, repeats: int = 10) -> float:
    """Median over repeats of the seconds one step's matmuls take: shapes (out, in, count) each run `count` times."""
    g = torch.Generator().manual_seed(0)
    total = 0.0
    for out, inp, count in shapes:
        w, x = torch.randn(out, inp, generator=g).to(dtype), torch.randn(rows, inp, generator=g).to(dtype)
        for _ in range(2):
            F.linear(x, w)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            F.linear(x, w)
            times.append(time.perf_counter() - t)
        total += statistics.median(times) * count
    return total


def _rows(text: str) -> tuple:
    """--rows: positive integers, comma-separated (argparse turns the error into one line and exit 2)."""
    try:
        rows = tuple(int(r) for r in text.split(","))
    except ValueError:
        rows = ()
    if not rows or min(rows) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of positive row counts: use e.g. 50,84,134")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rows", type=_rows, default=(50, 84, 134), help="row counts, comma-separated (default 50,84,134)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    try:
        dtype, cfg = parse_dtype(args.dtype), load_model(args.model, args.dtype).cfg
    except ValueError as e:  # a model or dtype this machine cannot load: one line, exit 2
        ap.exit(2, f"matmul_probe.py: {e}\n")
    counts: dict = {}
    for specs in layer_specs(cfg)[1:]:  # every matmul (not the embedding lookup)
        for s in specs:
            if len(s.shape) == 2:
                counts[tuple(s.shape)] = counts.get(tuple(s.shape), 0) + 1
    shapes = [(out, inp, n) for (out, inp), n in counts.items()]
    flops = 2 * sum(out * inp * n for out, inp, n in shapes)
    for rows in args.rows:
        sec = step_seconds(shapes, rows, dtype)
        print(f"rows {rows}: one decode step's matmuls {sec * 1e3:.0f} ms, {rows * flops / sec / 1e9:.0f} GFLOP/s")


if __name__ == "__main__":
    main()
