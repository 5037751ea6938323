"""benchmarks/bench_common.py: a benchmark stopped with SIGTERM leaves nothing behind (its `finally` clauses run,
the flexh2o-run it waits on is killed)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from bench_common import terminated_as_exit  # noqa: E402


def test_sigterm_inside_the_block_is_a_system_exit_that_kills_the_child_and_runs_finally(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    cleaned, started = [], []
    pidfile = tmp_path / "pid"
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
    with pytest.raises(SystemExit) as exc:
        with terminated_as_exit():
            try:
                timer.start()
                started.append(True)
                subprocess.run(["sh", "-c", f"echo $$ > {pidfile}; exec sleep 30"], timeout=20)
            finally:
                cleaned.append(True)
    timer.join()
    assert exc.value.code == 143 and started and cleaned
    pid = int(pidfile.read_text())
    with pytest.raises(ProcessLookupError):  # subprocess.run killed and reaped it on the way out
        os.kill(pid, 0)
    assert signal.getsignal(signal.SIGTERM) is before
