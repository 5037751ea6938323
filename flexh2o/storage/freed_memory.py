"""Freed blocks go back to the operating system, so that a run's resident memory is what its plan counts.

glibc serves a block of at least its mmap threshold with its own mapping, which free() unmaps. By default the
threshold is dynamic: each mapped block freed raises it to that block's size (up to 32 MiB), after which blocks of
that size come from the heap, and a heap block freed below a live one stays resident. A prefill frees many large
transients (a sub-batch's MLP and attention, tens of MiB each), so after the first one the rest stayed: on opt-1.3b
bf16 with 128 sequences a 2-token run peaked at 1,451 MiB of RSS against 812 MiB in its tiers' plan; with the
threshold fixed at 4 MiB, 974 MiB (1 MiB: 912, 64 KiB: 889). Fixing it stops the raising; blocks under it (a
decode step's tensors, a small model's prefill rows) still come from the heap, so they pay no fresh mapping's page
faults: opt-125m's memory-resident prefill (8 x 64, fp32) took 0.507 s at glibc's default, 0.506 s at 4 MiB and
0.578 s at 1 MiB (medians of 4 alternated runs), decode the same in all.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MAPPED_FROM = 4 << 20  # blocks of this size or more are mapped, and unmapped when freed
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def return_freed_blocks(threshold: int = MAPPED_FROM) -> bool:
    """Fix glibc's mmap threshold at `threshold` bytes for this process (idempotent). False, changing nothing, where
    the C library is not glibc or the user set glibc's own malloc variables (theirs win)."""
    if any(v in os.environ for v in USER_SETTINGS):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): their allocators keep no dynamic threshold
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, threshold) == 1
