"""Pieces shared by model families: weight specs and small tensor helpers."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WeightSpec:
    """One weight tensor: its Hugging Face state-dict name, shape, and how dummy weights initialise it."""

    name: str
    shape: tuple
    init: str = "normal"  # "normal" (std 0.02), "ones" (norm scales, with small noise), "zeros" (biases, small noise)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(b, t, n*d) -> (b, n, t, d)"""
    b, t, _ = x.shape
    return x.view(b, t, num_heads, -1).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(b, n, t, d) -> (b, t, n*d)"""
    b, n, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, n * d)
