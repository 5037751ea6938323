"""Measure this machine's compute rates and bandwidths into a JSON hardware profile.

Run it on a quiet machine: set OMP_WAIT_POLICY=PASSIVE (idle OpenMP threads then sleep instead of spinning, which
matters when the engine's I/O threads share the cores), and the same OMP_NUM_THREADS as the runs it predicts.
The keys it writes are described in flexh2o.tuning.hardware.
"""
from __future__ import annotations

import os
import platform
import statistics
import threading
import time
from typing import Callable, Optional

import psutil
import torch
import torch.nn.functional as F

from flexh2o.dtypes import dtype_name, parse_dtype
from flexh2o.tuning.hardware import GRAIN
from flexh2o.planning.machine import fingerprint, load_now


def median_time(fn: Callable[[], object], repeat: int, sync: Callable[[], None] = lambda: None) -> float:
    """The median of the faster half of `repeat` timed calls of fn after one warm-up call: a rate the machine
    reaches, not one another process's burst imposed (the plain median drifted 2-5x with other processes on the
    cores)."""
    fn()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    times.sort()
    return max(statistics.median(times[:max(1, (len(times) + 1) // 2)]), 1e-9)


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
INT4_ROWS = (1, 4, 16, 64, 256)  # the int4 kernel's table (rates between are interpolated)


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


def int4_rows_rates(quick: bool) -> dict:
    """{rows: FLOP/s} of torch's int4 kernel (CPU) over the weights of _Matmuls stored 4-bit in groups of 64 along
    their input dimension, by the number of rows of x (bf16 activations, as the engine feeds it)."""
    from flexh2o.compress.codec import CompressionSpec, quantize
    from flexh2o.compress.kernels import PackedWeight, to_kernel_order
    mm = _Matmuls(torch.float32, torch.device("cpu"), quick)
    spec = CompressionSpec(4, 64, 1)
    packed = [PackedWeight.from_stored(to_kernel_order(quantize(w, spec, torch.bfloat16))) for w in mm.ws]
    shapes = {w.shape[1] for w in mm.ws}
    del mm.ws  # fp32 copies no longer needed

    def runner(rows: int) -> Callable[[], None]:
        xs = {n: torch.randn(rows, n) for n in shapes}
        return lambda: [p.linear(xs[p.packed.shape[1] * 2]) for p in packed]
    flops = 2 * sum(p.meta.shape[0] * p.packed.shape[1] * 2 for p in packed)
    return {str(r): r * flops / median_time(runner(r), 3 if quick else 5) for r in INT4_ROWS}


def memory_rates(device: torch.device, quick: bool) -> dict:
    """Memcpy rate (bytes copied per second) of host memory and of the device, and the fp16 -> fp32 conversion
    into a buffer already touched (weights.store.ConvertBuffers)."""
    nbytes = (64 if quick else 256) << 20
    rep = 3 if quick else 5
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src).fill_(0)
    out = {"cpu_mem_bw": nbytes / median_time(lambda: dst.copy_(src), rep)}
    half = torch.ones(nbytes // 2, dtype=torch.float16)
    wide = torch.empty(nbytes // 2, dtype=torch.float32).fill_(0)  # reused, as the engine's conversion buffers
    out["convert_bw"] = nbytes / median_time(lambda: wide.copy_(half), rep)
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
    from flexh2o.tuning.cost_model import OPS
    from flexh2o.engine import Engine
    from flexh2o.placement import Percent
    from flexh2o.prompts import synthetic_prompts
    from flexh2o.run_config import RunConfig
    cfg = ModelConfig("overhead-probe", "opt", hidden=64, num_layers=8, num_heads=4, ffn=256, vocab=512,
                      max_positions=64)
    b, nb, gen = 4, 2, 9
    rc = RunConfig(model=cfg, percent=Percent(100, 0, 100, 0, 100, 0), gpu_batch_size=b, num_gpu_batches=nb,
                   prompt_len=32, gen_len=gen, dtype=torch.float32, device=str(device), gpu_mem=1 << 30,
                   cpu_mem=1 << 30, disk_mem=1 << 30, overlap=False)
    prompts = synthetic_prompts(b * nb, 32, cfg.vocab)
    with Engine(rc) as eng:
        eng.generate(prompts, gen)  # warm-up
        decode = statistics.median(eng.generate(prompts, gen).decode_s for _ in range(3))
    ops_per_step = nb * (OPS["embed"] + cfg.num_layers * OPS["block"] + OPS["head"])
    return decode / (gen - 1) / ops_per_step


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
    run_dir, tier = make_run_dir(offload_dir), None
    try:  # the tier too: a full filesystem can refuse its first file, and the run dir must go all the same
        tier = DiskTier(run_dir, nbytes + (1 << 20))
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
        if tier is not None:
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
    prof.update(dtype_rates(dev, dtypes, quick, progress))
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
    quickness; the load they were measured at goes into `dtype_load_at_measure` (read by profile_cache)."""
    load = load_now()
    added = dtype_rates(torch.device(prof["device"]), dtypes, prof.get("quick", True), progress)
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
