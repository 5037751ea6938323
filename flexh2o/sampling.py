"""Next-token choice: greedy by default; temperature and top-p sampling with a seeded generator."""
from __future__ import annotations

import torch


class Sampler:
    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0):
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError(f"--temperature must be >= 0 and --top-p in (0, 1] (got {temperature}, {top_p})")
        self.temperature, self.top_p = temperature, top_p
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (b, vocab) fp32 on CPU -> token ids (b,)."""
        if self.temperature == 0:
            return logits.argmax(-1)
        probs = (logits / self.temperature).softmax(-1)
        if self.top_p < 1:
            sorted_p, idx = probs.sort(-1, descending=True)
            drop = sorted_p.cumsum(-1) - sorted_p > self.top_p  # keep the smallest set reaching top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
        return torch.multinomial(probs, 1, generator=self.gen)[:, 0]
