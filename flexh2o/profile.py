"""flexh2o-profile: measure this machine's compute rates and bandwidths into a JSON hardware profile.

The profile feeds flexh2o.cost_model through `Rates.from_profile`. Every rate is the best of a few timed repeats
after a warm-up (the least disturbed by other processes). Keys (all per second, bytes or FLOPs):
  matmul_flops / decode_matmul_flops / attention_flops / decode_attention_flops   {dtype name: FLOP/s}
  gpu_mem_bw, cpu_mem_bw (memcpy rate), convert_bw (float16 -> float32, source bytes), h2d_bw, d2h_bw,
  disk_read_bw, disk_write_bw (direct I/O through flexh2o's disk tier), disk_read_latency_s and
  disk_write_latency_s (seconds per file: open, one 4 KiB transfer, close), cpu_flops, op_overhead_s.
On a CPU-only machine the gpu tier is host memory, so gpu_mem_bw = cpu_mem_bw and h2d/d2h are null (free).

Run it on a quiet machine: set OMP_WAIT_POLICY=PASSIVE (idle OpenMP threads then sleep instead of spinning, which
matters when the engine's I/O threads share the cores), and the same OMP_NUM_THREADS as the runs it predicts.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import psutil
import torch
import torch.nn.functional as F

from flexh2o.console import Parser, run_main
from flexh2o.run_config import parse_dtype

GiB = 1 << 30


@dataclass(frozen=True)
class Rates:
    """The profile's figures for one compute dtype (per second). h2d/d2h None: host and device share memory."""

    matmul: float  # FLOP/s of prefill GEMMs, decode GEMMs, prefill and decode attention bmm
    decode_matmul: float
    attention: float
    decode_attention: float
    gpu_mem: float  # bytes/s: memcpy on the compute device and on the host, fp16 -> fp32 conversion (source bytes)
    cpu_mem: float
    convert: float
    h2d: Optional[float]
    d2h: Optional[float]
    disk_read: Optional[float]
    disk_write: Optional[float]
    cpu_flops: float  # host-side decode attention (--cpu-cache-compute)
    op_overhead: float  # seconds per op on the compute thread
    read_latency: float = 0.0  # seconds per disk file read / written (open, first transfer, close)
    write_latency: float = 0.0

    @staticmethod
    def from_profile(hw: dict, dtype: torch.dtype) -> "Rates":
        """Rates for `dtype` from a profile dict; per-dtype figures may be {dtype name: value} or one number."""
        name = str(dtype).replace("torch.", "")

        def f(*keys: str, default: Optional[float] = None) -> Optional[float]:
            for key in keys:
                v = _figure(hw, key, name)
                if v is not None:
                    return v
            return default
        mm, cpu_mem = f("matmul_flops"), f("cpu_mem_bw")
        if mm is None or cpu_mem is None:
            raise ValueError(f"hardware profile {hw.get('name', '?')} needs at least matmul_flops and cpu_mem_bw")
        return Rates(mm, f("decode_matmul_flops", default=mm), f("attention_flops", default=mm),
                     f("decode_attention_flops", "attention_flops", default=mm),
                     f("gpu_mem_bw", default=cpu_mem), cpu_mem, f("convert_bw", default=cpu_mem),
                     f("h2d_bw"), f("d2h_bw"), f("disk_read_bw"), f("disk_write_bw"),
                     f("cpu_flops", default=mm), f("op_overhead_s", default=0.0),
                     f("disk_read_latency_s", default=0.0), f("disk_write_latency_s", default=0.0))


def _figure(hw: dict, key: str, dtype: str) -> Optional[float]:
    v = hw.get(key)
    if isinstance(v, dict):
        if dtype not in v:
            raise ValueError(f"hardware profile {hw.get('name', '?')} has no {key} for {dtype} (it has "
                             f"{', '.join(v)}): run flexh2o-profile --dtype {dtype}")
        v = v[dtype]
    return None if v is None else float(v)


