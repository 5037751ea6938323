"""A refused run names, in its one-line error, a placement and batch that fit (from the policy search), and that
suggestion really fits."""
from __future__ import annotations

import re

from flexh2o.cli import run as cli

CAPS = ["--model", "opt-125m", "--prompt-len", "16", "--gen-len", "2", "--dtype", "float16", "--compute-dtype",
        "float32", "--gpu-mem", "400MB", "--cpu-mem", "100MB", "--disk-mem", "2GB", "--no-warmup"]


def test_refusal_names_a_placement_that_fits(capsys, offload_dir):
    assert cli.main(CAPS + ["--percent", "100", "0", "100", "0", "--offload-dir", offload_dir]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "gpu tier needs" in err and "This fits here: --percent" in err
    m = re.search(r"--percent ((?:\d+ ){5}\d+) --gpu-batch-size (\d+) --num-gpu-batches (\d+)", err)
    assert m, err
    fix = ["--percent", *m.group(1).split(), "--gpu-batch-size", m.group(2), "--num-gpu-batches", m.group(3)]
    assert cli.main(CAPS + fix + ["--offload-dir", offload_dir, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "\nfits\n" in out
