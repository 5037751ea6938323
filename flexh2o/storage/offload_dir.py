"""Run directories under --offload-dir: one per run, marked with its owner's pid, and cleaned up after killed runs."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from typing import Optional

import psutil

RUN_PREFIX = "flexh2o-run-"
OWNER_FILE = "owner.pid"  # "<pid> <process create time>\n"


def make_run_dir(offload_dir: str) -> str:
    """Create and return offload_dir/flexh2o-run-<pid>-<random>/ (with owner.pid), after removing stale run dirs.

    Raises ValueError with a one-line message when offload_dir cannot be created or written.
    """
    try:
        os.makedirs(offload_dir, exist_ok=True)
        remove_stale_run_dirs(offload_dir)
        path = tempfile.mkdtemp(prefix=f"{RUN_PREFIX}{os.getpid()}-", dir=offload_dir)
        with open(os.path.join(path, OWNER_FILE), "w") as f:
            f.write(f"{os.getpid()} {_create_time(os.getpid())}\n")
    except OSError as e:
        raise ValueError(f"--offload-dir {offload_dir} is not writable: {e.strerror or e}; "
                         "pass a writable directory") from None
    return path


def remove_run_dir(path: str) -> None:
    """Delete a run directory and everything in it; missing is fine. Refuses paths that are not run dirs."""
    if not os.path.basename(os.path.normpath(path)).startswith(RUN_PREFIX):
        raise ValueError(f"refusing to remove {path}: not a {RUN_PREFIX}* directory")
    shutil.rmtree(path, ignore_errors=True)


def remove_stale_run_dirs(offload_dir: str) -> list[str]:
    """Remove run dirs whose owner process is gone (or whose owner.pid is missing/corrupt); return their paths."""
    removed = []
    for name in sorted(os.listdir(offload_dir)):
        path = os.path.join(offload_dir, name)
        if not name.startswith(RUN_PREFIX) or not os.path.isdir(path) or _owner_alive(path):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            print(f"flexh2o: removed stale offload directory {path} left by a killed run", file=sys.stderr)
            removed.append(path)
    return removed


def free_disk_bytes(path: str) -> int:
    """Free bytes on the filesystem holding `path` (or its nearest existing ancestor): the default --disk-mem."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def _owner_alive(path: str) -> bool:
    """Is the process that made this run dir still running? A pid file that names a live pid with a different start
    time belongs to a reused pid, i.e. the owner is dead. A dir whose pid file is not written yet (a run starting right
    now) is judged by the pid in its name, so a concurrent start is never mistaken for a stale one."""
    pid, created = _read_owner(path)
    if pid is None:
        pid = _pid_from_name(os.path.basename(path))
        if pid is None or pid == 0:
            return False
        return psutil.pid_exists(pid) and os.path.getmtime(path) >= _create_time(pid) - 1.0
    if not psutil.pid_exists(pid) or _zombie(pid):  # a killed run not yet reaped by its parent is gone too
        return False
    return created is None or abs(_create_time(pid) - created) < 1.0


def _read_owner(path: str) -> tuple[Optional[int], Optional[float]]:
    try:
        with open(os.path.join(path, OWNER_FILE)) as f:
            fields = f.read().split()
        return int(fields[0]), float(fields[1]) if len(fields) > 1 else None
    except (OSError, ValueError, IndexError):
        return None, None


def _pid_from_name(name: str) -> Optional[int]:
    head = name[len(RUN_PREFIX):].split("-", 1)[0]
    return int(head) if head.isdigit() else None


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _create_time(pid: int) -> float:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0.0
