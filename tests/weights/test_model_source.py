"""--model / --path given a Hugging Face folder or a .gguf file (weights/source_cache.py, cli/model_source.py):
converted once into the cache, keyed by the source's files and the options, reused by later runs; an interrupted conversion
leaves no checkpoint behind; the conversion reads one tensor at a time."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from flexh2o.config import CONFIG_FILE
from flexh2o.weights import convert as convert_module
from flexh2o.weights.format import CheckpointReader
from flexh2o.weights.source_cache import converted, is_source
from tiny_models import tiny_opt

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def hf_folder(tmp_path) -> str:
    """A tiny OPT checkpoint folder written by transformers (bfloat16 in its config)."""
    transformers = pytest.importorskip("transformers")
    cfg = tiny_opt()
    hf_cfg = transformers.OPTConfig(vocab_size=cfg.vocab, hidden_size=cfg.hidden, num_hidden_layers=cfg.num_layers,
                                    ffn_dim=cfg.ffn, num_attention_heads=cfg.num_heads,
                                    max_position_embeddings=cfg.max_positions, word_embed_proj_dim=cfg.hidden)
    torch.manual_seed(0)
    model = transformers.OPTForCausalLM(hf_cfg).to(torch.bfloat16)
    path = str(tmp_path / "hf_opt")
    model.save_pretrained(path)
    return path


def _entries(root: str) -> list:
    """What the cache holds but the lock files of its entries."""
    return sorted(f for f in os.listdir(root) if not f.endswith(".lock"))


def _env(cache: str) -> dict:
    return {**os.environ, "FLEXH2O_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}


def test_converted_once_and_reused(hf_folder, tmp_path, monkeypatch):
    root = str(tmp_path / "cache")
    calls = []
    real = convert_module.convert
    monkeypatch.setattr(convert_module, "convert", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    first, fresh = converted(hf_folder, root=root)
    assert fresh and os.path.isfile(os.path.join(first, CONFIG_FILE)) and len(calls) == 1
    assert CheckpointReader(first).dtype("model.decoder.embed_tokens.weight") == torch.bfloat16  # the config's
    again, fresh = converted(hf_folder, root=root)
    assert (again, fresh) == (first, False) and len(calls) == 1
    other, fresh = converted(hf_folder, root, "float32")  # other options: another entry
    assert fresh and other != first
    os.utime(os.path.join(hf_folder, "config.json"), ns=(1, 1))  # the source changed: converted again
    changed, fresh = converted(hf_folder, root=root)
    assert fresh and changed not in (first, other)
    assert _entries(root) == sorted(os.path.basename(p) for p in (first, other, changed))


def test_interrupted_conversion_leaves_nothing(hf_folder, tmp_path, monkeypatch):
    """A conversion that fails after some tensors are written leaves no checkpoint (and no staging) in the cache;
    the next call converts from scratch."""
    from flexh2o.weights import format as fmt
    root = str(tmp_path / "cache")
    real_add, seen = fmt.CheckpointWriter.add, []

    def failing_add(self, name, tensor):
        seen.append(name)
        if len(seen) == 3:
            raise KeyboardInterrupt
        real_add(self, name, tensor)
    monkeypatch.setattr(fmt.CheckpointWriter, "add", failing_add)
    with pytest.raises(KeyboardInterrupt):
        converted(hf_folder, root=root)
    assert _entries(root) == []
    monkeypatch.setattr(fmt.CheckpointWriter, "add", real_add)
    path, fresh = converted(hf_folder, root=root)
    assert fresh and CheckpointReader(path).names()


def test_one_tensor_at_a_time(hf_folder, tmp_path, monkeypatch):
    """The writer receives tensors one by one from a generator: when each is written, the source has not produced
    the next (no tensor of the source is read ahead)."""
    from flexh2o.weights import format as fmt
    produced, written, real_add, real_read = [], [], fmt.CheckpointWriter.add, convert_module._read_file

    def reading(path):
        for key, t in real_read(path):
            produced.append(key)
            yield key, t
    monkeypatch.setattr(convert_module, "_read_file", reading)
    monkeypatch.setattr(fmt.CheckpointWriter, "add",
                        lambda self, name, t: written.append(len(produced)) or real_add(self, name, t))
    converted(hf_folder, root=str(tmp_path / "cache"))
    assert written == sorted(written) and len(set(written)) == len(written)  # one new source tensor per write


def test_is_source(hf_folder, tmp_path):
    assert is_source(hf_folder) and not is_source(str(tmp_path)) and not is_source("opt-125m")
    assert not is_source(str(tmp_path / "missing.gguf"))


def test_run_with_model_folder(hf_folder, tmp_path):
    """flexh2o-run --model FOLDER converts once (the note on stderr says so), and the second run reuses it; the
    generated tokens equal those of --path on a flexh2o-convert of the same folder."""
    cache, out = str(tmp_path / "cache"), [str(tmp_path / f"out{i}.json") for i in range(3)]
    args = ["--percent", "100", "0", "100", "0", "--prompt-len", "8", "--gen-len", "4", "--gpu-batch-size", "2",
            "--dtype", "float32", "--no-warmup", "--no-log", "--verbose", "0"]
    runs = []
    for i in range(2):
        runs.append(subprocess.run([sys.executable, "-m", "flexh2o.cli", "--model", hf_folder, *args,
                                    "--output-file", out[i]], env=_env(cache), capture_output=True, text=True,
                                   timeout=300))
        assert runs[-1].returncode == 0, runs[-1].stderr
    assert "converted once into" in runs[0].stderr and "already converted" in runs[1].stderr
    ref = str(tmp_path / "ref")
    subprocess.run([sys.executable, "-m", "flexh2o.cli.convert", hf_folder, ref, "--dtype", "bfloat16"],
                   check=True, capture_output=True, env=_env(cache), timeout=300)
    done = subprocess.run([sys.executable, "-m", "flexh2o.cli", "--path", ref, *args, "--output-file", out[2]],
                          env=_env(cache), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    tokens = [json.load(open(p)) for p in out]
    assert tokens[0] == tokens[1] == tokens[2]


def test_bad_model_paths(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for model, says in ((str(empty), "no config.json"), (str(tmp_path / "x.gguf"), "does not exist")):
        done = subprocess.run([sys.executable, "-m", "flexh2o.cli", "--model", model, "--dry-run"],
                              env=_env(str(tmp_path / "c")), capture_output=True, text=True, timeout=300)
        assert done.returncode == 2 and says in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_source_is_the_tokenizer_unless_one_is_given(hf_folder, tmp_path, monkeypatch):
    """A .gguf holds its vocabulary and a folder with tokenizer.json its tokenizer: --model on either tokenizes text
    prompts without --tokenizer (as the API does); a given --tokenizer stays; a folder without one gets none."""
    import argparse
    from flexh2o.cli.model_source import resolve_source
    from tiny_gguf import write_tiny_gguf
    monkeypatch.setenv("FLEXH2O_CACHE_DIR", str(tmp_path / "cache"))
    gguf = write_tiny_gguf(str(tmp_path / "tiny.gguf"))

    def resolved(model, tokenizer=None):
        args = argparse.Namespace(model=model, path="_DUMMY_", tokenizer=tokenizer)
        resolve_source(args, "test")
        return args.tokenizer
    assert resolved(gguf) == gguf
    assert resolved(gguf, "mine.json") == "mine.json"
    assert resolved(hf_folder) is None
    open(os.path.join(hf_folder, "tokenizer.json"), "w").close()
    assert resolved(hf_folder) == hf_folder
