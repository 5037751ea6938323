"""benchmarks/gpu_check.py --dry-run: every command of the GPU check parses (runs in CI, no GPU needed)."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(__file__, "../../.."))


def test_gpu_check_dry_run_passes(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--dry-run", "--out",
                        str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "every command parses" in r.stdout


def test_gpu_check_dry_run_catches_a_bad_flag(tmp_path, monkeypatch):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(gpu_check, "flexgen_argv", lambda out: ["--no-such-flexgen-flag"])
    monkeypatch.setattr(gpu_check, "flexh2o_argv", lambda system, out: ["--percent", "1", "2"] if system == "h2o"
                        else ["--no-such-flag"])
    problems = gpu_check.check_parses(str(tmp_path))
    assert any("flexgen" in p for p in problems) and any("flexh2o full" in p for p in problems)
