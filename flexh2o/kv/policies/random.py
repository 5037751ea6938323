"""`random`: a control. Keeps `heavy` tokens chosen at random (seeded) plus the protected `recent` window.

The random key of a token is a hash of (seed, layer, KV head, position), so the choice does not depend on batching.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from flexh2o.kv.policies.base import KVPolicy

if TYPE_CHECKING:  # torch is imported where a tensor is made: the flags' parser reads the policies without it
    import torch


def random_key(seed: int, layer: int, pos: torch.Tensor) -> torch.Tensor:
    """Float key in [0, 1) per slot of pos (b, h, s), a pure function of (seed, layer, head, position)."""
    import torch
    head = torch.arange(pos.shape[1], device=pos.device).view(1, -1, 1)
    x = (pos * 2654435761 + head * 40503 + layer * 97 + seed * 1000003) % 2147483647
    x = (x * 48271) % 2147483647
    x = (x * 48271) % 2147483647
    return x.double() / 2147483647.0


class RandomPolicy(KVPolicy):
    name = "random"
    windowed = True

    def priority(self, pos, score, layer, cur_pos, obs):
        return random_key(self.seed, layer, pos)
