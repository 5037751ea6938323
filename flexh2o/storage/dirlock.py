"""Directories owned by a live process: an fcntl.flock held on a file inside for the owner's lifetime.

The kernel drops the lock when the owner exits (however it exits: kill -9 included), and the lock is seen from other
pid namespaces (containers sharing the directory), so "is the owner alive?" is "is the lock held?", never a pid.
A directory is born locked: it is made under a hidden staging name, locked, and only then renamed to its real name,
so a sweeper never sees a real name without its lock.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
from typing import Optional

LOCK_FILE = ".lock"
NEW_GRACE_S = 60.0  # a staging dir with no lock file yet, younger than this, is a start in progress


class LockedDir(os.PathLike):
    """A directory whose lock this process holds; `remove()` deletes it and drops the lock (idempotent)."""

    def __init__(self, path: str, fd: int):
        self.path, self._fd = path, fd

    def __fspath__(self) -> str:
        return self.path

    def __str__(self) -> str:
        return self.path

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        self.release()

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def make_locked_dir(parent: str, staging_prefix: str, final_name=None, marker: Optional[tuple] = None) -> LockedDir:
    """mkdtemp(prefix=staging_prefix) in parent, lock it, and rename it to final_name(staging basename) if given.
    marker: (file name, text) written inside first, the proof a sweeper checks that the directory is its own."""
    path = tempfile.mkdtemp(prefix=staging_prefix, dir=parent)
    try:
        if marker is not None:
            with open(os.path.join(path, marker[0]), "w") as f:
                f.write(marker[1])
        fd = _lock(os.path.join(path, LOCK_FILE + ".new"))
        # the lock file gets its name only once locked: a sweeper (another rank starting at the same moment) never
        # sees a free lock in a directory being born (it would take it for a killed owner's and remove it)
        os.rename(os.path.join(path, LOCK_FILE + ".new"), os.path.join(path, LOCK_FILE))
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    if final_name is not None:
        final = os.path.join(parent, final_name(os.path.basename(path)))
        try:
            os.rename(path, final)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            os.close(fd)
            raise
        path = final
    return LockedDir(path, fd)


def lock_state(path: str) -> Optional[bool]:
    """True: a live process holds the directory's lock; False: the lock file is there and free (owner gone);
    None: no lock file (a directory made by an older flexh2o, or not a locked directory)."""
    try:
        fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError:
        return True  # cannot tell: keep it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def remove_if_unlocked(path: str) -> bool:
    """Take the directory's lock without waiting and delete the directory while holding it; False if it is held."""
    try:
        fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    try:
        shutil.rmtree(path, ignore_errors=True)
    finally:
        os.close(fd)
    return not os.path.exists(path)


def has_marker(path: str, marker: tuple) -> bool:
    """Whether the directory holds the marker file (name, text) make_locked_dir wrote at its creation."""
    try:
        with open(os.path.join(path, marker[0])) as f:
            return f.read(len(marker[1]) + 1) == marker[1]
    except (OSError, UnicodeDecodeError):
        return False


def stale_staging(path: str) -> bool:
    """A staging directory nobody is finishing: its lock is free, or it never got one and is past the grace time."""
    state = lock_state(path)
    if state is None:
        try:
            return time.time() - os.path.getmtime(path) > NEW_GRACE_S
        except OSError:
            return False
    return not state


def _lock(path: str) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd
