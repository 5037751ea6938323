"""Hardware profile: the JSON schema the cost model reads (`Rates`), and where profiles are found.

The profile feeds the cost model (tuning/step_cost.py) through `Rates.from_profile`. Every rate is the median of
the faster half of several timed repeats after a warm-up (tuning/probes.median_time), and the profile records the
load it was measured at (load_at_measure). Keys (all per second, bytes or FLOPs):
  matmul_flops / decode_matmul_flops / attention_flops / decode_attention_flops   {dtype name: FLOP/s}
  matmul_flops_by_rows   {dtype name: {rows: FLOP/s}}: x @ W.T for a weight set larger than the CPU caches, by the
                         number of rows of x (batch x tokens); small row counts are memory-bound and much slower
  int4_matmul_flops_by_rows  {rows: FLOP/s}: the same through torch's int4 kernel from 4-bit weights (CPU; bf16
                         activations whatever the compute dtype); absent: the cost model never assumes the kernel
                         faster (the engine decides by its own probe, planning/kernel_probe.py)
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

import importlib.resources
import math
import os
from dataclasses import dataclass
from typing import Optional

import torch

from flexh2o.jsonfile import read_json

GRAIN = 32768  # torch's at::internal::GRAIN_SIZE: elementwise ops on fewer elements run on one thread


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
    int4_by_rows: tuple = ()  # ((rows, FLOP/s), ...) ascending of the int4 kernel; empty: not measured

    def matmul_rate(self, rows: int, prefill: bool) -> float:
        """FLOP/s of x @ W.T with `rows` rows of x: interpolated in log(rows) from the measured table, clamped to
        its ends; without a table, the prefill (large) or decode (skinny) figure."""
        if not self.matmul_by_rows:
            return self.matmul if prefill else self.decode_matmul
        return by_rows(self.matmul_by_rows, rows)

    def int4_rate(self, rows: int) -> Optional[float]:
        """FLOP/s of the int4 kernel at `rows` rows (as matmul_rate), None when the profile has no figures."""
        return by_rows(self.int4_by_rows, rows) if self.int4_by_rows else None

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
                     rows, f("disk_read_bw_busy"), f("compute_busy", default=1.0), f("parallel_op_s"),
                     tuple(sorted((int(k), float(v)) for k, v in (hw.get("int4_matmul_flops_by_rows") or {}).items())))


def by_rows(table: tuple, rows: int) -> float:
    """A ((rows, FLOP/s), ...) table read at `rows`: interpolated in log(rows), clamped to its ends."""
    if rows <= table[0][0]:
        return table[0][1]
    for (r0, f0), (r1, f1) in zip(table, table[1:]):
        if rows <= r1:
            w = (math.log(rows) - math.log(r0)) / (math.log(r1) - math.log(r0))
            return f0 + w * (f1 - f0)
    return table[-1][1]


def _figure(hw: dict, key: str, dtype: str) -> Optional[float]:
    v = hw.get(key)
    if isinstance(v, dict):
        if dtype not in v:
            raise ValueError(f"hardware profile {hw.get('name', '?')} has no {key} for {dtype} (it has "
                             f"{', '.join(v)}): run flexh2o-profile --dtype {dtype}")
        v = v[dtype]
    return None if v is None else float(v)


def shipped_profiles() -> list:
    """Names of the profiles shipped as package data (flexh2o/configs/hardware/*.json)."""
    root = importlib.resources.files("flexh2o") / "configs" / "hardware"
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".json"))


def load_profile(name_or_path: str) -> dict:
    """A profile from a JSON file path, or by the name of a shipped profile (e.g. t4_paper)."""
    if not os.path.exists(name_or_path) and name_or_path in shipped_profiles():
        res = importlib.resources.files("flexh2o") / "configs" / "hardware" / f"{name_or_path}.json"
        with importlib.resources.as_file(res) as path:
            return read_json(str(path), "reinstall flexh2o (a shipped hardware profile is unreadable)", dict)
    hw = read_json(name_or_path, "pass a hardware profile written by flexh2o-profile, or one of "
                   + ", ".join(shipped_profiles()) + " (--hardware)", dict)
    check_profile(hw, name_or_path)
    return hw


PER_DTYPE = ("matmul_flops", "decode_matmul_flops", "attention_flops", "decode_attention_flops")
NUMBERS = ("gpu_mem_bw", "cpu_mem_bw", "convert_bw", "h2d_bw", "d2h_bw", "disk_read_bw", "disk_write_bw",
           "disk_read_latency_s", "disk_write_latency_s", "cpu_flops", "op_overhead_s", "parallel_op_s",
           "disk_read_bw_busy", "compute_busy", "gpu_mem", "cpu_mem", "disk_mem")
REQUIRED = ("matmul_flops", "cpu_mem_bw")


def check_profile(hw: dict, source: str) -> None:
    """A profile read from a file: the fields the cost model needs are there and every known field holds a finite
    number >= 0 (per dtype where the schema allows; null for optional ones), else one ValueError naming the field."""
    def bad(key, why):
        return ValueError(f"--hardware {source}: {key} {why}; pass a profile written by flexh2o-profile")

    for key in REQUIRED:
        if hw.get(key) is None:
            raise bad(key, "is missing")
    for key in PER_DTYPE + NUMBERS:
        v = hw.get(key)
        values = v.values() if isinstance(v, dict) and key in PER_DTYPE else [v]
        if v is not None and not all(_is_rate(x) for x in values):
            raise bad(key, f"is {v!r}, not a number >= 0" + (" or {dtype: number}" if key in PER_DTYPE else ""))
    for key in ("matmul_flops_by_rows", "int4_matmul_flops_by_rows"):
        v = hw.get(key)
        tables = (v.values() if key == "matmul_flops_by_rows" else [v]) if isinstance(v, dict) else [v]
        if v is not None and not all(isinstance(t, dict) and all(str(r).isdigit() and _is_rate(x)
                                                                 for r, x in t.items()) for t in tables):
            raise bad(key, "is not a table of {rows: FLOP/s}")


def _is_rate(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
