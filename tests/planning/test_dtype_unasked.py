"""No precision is given away unasked (planning/dtype_choice.py): an explicit --dtype X without --compute-dtype
computes in X or fp32, even where the probe finds another dtype much faster, and a note names the faster pair;
auto for both may still pick a 16-bit compute dtype."""
from __future__ import annotations

import json

import pytest
import torch

from flexh2o.cli import run as cli
from flexh2o.planning import dtype_choice
from test_dtype_choice import rc_for, timings

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
NAMES = {F32: "float32", BF16: "bfloat16", F16: "float16"}


def _choose(dtype, compute, fast):
    return dtype_choice.choose_dtypes(rc_for(), dtype, compute, probe=lambda: (timings(fast, slow=8.0), True))


@pytest.mark.parametrize("fast", ["bfloat16", "float16"])
def test_float32_storage_computes_in_float32(fast):
    got = _choose("float32", "auto", fast)
    assert (got.dtype, got.compute, got.decode) == (F32, F32, None)
    assert got.note and f"--compute-dtype {fast}" in got.note  # the faster pair is still named


@pytest.mark.parametrize("fast", ["bfloat16", "float16", "float32"])
def test_bfloat16_storage_computes_in_itself_or_wider(fast):
    got = _choose("bfloat16", None, fast)
    assert got.dtype == BF16 and got.decode in (None, BF16) and got.compute in (BF16, F32)  # never fp16
    if fast != "float16":  # the fastest allowed (with fp16 fastest, bf16 and fp32 tie)
        assert got.compute == {"bfloat16": BF16, "float32": F32}[fast]


@pytest.mark.parametrize("fast", ["bfloat16", "float16", "float32"])
def test_float16_storage_computes_in_float32(fast):
    got = _choose("float16", "auto", fast)
    assert (got.dtype, got.compute, got.decode) == (F16, F32, None)


@pytest.mark.parametrize("fast", ["bfloat16", "float16"])
def test_auto_for_both_may_pick_16_bits(fast):
    got = _choose("auto", "auto", fast)
    assert got.compute == {"bfloat16": BF16, "float16": F16}[fast] and got.note is None


def test_cli_dtype_float32_alone_runs_in_float32(tmp_path, monkeypatch, capsys):
    """The run's record: --dtype float32 on a machine whose probe finds bf16 8x faster computes in float32."""
    monkeypatch.setattr(dtype_choice, "cached_probe", lambda: (timings("bfloat16", slow=8.0), True))
    log = tmp_path / "log.jsonl"
    argv = ["--model", "opt-125m", "--percent", "0", "100", "100", "0", "--gpu-batch-size", "2", "--prompt-len", "8",
            "--gen-len", "2", "--no-warmup", "--log-file", str(log), "--dtype", "float32"]
    assert cli.main(argv) == 0
    rec = json.loads(log.read_text())
    assert rec["policy"]["dtype"] == rec["policy"]["compute_dtype"] == "float32"
    assert "note: --dtype float32 --compute-dtype float32 is about" in capsys.readouterr().err
