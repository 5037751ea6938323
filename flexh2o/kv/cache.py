"""KV cache blocks, one per (layer, GPU batch), each kept in its home tier.

A block holds, per sequence and KV head, `slots` cached tokens. Slots are unordered: `pos` says which token
a slot holds (-1 = empty), so eviction frees a slot and the next token is written into it in place. A sliding-window
layer's blocks hold at most `window` slots: attention drops the token the next query cannot see (kv/attention.py),
which frees the slot the next token is written into, so they work as a ring whatever the policy and tier.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from flexh2o.compress import fused_step
from flexh2o.compress.form import as_form
from flexh2o.kv.layout import FIELDS, CacheLayout, CacheQuant
from flexh2o.tensors import flat_slots, row_extents


@dataclass
class KVBlock:
    """One block on the compute side.

    k, v: (b, kv_heads, slots, head_dim), plain tensors or cache forms as kv/layout.py says (compress/form.py's
    CacheForm, whatever the scheme; `as_form` reads a plain one as one too): a slot is written alone either way;
    pos int64 and score fp32: (b, kv_heads, slots).
    """

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor
    score: torch.Tensor
    written: Optional[torch.Tensor] = field(default=None, compare=False)  # (b, kv[, n]) slots written since load

    def append(self, k: torch.Tensor, v: torch.Tensor, cur_pos: torch.Tensor, in_order: bool = False,
               at: Optional[list] = None, step=None) -> torch.Tensor:
        """Write one token per row (k/v (b, kv, d), cur_pos (b,)) into each row's first free slot, in place;
        remember and return the slots (b, kv), so storing the block home writes only them. in_order: the caller
        knows that no token was ever evicted, so slot i holds position i and the first free slot is cur_pos (the
        block is not searched); at: then cur_pos as a list, when the caller has it, so that a plain block is
        written through a slice where every row writes the same slot (no index tensors), or else by row; step: the
        caller's kv/step_rows.StepRows for these positions, where a ragged write's flat index is made once a step."""
        b, kv = self.pos.shape[:2]
        slot = self._append_one_call(k, v, cur_pos, in_order)
        if slot is not None:
            return slot
        if in_order:
            slot = cur_pos.view(b, 1).expand(b, kv)
        else:
            slot = (self.pos < 0).to(torch.int8).argmax(-1)  # (b, kv) first free slot
        form_k, form_v = as_form(self.k), as_form(self.v)
        plain = not (form_k.quantized or form_v.quantized)
        if in_order and at is not None and plain and min(at) != max(at) and self._flat():
            return self._append_flat(k, v, cur_pos, slot, step)
        if in_order and at is not None and (plain or min(at) == max(at)):  # a quantized block too: slices, no puts
            index = ((slice(None), slice(None), at[0]) if min(at) == max(at)
                     else (torch.arange(b, device=self.pos.device), slice(None), cur_pos))  # (b, kv[, d]) either way
        else:
            index = (torch.arange(b, device=self.pos.device)[:, None],
                     torch.arange(kv, device=self.pos.device)[None, :], slot)
        for form, val in ((form_k, k), (form_v, v)):  # indexing, not scatter_: 16-bit scatter_ on CPU scans the block
            form.append(index, slot, cur_pos, val)  # a quantized form quantizes the new token's K/V here
        self.pos[index] = cur_pos.view(b, 1).expand(b, kv)
        self.score[index] = 0.0
        self.written = slot
        return slot

    def _append_one_call(self, k, v, cur_pos, in_order: bool) -> Optional[torch.Tensor]:
        """append's write by one compiled call where the block's forms take it (compress/fused_step.py: a quantized
        block of the default scheme on the CPU), remembering the slots; None where they do not."""
        kn = fused_step.kernel() if as_form(self.k).quantized else None
        found = fused_step.parts(self.k, self.v, self.pos, self.score) if kn is not None else None
        if found is None:
            return None
        self.written = fused_step.append(kn, found, self.pos, self.score, k, v, cur_pos, in_order)
        return self.written

    def _flat(self) -> bool:
        return all(t.is_contiguous() for t in (self.k, self.v, self.pos, self.score))

    def _append_flat(self, k, v, cur_pos, slot, step=None) -> torch.Tensor:
        """append's write where rows write different slots of plain, contiguous tensors (a refilled batch's rows):
        one flat index of (row, head, slot) and index_copy_ / index_fill_ along it, so the write costs a few small
        ops rather than four advanced-index puts (each about 100 us with passive OpenMP threads)."""
        b, kv, s = self.pos.shape
        dev = self.pos.device

        def flat():
            return flat_slots(b, kv, s, cur_pos.view(b, 1))
        at = flat() if step is None else step.made(("flat", b, kv, s, str(dev)), flat)
        d = self.k.shape[-1]
        self.k.view(-1, d).index_copy_(0, at, k.reshape(-1, d).to(self.k.dtype))
        self.v.view(-1, v.shape[-1]).index_copy_(0, at, v.reshape(-1, v.shape[-1]).to(self.v.dtype))
        self.pos.view(-1).index_copy_(0, at, slot.reshape(-1))
        self.score.view(-1).index_fill_(0, at, 0.0)
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
        if not as_form(self.v).quantized and int((target >= 0).sum(-1).max()) <= 1:
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
            as_form(self.v).assign((rows[bi], hj, t[bi, hj, 0]), new[bi, hj, 0])
        return torch.zeros_like(src).scatter_(-1, t, ok)

    def _merge_many(self, rows: torch.Tensor, target: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
        """merge in general (prefill, or a compressed block) on the block's `rows` (target, mass: theirs), up to the
        last slot they use. -> changed (r, kv, s)."""
        n = max(row_extents(self.pos.index_select(0, rows)), default=0)
        form = as_form(self.v)
        sub = form.map(lambda t: t.index_select(0, rows)).front(n)
        values, part = merged_values(sub.expanded(torch.float32), target[:, :, :n], mass[:, :, :n])
        ri, hi, si = part.nonzero(as_tuple=True)
        if len(ri):
            form.assign((rows[ri], hi, si), values[ri, hi, si])
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
              compress=None) -> "KVBlock":
        """An empty block; compress: a CacheQuant, or a CompressionSpec (FlexGen's scheme), or None."""
        return KVBlock.of_layout(CacheLayout(b, heads, slots, head_dim, dtype, CacheQuant.of(compress)), device)

    @staticmethod
    def of_layout(layout: CacheLayout, device) -> "KVBlock":
        """An empty block of `layout` on `device`."""
        return KVBlock(**layout.empty(device))

    def calibrate(self, k: torch.Tensor, valid: torch.Tensor) -> None:
        """Keys quantized per channel: calibrate their scales on the prompt's keys k (b, kv, t, d) at the tokens
        marked in valid (b, kv, t) (prefill, before any key is written); other forms need nothing."""
        as_form(self.k).calibrate(k, valid)

    def rows(self, sl: slice) -> "KVBlock":
        """A view of some sequences of the block."""
        return KVBlock(*(as_form(x).map(lambda t: t[sl]).held() for x in (self.k, self.v)), self.pos[sl],
                       self.score[sl])

    def front(self, n: int) -> "KVBlock":
        """A view of the first `n` slots of every row (all a decode step reads when no row uses a slot past them);
        it shares `written` with the block until a merge replaces it."""
        return KVBlock(*self.front_kv(n), self.pos[:, :, :n], self.score[:, :, :n], self.written)

    def front_kv(self, n: int) -> tuple:
        """(k, v) of the first `n` slots of every row, in the block's own form (the plain tensors themselves when
        n is all of them)."""
        return as_form(self.k).front(n).held(), as_form(self.v).front(n).held()

    def kept(self) -> torch.Tensor:
        """(b, kv_heads): tokens held per row."""
        return (self.pos >= 0).sum(-1)


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
    Each block's parts are those of its layer's CacheLayout (kv/layout.py): with `compress` (a CacheQuant, or
    FlexGen's CompressionSpec) K and V live quantized in their tier and move quantized (attention expands them).
    slots: one count for every layer, or one per layer (ModelConfig.layer_slots: a windowed layer holds fewer);
    `layout` and `shape` are the largest layer's."""

    def __init__(self, tiers: dict, homes: list, b: int, heads: int, slots, head_dim: int, dtype: torch.dtype,
                 compress=None):
        self.tiers, self.homes = tiers, homes
        per_layer = [slots] * len(homes) if isinstance(slots, int) else list(slots)
        quant = CacheQuant.of(compress)
        self.layouts = [CacheLayout(b, heads, s, head_dim, dtype, quant) for s in per_layer]
        self.layout = CacheLayout(b, heads, max(per_layer), head_dim, dtype, quant)
        self.shape = self.layout.kv_shape
        self.dtype = dtype
        self.handles = {}
        try:
            for layer, row in enumerate(homes):
                for batch, tier in enumerate(row):
                    self.handles[layer, batch] = self._alloc(tiers[tier], self.layouts[layer])
        except BaseException:
            self.close()
            raise

    def _alloc(self, tier, layout: CacheLayout) -> dict:
        """Part key (Part.key: "pos", "k" or "k.data", ...) -> the tier's handle of that part."""
        out = {}
        try:
            for p in layout.parts():
                out[p.key] = tier.alloc(p.shape, p.dtype)
        except BaseException:
            for h in out.values():
                tier.free(h)
            raise
        return out

    def tier_of(self, layer: int, batch: int):
        return self.tiers[self.homes[layer][batch]]

    def load(self, layer: int, batch: int, device) -> KVBlock:
        """The block on `device` (a view of the home when it is already there)."""
        tier, hs, layout = self.tier_of(layer, batch), self.handles[layer, batch], self.layouts[layer]
        fields = {f: layout.assemble(f, {p.name: tier.load(hs[p.key], device) for p in layout.field_parts(f)})
                  for f in FIELDS}
        return KVBlock(**fields)

    def store(self, layer: int, batch: int, block: KVBlock) -> None:
        """Write a block home: only K/V at the slots its last append wrote (plus the small pos/score arrays and a
        per-channel key calibration), or all of it when it was built whole (prefill)."""
        tier, hs, layout = self.tier_of(layer, batch), self.handles[layer, batch], self.layouts[layer]
        for f in FIELDS:
            tensors = layout.split(getattr(block, f))
            for p in layout.field_parts(f):
                tier.store(hs[p.key], tensors[p.name], block.written if p.sparse else None)

    def close(self) -> None:
        for (layer, batch), hs in self.handles.items():
            tier = self.tier_of(layer, batch)
            for h in hs.values():
                tier.free(h)
        self.handles = {}
