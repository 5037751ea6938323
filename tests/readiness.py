"""Waiting for a process under test to be decoding, from its own word rather than a guessed sleep: flexh2o appends
'<pid> decode' to $FLEXH2O_READY_FILE once a generate() call has computed its first decode op
(flexh2o/generation/ready.py); a test names the file, starts the process and waits on the file, bounded."""
from __future__ import annotations

import os
import time

from flexh2o.generation.ready import ENV

POLL_S = 0.02  # how often the file is read while waiting (the wait itself ends on the file, not on this)


def ready_env(path, env: dict) -> dict:
    """`env` with $FLEXH2O_READY_FILE naming `path` (removed first, so only this run's lines are read)."""
    if os.path.exists(path):
        os.remove(path)
    return {**env, ENV: str(path)}


def decoding_pids(path) -> set:
    """The pids whose run has announced its first decode op in `path`."""
    if not os.path.exists(path):
        return set()
    with open(path) as f:
        return {int(line.split()[0]) for line in f if line.endswith(" decode\n")}


def wait_decoding(path, proc, processes: int = 1, timeout: float = 60) -> set:
    """The pids in `path` once `processes` distinct ones have announced their decode; AssertionError (with the
    process's stderr) when `proc` exits first or the deadline passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        pids = decoding_pids(path)
        if len(pids) >= processes:
            return pids
        time.sleep(POLL_S)
    state = "ended" if proc.poll() is not None else f"still running after {timeout} s"
    proc.kill()
    err = proc.communicate()[1]
    raise AssertionError(f"{processes} process(es) did not announce their decode ({state}): {err}")
