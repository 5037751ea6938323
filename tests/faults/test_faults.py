"""Fault injection: full disks, signals in every phase, kill -9 then restart, a run dir locked by a live
run in another process. Each case ends in exit 0, or in one line and exit 2 (128 + signal for SIGTERM/SIGHUP), and
nothing is left under --offload-dir. Corrupted checkpoints and convert's staging dirs:
tests/faults/test_faults_checkpoints.py."""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from flexh2o.cli import run as cli
from flexh2o.storage import offload_dir as od
from readiness import ready_env, wait_decoding
from tiny_models import tiny_opt, write_tiny_checkpoint

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
DISK = ["--percent", "0", "0", "0", "0", "0", "0"]  # everything on the disk tier


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cfg = tiny_opt(vocab=256, hidden=32, max_positions=2048)
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "tiny"), cfg)


def _argv(ckpt, off, *extra, gen="4"):
    return ["--path", ckpt, "--prompt-len", "8", "--gen-len", gen, "--gpu-batch-size", "2", "--no-warmup", "--dtype",
            "float32",
            "--offload-dir", str(off), *extra]


def _one_line(err: str, prefix: str = "flexh2o-run: error: ") -> str:
    err = err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(prefix) and "Traceback" not in err, err
    return err


def _leftovers(d) -> list:
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


# ---------------------------------------------------------------- full disk, broken tier, truncated offload file

def test_disk_full_during_the_run(capsys, monkeypatch, ckpt, tmp_path):
    """A fake full filesystem: the disk tier's writes fail with ENOSPC once the run has written 64 KiB."""
    from flexh2o.storage import disk
    real, written = os.pwritev, [0]

    def pwritev(fd, bufs, offset):
        written[0] += sum(len(b) for b in bufs)
        if written[0] > 64 << 10:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, bufs, offset)
    monkeypatch.setattr(disk.os, "pwritev", pwritev)
    off = tmp_path / "off"
    assert cli.main(_argv(ckpt, off, *DISK, "--disk-mem", "1GB")) == 2
    err = _one_line(capsys.readouterr().err)
    for needle in ("disk tier", "no space left", str(off), "bytes", "free", "--disk-mem", "--offload-dir"):
        assert needle in err, err
    assert _leftovers(off) == []


