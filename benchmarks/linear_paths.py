"""The products a decode step can run, alternated call by call in one process: F.linear (MKL's sgemm in fp32), the
transposed product (models/common.skinny_linear) and oneDNN's linear (models/common.linear on an AVX-512 CPU), on
opt-125m's weight shapes at a decode step's rows, beside the probe's square matmul; in --dtype (fp32 by default).

    OMP_WAIT_POLICY=PASSIVE flock /tmp/flexh2o-timed.lock python benchmarks/linear_paths.py --rows 64
    MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ... python benchmarks/linear_paths.py --rows 64
    ... python benchmarks/linear_paths.py --rows 128 --dtype bfloat16

Prints GFLOP/s per shape and path (median of --repeat alternated calls after 2 warm-ups).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flexh2o.dtypes import parse_dtype  # noqa: E402

SHAPES = ((768, 768), (3072, 768), (768, 3072), (50272, 768))  # (out, in): q/k/v/out, fc1, fc2, the head


def paths(rows: int, dtype: torch.dtype = torch.float32) -> dict:
    """(shape, path) -> (FLOPs, a call): each path on fresh operands in `dtype`; the square matmul as the probe's."""
    n = 1024
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    out = {("square 1024", "mm"): (2.0 * n ** 3, lambda: a @ b)}
    for o, i in SHAPES:
        w, x, bias = (t.to(dtype) for t in (torch.randn(o, i), torch.randn(rows, i), torch.randn(o)))
        fl = 2.0 * rows * o * i
        out[f"{o}x{i}", "F.linear"] = (fl, lambda x=x, w=w, b=bias: F.linear(x, w, b))
        out[f"{o}x{i}", "transposed"] = (fl, lambda x=x, w=w, b=bias: torch.addmm(b[:, None], w, x.t()))
        out[f"{o}x{i}", "oneDNN"] = (fl, lambda x=x, w=w, b=bias: torch.ops.mkldnn._linear_pointwise(
            x, w, b, "none", [], ""))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=11)
    ap.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    args = ap.parse_args(argv)
    calls = paths(args.rows, parse_dtype(args.dtype))
    times: dict = {k: [] for k in calls}
    with torch.inference_mode():
        for r in range(args.repeat + 2):
            for key, (_, fn) in calls.items():
                start = time.perf_counter()
                fn()
                if r >= 2:
                    times[key].append(time.perf_counter() - start)
    line: dict = {}
    for (shape, path), ts in times.items():
        line.setdefault(shape, []).append(f"{path} {calls[shape, path][0] / statistics.median(ts) / 1e9:.0f}")
    print(f"rows {args.rows}, {args.dtype}, GFLOP/s: " + " | ".join(f"{s}: " + " ".join(v) for s, v in line.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
