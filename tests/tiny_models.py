"""A tiny seeded converted checkpoint written straight through CheckpointWriter (no transformers needed)."""
from __future__ import annotations

import os

import torch

from flexh2o.config import ModelConfig
from flexh2o.weights.format import CheckpointWriter


def tiny_opt(vocab: int = 512, hidden: int = 16, num_layers: int = 2, max_positions: int = 128) -> ModelConfig:
    return ModelConfig(name="tiny-opt", family="opt", hidden=hidden, num_layers=num_layers, num_heads=2,
                       ffn=2 * hidden, vocab=vocab, max_positions=max_positions)


def write_tiny_checkpoint(dst: str, cfg: ModelConfig = None, dtype: str = "float32", seed: int = 0) -> str:
    """A converted checkpoint of `cfg` (default tiny_opt()) with seeded normal(0, 0.02) weights (norm scales 1)."""
    cfg = cfg or tiny_opt()
    g = torch.Generator().manual_seed(seed)
    with CheckpointWriter(dst, cfg, dtype) as w:
        for name, spec in w.specs.items():
            t = torch.randn(spec.shape, generator=g) * 0.02
            if spec.init == "ones":
                t += 1.0
            w.add(name, t)
        w.finish()
    return os.path.abspath(dst)
