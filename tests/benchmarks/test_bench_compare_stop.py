"""benchmarks/compare.py stopped with SIGTERM leaves nothing behind: its checkpoint folder is removed, the
flexh2o-run it waits on is killed, and it exits with 128 + the signal."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

sys.path.insert(0, os.path.join(os.path.abspath(os.path.join(__file__, "../../..")), "benchmarks"))
from compare import in_checkpoint_dir  # noqa: E402


def test_sigterm_in_the_checkpoint_folder_kills_the_child_removes_the_folder_and_exits_143(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    started, folders = [], []
    pidfile = tmp_path / "pid"
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))

    def body(workdir):
        folders.append(workdir)
        timer.start()
        started.append(True)
        subprocess.run(["sh", "-c", f"echo $$ > {pidfile}; exec sleep 30"], timeout=20)
        return 0
    code = in_checkpoint_dir(str(tmp_path), body)
    timer.join()
    assert code == 143 and started and folders and folders[0].startswith(str(tmp_path))
    assert not os.path.exists(folders[0])  # the finally ran
    pid = int(pidfile.read_text())
    with pytest.raises(ProcessLookupError):  # subprocess.run killed and reaped it on the way out
        os.kill(pid, 0)
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_folder_is_removed_when_the_body_returns():
    import tempfile
    with tempfile.TemporaryDirectory() as root:
        seen = []
        assert in_checkpoint_dir(root, lambda wd: seen.append(wd) or 7) == 7
        assert seen and not os.path.exists(seen[0]) and os.listdir(root) == []
