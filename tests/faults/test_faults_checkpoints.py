"""Fault injection in checkpoints: a corrupted tensor file refused naming it, NaN/Inf weights and an
all-0xFF safetensors refused at conversion, and convert's staging dirs after SIGTERM and kill -9. Each case ends in
exit 0, or in one line and exit 2 (128 + signal for SIGTERM), and nothing is left under --offload-dir or beside a
convert's DST. Full disks, signals and run-dir locks: tests/faults/test_faults.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from flexh2o.cli import convert as convert_cli
from flexh2o.cli import run as cli
from tiny_models import tiny_opt
from test_faults import ENV, _argv, _leftovers, _one_line, ckpt  # noqa: F401 (ckpt: a module fixture)


@pytest.mark.parametrize("damage", ["flip", "nan"])
def test_corrupted_tensor_file_refused_naming_it(capsys, ckpt, tmp_path, damage):
    import shutil
    bad = str(tmp_path / "bad")
    shutil.copytree(ckpt, bad)
    index = json.load(open(os.path.join(bad, "index.json")))
    entry = index["tensors"]["model.decoder.layers.0.fc1.weight"]
    path = os.path.join(bad, "tensors", entry["file"])
    data = bytearray(open(path, "rb").read())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        data[:] = torch.full((len(data) // 4,), float("nan")).numpy().tobytes()
    open(path, "wb").write(bytes(data))  # same size: only the checksum can tell
    off = tmp_path / "off"
    assert cli.main(_argv(bad, off)) == 2
    err = _one_line(capsys.readouterr().err)
    assert path in err and "checksum" in err and "flexh2o-convert" in err, err
    assert _leftovers(off) == []


def test_nan_weights_refused_at_conversion(tmp_path):
    from flexh2o.weights.format import CheckpointWriter
    cfg = tiny_opt()
    with pytest.raises(ValueError, match="NaN/Inf"):
        with CheckpointWriter(str(tmp_path / "c"), cfg, "float32") as w:
            name, spec = next(iter(w.specs.items()))
            w.add(name, torch.full(spec.shape, float("nan")))
    with pytest.raises(ValueError, match="overflow float16.*--dtype bfloat16"):
        with CheckpointWriter(str(tmp_path / "c"), cfg, "float16") as w:
            name, spec = next(iter(w.specs.items()))
            w.add(name, torch.full(spec.shape, 1e6))
    assert os.listdir(tmp_path) == []


HF_OPT = {"model_type": "opt", "hidden_size": 16, "ffn_dim": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
          "vocab_size": 64, "max_position_embeddings": 32}


def _hf_folder(src, fill=None) -> None:
    """A tiny HF OPT folder (config.json + model.safetensors) written without transformers; `fill` (a byte) sets
    every byte of every tensor."""
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file
    from flexh2o.weights.hf_config import from_hf_config
    from flexh2o.models import unique_specs
    os.makedirs(src)
    json.dump(HF_OPT, open(os.path.join(src, "config.json"), "w"))
    g = torch.Generator().manual_seed(0)
    sd = {}
    for name, spec in unique_specs(from_hf_config(HF_OPT)).items():
        t = torch.randn(spec.shape, generator=g) * 0.02
        if fill is not None:
            t = torch.frombuffer(bytearray(bytes([fill]) * t.numel() * 4), dtype=torch.float32).view(spec.shape)
        sd[name] = t
    save_file(sd, os.path.join(src, "model.safetensors"))


def test_all_0xff_safetensors_refused(capsys, tmp_path):
    src = tmp_path / "src"
    _hf_folder(str(src), fill=0xFF)
    assert convert_cli.main([str(src), str(tmp_path / "dst")]) == 2
    err = _one_line(capsys.readouterr().err, "flexh2o-convert: error: ")
    assert "NaN/Inf" in err and "model.safetensors" in err, err
    assert sorted(os.listdir(tmp_path)) == ["src"]


KILLED_WRITER = textwrap.dedent("""
    import os, signal, sys, torch
    from flexh2o.config import ModelConfig
    from flexh2o.weights.format import CheckpointWriter
    cfg = ModelConfig(**{k: int(v) if v.isdigit() else v for k, v in (a.split("=") for a in sys.argv[2:])})
    w = CheckpointWriter(sys.argv[1], cfg, "float32")
    name, spec = next(iter(w.specs.items()))
    w.add(name, torch.zeros(spec.shape))
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_convert_sigterm_and_kill_9_leave_no_staging_dir(capsys, monkeypatch, tmp_path):
    from flexh2o.weights import format as fmt
    src, dst = tmp_path / "src", tmp_path / "dst"
    _hf_folder(str(src))
    real_add, n = fmt.CheckpointWriter.add, [0]

    def add(self, name, tensor):
        n[0] += 1
        if n[0] == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_add(self, name, tensor)
    monkeypatch.setattr(fmt.CheckpointWriter, "add", add)
    capsys.readouterr()
    assert convert_cli.main([str(src), str(dst)]) == 128 + signal.SIGTERM
    assert capsys.readouterr().err.strip() == "flexh2o-convert: interrupted; nothing written (SIGTERM)"
    assert sorted(os.listdir(tmp_path)) == ["src"]
    monkeypatch.undo()
    c = tiny_opt()
    fields = [f"{k}={getattr(c, k)}" for k in ("name", "family", "hidden", "num_layers", "num_heads", "ffn", "vocab")]
    r = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(dst), *fields], env=ENV, timeout=120)
    assert r.returncode == -signal.SIGKILL
    left = [n for n in os.listdir(tmp_path) if n.startswith(".dst.partial-")]
    assert len(left) == 1  # kill -9 leaves the staging dir; its lock died with the process
    assert convert_cli.main([str(src), str(dst)]) == 0
    assert f"removed {tmp_path / left[0]} left by an interrupted convert" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["dst", "src"] and ".lock" not in os.listdir(dst)
