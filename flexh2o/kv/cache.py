"""KV cache blocks, one per (layer, GPU batch), each kept in its home tier.

A block holds, per sequence and KV head, `slots` cached tokens. Slots are unordered: `pos` says which token
a slot holds (-1 = empty), so eviction frees a slot and the next token is written into it in place.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

FIELDS = ("k", "v", "pos", "score")


@dataclass
class KVBlock:
    """One block on the compute side.

    k, v: (b, kv_heads, slots, head_dim); pos int64 and score fp32: (b, kv_heads, slots).
    """

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor
    score: torch.Tensor

    @staticmethod
    def empty(b: int, heads: int, slots: int, head_dim: int, dtype: torch.dtype, device) -> "KVBlock":
        return KVBlock(torch.zeros(b, heads, slots, head_dim, dtype=dtype, device=device),
                       torch.zeros(b, heads, slots, head_dim, dtype=dtype, device=device),
                       torch.full((b, heads, slots), -1, dtype=torch.int64, device=device),
                       torch.zeros(b, heads, slots, dtype=torch.float32, device=device))

    def rows(self, sl: slice) -> "KVBlock":
        """A view of some sequences of the block."""
        return KVBlock(self.k[sl], self.v[sl], self.pos[sl], self.score[sl])

    def kept(self) -> torch.Tensor:
        """(b, kv_heads): tokens held per row."""
        return (self.pos >= 0).sum(-1)


class KVCache:
    """Home storage of every block: `homes[layer][batch]` names the tier; `tiers` maps names to Tier objects."""

    def __init__(self, tiers: dict, homes: list, b: int, heads: int, slots: int, head_dim: int, dtype: torch.dtype):
        self.tiers, self.homes = tiers, homes
        self.shape = (b, heads, slots, head_dim)
        self.dtype = dtype
        self.handles = {}
        for layer, row in enumerate(homes):
            for batch, tier in enumerate(row):
                self.handles[layer, batch] = self._alloc(tiers[tier])

    def _alloc(self, tier) -> dict:
        b, h, s, d = self.shape
        return {"k": tier.alloc((b, h, s, d), self.dtype), "v": tier.alloc((b, h, s, d), self.dtype),
                "pos": tier.alloc((b, h, s), torch.int64), "score": tier.alloc((b, h, s), torch.float32)}

    def tier_of(self, layer: int, batch: int):
        return self.tiers[self.homes[layer][batch]]

    def load(self, layer: int, batch: int, device) -> KVBlock:
        """The block on `device` (a view of the home when it is already there)."""
        tier, hs = self.tier_of(layer, batch), self.handles[layer, batch]
        return KVBlock(**{f: tier.load(hs[f], device) for f in FIELDS})

    def store(self, layer: int, batch: int, block: KVBlock, slots: Optional[torch.Tensor] = None) -> None:
        """Write a block home: all of it, or only K/V at `slots` (b, kv_heads) plus the small pos/score arrays."""
        tier, hs = self.tier_of(layer, batch), self.handles[layer, batch]
        for f in ("k", "v"):
            tier.store(hs[f], getattr(block, f), slots)
        tier.store(hs["pos"], block.pos)
        tier.store(hs["score"], block.score)

    def close(self) -> None:
        for (layer, batch), hs in self.handles.items():
            tier = self.tier_of(layer, batch)
            for h in hs.values():
                tier.free(h)
        self.handles = {}