def best_time(fn: Callable[[], object], repeat: int, sync: Callable[[], None] = lambda: None) -> float:
    """Least wall time of `repeat` calls of fn after one warm-up call."""
    fn()
    sync()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def _sync(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def compute_rates(dtype: torch.dtype, device: torch.device, quick: bool) -> dict:
    """FLOP/s of a large square matmul, a decode-shaped skinny one (32 rows), and attention-shaped bmm."""
    n = 1024 if quick else 2048
    if device.type == "cuda":
        n *= 4
    sync, rep = _sync(device), 2 if quick else 3
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = {"matmul_flops": 2 * n ** 3 / best_time(lambda: a @ b, rep, sync)}
    h = 2048 if quick else 4096
    x = torch.randn(32, h, device=device).to(dtype)  # (tokens, hidden)
    w = torch.randn(h, h, device=device).to(dtype)  # (out, in)
    out["decode_matmul_flops"] = 2 * 32 * h * h / best_time(lambda: F.linear(x, w), rep, sync)
    bh, s, d = (32 if quick else 64), 512, 64  # (batch x heads, tokens, head_dim)
    q = torch.randn(bh, s, d, device=device).to(dtype)
    kt = torch.randn(bh, d, s, device=device).to(dtype)
    out["attention_flops"] = 2 * bh * s * s * d / best_time(lambda: torch.bmm(q, kt), rep, sync)
    bh, s = (256 if quick else 1024), 1024  # one query per sequence and head over `s` cached tokens
    q1 = torch.randn(bh, 1, d, device=device).to(dtype)
    kc = torch.randn(bh, s, d, device=device).to(dtype)
    out["decode_attention_flops"] = 2 * bh * s * d / best_time(lambda: torch.bmm(q1, kc.transpose(1, 2)), rep, sync)
    return out


def memory_rates(device: torch.device, quick: bool) -> dict:
    """Memcpy rate (bytes copied per second) of host memory and of the device, and the fp16 -> fp32 conversion."""
    nbytes = (64 if quick else 256) << 20
    rep = 2 if quick else 3
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src).fill_(0)
    out = {"cpu_mem_bw": nbytes / best_time(lambda: dst.copy_(src), rep)}
    half = torch.ones(nbytes // 2, dtype=torch.float16)
    out["convert_bw"] = nbytes / best_time(lambda: half.float(), rep)
    del dst, half
    if device.type == "cuda":
        gsrc = torch.ones(nbytes * 4, dtype=torch.uint8, device=device)
        gdst = torch.empty_like(gsrc)
        out["gpu_mem_bw"] = nbytes * 4 / best_time(lambda: gdst.copy_(gsrc), rep, _sync(device))
        pinned = src.pin_memory()
        gbuf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        out["h2d_bw"] = nbytes / best_time(lambda: gbuf.copy_(pinned, non_blocking=True), rep, _sync(device))
        out["d2h_bw"] = nbytes / best_time(lambda: pinned.copy_(gbuf, non_blocking=True), rep, _sync(device))
    else:
        out.update(gpu_mem_bw=out["cpu_mem_bw"], h2d_bw=None, d2h_bw=None)
    return out


def cpu_attention_flops(quick: bool) -> float:
    """FLOP/s of decode attention run on the host in float32 (what --cpu-cache-compute does next to the cache)."""
    bh, s, d = (256 if quick else 1024), 1024, 64
    q = torch.randn(bh, 1, d)
    kc = torch.randn(bh, s, d)
    return 2 * bh * s * d / best_time(lambda: torch.bmm(q, kc.transpose(1, 2)), 2 if quick else 3)


def op_overhead(device: torch.device) -> float:
    """Seconds of framework overhead per small op (dispatch, allocation; kernel launch on CUDA)."""
    x = torch.randn(4, 64, device=device)
    w = torch.randn(64, 64, device=device)

    def ops():
        for _ in range(50):
            F.softmax(F.linear(x, w) + 1.0, -1)
    return best_time(ops, 3, _sync(device)) / 150


def disk_rates(offload_dir: str, quick: bool) -> dict:
    """Direct-I/O read and write bandwidth of flexh2o's disk tier in a fresh run directory under offload_dir."""
    from flexh2o.storage.disk import DiskTier
    from flexh2o.storage.offload_dir import make_run_dir, remove_run_dir
    nbytes = (64 if quick else 256) << 20
    run_dir = make_run_dir(offload_dir)
    tier = DiskTier(run_dir, 2 * nbytes)
    try:
        data = torch.ones(nbytes, dtype=torch.uint8)
        h = tier.alloc((nbytes,), torch.uint8)
        rep = 2 if quick else 3
        small, hs = torch.ones(4096, dtype=torch.uint8), tier.alloc((4096,), torch.uint8)
        lat_w = best_time(lambda: tier.store(hs, small), 3 * rep)
        lat_r = best_time(lambda: tier.load(hs, torch.device("cpu")), 3 * rep)
        write = max(best_time(lambda: tier.store(h, data), rep) - lat_w, 1e-9)
        read = max(best_time(lambda: tier.load(h, torch.device("cpu")), rep) - lat_r, 1e-9)
        return {"disk_read_bw": nbytes / read, "disk_write_bw": nbytes / write, "disk_read_latency_s": lat_r,
                "disk_write_latency_s": lat_w, "direct_io": tier.is_direct}
    finally:
        tier.close()
        remove_run_dir(run_dir)


def measure(device: str, dtypes: list, offload_dir: Optional[str], quick: bool) -> dict:
    """The whole profile as a JSON-ready dict (disk figures are null when offload_dir is None)."""
    dev = torch.device(device)
    prof = {"name": f"{platform.node()}-{dev.type}", "device": dev.type, "threads": torch.get_num_threads(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(), "quick": quick,
            "cpu_mem": psutil.virtual_memory().total}
    if dev.type == "cuda":
        prof["gpu"] = torch.cuda.get_device_name(dev)
        prof["gpu_mem"] = torch.cuda.get_device_properties(dev).total_memory
    rates = [compute_rates(parse_dtype(d), dev, quick) for d in dtypes]
    for key in rates[0]:
        prof[key] = {str(parse_dtype(d)).replace("torch.", ""): r[key] for d, r in zip(dtypes, rates)}
    prof.update(memory_rates(dev, quick))
    prof["cpu_flops"] = cpu_attention_flops(quick)
    prof["op_overhead_s"] = op_overhead(dev)
    if offload_dir is not None:
        prof.update(disk_rates(offload_dir, quick))
        from flexh2o.storage.offload_dir import free_disk_bytes
        prof["disk_mem"] = free_disk_bytes(offload_dir)
    else:
        prof.update(disk_read_bw=None, disk_write_bw=None, disk_read_latency_s=None, disk_write_latency_s=None,
                    direct_io=None)
    return prof


def summary(prof: dict) -> str:
    """Human-readable lines of the main figures."""
    lines = [f"device {prof['device']}  threads {prof['threads']}"]
    for key in ("matmul_flops", "decode_matmul_flops", "attention_flops", "decode_attention_flops"):
        lines.append(f"{key:<24}" + "  ".join(f"{d} {v / 1e9:.1f} GFLOP/s" for d, v in prof[key].items()))
    for key in ("cpu_mem_bw", "gpu_mem_bw", "convert_bw", "h2d_bw", "d2h_bw", "disk_read_bw", "disk_write_bw"):
        v = prof.get(key)
        lines.append(f"{key:<24}" + ("n/a" if v is None else f"{v / 1e9:.2f} GB/s"))
    lines.append(f"{'cpu_flops':<24}{prof['cpu_flops'] / 1e9:.1f} GFLOP/s")
    for key in ("disk_read_latency_s", "disk_write_latency_s", "op_overhead_s"):
        if prof.get(key) is not None:
            lines.append(f"{key:<24}{prof[key] * 1e6:.1f} us")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="flexh2o-profile", description=__doc__.split("\n")[0])
    p.add_argument("--output", help="write the JSON profile here (default: print it)")
    p.add_argument("--offload-dir", default=os.path.join(os.path.expanduser("~"), "flexh2o_offload"),
                   help="where to measure disk bandwidth (a run directory is made and removed)")
    p.add_argument("--no-disk", action="store_true", help="skip the disk measurement")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    p.add_argument("--dtype", action="append", help="compute dtype to time (repeatable; default: float32 and "
                   "bfloat16 on CPU, float16 on CUDA)")
    p.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats (< 10 s)")
    p.add_argument("--name", help="profile name (default: host-device)")
    return p


def main(argv: Optional[list] = None) -> int:
    return run_main("flexh2o-profile", lambda: _profile(build_parser().parse_args(argv), argv))


def _profile(args, argv: Optional[list]) -> int:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available here")
    dtypes = args.dtype or (["float16"] if device.startswith("cuda") else ["float32", "bfloat16"])
    for d in dtypes:
        parse_dtype(d)
    prof = measure(device, dtypes, None if args.no_disk else args.offload_dir, args.quick)
    if args.name:
        prof["name"] = args.name
    env = [f"{k}={os.environ[k]}" for k in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS") if k in os.environ]
    prof["command"] = " ".join(env + ["flexh2o-profile"] + (argv if argv is not None else sys.argv[1:]))
    text = json.dumps(prof, indent=1)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    print(summary(prof), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
