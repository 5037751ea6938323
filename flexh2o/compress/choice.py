"""Which phases run the int4 kernel: by the run's --weight-kernel, and under "auto" by a measurement on this machine.

The probe times both paths of one (N, K) weight the way a phase multiplies it (decode: a GPU batch's rows; prefill:
a prefill sub-batch's tokens), alternated over a few rounds, medians compared: the generic path (the weight expanded
from the kernel's order into a reused buffer of the compute dtype, as a weight load does, in one pass where
compress/expand_native.py builds; then a dense matmul) against the kernel (bf16 activations). Nothing is assumed
about the machine: a CPU without bf16 instructions runs the kernel's bf16 arithmetic in software and the probe
sees it.

The kernel holds no expanded copy of a layer (an expanded prefill holds two in flight: hundreds of MiB the plan must
find room for), so the generic path is taken only where it is faster by more than KERNEL_MARGIN: within that, the
probe's own spread from round to round (prefill of a (2048, 2048) 4-bit weight at 128-256 rows on a Zen 3: ratios
0.89-1.34 between three runs of `probe` each, 2026-12-07 at 20e85ca) would decide.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from flexh2o.compress.codec import CompressionSpec, quantize
from flexh2o.compress.kernels import PackedWeight, expand_kernel_order, to_kernel_order

MODES = ("auto", "int4", "generic")
PHASES = ("prefill", "decode")
PROBE_ROWS = 2048  # output rows of the probe weight (a slice of the real shape keeps the probe to well under a second)
ROUNDS = 3
KERNEL_MARGIN = 1.15  # the generic path must take under 1 / this of the kernel's time (see the module docstring)


def kernel_phases(mode: str, shape: tuple, rows: dict, spec: CompressionSpec, dtypes: dict,
                  fits: Callable[[dict], bool] = lambda kernel: True, timer: Optional[Callable] = None) -> dict:
    """phase -> True where that phase's block matmuls run the kernel: the one rule, whoever times the paths.
    rows: phase -> rows multiplied at once; shape: the largest weight stored in the kernel's order; dtypes: phase ->
    its compute dtype. Under auto, the faster path by `timer` (shape, rows, spec, dtypes) -> phase -> {"int4": s,
    "generic": s} (by default `probe`, this machine's measurement; the engine's is cached, planning/kernel_probe.py),
    the kernel unless the generic path is faster by KERNEL_MARGIN, then by `forced_by_memory`."""
    if mode not in MODES:
        raise ValueError(f"--weight-kernel {mode}: choose one of {', '.join(MODES)}")
    if mode != "auto":
        return {p: mode == "int4" for p in PHASES}
    times = (timer or probe)((min(shape[0], PROBE_ROWS), shape[1]), rows, spec, dtypes)
    return forced_by_memory({p: times[p]["int4"] < times[p]["generic"] * KERNEL_MARGIN for p in PHASES}, fits)


def forced_by_memory(faster: dict, fits: Callable[[dict], bool]) -> dict:
    """`faster` (phase -> True where the kernel is faster), with the kernel also at the phases (prefill first)
    whose expanded weights would not fit: fits(kernel) says whether the memory plan fits that choice."""
    kernel = dict(faster)
    for phase in PHASES:
        if not kernel[phase] and not fits(kernel):
            kernel[phase] = True
    return kernel


def probe(shape: tuple, rows: dict, spec: CompressionSpec, dtypes: dict) -> dict:
    """phase -> {"int4": seconds, "generic": seconds} for one matmul of a random (N, K) weight, medians."""
    g = torch.Generator().manual_seed(0)
    ct = to_kernel_order(quantize(torch.randn(shape, generator=g) * 0.02, spec, torch.bfloat16))
    packed = PackedWeight.from_stored(ct)
    out = {}
    with torch.inference_mode():
        for phase in PHASES:
            x = torch.randn(rows[phase], shape[1], generator=g).to(dtypes[phase])
            buf = torch.empty(shape, dtype=x.dtype)  # as a weight load expands it: into the compute dtype
            paths = {"int4": packed.linear, "generic": lambda x, buf=buf: F.linear(x, expand_kernel_order(ct, buf))}
            times = {name: [] for name in paths}
            for _ in range(ROUNDS + 1):  # alternated; the first round warms up
                for name, fn in paths.items():
                    start = time.perf_counter()
                    fn(x)
                    times[name].append(time.perf_counter() - start)
            out[phase] = {name: statistics.median(ts[1:]) for name, ts in times.items()}
    return out
