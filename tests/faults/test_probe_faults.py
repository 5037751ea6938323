"""Fault-probe cases (2026-12-02, 5d976f9): --dry-run's exit status, the offload-dir sweep's proof of ownership, the
memory cgroup's limit as the default capacities, Ctrl-C at start-up and twice during decode, stdout on a full device,
the profiler's disk measurement on a full filesystem."""
from __future__ import annotations

import glob
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from flexh2o.cli import run as cli
from flexh2o.planning import memory_limit
from flexh2o.storage import offload_dir as od
from test_faults import (DISK, ENV, _argv, _leftovers, _one_line, _start_and_wait_for_run_dir, ckpt,  # noqa: F401
                         interruptible)

TIER_NEEDS = r"(tier|compute memory \(host memory, --gpu-mem\)) needs"  # a tier's refusal (a CPU run's gpu tier)

DRY = ["--model", "opt-125m", "--prompt-len", "8", "--gen-len", "2", "--dry-run"]
ROOT = os.path.abspath(os.path.join(__file__, "../../.."))


# ------------------------------------------------------------------------------------------------ --dry-run status

def test_dry_run_that_fits_exits_0_with_its_prediction(capsys, tmp_path):
    assert cli.main(DRY + ["--offload-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "\nfits\n" in out and "predicted (cost model" in out


def test_dry_run_that_does_not_fit_exits_2_naming_the_tier(capsys, tmp_path):
    argv = DRY + ["--percent", "0", "100", "100", "0", "--gpu-mem", "1GB", "--cpu-mem", "20MB", "--offload-dir",
                  str(tmp_path)]
    assert cli.main(argv) == 2
    got = capsys.readouterr()
    assert "does NOT fit: cpu tier needs" in got.out and "predicted" not in got.out
    err = _one_line(got.err)
    assert "cpu tier needs" in err and "--cpu-mem" in err


# ------------------------------------------------------------------------------------ the sweep deletes only its own

def test_sweep_keeps_a_users_dir_of_the_same_name(tmp_path, capsys):
    mine = tmp_path / f"{od.RUN_PREFIX}notes"  # the user's: no lock, no marker, no owner.pid
    mine.mkdir()
    (mine / "data.txt").write_text("keep me")
    locked_look = tmp_path / f"{od.RUN_PREFIX}123-abc"  # even with a free lock file and a dead owner.pid
    locked_look.mkdir()
    (locked_look / ".lock").write_text("")
    (locked_look / od.OWNER_FILE).write_text("999999999 0\n")
    staging = tmp_path / f"{od.NEW_PREFIX}1-x"  # a staging name, old and unmarked, with a file
    staging.mkdir()
    (staging / "f").write_text("x")
    os.utime(staging, (0, 0))
    empty = tmp_path / f"{od.NEW_PREFIX}2-y"  # a start killed before it wrote anything
    empty.mkdir()
    os.utime(empty, (0, 0))
    ours = od.make_run_dir(str(tmp_path))
    ours.release()  # its owner "dies": the lock is free
    assert od.sweep(str(tmp_path)) == [str(ours)]
    assert (mine / "data.txt").read_text() == "keep me" and (locked_look / ".lock").exists()
    assert (staging / "f").exists() and not empty.exists()
    assert sorted(os.listdir(tmp_path)) == sorted([mine.name, locked_look.name, staging.name])


def test_run_dirs_carry_the_marker_from_birth(tmp_path):
    run = od.make_run_dir(str(tmp_path))
    try:
        with open(os.path.join(run, od.MARKER[0])) as f:
            assert f.read() == od.MARKER[1]
    finally:
        run.remove()


# ----------------------------------------------------------------------------------------- memory cgroup's limit

def _tree(tmp_path, files: dict, proc: str):
    for rel, text in files.items():
        p = tmp_path / "fs" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    (tmp_path / "cgroup").write_text(proc)
    return str(tmp_path / "cgroup"), str(tmp_path / "fs")


def test_cgroup_v2_limit_smallest_ancestor_and_cache_not_counted(tmp_path):
    proc, root = _tree(tmp_path, {"a/memory.max": "2147483648\n", "a/b/memory.max": "max\n",
                                  "a/memory.current": "1500000000\n", "a/memory.stat": "anon 1\nfile 500000000\n"},
                       "0::/a/b\n")
    got = memory_limit.cgroup_memory(proc, root)
    assert (got.limit, got.used, got.headroom) == (2 << 30, 1_000_000_000, (2 << 30) - 1_000_000_000)


def test_cgroup_v1_limit_and_no_limit(tmp_path):
    proc, root = _tree(tmp_path, {"memory/docker/x/memory.limit_in_bytes": "1073741824\n",
                                  "memory/docker/x/memory.usage_in_bytes": "300000000\n",
                                  "memory/docker/x/memory.stat": "cache 100000000\ntotal_cache 100000000\n",
                                  "memory/memory.limit_in_bytes": "9223372036854771712\n"},
                       "12:memory:/docker/x\n4:cpu,cpuacct:/docker/x\n")
    got = memory_limit.cgroup_memory(proc, root)
    assert (got.limit, got.used) == (1 << 30, 200_000_000)
    proc, root = _tree(tmp_path / "none", {"memory/memory.limit_in_bytes": "9223372036854771712\n"}, "3:memory:/\n")
    assert memory_limit.cgroup_memory(proc, root) is None


def test_default_capacities_come_from_the_cgroup(capsys, monkeypatch, tmp_path):
    """A reported command in a 1 GiB group holding 400 MB (this process): refused by the plan, not OOM-killed."""
    group = memory_limit.CgroupMemory(1 << 30, 400 << 20, "/sys/fs/cgroup/test")
    monkeypatch.setattr(memory_limit, "cgroup_memory", lambda *a: group)
    argv = ["--model", "opt-1.3b", "--percent", "0", "100", "100", "0", "--prompt-len", "32", "--gen-len", "4",
            "--gpu-batch-size", "1", "--offload-dir", str(tmp_path), "--hardware", "cpu_measured"]
    assert cli.main(argv) == 2
    assert re.search(TIER_NEEDS, _error_line(capsys.readouterr().err))
    assert cli.main(argv + ["--cpu-mem", "4GB"]) == 2  # asked for more than the group allows
    err = _error_line(capsys.readouterr().err)
    assert "memory cgroup limit" in err and "/sys/fs/cgroup/test" in err


def _error_line(err: str) -> str:
    """The one error line (after the shipped profile's warning that it is not this machine's, and the dtype probe's
    note that the chosen --dtype is slower here, printed on CPUs where another dtype is faster)."""
    lines = [ln for ln in err.strip().splitlines()
             if "warning: hardware profile" not in ln and "note: --dtype" not in ln]
    return _one_line("\n".join(lines))


def test_plan_refuses_inside_a_real_1gib_cgroup(tmp_path):
    """A real memory cgroup of 1 GiB (benchmarks/memcap.py; needs a writable cgroup file system): the run whose
    2.6 GB of weights the kernel would kill (it did, before the capacities read the limit) is refused by the plan, one line, exit 2, no OOM kill."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from memcap import MemCap
    try:
        cap = MemCap(1 << 30, "faults-test")
    except RuntimeError as e:
        pytest.skip(f"no writable memory cgroup here: {e}")
    try:
        argv = ["--model", "opt-1.3b", "--percent", "0", "100", "100", "0", "--prompt-len", "32", "--gen-len", "4",
                "--gpu-batch-size", "1", "--offload-dir", str(tmp_path), "--hardware", "cpu_measured"]
        p = subprocess.run([sys.executable, "-m", "flexh2o.cli", *argv], preexec_fn=cap.preexec, env=ENV,
                           capture_output=True, text=True, timeout=300)
        stats = cap.stats()
    finally:
        cap.close()
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert re.search(TIER_NEEDS, _error_line(p.stderr)) and not stats["oom_kills"]


# ----------------------------------------------------------------------------------------------- signals, stdout

def _script(name: str) -> str:
    """The console script itself (not a shell shim in front of it)."""
    path = os.path.join(os.path.dirname(sys.executable), name)
    if not os.path.exists(path):
        pytest.skip(f"{name} is not installed beside {sys.executable}")
    return path


def test_ctrl_c_while_torch_loads_exits_130_quietly(tmp_path):
    p = subprocess.Popen([_script("flexh2o-run"), *DRY, "--offload-dir", str(tmp_path)], env=ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=interruptible)
    maps, deadline = f"/proc/{p.pid}/maps", time.time() + 60
    while time.time() < deadline and p.poll() is None:  # torch's libraries are being mapped: start-up
        with open(maps) as f:
            if "libtorch" in f.read():
                break
        time.sleep(0.01)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, (p.returncode, err)
    # torch now loads inside the run (after the flags are parsed), where an interrupt's line also says that the
    # offload files are gone: none may be left
    assert err.strip() in ("flexh2o-run: interrupted", "flexh2o-run: interrupted; offload files removed"), err
    assert out == "" and not glob.glob(str(tmp_path / "flexh2o-run-*")), (out, os.listdir(tmp_path))


def test_two_ctrl_c_50ms_apart_during_decode_leave_nothing(ckpt, tmp_path):
    p, run = _start_and_wait_for_run_dir(ckpt, tmp_path / "off")
    p.send_signal(signal.SIGINT)
    time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "Traceback" not in err, err
    assert not run.exists() and _leftovers(tmp_path / "off") == []


@pytest.mark.parametrize("dry", [True, False])
def test_stdout_on_a_full_device_is_one_line(ckpt, tmp_path, dry):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    argv = [*_argv(ckpt, tmp_path / "off", *DISK, gen="2"), *(["--dry-run"] if dry else []), "--hardware",
            "cpu_measured"]
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-m", "flexh2o.cli", *argv], env=ENV, stdout=full,
                           stderr=subprocess.PIPE, text=True, timeout=300)
    assert p.returncode == 2 and "No space left on device" in _error_line(p.stderr), p.stderr
    assert _leftovers(tmp_path / "off") == []


@pytest.fixture
def full_tmpfs(tmp_path):
    """A 1 MiB tmpfs, three quarters full (room for a run dir's small files, not for the measurement)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        (mnt / "fill").write_bytes(b"\0" * (768 << 10))
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_profile_disk_on_a_full_tmpfs_leaves_nothing(full_tmpfs):
    from flexh2o.storage.base import TierError
    from flexh2o.tuning.disk_probe import disk_rates
    for _ in range(2):  # nearly full, then completely full
        with pytest.raises((TierError, ValueError, OSError)):
            disk_rates(str(full_tmpfs), quick=True, busy=False)
        assert sorted(os.listdir(full_tmpfs)) == ["fill"]
        with open(full_tmpfs / "fill", "ab") as f:
            try:
                f.write(b"\0" * (1 << 20))
                f.flush()
            except OSError:
                pass
