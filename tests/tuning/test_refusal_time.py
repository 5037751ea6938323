"""A refusal's suggested placement states its predicted time (the cost model's, with this machine's profile; when
there is none, it says so), and its search shows progress on stderr (on a terminal, not with --verbose 0)."""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys

import pytest

from flexh2o.cli import run as cli
from flexh2o.tuning.refusal import seconds
from flexh2o.tuning.search import search, weight_splits

# 240 MB: under opt-125m's fp16 weights at this placement (239 MiB; 400 MB fits since its vocabulary table stays
# stored, 280 MB since its matmul weights are converted on use, weights/on_use.py)
CAPS = ["--model", "opt-125m", "--prompt-len", "16", "--gen-len", "2", "--dtype", "float16", "--compute-dtype",
        "float32", "--gpu-mem", "240MB", "--cpu-mem", "100MB", "--disk-mem", "2GB", "--no-warmup",
        "--percent", "100", "0", "100", "0"]
SUGGESTED = r"--percent ((?:\d+ ){5}\d+) --gpu-batch-size (\d+) --num-gpu-batches (\d+)"
NUMBER = r"([\d,.]+) s(?: \([\d.]+ h\))?"


def _refusal(capsys, argv) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    return err.splitlines()[-1]


def test_the_suggestion_states_the_time_its_dry_run_predicts(capsys, offload_dir):
    line = _refusal(capsys, CAPS + ["--offload-dir", offload_dir])
    m = re.search(SUGGESTED + r" \(predicted by the cost model: prefill " + NUMBER + ", decode " + NUMBER
                  + r", ([\d.e+]+) tok/s", line)
    assert m, line
    fix = ["--percent", *m.group(1).split(), "--gpu-batch-size", m.group(2), "--num-gpu-batches", m.group(3)]
    assert cli.main(CAPS + fix + ["--offload-dir", offload_dir, "--dry-run"]) == 0
    out = capsys.readouterr().out
    dry = re.search(r"predicted \(cost model, [^)]*\)\): prefill ([\d.]+) s, decode ([\d.]+) s, total ([\d.]+) tok/s",
                    out)
    assert dry, out  # the dry run of the suggested flags predicts what the refusal said
    for said, planned in zip(m.group(4, 5, 6), dry.groups()):
        assert float(said.replace(",", "")) == pytest.approx(float(planned), rel=0.006, abs=0.006), (line, out)


def test_without_a_profile_the_suggestion_says_it_has_no_time(capsys, offload_dir, tmp_path, monkeypatch,
                                                              flexh2o_cache):
    empty = tmp_path / "cache"
    empty.mkdir()
    for probe in glob.glob(os.path.join(flexh2o_cache, "dtype_probe-*")):  # the dtype probe, not the profile
        shutil.copy(probe, empty)
    monkeypatch.setenv("FLEXH2O_CACHE_DIR", str(empty))
    line = _refusal(capsys, CAPS + ["--offload-dir", offload_dir])
    assert re.search(SUGGESTED + r" \(no predicted time: no profile of this machine yet", line), line
    assert "tok/s" not in line


@pytest.fixture
def quick_search(monkeypatch):
    """The refusal's search replaced by one that reports progress over 3 splits and finds nothing (the real one is
    run by the tests above)."""
    import flexh2o.tuning.search as search_module

    def fake(rc, hw, limit=20, progress=None, **kw):
        for done in range(1, 4):
            progress and progress(done, 3)
        return []
    monkeypatch.setattr(search_module, "search", fake)


@pytest.mark.parametrize("verbose,shown", [(None, True), ("0", False)])
def test_the_search_of_a_refusal_shows_progress_on_a_terminal(capsys, monkeypatch, offload_dir, quick_search,
                                                             verbose, shown):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    argv = CAPS + ["--offload-dir", offload_dir] + (["--verbose", verbose] if verbose else [])
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert ("searching for a placement that fits" in err) == shown, err
    assert "Nothing fits even one sequence" in err.splitlines()[-1]


def test_no_progress_bar_when_stderr_is_not_a_terminal(capsys, offload_dir, quick_search):
    assert cli.main(CAPS + ["--offload-dir", offload_dir]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("flexh2o-run: error: ") and "searching" not in err, err


def test_search_reports_progress_over_every_weight_split():
    from flexh2o.config import from_name
    from flexh2o.kv.spec import KVSpec
    from flexh2o.run_config import RunConfig
    from flexh2o.tuning.hardware import load_profile
    rc = RunConfig(model=from_name("opt-125m"), prompt_len=16, gen_len=2, kv=KVSpec(), gpu_mem=400 << 20,
                   cpu_mem=100 << 20, disk_mem=2 << 30)
    calls = []
    found = search(rc, load_profile("cpu_measured"), step=50, max_num_gpu_batches=2, limit=1,
                   progress=lambda done, total: calls.append((done, total)))
    total = len(weight_splits(50))
    assert found and calls == [(i, total) for i in range(1, total + 1)]


def test_the_console_script_refuses_with_the_same_line(capsys, offload_dir):
    """From the console script (argv from the command line) a refusal leaves at once, without the interpreter's
    teardown (cli/run.py's Refusal): the same one line as in-process, exit status 2, nothing on stdout, and the
    offload directory as it was."""
    argv = CAPS + ["--offload-dir", offload_dir]
    want = _refusal(capsys, argv)
    before = sorted(os.listdir(offload_dir)) if os.path.isdir(offload_dir) else None
    p = subprocess.run([sys.executable, "-m", "flexh2o.cli.run", *argv], capture_output=True, text=True, timeout=120)
    assert (p.returncode, p.stdout, p.stderr) == (2, "", want + "\n")
    assert (sorted(os.listdir(offload_dir)) if os.path.isdir(offload_dir) else None) == before


def test_seconds_read_as_a_person_would():
    assert seconds(0.5234) == "0.523 s"
    assert seconds(95.4) == "95.4 s"
    assert seconds(19363.2) == "19,363 s (5.4 h)"
