"""Run a benchmark process under a hard memory cap: a fresh Linux memory cgroup (v1 or v2) of its own.

The cap counts everything the kernel charges to the process: its own memory and the page cache of the files it
reads. That is what makes a fair "the model does not fit in memory" comparison on a machine with plenty of RAM:
without it, Accelerate's "disk" weights (a memory-mapped safetensors file) stay in the page cache after the first
step and are never read from disk again, while flexh2o reads its disk tier with direct I/O every step. Needs write
access to the cgroup file system (root, or a delegated subtree); otherwise MemCap() raises with what to do.
"""
from __future__ import annotations

import os
from typing import Optional

V1 = "/sys/fs/cgroup/memory"
V2 = "/sys/fs/cgroup"


class MemCap:
    """One cgroup capped at `limit` bytes for one child process: pass `preexec` to subprocess (it moves the child
    into the group before exec), read `stats()` after the child ended, then `close()`."""

    def __init__(self, limit: int, name: str):
        self.limit = limit
        if os.path.isdir(V1) and os.path.exists(os.path.join(V1, "memory.limit_in_bytes")):
            self.v2, root = False, V1
        elif "memory" in _read(os.path.join(V2, "cgroup.controllers")).split():
            self.v2, root = True, V2
        else:
            raise RuntimeError("--mem-cap needs the cgroup memory controller (/sys/fs/cgroup/memory or cgroup v2 "
                               "with memory enabled); run without --mem-cap")
        self.path = os.path.join(root, f"flexh2o-bench-{os.getpid()}-{name}")
        try:
            os.mkdir(self.path)
            self._write("memory.max" if self.v2 else "memory.limit_in_bytes", str(limit))
            if self.v2:
                self._write("memory.swap.max", "0", missing_ok=True)
        except OSError as e:
            self.close()
            raise RuntimeError(f"--mem-cap: cannot create a memory cgroup under {root} ({e.strerror}): run as root "
                               f"or without --mem-cap") from None

    def preexec(self) -> None:
        """In the child, before exec: join the capped group."""
        with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    def stats(self) -> dict:
        """The cap, the group's peak charge (memory + page cache) and how often it hit the cap (or OOM-killed)."""
        peak = self._read_int("memory.peak" if self.v2 else "memory.max_usage_in_bytes")
        if self.v2:
            events = self._read_keyed("memory.events")
            hits, oom = events.get("max", 0), events.get("oom_kill", 0)
        else:
            hits = self._read_int("memory.failcnt")
            oom = self._read_keyed("memory.oom_control").get("oom_kill")  # absent on older kernels
        return {"limit": self.limit, "peak_charged": peak, "times_at_limit": hits, "oom_kills": oom}

    def close(self) -> None:
        try:
            os.rmdir(self.path)
        except OSError:
            pass

    def _write(self, name: str, value: str, missing_ok: bool = False) -> None:
        try:
            with open(os.path.join(self.path, name), "w") as f:
                f.write(value)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def _read_keyed(self, name: str) -> dict:
        """A cgroup file of "key value" lines -> {key: int}."""
        return {k: int(v) for k, v in (line.split() for line in _read(os.path.join(self.path, name)).splitlines())}

    def _read_int(self, name: str) -> Optional[int]:
        text = _read(os.path.join(self.path, name)).strip()
        return int(text) if text.isdigit() else None


def drop_cached(path: str) -> None:
    """Evict the page cache of every file under `path` (written files are synced first), so the next reader reads
    the disk and its cgroup, not the writer's, is charged for the pages."""
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""
