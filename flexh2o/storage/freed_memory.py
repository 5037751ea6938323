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

Fixing the threshold also fixes glibc's trim threshold, the free memory at the top of the heap that free() returns
to the system, at its default of 128 KiB (the dynamic rule had raised it with the mmap threshold). A decode step's
blocks under 4 MiB (the quantized cache's levels cast for its matmuls, a step's scores) then went back to the
system at the end of each layer and were faulted in again by the next: the trim threshold is set to KEPT_AT_TOP,
32 MiB, which a step reuses and which bounds what stays resident: opt-125m bf16, prompt 512, batch 12, the quantized
cache: decode compute 0.315 -> 0.213 s a step, peak RSS 746 -> 752 MiB (8 MiB kept: 0.293 s, 16 MiB: 0.246 s).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
MAPPED_FROM = 4 << 20  # blocks of this size or more are mapped, and unmapped when freed
KEPT_AT_TOP = 32 << 20  # free memory at the top of the heap kept for the next blocks, not returned
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def return_freed_blocks(threshold: int = MAPPED_FROM, kept: int = KEPT_AT_TOP) -> bool:
    """Fix glibc's mmap threshold at `threshold` bytes and its trim threshold at `kept` bytes for this process
    (idempotent). False, changing nothing, where the C library is not glibc or the user set glibc's own malloc
    variables (theirs win)."""
    if any(v in os.environ for v in USER_SETTINGS):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): their allocators keep no dynamic threshold
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, threshold) == 1 and mallopt(M_TRIM_THRESHOLD, kept) == 1
