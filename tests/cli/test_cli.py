"""flexh2o-run: a real run, and every bad input ends in one line on stderr, exit status 2, nothing left behind."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from flexh2o.cli import run as cli

# the gpu tier's refusal: without a GPU named as the host memory computed in (its flag stays --gpu-mem)
GPU_TIER_NEEDS = "gpu tier needs" if torch.cuda.is_available() else "compute memory (host memory, --gpu-mem) needs"
SMALL = ["--model", "opt-125m", "--prompt-len", "8", "--gen-len", "3", "--gpu-batch-size", "2", "--dtype",
         "bfloat16", "--no-warmup"]


def _fails(capsys, argv, *needles):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("flexh2o-run: error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, err
    return err


@pytest.mark.parametrize("percent,needle", [
    (["100", "0", "100"], "4 or 6 integers"),
    (["100", "0", "100", "0", "100"], "4 or 6 integers"),
    (["-10", "0", "100", "0"], "weights"),
    (["60", "50", "100", "0"], "weights is 60 50"),
    (["100", "0", "70", "40"], "cache is 70 40"),
    (["100", "0", "100", "0", "80", "30"], "activations"),
    (["a", "0", "100", "0"], "integers"),
])
def test_bad_percent(capsys, offload_dir, percent, needle):
    _fails(capsys, SMALL + ["--percent", *percent, "--offload-dir", offload_dir], "--percent", needle)


def test_unknown_model(capsys):
    _fails(capsys, ["--model", "opt-7b"], "unknown model 'opt-7b'", "opt-6.7b")


def test_facebook_prefix_accepted(capsys):
    assert cli.main(["--model", "facebook/opt-125m", "--dry-run", "--prompt-len", "8", "--gen-len", "2"]) == 0
    assert "opt-125m" in capsys.readouterr().out


def test_missing_weights(capsys, tmp_path):
    _fails(capsys, ["--path", str(tmp_path / "nope")], "not a converted checkpoint", "flexh2o-convert")


def test_corrupt_checkpoint_config(capsys, tmp_path):
    (tmp_path / "flexh2o_config.json").write_text("{not json")
    _fails(capsys, ["--path", str(tmp_path)], "flexh2o_config.json", "corrupt")


def test_unwritable_offload_dir(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    _fails(capsys, SMALL + ["--percent", "0", "0", "0", "0", "--offload-dir", str(blocker / "sub")],
           "--offload-dir", "writable")


def test_positions_beyond_model(capsys):
    _fails(capsys, ["--model", "opt-125m", "--prompt-len", "2000", "--gen-len", "100"], "2048 positions")


def test_batch_that_does_not_fit(capsys, offload_dir):
    err = _fails(capsys, SMALL + ["--gpu-mem", "1MB", "--offload-dir", offload_dir], GPU_TIER_NEEDS, "--gpu-mem")
    assert "1.0 MiB" in err


def test_bad_sizes_and_flags(capsys):
    _fails(capsys, SMALL + ["--gpu-mem", "lots"], "lots", "16GB")
    _fails(capsys, SMALL + ["--gpu-batch-size", "0"], "--gpu-batch-size")
    _fails(capsys, SMALL + ["--no-such-flag"], "unrecognized arguments")
    _fails(capsys, SMALL + ["--kv-policy", "h2o"], "needs a budget")
    _fails(capsys, SMALL + ["--dtype", "int8"], "unknown dtype")
    _fails(capsys, SMALL + ["--top-p", "0"], "--top-p")
    _fails(capsys, SMALL + ["--top-p", "0.9"], "--top-p 0.9 is unused", "temperature > 0")


def test_bad_prompt_files(capsys, tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text("[[1, 2], []]")
    _fails(capsys, SMALL + ["--prompt-file", str(bad)], str(bad), "non-empty")
    bad.write_text("[[1, 99999999]]")
    _fails(capsys, SMALL + ["--prompt-file", str(bad)], "outside the vocabulary")
    txt = tmp_path / "p.txt"
    txt.write_text("hello\n")
    _fails(capsys, SMALL + ["--prompt-file", str(txt)], "--tokenizer")
    _fails(capsys, SMALL + ["--prompt-file", str(tmp_path / "missing.json")], "does not exist")


def test_run_writes_outputs_and_log(capsys, tmp_path, offload_dir):
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([[5, 6, 7, 8], [9, 10]]))
    out, log = tmp_path / "out.json", tmp_path / "log.jsonl"
    argv = SMALL + ["--percent", "0", "50", "50", "0", "--prompt-file", str(prompts), "--output-file", str(out),
                    "--log-file", str(log), "--offload-dir", offload_dir, "--kv-policy", "h2o", "--kv-budget", "4"]
    assert cli.main(argv) == 0
    rows = json.loads(out.read_text())
    assert len(rows) == 2 and all(len(r["tokens"]) == 3 for r in rows)
    rec = json.loads(log.read_text().splitlines()[0])
    assert rec["num_seqs"] == 2 and rec["gen_len"] == 3 and rec["policy"]["kv_policy"] == "h2o"
    assert rec["total_throughput"] > 0 and rec["peak_bytes"]["disk"] > 0
    assert "total" in capsys.readouterr().out


def test_interrupt_cleans_offload_files(capsys, monkeypatch, offload_dir):
    from flexh2o import engine

    def boom(self, op):
        raise KeyboardInterrupt
    monkeypatch.setattr(engine._Run, "compute", boom)
    assert cli.main(SMALL + ["--percent", "0", "0", "0", "0", "--offload-dir", offload_dir]) == 130
    assert "interrupted" in capsys.readouterr().err
    assert os.listdir(offload_dir) == []


def test_console_script_exit_status(tmp_path):
    """The installed entry point: exit 2 and one line, no traceback (a real process)."""
    r = subprocess.run([sys.executable, "-m", "flexh2o.cli", "--percent", "1", "2"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--percent" in r.stderr


# slow: a policy search and a real opt-125m run in bf16; --policy auto's line and refusals: the tests below
@pytest.mark.slow
def test_policy_auto_and_predictions(capsys, tmp_path, offload_dir):
    log = tmp_path / "log.jsonl"
    argv = ["--model", "opt-125m", "--prompt-len", "16", "--gen-len", "3", "--dtype", "bfloat16", "--no-warmup",
            "--policy", "auto", "--gpu-mem", "200MB", "--cpu-mem", "300MB", "--disk-mem", "2GB",
            "--offload-dir", offload_dir, "--hardware",
            os.path.join(os.path.abspath(os.path.join(__file__, "../../..")), "flexh2o", "configs", "hardware",
                         "cpu_measured.json"), "--log-file", str(log)]
    assert cli.main(argv + ["--dry-run"]) == 0
    out = capsys.readouterr()
    assert "--policy auto: flexh2o-run --model opt-125m --percent" in out.err and "predicted" in out.out
    assert cli.main(argv) == 0
    rec = json.loads(log.read_text())
    assert rec["predicted"]["total_throughput"] > 0 and rec["total_ratio_measured_to_predicted"] > 0


def test_policy_auto_needs_a_profile(capsys):
    _fails(capsys, SMALL + ["--policy", "auto", "--hardware", "/nonexistent.json"], "nonexistent")


def test_prediction_is_advisory(capsys):
    """A named profile that lacks the compute dtype warns (only this machine's auto profile gets a missing dtype
    measured); the run (here a dry run) still goes ahead."""
    assert cli.main(["--model", "opt-125m", "--prompt-len", "8", "--gen-len", "2", "--compute-dtype", "float16",
                     "--hardware", "cpu_measured", "--dry-run"]) == 0
    assert "warning: no prediction" in capsys.readouterr().err


@pytest.mark.parametrize("module,prog", [("flexh2o.cli.run", "flexh2o-run"),
                                         ("flexh2o.cli.convert", "flexh2o-convert"),
                                         ("flexh2o.cli.plan", "flexh2o-plan"),
                                         ("flexh2o.cli.profile", "flexh2o-profile"),
                                         ("flexh2o.cli.eval", "flexh2o-eval")])
def test_every_script_reports_a_bad_flag_in_one_line(capsys, module, prog):
    import importlib
    assert importlib.import_module(module).main(["--no-such-flag"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"{prog}: error: "), err


def test_read_json_errors_are_one_line_naming_file_and_fix(tmp_path):
    from flexh2o.jsonfile import read_json
    bad, wrong, missing = tmp_path / "bad.json", tmp_path / "list.json", tmp_path / "none.json"
    bad.write_text("{not json\n")
    wrong.write_text("[1, 2]")
    for path, what in ((bad, "is corrupt (not valid JSON"), (wrong, "does not hold a JSON dict"),
                       (missing, "cannot be read (No such file")):
        with pytest.raises(ValueError) as e:
            read_json(str(path), "do X", dict)
        msg = str(e.value)
        assert msg.startswith(str(path)) and what in msg and msg.endswith(": do X") and "\n" not in msg
    assert read_json(str(wrong), "do X", list) == [1, 2]


def test_max_seqs_needs_policy_auto_and_a_positive_count(capsys):
    _fails(capsys, SMALL + ["--max-seqs", "4"], "--max-seqs", "--policy auto")
    _fails(capsys, SMALL + ["--policy", "auto", "--max-seqs", "0"], "--max-seqs")
