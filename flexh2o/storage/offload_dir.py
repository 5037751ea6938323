"""Run directories under --offload-dir: one per run, locked by its owner for the run's lifetime (dirlock.py), and
swept at every start when their owner is gone (killed runs)."""
from __future__ import annotations

import os
import shutil
import sys
from typing import Optional

import psutil

from flexh2o.storage.dirlock import LOCK_FILE, LockedDir, has_marker, lock_state, make_locked_dir, \
    remove_if_unlocked, stale_staging

RUN_PREFIX = "flexh2o-run-"
NEW_PREFIX = ".flexh2o-new-"  # a run dir being born: renamed to RUN_PREFIX... once its lock is held
OWNER_FILE = "owner.pid"  # "<pid> <process create time>\n": for people reading the directory, and older versions
MARKER = (".flexh2o-run-dir", "made by flexh2o-run as its offload run directory; deleted when its run ends\n")
# written at creation: the sweep deletes only directories holding it (a user's own flexh2o-run-* dir is never touched)


def make_run_dir(offload_dir: str) -> LockedDir:
    """Create offload_dir/flexh2o-run-<pid>-<random>/ holding its lock (and owner.pid), after removing stale run
    dirs. The result is a path (os.PathLike); its `remove()` deletes the directory and drops the lock.

    Raises ValueError with a one-line message when offload_dir cannot be created or written.
    """
    try:
        os.makedirs(offload_dir, exist_ok=True)
        remove_stale_run_dirs(offload_dir)
        pid = os.getpid()
        run = make_locked_dir(offload_dir, f"{NEW_PREFIX}{pid}-",
                              lambda staged: RUN_PREFIX + staged[len(NEW_PREFIX):], MARKER)
        try:
            with open(os.path.join(run.path, OWNER_FILE), "w") as f:
                f.write(f"{pid} {_create_time(pid)}\n")
        except BaseException:
            run.remove()
            raise
    except OSError as e:
        raise ValueError(f"--offload-dir {offload_dir} is not writable: {e.strerror or e}; "
                         "pass a writable directory") from None
    return run


def remove_run_dir(path) -> None:
    """Delete a run directory and everything in it (dropping its lock if this process holds it); missing is fine.
    Refuses paths that are not run dirs."""
    if not os.path.basename(os.path.normpath(os.fspath(path))).startswith(RUN_PREFIX):
        raise ValueError(f"refusing to remove {os.fspath(path)}: not a {RUN_PREFIX}* directory")
    if isinstance(path, LockedDir):
        path.remove()
    else:
        shutil.rmtree(path, ignore_errors=True)


def sweep(offload_dir: Optional[str]) -> list[str]:
    """The stale sweep every start does (dry runs and runs without a disk tier too), before free space is
    measured; a missing offload dir is left alone (not created)."""
    if not offload_dir or not os.path.isdir(offload_dir):
        return []
    try:
        return remove_stale_run_dirs(offload_dir)
    except OSError:
        return []  # unreadable: make_run_dir reports it if the run needs the directory


def remove_stale_run_dirs(offload_dir: str) -> list[str]:
    """Remove run dirs whose owner is gone (their lock is free; without a lock file, the owner.pid names no live
    process); return their paths. Only directories holding MARKER are deleted (an empty staging dir, of a start
    killed before it wrote one, is removed with rmdir): a directory of the same name without it is not ours."""
    removed = []
    for name in sorted(os.listdir(offload_dir)):
        path = os.path.join(offload_dir, name)
        if not os.path.isdir(path) or os.path.islink(path):
            continue
        if name.startswith(RUN_PREFIX) and has_marker(path, MARKER):
            state = lock_state(path)
            gone = remove_if_unlocked(path) if state is False else (state is None and _remove_legacy(path))
        elif name.startswith(NEW_PREFIX) and stale_staging(path):
            gone = _remove_staging(path)
        else:
            continue
        if gone:
            print(f"flexh2o: removed stale offload directory {path} left by a killed run", file=sys.stderr)
            removed.append(path)
    return removed


def free_disk_bytes(path: str) -> int:
    """Free bytes on the filesystem holding `path` (or its nearest existing ancestor): the default --disk-mem."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def _remove_staging(path: str) -> bool:
    """A stale staging dir: deleted with its files when it holds MARKER, else only when empty."""
    if has_marker(path, MARKER):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.rmdir(path)
        except OSError:
            return False
    return not os.path.exists(path)


def _remove_legacy(path: str) -> bool:
    if os.path.exists(os.path.join(path, LOCK_FILE)) or _owner_alive(path):
        return False
    shutil.rmtree(path, ignore_errors=True)
    return not os.path.exists(path)


def _owner_alive(path: str) -> bool:
    """Run dirs of older versions (no lock file): is the process named in owner.pid (or in the name, while the pid
    file is not written yet) still running with the same start time?"""
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
