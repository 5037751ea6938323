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

Blocks under the threshold still leave free memory in the heaps: in glibc's main arena and in the arena each
thread that allocates takes (up to 8 a core: the I/O threads, the disk readers, the compute), a block freed below a
live one stays resident, and each arena keeps up to KEPT_AT_TOP at its top. A disk-streamed prefill gathered it a
layer at a time: opt-1.3b 4-bit, 35 sequences of 128 tokens, weights and cache on disk, peaked at 1,019 MiB RssAnon
with 17 thread arenas holding 140 MiB. Giving it back (`give_back_freed`: glibc's malloc_trim) after every prefill
layer and once a decode step took that peak to 891 MiB, but cost a memory-resident opt-125m run (fp32, 32 x 256+32)
1.08x a prefill row and 1.17x a decode step: what the next layer takes again was faulted in again. So the run asks
a FreedMemory at those points (`checked_after`), which gives the memory back only when the heaps' free memory has
grown by HELD_FREE since its least: the disk-streamed peak 944 MiB, opt-350m 4-bit on disk (batch 16, 128+16) 903 ->
847 MiB of peak RSS at the same decode step, and the memory-resident run never gave any back (60 checks, 12 ms in
all). Limiting glibc to 2 arenas (M_ARENA_MAX) took that peak to 949 MiB alone and nothing more with the give-back,
so the arenas are left to glibc (benchmarks/RESULTS.md, row 145).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import threading
from typing import Optional

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
MAPPED_FROM = 4 << 20  # blocks of this size or more are mapped, and unmapped when freed
KEPT_AT_TOP = 32 << 20  # free memory at the top of the heap kept for the next blocks, not returned
HELD_FREE = 64 << 20  # free memory the heaps may gather beyond its least before it is given back (FreedMemory)
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def return_freed_blocks(threshold: int = MAPPED_FROM, kept: int = KEPT_AT_TOP) -> bool:
    """Fix glibc's mmap threshold at `threshold` bytes and its trim threshold at `kept` bytes for this process
    (idempotent). False, changing nothing, where the C library is not glibc or the user set glibc's own malloc
    variables (theirs win)."""
    if any(v in os.environ for v in USER_SETTINGS):
        return False
    mallopt = _glibc("mallopt", (ctypes.c_int, ctypes.c_int), ctypes.c_int)
    if mallopt is None:  # not glibc (musl, macOS): their allocators keep no dynamic threshold
        return False
    return mallopt(M_MMAP_THRESHOLD, threshold) == 1 and mallopt(M_TRIM_THRESHOLD, kept) == 1


def checked_after(step: int, layer: int, last: int) -> bool:
    """Whether the run asks its FreedMemory once the weights of `layer` are freed at `step` (last: the last layer
    index the process computes, the vocabulary head's, or a pipeline stage's own last): after every layer of the
    prefill (step 0), after the last layer at a decode step."""
    return step == 0 or layer == last


class FreedMemory:
    """Gives the heaps' free memory back (`give_back_freed`) when what they hold free has grown by more than
    `bound` bytes since its least (glibc's mallinfo2 `fordblks`, free chunks resident or given back): memory
    gathered free and not reused, as a disk-streamed prefill's thread arenas did, not a step's blocks that the
    next layer takes again (those leave the count unchanged; giving them back cost a memory-resident opt-125m
    decode step 1.17x)."""

    def __init__(self, bound: int = HELD_FREE):
        self.bound = bound
        self.least = _free_held()
        self.lock = threading.Lock()  # weights are freed on the I/O threads

    def check(self) -> bool:
        """Give the free memory back if it grew past the bound; True when it did."""
        with self.lock:
            held = _free_held()
            if held is None or self.least is None:
                return False
            if held - self.least <= self.bound:
                self.least = min(self.least, held)
                return False
            give_back_freed()
            self.least = _free_held()
            return True


def give_back_freed() -> bool:
    """Return the free memory of every glibc arena to the system, wherever it lies in the heaps (malloc_trim(0));
    False, doing nothing, where the C library is not glibc."""
    trim = _glibc("malloc_trim", (ctypes.c_size_t,), ctypes.c_int)
    if trim is None:
        return False
    trim(0)
    return True


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                 "fsmblks", "uordblks", "fordblks", "keepcost")]


def _free_held() -> Optional[int]:
    """Bytes in free chunks of every glibc arena (mallinfo2's fordblks; glibc 2.33 on), None elsewhere."""
    info = _glibc("mallinfo2", (), _MallInfo2)
    return None if info is None else int(info().fordblks)


@functools.lru_cache(maxsize=None)
def _glibc(name: str, argtypes: tuple, restype) -> Optional[object]:
    """glibc's function `name` with its C signature, looked up and typed once a process; None where the C library
    lacks it."""
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, restype
    return fn
