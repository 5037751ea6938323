"""--help and a flag's error are quick: every console script parses its flags without importing torch (its import
alone takes about 1.4 s here). Checked in a fresh interpreter through sys.modules, not by a clock."""
from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPTS = ("run", "serve", "plan", "eval", "profile")
PROBE = """
import contextlib, io, sys
from flexh2o.cli import {script} as cli
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
    try:
        code = cli.main({argv!r})
    except SystemExit as e:
        code = e.code
print(code, 'torch' in sys.modules, len(out.getvalue()))
"""


@pytest.mark.parametrize("argv", [["--help"], ["--bogus"]], ids=["help", "unknown-flag"])
@pytest.mark.parametrize("script", SCRIPTS)
def test_parsing_imports_no_torch(script, argv):
    done = subprocess.run([sys.executable, "-c", PROBE.format(script=script, argv=argv)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    code, imported, said = done.stdout.split()
    assert code == ("0" if argv == ["--help"] else "2"), done.stdout  # it did answer: help, or the flag's error
    assert int(said) > 0
    assert imported == "False", f"flexh2o-{script} {' '.join(argv)} imported torch"


def test_a_run_imports_torch_after_parsing():
    """The probe can fail: a run that goes on past its flags (to its RunConfig, refused there) imports torch."""
    probe = PROBE.format(script="run", argv=["--model", "opt-125m", "--gpu-batch-size", "x"])
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.stdout.split()[:2] == ["2", "True"], done.stdout + done.stderr
