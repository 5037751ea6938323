"""Property-based fuzz of flexh2o-run's argument space: whatever the flags, the run ends in exit 0, or in
exactly one line on stderr with exit status 2; never a traceback or another exception, never a file left behind.
Mostly dry runs of opt-125m (fast), some real runs of a tiny converted model. Deterministic (derandomize) in CI."""
from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from flexh2o.cli import run as cli  # noqa: E402
from tiny_models import tiny_opt, write_tiny_checkpoint  # noqa: E402

INTS = st.one_of(st.integers(-3, 70), st.sampled_from([0, 1, 2, 4096, 4097, 10 ** 8, 2 ** 63, 10 ** 30]))
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.0, 0.2, 1.0, 1.5]))
TEXT = st.sampled_from(["", "x", "1e3", "-1", "1.5", "nan", "inf", "1e400", " 7 "])
SIZES = st.sampled_from(["1MB", "64MB", "1GB", "16GB", "0", "inf", "nan", "", "-1GB", "1e400", "lots", "2.5G",
                         "1000TB", "100"])
VALUES = {
    "--model": st.sampled_from(["opt-125m", "facebook/opt-125m", "opt-7b", "", "smollm2-135m", "OPT-125M"]),
    "--prompt-len": st.one_of(st.sampled_from(["8", "16", "0", "2049", "-5"]), INTS.map(str), TEXT),
    "--gen-len": st.one_of(st.sampled_from(["2", "4", "0", "3000"]), INTS.map(str), TEXT),
    "--gpu-batch-size": st.one_of(st.sampled_from(["auto", "1", "4", "0", "-1", "1.5", "1e9"]), INTS.map(str)),
    "--num-gpu-batches": st.one_of(st.sampled_from(["1", "2", "0"]), INTS.map(str), TEXT),
    "--gpu-mem": SIZES, "--cpu-mem": SIZES, "--disk-mem": SIZES,
    "--kv-policy": st.sampled_from(["full", "h2o", "local", "streaming", "random", "bogus"]),
    "--hh-ratio": st.one_of(FLOATS.map(repr), TEXT), "--recent-ratio": st.one_of(FLOATS.map(repr), TEXT),
    "--kv-budget": st.one_of(INTS.map(str), TEXT), "--num-sinks": st.one_of(INTS.map(str), TEXT),
    "--temperature": st.one_of(FLOATS.map(repr), TEXT), "--top-p": st.one_of(FLOATS.map(repr), TEXT),
    "--seed": st.one_of(INTS.map(str), TEXT),
    "--dtype": st.sampled_from(["float16", "bfloat16", "float32", "int8", "auto", "fp8"]),
    "--compute-dtype": st.sampled_from(["float32", "bfloat16", "auto", "float64"]),
    "--device": st.sampled_from(["cpu", "cuda", "tpu", "cuda:1"]),
    "--overlap": st.sampled_from(["true", "false", "maybe"]),
    "--hardware": st.sampled_from(["cpu_measured", "/nonexistent.json"]),
}
PERCENT = st.lists(st.one_of(st.integers(-10, 150).map(str), st.sampled_from(["100", "0", "50", "a"])),
                   min_size=2, max_size=7)
SWITCHES = ["--cpu-cache-compute", "--no-warmup", "--hh-all"]


@st.composite
def command_lines(draw):
    flags = draw(st.lists(st.sampled_from(sorted(VALUES) + ["--percent"] + SWITCHES), max_size=6, unique=True))
    argv = []
    for f in flags:
        if f == "--percent":
            argv += [f, *draw(PERCENT)]
        elif f in SWITCHES:
            argv.append(f)
        else:
            argv.append(f"{f}={draw(VALUES[f])}")  # '=' so values like -1 stay values
    real = draw(st.integers(0, 9)) == 0  # one in ten: a real run of the tiny model
    return argv, real


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("fuzz") / "tiny"), tiny_opt(vocab=128))


# the default run draws 60 command lines (about a fifth of the time); the slow run 300 others
FUZZ = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@settings(max_examples=60, **FUZZ)
@given(case=command_lines())
def test_fuzz_exit_0_or_one_line_exit_2(tiny, case):
    _exit_0_or_one_line_exit_2(tiny, case)


@pytest.mark.slow
@settings(max_examples=300, **FUZZ)
@given(case=command_lines())
def test_fuzz_at_length_exit_0_or_one_line_exit_2(tiny, case):
    _exit_0_or_one_line_exit_2(tiny, case)


def _exit_0_or_one_line_exit_2(tiny, case):
    argv, real = case
    work = tempfile.mkdtemp(prefix="flexh2o-fuzz-")
    off = os.path.join(work, "off")
    if real:  # tiny model, small lengths first (later flags win in argparse, so fuzzed values still apply)
        argv = [a for a in argv if not a.startswith("--model")]
        argv = ["--path", tiny, "--prompt-len", "4", "--gen-len", "2", "--gpu-batch-size", "2",
                "--output-file", os.path.join(work, "out.json")] + argv + ["--offload-dir", off]
    else:
        argv = argv + ["--offload-dir", off, "--dry-run"]
    err, out = io.StringIO(), io.StringIO()
    try:
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
                status = cli.main(argv)
        except Exception as e:  # anything but exit 0 / exit 2 through run_main is a failure: name the command line
            raise AssertionError(f"{argv}: {type(e).__name__}: {e}") from e
        lines = err.getvalue().strip().splitlines()
        assert "Traceback" not in err.getvalue(), (argv, err.getvalue())
        assert "cannot convert float NaN" not in err.getvalue(), (argv, err.getvalue())
        assert status in (0, 2), (argv, status, err.getvalue())
        if status == 2:
            assert len([ln for ln in lines if ln.startswith("flexh2o-run: error: ")]) == 1, (argv, lines)
            assert lines[-1].startswith("flexh2o-run: error: "), (argv, lines)
        left = os.listdir(off) if os.path.isdir(off) else []
        assert left == [], (argv, left)
        extra = sorted(set(os.listdir(work)) - {"off", "out.json"})
        assert extra == [], (argv, extra)
    finally:
        shutil.rmtree(work, ignore_errors=True)
