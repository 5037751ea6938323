"""A refused run names, in its one-line error, a placement and batch that fit (from the policy search), and that
suggestion really fits."""
from __future__ import annotations

import re

import torch

from flexh2o.cli import run as cli

# opt-125m's weights in fp16 (239 MiB) overflow a 240 MB gpu tier by themselves (280 MB fits them since their fp32
# compute-side buffers shrank to one 8 MiB chunk: matmul weights converted on use, weights/on_use.py); with some
# of them on cpu they fit
CAPS = ["--model", "opt-125m", "--prompt-len", "16", "--gen-len", "2", "--dtype", "float16", "--compute-dtype",
        "float32", "--gpu-mem", "240MB", "--cpu-mem", "100MB", "--disk-mem", "2GB", "--no-warmup"]


def test_refusal_names_a_placement_that_fits(capsys, offload_dir):
    assert cli.main(CAPS + ["--percent", "100", "0", "100", "0", "--offload-dir", offload_dir]) == 2
    err = capsys.readouterr().err
    # without a GPU the gpu tier is named as what it is, the host memory computed in (its flag stays --gpu-mem)
    tier = "gpu tier" if torch.cuda.is_available() else "compute memory (host memory, --gpu-mem)"
    assert err.count("\n") == 1 and f"{tier} needs" in err and "This fits here: --percent" in err, err
    assert torch.cuda.is_available() or "gpu tier" not in err
    m = re.search(r"--percent ((?:\d+ ){5}\d+) --gpu-batch-size (\d+) --num-gpu-batches (\d+)", err)
    assert m, err
    fix = ["--percent", *m.group(1).split(), "--gpu-batch-size", m.group(2), "--num-gpu-batches", m.group(3)]
    assert cli.main(CAPS + fix + ["--offload-dir", offload_dir, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "\nfits\n" in out
