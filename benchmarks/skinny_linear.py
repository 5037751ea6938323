"""A decode step's matmuls, F.linear against the transposed product that models/common.skinny_linear runs.

    python benchmarks/skinny_linear.py --threads 2 --rows 8 64 --repeats 21

For each weight shape (opt-125m's attention, fc1, fc2 and head; SmolLM2-135M's MLP and head) and row count: the
median seconds of F.linear(x, w, b) and of addmm(b, w, x.T).T over alternated calls, and their ratio (> 1: the
transposed product is faster). Prints which of them flexh2o picks (is_skinny). Timed in-process: quote medians and
the ratios; the machine's load moves both alike.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flexh2o.models.common import is_skinny, skinny_linear  # noqa: E402

SHAPES = [(768, 768), (3072, 768), (768, 3072), (50272, 768), (1536, 576), (576, 1536), (49152, 576)]


def timed(fn, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return statistics.median(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--repeats", type=int, default=21)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        w, b = torch.randn(n, k, generator=g) * 0.02, torch.zeros(n)
        cells = []
        for r in args.rows:
            x = torch.randn(r, k, generator=g)
            reps = args.repeats if n * k < 1 << 24 else max(5, args.repeats // 4)
            plain = timed(lambda: F.linear(x, w, b), reps)
            skinny = timed(lambda: skinny_linear(x, w, b), reps)
            cells.append(f"{r} rows: {plain * 1e3:.3f} / {skinny * 1e3:.3f} ms = {plain / skinny:.2f}x "
                         f"({'transposed' if is_skinny(x, w) else 'F.linear'})")
        print(f"{n} x {k}, {args.threads} threads: " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
