"""This machine: its fingerprint (what decides the speed of a profile or a dtype probe) and the per-user cache dir.

The fingerprint holds the CPU model name and the flags that decide low-precision speed (avx512f, avx512_bf16, amx,
f16c), the core count, torch's version and intra-op threads, the GPU's name and memory when CUDA is present, and
the instruction-set caps set in the environment (ISA_LIMITS), where any is.
Measurements taken here (hardware profile, dtype probe) are cached under cache_dir(), keyed by the fingerprint,
with the load they were taken at (LoadSeen: the load average, or the load implied by the CPU the measurement got where
that is higher): one taken on a busy machine (other processes on every core make every rate look slower, 10x was
seen) is measured again once the machine is much quieter (stale_by_load).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from typing import Callable, Optional

import torch

from flexh2o.paths import cache_dir  # noqa: F401  (read here and by the modules that import it from here)

FLAGS = ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "f16c", "avx2")
COMPARED = ("cpu_model", "cpu_flags", "cores", "torch", "threads", "gpu", "gpu_mem", "isa_limits")  # a mismatch names
# environment variables that cap the instruction set torch's kernels use: ATen's own (elementwise, conversions),
# oneDNN's (bf16/fp16 matmuls) and MKL's (fp32 matmuls); on an AVX-512 CPU all three give the AVX2 path's speeds
ISA_LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def models_dir() -> str:
    """Where a .gguf file or Hugging Face folder is converted once (weights/source.py): cache_dir()/models."""
    return os.path.join(cache_dir(), "models")


def _cpuinfo_fields(path: str = "/proc/cpuinfo") -> dict:
    """The first CPU's fields in /proc/cpuinfo (empty where there is none)."""
    fields = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if not key.strip():
                    break  # the first processor's block ends at its blank line
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def _cpuinfo(fields: dict) -> tuple:
    """(model name, the flags of FLAGS it has, sorted) from _cpuinfo_fields; platform's name where there is none."""
    flags = set(fields.get("flags", "").split())
    return (fields.get("model name") or platform.processor() or platform.machine(),
            sorted(f for f in FLAGS if f in flags))


def cpu_record(path: str = "/proc/cpuinfo") -> dict:
    """The CPU for a table's record: model name, family and model numbers (one model name covers several
    generations: "AMD EPYC" was a Zen 3 on one day and a Zen 4 on the next) and the flags of FLAGS it has."""
    fields = _cpuinfo_fields(path)
    model, flags = _cpuinfo(fields)
    return {"cpu_model": model, "cpu_family": fields.get("cpu family"), "cpu_model_number": fields.get("model"),
            "cpu_flags": flags}


def fingerprint(device: str = "cpu") -> dict:
    """What a measurement of this machine depends on (see the module docstring)."""
    model, flags = _cpuinfo(_cpuinfo_fields())
    fp = {"cpu_model": model, "cpu_flags": flags, "cores": os.cpu_count(),
          "torch": torch.__version__.split("+")[0], "threads": torch.get_num_threads(), "gpu": None, "gpu_mem": None}
    isa = {k: os.environ[k] for k in ISA_LIMITS if os.environ.get(k)}
    if isa:  # the instruction set capped below the CPU's (the AVX2 path of an AVX-512 CPU): its own measurements
        fp["isa_limits"] = isa
    if device.startswith("cuda") and torch.cuda.is_available():
        dev = torch.device(device)
        fp["gpu"] = torch.cuda.get_device_name(dev)
        fp["gpu_mem"] = torch.cuda.get_device_properties(dev).total_memory
    return fp


def fingerprint_key(fp: dict) -> str:
    """A short stable name for a fingerprint (file names in the cache)."""
    return hashlib.sha1(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:12]


def differences(theirs: Optional[dict], ours: dict) -> list:
    """Keys of COMPARED whose values differ ('fingerprint' when the profile has none)."""
    if not theirs:
        return ["fingerprint"]
    return [k for k in COMPARED if theirs.get(k) != ours.get(k)]


BUSY_PER_CORE = 1.0  # a 1-minute load average above cores x this: the machine was busy
QUIETER = 0.5  # a busy measurement is retaken when the load is now below this fraction of its load
FULL_SHARE = 0.75  # a measurement that got less than this share of its threads' CPU time was crowded out
MIN_WALL_S = 0.1  # shorter than this, the CPU clock's ticks (10 ms on Linux) say nothing of the share


class LoadSeen:
    """The load a measurement ran under (`load`, set when the block ends): the 1-minute load average, or, where the
    process got less than FULL_SHARE of the CPU time its `threads` ask for while it ran (other processes held the
    cores; the load average lags by a minute, and a process at a low priority is crowded out at any load), the load
    that share implies, threads / share, whichever is larger (a block under MIN_WALL_S: the load average)."""

    def __init__(self, threads: int, clocks: tuple = (time.perf_counter, time.process_time),
                 load: Callable[[], float] = None):
        self.threads, self.clocks, self.load_now, self.load = max(1, threads), clocks, load or load_now, None

    def __enter__(self) -> "LoadSeen":
        self.start = [c() for c in self.clocks]
        return self

    def __exit__(self, *exc) -> None:
        wall, cpu = (c() - s for c, s in zip(self.clocks, self.start))
        share = cpu / (wall * self.threads) if wall >= MIN_WALL_S else 1.0
        self.load = max(self.load_now(), self.threads / max(share, 0.01) if share < FULL_SHARE else 0.0)


def load_now() -> float:
    """The 1-minute load average (0.0 where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return 0.0


def stale_by_load(measured_at: Optional[float], now: Optional[float] = None, cores: Optional[int] = None) -> bool:
    """Whether a measurement taken at load `measured_at` should be taken again now: it was taken on a busy machine
    and the machine is now much quieter. Unknown loads (older files) never count as stale."""
    if measured_at is None:
        return False
    now = load_now() if now is None else now
    cores = cores or os.cpu_count() or 1
    return measured_at > BUSY_PER_CORE * cores and now < QUIETER * measured_at


def read_cached(name: str) -> Optional[dict]:
    """A JSON file from the cache dir, or None when absent or unreadable (a cache is never an error)."""
    try:
        with open(os.path.join(cache_dir(), name)) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_cached(name: str, data: dict) -> Optional[str]:
    """Write JSON into the cache dir atomically (temp file + rename); None when the dir is not writable."""
    d = cache_dir()
    try:
        os.makedirs(d, exist_ok=True)
        tmp = os.path.join(d, f".{name}.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, os.path.join(d, name))
    except OSError:
        return None
    return os.path.join(d, name)
