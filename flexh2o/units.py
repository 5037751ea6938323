"""Byte sizes: reading '16GB' from the command line, printing 1.5 GiB, and the disk tier's alignment."""
from __future__ import annotations

import math

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
ALIGN = 4096  # direct I/O: disk-tier buffers, offsets and file sizes are multiples of this


def padded(nbytes: int, align: int = ALIGN) -> int:
    """nbytes rounded up to a multiple of `align`."""
    return -(-nbytes // align) * align


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def parse_bytes(text: str) -> int:
    """'16GB', '512MiB', '1.5G', '1000' -> bytes (powers of 1024 for every suffix)."""
    s = text.strip().upper().replace("IB", "B")
    units = {"TB": TiB, "GB": GiB, "MB": MiB, "KB": KiB, "T": TiB, "G": GiB, "M": MiB, "K": KiB, "B": 1}
    for u, mult in units.items():
        if s.endswith(u):
            s, m = s[: -len(u)], mult
            break
    else:
        m = 1
    try:
        value = float(s)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ValueError(f"cannot read {text!r} as a size: use a finite number with a unit, e.g. 16GB or 512MB")
    if value < 0:
        raise ValueError(f"size {text!r} is negative")
    return int(value * m)
