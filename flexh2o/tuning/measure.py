"""Measure this machine's compute rates and bandwidths into a JSON hardware profile.

Run it on a quiet machine: set OMP_WAIT_POLICY=PASSIVE (idle OpenMP threads then sleep instead of spinning, which
matters when the engine's I/O threads share the cores), and the same OMP_NUM_THREADS as the runs it predicts.
The keys it writes are described in flexh2o.tuning.hardware; the probes are in tuning/probes.py and
tuning/disk_probe.py.
"""
from __future__ import annotations

import os
import platform
from typing import Callable, Optional

import psutil
import torch

from flexh2o.dtypes import dtype_name, parse_dtype
from flexh2o.planning.machine import LoadSeen, fingerprint, load_now
from flexh2o.tuning.disk_probe import disk_rates
from flexh2o.tuning.probes import (compute_rates, cpu_attention_flops, int4_rows_rates, matmul_rows_rates,
                                   memory_rates, op_overhead, parallel_op)


def measure(device: str, dtypes: list, offload_dir: Optional[str], quick: bool,
            progress: Callable[[int], object] = lambda n: None) -> dict:
    """The whole profile as a JSON-ready dict (disk figures are null when offload_dir is None), with this machine's
    fingerprint. progress(1) is called after each of measure_steps(dtypes, offload_dir) steps."""
    dev = torch.device(device)
    prof = {"name": f"{platform.node()}-{dev.type}", "device": dev.type, "threads": torch.get_num_threads(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(), "quick": quick,
            "cpu_mem": psutil.virtual_memory().total, "fingerprint": fingerprint(device),
            "load_at_measure": load_now()}
    if dev.type == "cuda":
        prof["gpu"] = torch.cuda.get_device_name(dev)
        prof["gpu_mem"] = torch.cuda.get_device_properties(dev).total_memory
    with LoadSeen(torch.get_num_threads()) as seen:  # the matmul probes use every thread: crowded out, they read slow
        prof.update(dtype_rates(dev, dtypes, quick, progress))
    prof["load_at_measure"] = max(prof["load_at_measure"], seen.load)
    prof.update(memory_rates(dev, quick))
    prof["cpu_flops"] = cpu_attention_flops(quick)
    progress(1)
    prof["op_overhead_s"] = op_overhead(dev)
    prof["parallel_op_s"] = parallel_op(dev)
    from flexh2o.compress.kernels import kernel_available
    if kernel_available(dev):
        prof["int4_matmul_flops_by_rows"] = int4_rows_rates(quick)
    progress(1)
    if offload_dir is not None:
        prof.update(disk_rates(offload_dir, quick, busy=dev.type == "cpu"))
        from flexh2o.storage.offload_dir import free_disk_bytes
        prof["disk_mem"] = free_disk_bytes(offload_dir)
        progress(1)
    else:
        prof.update(disk_read_bw=None, disk_write_bw=None, disk_read_latency_s=None, disk_write_latency_s=None,
                    direct_io=None, disk_read_bw_busy=None, compute_busy=None)
    return prof


def dtype_rates(dev: torch.device, dtypes: list, quick: bool,
                progress: Callable[[int], object] = lambda n: None) -> dict:
    """The per-dtype part of a profile: {rate key: {dtype: FLOP/s}} plus matmul_flops_by_rows; progress(1) twice per
    dtype."""
    rates, by_rows = {}, {}
    for d in dtypes:
        rates[dtype_name(parse_dtype(d))] = compute_rates(parse_dtype(d), dev, quick)
        progress(1)
        by_rows[dtype_name(parse_dtype(d))] = matmul_rows_rates(parse_dtype(d), dev, quick)
        progress(1)
    out = {key: {d: r[key] for d, r in rates.items()} for key in next(iter(rates.values()))}
    out["matmul_flops_by_rows"] = by_rows
    return out


def add_dtypes(prof: dict, dtypes: list, progress: Callable[[int], object] = lambda n: None) -> dict:
    """`prof` (this machine's) with the per-dtype rates of `dtypes` measured now and merged in, at the profile's own
    quickness; the load they were measured at (machine.LoadSeen) goes into `dtype_load_at_measure` (read by
    profile_cache)."""
    with LoadSeen(torch.get_num_threads()) as seen:
        added = dtype_rates(torch.device(prof["device"]), dtypes, prof.get("quick", True), progress)
    load = seen.load
    out = dict(prof)
    for key, by_dtype in added.items():
        out[key] = {**prof.get(key, {}), **by_dtype}
    loads = {d: load for d in added["matmul_flops"]}
    out["dtype_load_at_measure"] = {**prof.get("dtype_load_at_measure", {}), **loads}
    return out


def measure_steps(dtypes: list, offload_dir: Optional[str]) -> int:
    """How many times measure() calls progress (for a progress bar)."""
    return 2 * len(dtypes) + 2 + (offload_dir is not None)


def summary(prof: dict) -> str:
    """Human-readable lines of the main figures."""
    lines = [f"device {prof['device']}  threads {prof['threads']}"]
    for key in ("matmul_flops", "decode_matmul_flops", "attention_flops", "decode_attention_flops"):
        lines.append(f"{key:<24}" + "  ".join(f"{d} {v / 1e9:.1f} GFLOP/s" for d, v in prof[key].items()))
    for d, table in prof.get("matmul_flops_by_rows", {}).items():
        lines.append(f"{'matmul by rows ' + d:<24}" + " ".join(f"{r}:{v / 1e9:.0f}" for r, v in table.items())
                     + " GFLOP/s")
    if prof.get("int4_matmul_flops_by_rows"):
        lines.append(f"{'int4 kernel by rows':<24}" + " ".join(
            f"{r}:{v / 1e9:.0f}" for r, v in prof["int4_matmul_flops_by_rows"].items()) + " GFLOP/s")
    for key in ("cpu_mem_bw", "gpu_mem_bw", "convert_bw", "h2d_bw", "d2h_bw", "disk_read_bw", "disk_write_bw",
                "disk_read_bw_busy"):
        v = prof.get(key)
        lines.append(f"{key:<24}" + ("n/a" if v is None else f"{v / 1e9:.2f} GB/s"))
    lines.append(f"{'cpu_flops':<24}{prof['cpu_flops'] / 1e9:.1f} GFLOP/s")
    if prof.get("compute_busy") is not None:
        lines.append(f"{'compute_busy':<24}{prof['compute_busy']:.2f} of the idle matmul rate during disk reads")
    for key in ("disk_read_latency_s", "disk_write_latency_s", "op_overhead_s", "parallel_op_s"):
        if prof.get(key) is not None:
            lines.append(f"{key:<24}{prof[key] * 1e6:.1f} us")
    return "\n".join(lines)
