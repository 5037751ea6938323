"""The memory this process may use: the host's, or less inside a memory cgroup (Docker, Kubernetes and systemd all
set one). The kernel OOM-kills a process whose cgroup charge reaches the limit, so the default capacities must come
from the limit, less what the group already holds (this process's own imports and tensors included), or the plan
would allow what the kernel then kills.

cgroup v2: /proc/self/cgroup has a line `0::/path`; the limit is memory.max ("max": none) of that group and of
every ancestor below the mount (the smallest wins), the charge memory.current, the reclaimable page cache the
"file" line of memory.stat. cgroup v1: the line whose controllers include `memory`; memory.limit_in_bytes (a huge
value: none), memory.usage_in_bytes, memory.stat's "total_cache" (or "cache").
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import psutil

ROOT = "/sys/fs/cgroup"
NO_LIMIT = 1 << 60  # v1 writes "no limit" as a page-rounded 2^63 - 1


@dataclass(frozen=True)
class CgroupMemory:
    """This process's memory cgroup: its limit and what the group holds now that the kernel will not reclaim."""

    limit: int
    used: int
    path: str  # the group's directory whose file set the limit (for messages)

    @property
    def headroom(self) -> int:
        return max(0, self.limit - self.used)


def cgroup_memory(proc_cgroup: str = "/proc/self/cgroup", root: str = ROOT) -> Optional[CgroupMemory]:
    """The memory cgroup's limit and use, or None when no limit applies (or nothing can be read)."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3 and "memory" in parts[1].split(","):
            return _group(os.path.join(root, "memory"), parts[2], ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                                                    ("total_cache", "cache")))
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3 and parts[0] == "0" and parts[1] == "":
            return _group(root, parts[2], ("memory.max", "memory.current", ("file",)))
    return None


def _group(mount: str, rel: str, files: tuple) -> Optional[CgroupMemory]:
    """The smallest limit over the group and its ancestors under `mount`, and the use of the group that sets it.
    Inside a container the group's path may not exist under the mount (its own view starts at the mount): then
    the mount's own files are the group's."""
    limit_file, usage_file, cache_keys = files
    parts = [p for p in rel.strip().split("/") if p]
    best = None
    for depth in range(len(parts), -1, -1):
        d = os.path.join(mount, *parts[:depth])
        limit = _read_int(os.path.join(d, limit_file))
        if limit is not None and limit < NO_LIMIT and (best is None or limit < best[0]):
            best = (limit, d)
    if best is None:
        return None
    limit, d = best
    usage = _read_int(os.path.join(d, usage_file)) or 0
    stat = _read_stat(os.path.join(d, "memory.stat"))
    cache = next((stat[k] for k in cache_keys if k in stat), 0)
    return CgroupMemory(limit, max(0, usage - cache), d)


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _read_stat(path: str) -> dict:
    out = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if value.strip().isdigit():
                    out[key] = int(value)
    except OSError:
        pass
    return out


def available_bytes() -> int:
    """Bytes a new allocation of this process may take: the host's available memory, or less, the cgroup's
    headroom (its limit less what the group holds now, this process's own overhead included)."""
    avail = psutil.virtual_memory().available
    group = cgroup_memory()
    return avail if group is None else min(avail, group.headroom)


def total_bytes() -> int:
    """The most memory this process can ever hold: RAM + swap, or the cgroup's limit when smaller."""
    have = psutil.virtual_memory().total + psutil.swap_memory().total
    group = cgroup_memory()
    return have if group is None else min(have, group.limit)
