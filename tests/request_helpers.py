"""Shared pieces of the request-job tests: a tiny OPT checkpoint whose weights are kept for a transformers
reference, a word-level tokenizer over its vocabulary, and JSONL writers."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time

import torch

from flexh2o.config import ModelConfig
from flexh2o.weights.format import CheckpointWriter

TINY = ModelConfig(name="tiny-req", family="opt", hidden=64, num_layers=2, num_heads=4, ffn=128, vocab=512,
                   max_positions=160)


def write_checkpoint(dst: str, cfg: ModelConfig = TINY, seed: int = 3) -> dict:
    """A float32 converted checkpoint of seeded normal(0, 0.1) weights; returns the weights (HF names)."""
    g = torch.Generator().manual_seed(seed)
    weights = {}
    with CheckpointWriter(dst, cfg, "float32") as w:
        for name, spec in w.specs.items():
            t = torch.randn(spec.shape, generator=g) * 0.1
            if spec.init == "ones":
                t += 1.0
            weights[name] = t
            w.add(name, t)
        w.finish()
    return weights


def write_tokenizer(path: str, vocab: int) -> str:
    """A word-level tokenizer.json: id i is the word 'w{i}' (words joined by spaces when decoded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.save(path)
    return path


def chat_model(root, template: str) -> tuple:
    """(checkpoint, tokenizer folder holding `template` as chat_template.jinja, a tokenizer folder without one)
    under the folder `root`."""
    write_checkpoint(os.path.join(root, "ckpt"))
    for name in ("tok", "plain"):
        os.makedirs(os.path.join(root, name))
        write_tokenizer(os.path.join(root, name, "tokenizer.json"), TINY.vocab)
    with open(os.path.join(root, "tok", "chat_template.jinja"), "w") as f:
        f.write(template)
    return os.path.join(root, "ckpt"), os.path.join(root, "tok"), os.path.join(root, "plain")


def write_jsonl(path, rows: list) -> str:
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def read_jsonl(path) -> list:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def kill_9_until_done(argv: list, out, rng: random.Random) -> int:
    """Run `argv` (a --resume job writing `out`) up to 8 times, the first 4 killed with SIGKILL at a random moment
    soon after the run wrote something (0-20 ms: 12 ms left a fast quiet machine no work after the first line), the
    last run to its end (exit 0 asserted); the number of kills."""
    kills = 0
    for attempt in range(8):
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        size = _size(out)
        while proc.poll() is None and _size(out) == size:
            time.sleep(0.002)
        if proc.poll() is None and attempt < 4:
            time.sleep(rng.uniform(0.0, 0.02))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            kills += 1
            continue
        assert proc.wait() == 0, proc.stderr.read()
        break
    return kills


def _size(path) -> int:
    return os.path.getsize(path) if os.path.exists(path) else 0
