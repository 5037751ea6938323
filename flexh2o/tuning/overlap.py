"""Disk reads and compute side by side on a CPU-only machine's shared cores (the cost model's overlap term)."""
from __future__ import annotations


def contended(disk: float, compute: float, disk_slowdown: float, compute_slowdown: float) -> float:
    """Seconds for `disk` and `compute` seconds of idle-rate work run side by side on shared cores: while both run,
    each goes `slowdown` times slower; once one is done the other runs at its idle rate."""
    # each one's time if the other ran throughout (a profile's noise can put a busy rate above its idle one)
    d, c = disk * max(1.0, disk_slowdown), compute * max(1.0, compute_slowdown)
    if c <= d:
        return c + (1.0 - c / d) * disk
    return d + (1.0 - d / c) * compute