def test_small_tmpfs_is_full(capsys, ckpt, tmp_path):
    """A real 32 KiB tmpfs (root only, where mounting is allowed): by default --disk-mem is its free space and the
    plan refuses the run; with a --disk-mem larger than the filesystem the run hits ENOSPC and says so."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32k", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        assert cli.main(_argv(ckpt, mnt / "off", *DISK)) == 2
        err = _one_line(capsys.readouterr().err)
        assert ("disk tier needs" in err or "no space left" in err) and "--disk-mem" in err, err
        assert cli.main(_argv(ckpt, mnt / "off", *DISK, "--disk-mem", "1GB")) == 2
        err = _one_line(capsys.readouterr().err)
        assert "no space left" in err and "--disk-mem" in err, err
        assert _leftovers(mnt / "off") == []
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_disk_tier_that_cannot_be_made_leaves_nothing(capsys, monkeypatch, ckpt, tmp_path):
    from flexh2o.storage import disk

    def no_inodes(directory):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(disk, "probe_direct_io", no_inodes)
    off = tmp_path / "off"
    assert cli.main(_argv(ckpt, off, *DISK)) == 2
    err = _one_line(capsys.readouterr().err)
    assert "disk tier" in err and str(off) in err
    assert _leftovers(off) == []


def test_offload_file_truncated_under_a_running_job(capsys, monkeypatch, ckpt, tmp_path):
    from flexh2o import engine
    real = engine._Run.compute

    def compute(self, op):
        if op.step == 1 and op.layer == 1 and op.batch == 0:
            d = self.eng.tiers["disk"].directory
            for f in os.listdir(d):
                if f.endswith(".bin"):
                    os.truncate(os.path.join(d, f), 0)
        return real(self, op)
    monkeypatch.setattr(engine._Run, "compute", compute)
    off = tmp_path / "off"
    assert cli.main(_argv(ckpt, off, *DISK)) == 2
    err = _one_line(capsys.readouterr().err)
    assert "disk tier" in err and "truncated" in err, err
    assert _leftovers(off) == []


# ---------------------------------------------------------------- signals

def _signal_at(monkeypatch, phase: str, sig: int) -> None:
    """Make the process signal itself (a real signal, delivered by the kernel) in one phase of the run."""
    from flexh2o import engine, job
    from flexh2o.weights import store

    def hit():
        os.kill(os.getpid(), sig)
    if phase == "load":
        real_fill = store.WeightStore.fill_from

        def fill_from(self, *a, **k):
            hit()
            return real_fill(self, *a, **k)
        monkeypatch.setattr(store.WeightStore, "fill_from", fill_from)
    elif phase in ("prefill", "decode"):
        real_compute, want = engine._Run.compute, 0 if phase == "prefill" else 2

        def compute(self, op):
            if op.step == want and op.layer == 2:
                hit()
            return real_compute(self, op)
        monkeypatch.setattr(engine._Run, "compute", compute)
    else:
        real_write = job.write_outputs

        def write_outputs(*a, **k):
            hit()
            return real_write(*a, **k)
        monkeypatch.setattr(job, "write_outputs", write_outputs)


@pytest.mark.parametrize("phase,sig", [("load", signal.SIGTERM), ("prefill", signal.SIGHUP),
                                       ("decode", signal.SIGTERM), ("write", signal.SIGHUP)])
def test_signal_in_each_phase(capsys, monkeypatch, ckpt, tmp_path, phase, sig):
    off, out = tmp_path / "off", tmp_path / "out.json"
    _signal_at(monkeypatch, phase, sig)
    # a suite started under nohup inherits SIGHUP ignored, and the run rightly keeps ignoring it (cli/console.py)
    inherited = signal.signal(sig, signal.SIG_DFL)
    try:
        before = signal.getsignal(sig)
        code = cli.main(_argv(ckpt, off, *DISK, "--output-file", str(out)))
        after = signal.getsignal(sig)
    finally:
        signal.signal(sig, inherited)
    assert code == 128 + sig
    err = capsys.readouterr().err.strip()
    assert err.splitlines()[-1] == f"flexh2o-run: interrupted; offload files removed ({sig.name})", err
    assert "Traceback" not in err and after == before  # the handler is put back
    assert _leftovers(off) == [] and sorted(os.listdir(tmp_path)) == ["off"]  # no output, not even a temp file


def interruptible():
    """A child's Ctrl-C as a terminal's foreground process has it: a suite started in the background (`cmd &` in a
    script: SIGINT and SIGQUIT ignored, which every process it starts inherits, as Python's start-up respects) would
    otherwise run the child with Ctrl-C ignored, and the run would rightly finish (exit 0)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_and_wait_for_run_dir(ckpt, off, gen="2000"):
    """A run on the disk tier started in a child process, returned once it says it is decoding (its ready file)."""
    ready = off.parent / f"{off.name}.ready"  # beside --offload-dir, which must be left empty
    p = subprocess.Popen([sys.executable, "-m", "flexh2o.cli", *_argv(ckpt, off, *DISK, gen=gen),
                          "--kv-policy", "h2o", "--kv-budget", "8"], env=ready_env(ready, ENV),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=interruptible)
    wait_decoding(ready, p)
    runs = [n for n in _leftovers(off) if n.startswith(od.RUN_PREFIX)]
    assert len(runs) == 1 and any(f.endswith(".bin") for f in os.listdir(off / runs[0])), runs
    return p, off / runs[0]


def test_external_sigterm_during_decode(ckpt, tmp_path):
    """A real process signalled from outside while it decodes (as a job scheduler or `kill` does)."""
    sig = signal.SIGTERM
    p, run = _start_and_wait_for_run_dir(ckpt, tmp_path / "off")
    p.send_signal(sig)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 128 + sig, err
    assert err.strip().splitlines()[-1].endswith(f"({signal.Signals(sig).name})") and "Traceback" not in err, err
    assert not run.exists() and _leftovers(tmp_path / "off") == []


def test_kill_9_then_a_dry_run_sweeps_the_stale_dir(capsys, ckpt, tmp_path):
    off = tmp_path / "off"
    p, run = _start_and_wait_for_run_dir(ckpt, off)
    p.kill()
    p.communicate(timeout=30)
    assert run.exists()  # nothing can clean up after kill -9 ...
    assert cli.main(_argv(ckpt, off, "--dry-run")) == 0  # ... but the next start does, a dry run too
    assert f"removed stale offload directory {run}" in capsys.readouterr().err
    assert _leftovers(off) == []


def test_stale_sweep_before_free_space_is_measured(capsys, monkeypatch, ckpt, tmp_path):
    off = tmp_path / "off"
    off.mkdir()
    stale = off / f"{od.RUN_PREFIX}12345-old"
    stale.mkdir()
    (stale / ".lock").write_text("")  # its owner died: nobody holds the lock
    (stale / od.MARKER[0]).write_text(od.MARKER[1])  # made by flexh2o (only marked dirs are deleted)
    (stale / "t000000.bin").write_bytes(b"\0" * 4096)
    seen = []
    real = od.free_disk_bytes

    def free(path):
        seen.append(stale.exists())
        return real(path)
    monkeypatch.setattr(od, "free_disk_bytes", free)
    assert cli.main(_argv(ckpt, off, "--gen-len", "2")) == 0  # a run that does not use the disk tier
    assert seen == [False] and _leftovers(off) == []


HOLDER = textwrap.dedent("""
    import os, sys, time
    from flexh2o.storage.offload_dir import OWNER_FILE, make_run_dir
    run = make_run_dir(sys.argv[1])
    with open(os.path.join(run, OWNER_FILE), "w") as f:
        f.write("999999999 0\\n")  # a pid from another pid namespace: means nothing here
    print(run, flush=True)
    time.sleep(120)
""")


def test_lock_held_by_a_live_run_in_another_process(tmp_path):
    off = tmp_path / "off"
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(off)], stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        run = p.stdout.readline().strip()
        assert os.path.isdir(run)
        assert od.sweep(str(off)) == [] and os.path.isdir(run)  # the owner.pid lies, the lock does not
        d = od.make_run_dir(str(off))  # a second run beside it
        assert os.path.isdir(run) and os.path.isdir(d)
        d.remove()
    finally:
        p.kill()
        p.wait()
    assert od.sweep(str(off)) == [run] and _leftovers(off) == []
