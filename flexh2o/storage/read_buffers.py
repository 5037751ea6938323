"""Two reused aligned arenas for the disk tier's weight reads, one layer each.

A fresh buffer for every direct-I/O read is mapped and page-faulted by the read itself (the kernel pins and zeroes
each 4 KiB page first): on a decode step that streams every weight from disk that took a third of the reading time
(opt-125m / opt-350m, 2026-12-03, eeec47e). The block schedule holds at most two layers of weights at once
(schedule/run.py), so two arenas of the largest layer's disk bytes (the memory plan's two layers in flight) serve every
load, in turn; a load that finds both still lent (a caller holding more than two layers) reads into fresh buffers
instead.
"""
from __future__ import annotations

import threading
from typing import Optional

from flexh2o.storage.disk import aligned_empty


class ReadArenas:
    """lend(sizes) -> (token, aligned uint8 buffers of those padded sizes carved from one arena), lent until
    give(token) (thread-safe)."""

    def __init__(self, size: int):
        self.size = size
        self.arenas: list = [None, None]
        self.busy = [False, False]
        self.turn = 0
        self.lock = threading.Lock()
        self.fresh = 0  # loads that found their arena lent, or too small (diagnostics and tests)

    def lend(self, sizes: list) -> tuple:
        with self.lock:
            free = [a for a in (self.turn, 1 - self.turn) if not self.busy[a]]
            if not free or sum(sizes) > self.size:
                self.fresh += 1
                return None, [aligned_empty(n) for n in sizes]
            a = free[0]
            self.busy[a], self.turn = True, 1 - a
            if self.arenas[a] is None:
                self.arenas[a] = aligned_empty(self.size)
        out, at = [], 0
        for n in sizes:  # padded sizes are multiples of ALIGN, so every piece stays aligned
            out.append(self.arenas[a][at:at + n])
            at += n
        return a, out

    def give(self, token: Optional[int]) -> None:
        """The arena of a lend() is free again (its buffers must no longer be read); None: fresh buffers."""
        if token is not None:
            with self.lock:
                self.busy[token] = False

    def held(self) -> int:
        """Bytes of the arenas made so far."""
        return sum(a.numel() for a in self.arenas if a is not None)
