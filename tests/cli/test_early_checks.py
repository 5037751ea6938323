"""Every CLI checks its arguments before long work: flexh2o-profile its --output and --offload-dir (writable, room
for the disk measurement) before measuring, and its errors name only flags it has; flexh2o-eval its output paths
before loading a model; flexh2o-plan its model and flags before measuring a profile."""
from __future__ import annotations

import re

import pytest

from flexh2o.cli import profile
from flexh2o.storage.base import TierFullError
from flexh2o.tuning import measure as measure_module  # what flexh2o-profile calls (imported where it runs)


def _flags() -> set:
    return {s for a in profile.build_parser()._actions for s in a.option_strings}


@pytest.fixture
def no_measuring(monkeypatch):
    def measure(*args, **kwargs):
        raise AssertionError("measured before checking the arguments")
    monkeypatch.setattr(measure_module, "measure", measure)


def _error(capsys, argv) -> str:
    assert profile.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("flexh2o-profile: error: "), err
    unknown = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", err[0])) - _flags()
    assert not unknown, f"names flags flexh2o-profile does not have: {unknown}: {err[0]}"
    return err[0]


def test_output_in_a_missing_directory_is_refused_before_measuring(capsys, tmp_path, no_measuring):
    line = _error(capsys, ["--quick", "--no-disk", "--output", str(tmp_path / "missing" / "p.json")])
    assert "--output" in line and "does not exist" in line


def test_output_that_is_a_directory_is_refused_before_measuring(capsys, tmp_path, no_measuring):
    assert "--output" in _error(capsys, ["--quick", "--no-disk", "--output", str(tmp_path)])


def test_an_offload_dir_under_a_file_is_refused_before_measuring(capsys, tmp_path, no_measuring):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    line = _error(capsys, ["--quick", "--offload-dir", str(blocker / "sub")])
    assert "--offload-dir" in line and "writable" in line
    assert blocker.read_text() == "x"


def test_too_little_free_space_is_refused_before_measuring(capsys, tmp_path, monkeypatch, no_measuring):
    import flexh2o.storage.offload_dir as offload_dir
    monkeypatch.setattr(offload_dir, "free_disk_bytes", lambda path: 1 << 20)
    line = _error(capsys, ["--quick", "--offload-dir", str(tmp_path / "off")])
    assert "--offload-dir" in line and "1.0 MiB free" in line and "--no-disk" in line
    assert list((tmp_path / "off").iterdir()) == []  # the trial run directory is gone


def test_a_disk_that_fills_during_the_measurement_names_only_the_profilers_flags(capsys, tmp_path, monkeypatch):
    def full(*args, **kwargs):  # what the disk tier raises (its text names flexh2o-run's --disk-mem, --percent)
        raise TierFullError("disk tier: no space left ... asked for up to 1 (--disk-mem) ... move --percent")
    monkeypatch.setattr(measure_module, "measure", full)
    line = _error(capsys, ["--quick", "--offload-dir", str(tmp_path / "off")])
    assert "--disk-mem" not in line and "--percent" not in line and "--no-disk" in line



def test_eval_checks_its_output_paths_before_loading_a_model(capsys, tmp_path, monkeypatch):
    from flexh2o.cli import eval as cli_eval
    import flexh2o.eval.common as common

    def load(*args, **kwargs):
        raise AssertionError("loaded the model before checking the arguments")
    monkeypatch.setattr(common, "load_model", load)
    for flag in ("--out", "--plot"):
        argv = ["ppl", "--dtype", "float32", flag, str(tmp_path / "missing" / "x")]
        assert cli_eval.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and flag in err[0] and "does not exist" in err[0], err


def test_plan_checks_the_model_before_measuring_a_profile(capsys, monkeypatch):
    from flexh2o.cli import plan
    import flexh2o.tuning.profile_cache as profile_cache

    def auto(*args, **kwargs):
        raise AssertionError("measured before checking the arguments")
    monkeypatch.setattr(profile_cache, "auto_profile", auto)
    for bad, needle in ((["--model", "opt-999m"], "unknown model"), (["--model", "opt-125m", "--top", "0"], "--top"),
                        (["--model", "opt-125m", "--hh-ratio", "2"], "--hh-ratio")):
        assert plan.main(bad + ["--hardware", "auto"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err
