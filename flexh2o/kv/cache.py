"""KV cache blocks, one per (layer, GPU batch), each kept in its home tier.

A block holds, per sequence and KV head, `slots` cached tokens. Slots are unordered: `pos` says which token
a slot holds (-1 = empty), so eviction frees a slot and the next token is written into it in place.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from flexh2o.compress import CompressedTensor, CompressionSpec
from flexh2o.compress.codec import assign, empty_like_layout, expand
from flexh2o.compress.tier import CompressedTier

FIELDS = ("k", "v", "pos", "score")


@dataclass
class KVBlock:
    """One block on the compute side.

    k, v: (b, kv_heads, slots, head_dim), plain or a CompressedTensor grouped along head_dim (one slot = whole
    groups, so a slot is written alone); pos int64 and score fp32: (b, kv_heads, slots).
    """

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor
    score: torch.Tensor
    written: Optional[torch.Tensor] = field(default=None, compare=False)  # (b, kv[, n]) slots written since load

    def append(self, k: torch.Tensor, v: torch.Tensor, cur_pos: torch.Tensor, in_order: bool = False) -> torch.Tensor:
        """Write one token per row (k/v (b, kv, d), cur_pos (b,)) into each row's first free slot, in place;
        remember and return the slots (b, kv), so storing the block home writes only them. in_order: the caller
        knows that no token was ever evicted, so slot i holds position i and the first free slot is cur_pos (the
        block is not searched)."""
        b, kv = self.pos.shape[:2]
        if in_order:
            slot = cur_pos.view(b, 1).expand(b, kv)
        else:
            slot = (self.pos < 0).to(torch.int8).argmax(-1)  # (b, kv) first free slot
        bi = torch.arange(b, device=self.pos.device)[:, None]
        hi = torch.arange(kv, device=self.pos.device)[None, :]
        assign(self.k, (bi, hi, slot), k)  # indexing, not scatter_: 16-bit scatter_ on CPU scans the block
        assign(self.v, (bi, hi, slot), v)  # a compressed block quantizes the new token's K/V here
        self.pos[bi, hi, slot] = cur_pos.view(b, 1).expand(b, kv)
        self.score[bi, hi, slot] = 0.0
        self.written = slot
        return slot

    def merge(self, target: torch.Tensor, mass: torch.Tensor) -> None:
        """Merge values as a policy's merge_plan says (target, mass: see merged_values), in place: a compressed block
        re-quantizes each merged slot; the merged slot (one per row at most, in decode) is stored home with the
        appended one. Only the rows that merge something are read."""
        rows = (target >= 0).flatten(1).any(-1).nonzero().flatten()
        if not len(rows):
            return
        target, mass = target.index_select(0, rows), mass.index_select(0, rows)  # (r, kv, s): those rows
        if not isinstance(self.v, CompressedTensor) and int((target >= 0).sum(-1).max()) <= 1:
            changed = self._merge_single(rows, target, mass)  # decode: one evicted slot per row and head at most
        else:
            changed = self._merge_many(rows, target, mass)
        if self.written is not None:
            merged = self.written.clone()
            merged[rows] = torch.where(changed.any(-1), changed.to(torch.int8).argmax(-1), self.written[rows])
            self.written = torch.stack([self.written, merged], -1)  # (b, kv, 2)

    def _merge_single(self, rows: torch.Tensor, target: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
        """merge when every row and head has at most one slot with a target (target, mass: of the block's `rows`):
        (m_t v_t + m_e v_e) / (m_t + m_e) written into its target t, the values of nothing else read (merged_values'
        arithmetic, in its order). -> changed (r, kv, s)."""
        src = target >= 0
        has = src.any(-1, keepdim=True)
        e = src.to(torch.int8).argmax(-1, keepdim=True)  # (r, h, 1) the merged slot
        t = target.gather(-1, e).clamp(min=0)  # (r, h, 1) its target
        me, mt = torch.where(has, mass.gather(-1, e), 0.0), mass.gather(-1, t)
        total = mt + me
        ok = has & (total > 0)  # (r, h, 1)
        r, h = target.shape[:2]
        ri = rows.view(-1, 1).expand(r, h)
        hi = torch.arange(h, device=rows.device).view(1, -1).expand(r, h)
        ve, vt = (self.v[ri, hi, i[..., 0]].float()[:, :, None] for i in (e, t))  # (r, h, 1, d)
        new = (vt * mt[..., None] + ve * me[..., None]) / torch.where(ok, total, 1.0)[..., None]
        bi, hj, _ = ok.nonzero(as_tuple=True)
        if len(bi):
            assign(self.v, (rows[bi], hj, t[bi, hj, 0]), new[bi, hj, 0])
        return torch.zeros_like(src).scatter_(-1, t, ok)

    def _merge_many(self, rows: torch.Tensor, target: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
        """merge in general (prefill, or a compressed block) on the block's `rows` (target, mass: theirs), up to the
        last slot they use. -> changed (r, kv, s)."""
        n = max(row_extents(self.pos.index_select(0, rows)), default=0)

        def cut(t):
            return t.index_select(0, rows)[:, :, :n]
        sub = self.v.map(cut) if isinstance(self.v, CompressedTensor) else cut(self.v)
        values, part = merged_values(expand(sub, torch.float32), target[:, :, :n], mass[:, :, :n])
        ri, hi, si = part.nonzero(as_tuple=True)
        if len(ri):
            assign(self.v, (rows[ri], hi, si), values[ri, hi, si])
        changed = torch.zeros_like(target, dtype=torch.bool)
        changed[:, :, :n] = part
        return changed

    def evict(self, mask: Optional[torch.Tensor]) -> None:
        """Free the slots marked in `mask` (b, kv, slots); None evicts nothing."""
        if mask is not None:
            self.pos.masked_fill_(mask, -1)
            self.score.masked_fill_(mask, 0.0)

    @staticmethod
    def empty(b: int, heads: int, slots: int, head_dim: int, dtype: torch.dtype, device,
              compress: Optional[CompressionSpec] = None) -> "KVBlock":
        shape = (b, heads, slots, head_dim)
        return KVBlock(empty_like_layout(shape, dtype, compress, device),
                       empty_like_layout(shape, dtype, compress, device),
                       torch.full((b, heads, slots), -1, dtype=torch.int64, device=device),
                       torch.zeros(b, heads, slots, dtype=torch.float32, device=device))

    def rows(self, sl: slice) -> "KVBlock":
        """A view of some sequences of the block."""
        return KVBlock(*(x.map(lambda t: t[sl]) if isinstance(x, CompressedTensor) else x[sl]
                         for x in (self.k, self.v)), self.pos[sl], self.score[sl])

    def front(self, n: int) -> "KVBlock":
        """A view of the first `n` slots of every row (all a decode step reads when no row uses a slot past them);
        it shares `written` with the block until a merge replaces it."""
        def cut(x):
            return x.map(lambda t: t[:, :, :n]) if isinstance(x, CompressedTensor) else x[:, :, :n]
        return KVBlock(cut(self.k), cut(self.v), self.pos[:, :, :n], self.score[:, :, :n], self.written)

    def kept(self) -> torch.Tensor:
        """(b, kv_heads): tokens held per row."""
        return (self.pos >= 0).sum(-1)


def row_extents(pos: torch.Tensor) -> list:
    """pos (b, h, s) -> per row, its slots up to the last one any of its heads uses (the whole width off the CPU:
    reading it would make the host wait for the device)."""
    b, s = pos.shape[0], pos.shape[-1]
    if pos.device.type != "cpu":
        return [s] * b
    used = (pos >= 0).any(1)  # (b, s)
    last = s - used.flip(-1).to(torch.int8).argmax(-1)  # one past the last used slot (s when none is used)
    return torch.where(used.any(-1), last, 0).tolist()


def merged_values(v: torch.Tensor, target: torch.Tensor, mass: torch.Tensor) -> tuple:
    """v (b, h, s, d) fp32, target (b, h, s) int64 (-1: no merge), mass (b, h, s) fp32 -> (values, changed (b, h, s)):
    each slot with a target adds its mass-weighted value there; a target's value becomes (m_t v_t + sum m_e v_e) /
    (m_t + sum m_e) over the slots e merged into it (unchanged where that mass is 0)."""
    src = target >= 0
    idx = target.clamp(min=0)  # (b, h, s)
    w = torch.where(src, mass, 0.0)
    num = torch.zeros_like(v).scatter_add_(2, idx[..., None].expand_as(v), v * w[..., None])  # (b, h, s, d)
    den = torch.zeros_like(mass).scatter_add_(2, idx, w)
    hits = torch.zeros_like(mass).scatter_add_(2, idx, src.float()) > 0
    total = mass + den
    changed = hits & (total > 0)
    new = (v * mass[..., None] + num) / torch.where(changed, total, 1.0)[..., None]
    return torch.where(changed[..., None], new, v), changed


class KVCache:
    """Home storage of every block: `homes[layer][batch]` names the tier; `tiers` maps names to Tier objects.
    With `compress`, K and V live compressed in their tier and move compressed (attention expands them)."""

    def __init__(self, tiers: dict, homes: list, b: int, heads: int, slots: int, head_dim: int, dtype: torch.dtype,
                 compress: Optional[CompressionSpec] = None):
        self.tiers, self.homes = tiers, homes
        self.kv_tiers = {n: CompressedTier(t, compress) for n, t in tiers.items()} if compress else tiers
        self.shape = (b, heads, slots, head_dim)
        self.dtype = dtype
        self.handles = {}
        for layer, row in enumerate(homes):
            for batch, tier in enumerate(row):
                self.handles[layer, batch] = self._alloc(tiers[tier])

    def _alloc(self, tier) -> dict:
        b, h, s, d = self.shape
        kv = self.kv_tiers[tier.name]
        return {"k": kv.alloc((b, h, s, d), self.dtype), "v": kv.alloc((b, h, s, d), self.dtype),
                "pos": tier.alloc((b, h, s), torch.int64), "score": tier.alloc((b, h, s), torch.float32)}

    def tier_of(self, layer: int, batch: int):
        return self.tiers[self.homes[layer][batch]]

    def load(self, layer: int, batch: int, device) -> KVBlock:
        """The block on `device` (a view of the home when it is already there)."""
        tier, hs = self.tier_of(layer, batch), self.handles[layer, batch]
        kv = self.kv_tiers[tier.name]
        load = kv.load_compressed if isinstance(kv, CompressedTier) else kv.load
        return KVBlock(load(hs["k"], device), load(hs["v"], device), tier.load(hs["pos"], device),
                       tier.load(hs["score"], device))

    def store(self, layer: int, batch: int, block: KVBlock) -> None:
        """Write a block home: only K/V at the slots its last append wrote (plus the small pos/score arrays), or
        all of it when it was built whole (prefill)."""
        tier, hs = self.tier_of(layer, batch), self.handles[layer, batch]
        for f in ("k", "v"):
            self.kv_tiers[tier.name].store(hs[f], getattr(block, f), block.written)
        tier.store(hs["pos"], block.pos)
        tier.store(hs["score"], block.score)

    def close(self) -> None:
        for (layer, batch), hs in self.handles.items():
            tier = self.tier_of(layer, batch)
            for f, h in hs.items():
                (self.kv_tiers[tier.name] if f in ("k", "v") else tier).free(h)
        self.handles = {}
