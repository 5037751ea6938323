"""benchmarks/memcap.py: a child process under a memory cgroup (skipped where cgroups are not writable)."""
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.abspath(os.path.join(__file__, "../../..")), "benchmarks"))
from memcap import MemCap  # noqa: E402


def _cap(limit: int, name: str) -> MemCap:
    try:
        return MemCap(limit, name)
    except RuntimeError as e:
        pytest.skip(str(e))


def test_child_runs_in_the_group_and_the_group_is_removed():
    cap = _cap(256 << 20, "test-ok")
    try:
        p = subprocess.run([sys.executable, "-c", "import os; print(open('/proc/self/cgroup').read())"],
                           preexec_fn=cap.preexec, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0
        assert os.path.basename(cap.path) in p.stdout  # the child's own cgroup file names the capped group
        stats = cap.stats()
        assert stats["limit"] == 256 << 20 and 0 < stats["peak_charged"] <= 256 << 20
    finally:
        cap.close()
    assert not os.path.exists(cap.path)


def test_a_child_over_the_cap_is_killed_and_counted():
    cap = _cap(64 << 20, "test-oom")
    try:
        code = "b = bytearray(256 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1"  # touch 256 MiB
        p = subprocess.run([sys.executable, "-c", code], preexec_fn=cap.preexec, capture_output=True, timeout=120)
        stats = cap.stats()
        assert p.returncode == -9
        assert stats["peak_charged"] == 64 << 20 and stats["times_at_limit"] > 0
        assert stats["oom_kills"] in (None, 1)  # None: the kernel's memory.oom_control has no oom_kill counter
    finally:
        cap.close()
