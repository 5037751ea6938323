"""The disk tier's part of a hardware profile: direct-I/O read and write rates on files of layer-tensor sizes, and
(CPU) the read rate while matmuls run on the compute threads."""
from __future__ import annotations

import statistics
import threading
import time
from typing import Callable

import torch

from flexh2o.tuning.probes import Matmuls, median_time


DISK_FILES = (4 << 20, 4 << 20, 16 << 20)  # decoder-layer tensor sizes (opt-350m: 2 and 8 MiB; opt-1.3b: 8 and 32)


def _disk_sizes(quick: bool) -> list:
    total = (64 if quick else 256) << 20
    return [DISK_FILES[i % len(DISK_FILES)] for i in range(total * len(DISK_FILES) // sum(DISK_FILES))]


def disk_test_bytes(quick: bool) -> int:
    """Bytes the disk measurement holds under --offload-dir at once (its files plus the latency probe's)."""
    return sum(_disk_sizes(quick)) + (1 << 20)


def disk_rates(offload_dir: str, quick: bool, busy: bool) -> dict:
    """Direct-I/O read and write bandwidth of flexh2o's disk tier, on files of layer-tensor sizes, in a fresh run
    directory under offload_dir. busy: also the read rate while matmuls run on the compute threads, and the
    fraction of the matmul rate kept meanwhile (CPU-only overlap)."""
    from flexh2o.storage.disk import DiskTier, aligned_empty
    from flexh2o.units import padded as round_up
    from flexh2o.storage.offload_dir import make_run_dir, remove_run_dir
    sizes = _disk_sizes(quick)
    nbytes = sum(sizes)
    run_dir, tier = make_run_dir(offload_dir), None
    try:  # the tier too: a full filesystem can refuse its first file, and the run dir must go all the same
        tier = DiskTier(run_dir, disk_test_bytes(quick))
        rep = 3 if quick else 5
        small, hs = torch.ones(4096, dtype=torch.uint8), tier.alloc((4096,), torch.uint8)
        lat_w = median_time(lambda: tier.store(hs, small), 3 * rep)
        lat_r = median_time(lambda: tier.load(hs, torch.device("cpu")), 3 * rep)
        handles = [tier.alloc((n,), torch.uint8) for n in sizes]
        data = {n: torch.ones(n, dtype=torch.uint8) for n in set(sizes)}

        def write():
            for h in handles:
                tier.store(h, data[h.nbytes])

        bufs = {n: aligned_empty(round_up(n)) for n in set(sizes)}  # reused, as the weight store's reads are

        def read():
            for h in handles:
                tier.load(h, torch.device("cpu"), None, bufs[h.nbytes])
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
    mm = Matmuls(dtype, torch.device("cpu"), quick)
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
