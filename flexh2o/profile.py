"""flexh2o-profile: measure this machine's compute rates and bandwidths into a JSON hardware profile.

The profile feeds flexh2o.cost_model through `Rates.from_profile`. Every rate is the median of several timed
repeats after a warm-up (a typical moment, not the best one). Keys (all per second, bytes or FLOPs):
  matmul_flops / decode_matmul_flops / attention_flops / decode_attention_flops   {dtype name: FLOP/s}
  matmul_flops_by_rows   {dtype name: {rows: FLOP/s}}: x @ W.T for a weight set larger than the CPU caches, by the
                         number of rows of x (batch x tokens); small row counts are memory-bound and much slower
  op_overhead_s          seconds per op of the engine's own decode step (small tensors, run serially)
  parallel_op_s          seconds of one elementwise op on a tensor just over torch's parallel grain (2 x 32768
                         elements): OpenMP wakes its threads for it, which costs ~50 us with OMP_WAIT_POLICY=PASSIVE
                         on a small VM and ~5 us when threads spin
  gpu_mem_bw, cpu_mem_bw (memcpy rate), convert_bw (float16 -> float32, source bytes), h2d_bw, d2h_bw,
  disk_read_bw, disk_write_bw (direct I/O through flexh2o's disk tier), disk_read_latency_s and
  disk_write_latency_s (seconds per file: open, one 4 KiB transfer, close), cpu_flops (host-side decode attention).
  disk_read_bw is timed on files of a decoder layer's tensor sizes (4 and 16 MiB), as the engine reads them.
  disk_read_bw_busy, compute_busy (CPU only): the disk read rate while matmuls keep the cores busy, and the matmul
  rate while the disk is read, as a fraction of its idle rate: with overlap the engine's I/O thread and its compute
  share the same cores, so neither runs at its idle rate.
On a CPU-only machine the gpu tier is host memory, so gpu_mem_bw = cpu_mem_bw and h2d/d2h are null (free).

Run it on a quiet machine: set OMP_WAIT_POLICY=PASSIVE (idle OpenMP threads then sleep instead of spinning, which
matters when the engine's I/O threads share the cores), and the same OMP_NUM_THREADS as the runs it predicts.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import threading
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
    matmul_by_rows: tuple = ()  # ((rows, FLOP/s), ...) ascending; empty: matmul / decode_matmul
    disk_read_busy: Optional[float] = None  # disk read rate while compute runs (CPU-only overlap)
    compute_busy: float = 1.0  # fraction of its idle rate that compute keeps while the disk is read
    parallel_op: Optional[float] = None  # seconds per op on tensors of >= GRAIN elements (None: op_overhead)

    def matmul_rate(self, rows: int, prefill: bool) -> float:
        """FLOP/s of x @ W.T with `rows` rows of x: interpolated in log(rows) from the measured table, clamped to
        its ends; without a table, the prefill (large) or decode (skinny) figure."""
        table = self.matmul_by_rows
        if not table:
            return self.matmul if prefill else self.decode_matmul
        if rows <= table[0][0]:
            return table[0][1]
        for (r0, f0), (r1, f1) in zip(table, table[1:]):
            if rows <= r1:
                w = (math.log(rows) - math.log(r0)) / (math.log(r1) - math.log(r0))
                return f0 + w * (f1 - f0)
        return table[-1][1]

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
        by_rows = hw.get("matmul_flops_by_rows") or {}
        table = by_rows.get(name) if isinstance(by_rows, dict) else None
        if by_rows and table is None:
            raise ValueError(f"hardware profile {hw.get('name', '?')} has no matmul_flops_by_rows for {name}: run "
                             f"flexh2o-profile --dtype {name}")
        rows = tuple(sorted((int(k), float(v)) for k, v in (table or {}).items()))
        return Rates(mm, f("decode_matmul_flops", default=mm), f("attention_flops", default=mm),
                     f("decode_attention_flops", "attention_flops", default=mm),
                     f("gpu_mem_bw", default=cpu_mem), cpu_mem, f("convert_bw", default=cpu_mem),
                     f("h2d_bw"), f("d2h_bw"), f("disk_read_bw"), f("disk_write_bw"),
                     f("cpu_flops", default=mm), f("op_overhead_s", default=0.0),
                     f("disk_read_latency_s", default=0.0), f("disk_write_latency_s", default=0.0),
                     rows, f("disk_read_bw_busy"), f("compute_busy", default=1.0), f("parallel_op_s"))


def _figure(hw: dict, key: str, dtype: str) -> Optional[float]:
    v = hw.get(key)
    if isinstance(v, dict):
        if dtype not in v:
            raise ValueError(f"hardware profile {hw.get('name', '?')} has no {key} for {dtype} (it has "
                             f"{', '.join(v)}): run flexh2o-profile --dtype {dtype}")
        v = v[dtype]
    return None if v is None else float(v)


def median_time(fn: Callable[[], object], repeat: int, sync: Callable[[], None] = lambda: None) -> float:
    """Median wall time of `repeat` calls of fn after one warm-up call."""
    fn()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return max(statistics.median(times), 1e-9)


def _sync(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def compute_rates(dtype: torch.dtype, device: torch.device, quick: bool) -> dict:
    """FLOP/s of a large square matmul, a decode-shaped skinny one (32 rows), and attention-shaped bmm."""
    n = 1024 if quick else 2048
    if device.type == "cuda":
        n *= 4
    sync, rep = _sync(device), 3 if quick else 5
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = {"matmul_flops": 2 * n ** 3 / median_time(lambda: a @ b, rep, sync)}
    h = 2048 if quick else 4096
    x = torch.randn(32, h, device=device).to(dtype)  # (tokens, hidden)
    w = torch.randn(h, h, device=device).to(dtype)  # (out, in)
    out["decode_matmul_flops"] = 2 * 32 * h * h / median_time(lambda: F.linear(x, w), rep, sync)
    bh, s, d = (32 if quick else 64), 512, 64  # (batch x heads, tokens, head_dim)
    q = torch.randn(bh, s, d, device=device).to(dtype)
    kt = torch.randn(bh, d, s, device=device).to(dtype)
    out["attention_flops"] = 2 * bh * s * s * d / median_time(lambda: torch.bmm(q, kt), rep, sync)
    bh, s = (256 if quick else 1024), 1024  # one query per sequence and head over `s` cached tokens
    q1 = torch.randn(bh, 1, d, device=device).to(dtype)
    kc = torch.randn(bh, s, d, device=device).to(dtype)
    out["decode_attention_flops"] = 2 * bh * s * d / median_time(lambda: torch.bmm(q1, kc.transpose(1, 2)), rep, sync)
    return out


ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class _Matmuls:
    """x @ W.T over the weights of several decoder layers (hidden h: four h x h projections, h -> 4h, 4h -> h), more
    than the CPU caches hold, as a decode step streams them. h = 1024 (opt-350m's size, the models run on a CPU);
    larger layers multiply somewhat faster at the same rows, so the figures are conservative for them."""

    def __init__(self, dtype: torch.dtype, device: torch.device, quick: bool):
        h = 1024
        layer = [(h, h)] * 4 + [(4 * h, h), (h, 4 * h)]  # (out, in)
        layers = max(2, ((64 if quick else 192) << 20) // (12 * h * h * dtype.itemsize))
        self.ws = [torch.randn(*shape, device=device).to(dtype) for _ in range(layers) for shape in layer]
        self.dtype, self.device = dtype, device

    def flops(self, rows: int) -> int:
        return 2 * rows * sum(w.numel() for w in self.ws)

    def runner(self, rows: int) -> Callable[[], None]:
        xs = {n: torch.randn(rows, n, device=self.device).to(self.dtype) for n in {w.shape[1] for w in self.ws}}

        def run():
            for w in self.ws:
                F.linear(xs[w.shape[1]], w)
        return run


def matmul_rows_rates(dtype: torch.dtype, device: torch.device, quick: bool) -> dict:
    """{rows: FLOP/s} of x @ W.T by the number of rows of x (see _Matmuls)."""
    mm, sync = _Matmuls(dtype, device, quick), _sync(device)
    return {str(r): mm.flops(r) / median_time(mm.runner(r), 3 if quick else 5, sync) for r in ROWS}


def memory_rates(device: torch.device, quick: bool) -> dict:
    """Memcpy rate (bytes copied per second) of host memory and of the device, and the fp16 -> fp32 conversion."""
    nbytes = (64 if quick else 256) << 20
    rep = 3 if quick else 5
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src).fill_(0)
    out = {"cpu_mem_bw": nbytes / median_time(lambda: dst.copy_(src), rep)}
    half = torch.ones(nbytes // 2, dtype=torch.float16)
    out["convert_bw"] = nbytes / median_time(lambda: half.float(), rep)
    del dst, half
    if device.type == "cuda":
        gsrc = torch.ones(nbytes * 4, dtype=torch.uint8, device=device)
        gdst = torch.empty_like(gsrc)
        out["gpu_mem_bw"] = nbytes * 4 / median_time(lambda: gdst.copy_(gsrc), rep, _sync(device))
        pinned = src.pin_memory()
        gbuf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        out["h2d_bw"] = nbytes / median_time(lambda: gbuf.copy_(pinned, non_blocking=True), rep, _sync(device))
        out["d2h_bw"] = nbytes / median_time(lambda: pinned.copy_(gbuf, non_blocking=True), rep, _sync(device))
    else:
        out.update(gpu_mem_bw=out["cpu_mem_bw"], h2d_bw=None, d2h_bw=None)
    return out


def cpu_attention_flops(quick: bool) -> float:
    """FLOP/s of decode attention run on the host in float32 (what --cpu-cache-compute does next to the cache)."""
    bh, s, d = (256 if quick else 1024), 1024, 64
    q = torch.randn(bh, 1, d)
    kc = torch.randn(bh, s, d)
    return 2 * bh * s * d / median_time(lambda: torch.bmm(q, kc.transpose(1, 2)), 3 if quick else 5)


def op_overhead(device: torch.device) -> float:
    """Seconds of framework overhead per op as the engine sees it: decode steps of a tiny model (hidden 64, all in
    the gpu tier) through flexh2o's own Engine, whose compute is negligible, per (layer, batch) and per op of the
    cost model's op count. Small ops timed alone mislead here: with OMP_WAIT_POLICY=PASSIVE a lone small op pays a
    thread wake-up (~50 us on a 2-core VM) that the engine's back-to-back ops mostly do not. (The tiny model's own
    matmuls and memory passes are counted in too; they are a few percent of it.)"""
    from flexh2o.config import ModelConfig
    from flexh2o.cost_model import OPS
    from flexh2o.engine import Engine
    from flexh2o.placement import Percent
    from flexh2o.prompts import synthetic_prompts
    from flexh2o.run_config import RunConfig
    cfg = ModelConfig("overhead-probe", "opt", hidden=64, num_layers=8, num_heads=4, ffn=256, vocab=512,
                      max_positions=64)
    b, nb, gen = 4, 2, 9
    rc = RunConfig(cfg, Percent(100, 0, 100, 0, 100, 0), b, nb, prompt_len=32, gen_len=gen, dtype=torch.float32,
                   device=str(device), gpu_mem=1 << 30, cpu_mem=1 << 30, disk_mem=1 << 30, overlap=False)
    prompts = synthetic_prompts(b * nb, 32, cfg.vocab)
    with Engine(rc) as eng:
        eng.generate(prompts, gen)  # warm-up
        decode = statistics.median(eng.generate(prompts, gen).decode_s for _ in range(3))
    ops_per_step = nb * (OPS["embed"] + cfg.num_layers * OPS["block"] + OPS["head"])
    return decode / (gen - 1) / ops_per_step


GRAIN = 32768  # torch's at::internal::GRAIN_SIZE: elementwise ops on fewer elements run on one thread


def parallel_op(device: torch.device) -> float:
    """Seconds of an elementwise op big enough for torch to run it on all threads (see the module docstring)."""
    x = torch.randn(2 * GRAIN, device=device)
    y = torch.empty_like(x)
    return median_time(lambda: torch.add(x, 1.0, out=y), 101, _sync(device))


DISK_FILES = (4 << 20, 4 << 20, 16 << 20)  # decoder-layer tensor sizes (opt-350m: 2 and 8 MiB; opt-1.3b: 8 and 32)


def disk_rates(offload_dir: str, quick: bool, busy: bool) -> dict:
    """Direct-I/O read and write bandwidth of flexh2o's disk tier, on files of layer-tensor sizes, in a fresh run
    directory under offload_dir. busy: also the read rate while matmuls run on the compute threads, and the
    fraction of the matmul rate kept meanwhile (CPU-only overlap)."""
    from flexh2o.storage.disk import DiskTier
    from flexh2o.storage.offload_dir import make_run_dir, remove_run_dir
    total = (64 if quick else 256) << 20
    sizes = [DISK_FILES[i % len(DISK_FILES)] for i in range(total * len(DISK_FILES) // sum(DISK_FILES))]
    nbytes = sum(sizes)
    run_dir = make_run_dir(offload_dir)
    tier = DiskTier(run_dir, nbytes + (1 << 20))
    try:
        rep = 3 if quick else 5
        small, hs = torch.ones(4096, dtype=torch.uint8), tier.alloc((4096,), torch.uint8)
        lat_w = median_time(lambda: tier.store(hs, small), 3 * rep)
        lat_r = median_time(lambda: tier.load(hs, torch.device("cpu")), 3 * rep)
        handles = [tier.alloc((n,), torch.uint8) for n in sizes]
        data = {n: torch.ones(n, dtype=torch.uint8) for n in set(sizes)}

        def write():
            for h in handles:
                tier.store(h, data[h.nbytes])

        def read():
            for h in handles:
                tier.load(h, torch.device("cpu"))
        write_s = median_time(write, rep)
        if not busy:
            read_s = median_time(read, rep)
            return {"disk_read_bw": nbytes / read_s, "disk_write_bw": nbytes / write_s,
                    "disk_read_latency_s": lat_r, "disk_write_latency_s": lat_w, "direct_io": tier.is_direct}
        read_s, busy_s, compute_busy = _busy_reads(read, rep, quick)
        return {"disk_read_bw": nbytes / read_s, "disk_write_bw": nbytes / write_s, "disk_read_latency_s": lat_r,
                "disk_write_latency_s": lat_w, "direct_io": tier.is_direct, "disk_read_bw_busy": nbytes / busy_s,
                "compute_busy": compute_busy}
    finally:
        tier.close()
        remove_run_dir(run_dir)


def _busy_reads(read: Callable[[], None], rep: int, quick: bool) -> tuple:
    """(idle read s, busy read s, compute_busy): reads on this thread, alternately alone and while another thread
    runs decode-shaped matmuls (torch releases the GIL, as the engine's compute thread does while its I/O thread
    reads), so that a change of the disk's speed during the measurement hits both alike."""
    dtype = torch.bfloat16 if torch.backends.mkldnn.is_available() else torch.float32
    mm = _Matmuls(dtype, torch.device("cpu"), quick)
    run, flops = mm.runner(64), mm.flops(64)
    idle_flops = flops / median_time(run, rep)
    active, stop, rates = threading.Event(), threading.Event(), []

    def spin():
        while not stop.is_set():
            if not active.wait(0.05):
                continue
            start = time.perf_counter()
            run()
            if active.is_set():
                rates.append(flops / (time.perf_counter() - start))
    thread = threading.Thread(target=spin, name="flexh2o-profile-compute")
    thread.start()
    idle, loaded = [], []
    try:
        read()  # warm-up
        for _ in range(rep):
            idle.append(_timed(read))
            active.set()
            time.sleep(0.1)
            loaded.append(_timed(read))
            active.clear()
            time.sleep(0.1)  # let the last matmul finish
    finally:
        stop.set()
        thread.join()
    busy_frac = min(1.0, statistics.median(rates) / idle_flops) if rates else 1.0
    return statistics.median(idle), statistics.median(loaded), busy_frac


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


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
    prof["matmul_flops_by_rows"] = {str(parse_dtype(d)).replace("torch.", ""): matmul_rows_rates(parse_dtype(d), dev,
                                                                                                quick)
                                    for d in dtypes}
    prof.update(memory_rates(dev, quick))
    prof["cpu_flops"] = cpu_attention_flops(quick)
    prof["op_overhead_s"] = op_overhead(dev)
    prof["parallel_op_s"] = parallel_op(dev)
    if offload_dir is not None:
        prof.update(disk_rates(offload_dir, quick, busy=dev.type == "cpu"))
        from flexh2o.storage.offload_dir import free_disk_bytes
        prof["disk_mem"] = free_disk_bytes(offload_dir)
    else:
        prof.update(disk_read_bw=None, disk_write_bw=None, disk_read_latency_s=None, disk_write_latency_s=None,
                    direct_io=None, disk_read_bw_busy=None, compute_busy=None)
    return prof


def summary(prof: dict) -> str:
    """Human-readable lines of the main figures."""
    lines = [f"device {prof['device']}  threads {prof['threads']}"]
    for key in ("matmul_flops", "decode_matmul_flops", "attention_flops", "decode_attention_flops"):
        lines.append(f"{key:<24}" + "  ".join(f"{d} {v / 1e9:.1f} GFLOP/s" for d, v in prof[key].items()))
    for d, table in prof.get("matmul_flops_by_rows", {}).items():
        lines.append(f"{'matmul by rows ' + d:<24}" + " ".join(f"{r}:{v / 1e9:.0f}" for r, v in table.items())
                     + " GFLOP/s")
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
