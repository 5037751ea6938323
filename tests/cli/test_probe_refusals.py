"""Values accepted silently before 2026-12-02 (d9d5840), and messages that did not name the flag. Each is one line
naming the flag, exit status 2, before anything is loaded or written."""
from __future__ import annotations

import json

import pytest

from flexh2o.cli import eval as eval_cli
from flexh2o.cli import plan as plan_cli
from flexh2o.cli import run as cli
from test_validation import _fails
from tiny_models import tiny_opt, write_tiny_checkpoint

DRY = ["--model", "opt-125m", "--prompt-len", "8", "--gen-len", "2", "--dry-run"]


@pytest.mark.parametrize("flag", ["--gpu-batch-size", "--model"])
def test_empty_values_refused(capsys, tmp_path, flag):
    _fails(capsys, cli.main, DRY + ["--offload-dir", str(tmp_path), flag, ""], f"{flag} is empty")


@pytest.mark.parametrize("profile,field", [({}, "matmul_flops"),
                                           ({"matmul_flops": "fast", "cpu_mem_bw": 1e10}, "matmul_flops"),
                                           ({"matmul_flops": 1e11, "cpu_mem_bw": [1]}, "cpu_mem_bw"),
                                           ({"matmul_flops": {"float32": None}, "cpu_mem_bw": 1e10}, "matmul_flops"),
                                           ({"matmul_flops": 1e11, "cpu_mem_bw": 1e10, "disk_read_bw": True},
                                            "disk_read_bw"),
                                           ({"matmul_flops": 1e11, "cpu_mem_bw": 1e10,
                                             "matmul_flops_by_rows": {"float32": {"x": 1}}}, "matmul_flops_by_rows")])
def test_hardware_file_with_missing_or_wrong_typed_fields(capsys, tmp_path, profile, field):
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(profile))
    _fails(capsys, cli.main, DRY + ["--offload-dir", str(tmp_path / "off"), "--hardware", str(path)],
           f"--hardware {path}: {field}")


def test_offload_dir_under_proc(capsys):
    _fails(capsys, cli.main, DRY + ["--offload-dir", "/proc/flexh2o"], "--offload-dir /proc/flexh2o", "/proc")


def test_converted_config_whose_vocab_does_not_match_its_tensors(capsys, tmp_path):
    ckpt = write_tiny_checkpoint(str(tmp_path / "ckpt"), tiny_opt(vocab=256))
    conf = tmp_path / "ckpt" / "flexh2o_config.json"
    d = json.loads(conf.read_text())
    d["vocab"] = 300
    conf.write_text(json.dumps(d))
    _fails(capsys, cli.main, ["--path", ckpt, "--prompt-len", "4", "--gen-len", "2", "--offload-dir",
                              str(tmp_path / "off")], f"--path {ckpt}", "embed_tokens", "300")


def test_plan_step_names_the_flag(capsys):
    _fails(capsys, plan_cli.main, ["--model", "opt-125m", "--hardware", "cpu_measured", "--step", "0"],
           "--step 0", prog="flexh2o-plan")


@pytest.mark.parametrize("argv,needle", [(["ppl", "--budgets", ","], "--budgets"),
                                         (["recall", "--budgets", " , "], "--budgets"),
                                         (["ppl", "--lane-mem", "nan"], "--lane-mem nan"),
                                         (["ppl", "--lane-mem", "0"], "--lane-mem 0"),
                                         (["ppl", "--separate", "--lane-mem", "1"], "--separate"),
                                         (["ppl", "--seed", "5", "--policies", "h2o,tova"], "--seed 5"),
                                         (["ppl", "--out", "/nonexistent-dir/r.json"], "--out /nonexistent-dir")])
def test_eval_values_refused_before_loading(capsys, monkeypatch, argv, needle):
    from flexh2o.eval import common
    monkeypatch.setattr(common, "load_model", None)  # nothing may be loaded
    _fails(capsys, eval_cli.main, argv, needle, prog="flexh2o-eval")
