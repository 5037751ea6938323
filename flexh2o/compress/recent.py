"""A quantized K or V with its newest tokens kept exact (a residual window, as KIVI's full-precision recent tokens).

Every token is quantized into its slot as it arrives (both key schemes quantize a token alone, with scales that do
not change after the prompt, so this is what quantizing it when it leaves the window would store); beside the
slots a ring of `R` entries keeps the newest R positions of each row exact: position p lives in entry p % R, which
names the slot holding it. After the ring, `sinks` S entries keep the row's first S positions exact (attention
sinks: position p < S lives in entry R + p, for as long as its slot holds it). Reading the block (`expanded`) puts
the exact values over their slots, so a token is read exact while it is among the newest R (or first S) and
quantized from the step it leaves the ring. Eviction is untouched: a
policy sees every slot; an evicted slot reused by a new token drops the ring entry that named it.

Parts (besides the quantized form's own, compress/codec.py or compress/channel.py), per row and head, not per slot:
  recent  dtype (b, h, R + S, d)   the exact values
  rslot   int32 (b, h, R + S)      the slot holding each entry's token (-1: none)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flexh2o.compress.codec import assign, expand, expand_stored, first_slots
from flexh2o.compress.rotation import rotate
from flexh2o.tensors import flat_slots

RING_PARTS = ("recent", "rslot")


@dataclass
class Recent:
    """A quantized form (`inner`: a CompressedTensor or ChannelKeys) and its exact ring (module docstring)."""

    inner: object
    recent: torch.Tensor
    rslot: torch.Tensor
    sinks: int = 0

    @property
    def window(self) -> int:
        return self.rslot.shape[2] - self.sinks

    @property
    def dtype(self) -> torch.dtype:
        return self.inner.dtype

    @property
    def shape(self) -> tuple:
        return self.inner.shape

    @property
    def spec(self):
        return self.inner.spec

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes + sum(t.numel() * t.element_size() for t in (self.recent, self.rslot))

    def map(self, fn) -> "Recent":
        """fn applied to every part (indexing of rows or heads, .to(device))."""
        return Recent(self.inner.map(fn), fn(self.recent), fn(self.rslot), self.sinks)

    def front(self, n: int) -> "Recent":
        """The first n slots (the ring unchanged: entries naming a later slot are not read)."""
        return Recent(first_slots(self.inner, n), self.recent, self.rslot, self.sinks)

    def calibrate(self, k: torch.Tensor, valid: torch.Tensor) -> None:
        if hasattr(self.inner, "calibrate"):
            self.inner.calibrate(k, valid)

    def assign(self, index: tuple, values: torch.Tensor) -> None:
        """self[index] = values: quantized into the slots, and exact into the ring entries that name them (a merge
        rewriting a value still in the window)."""
        assign(self.inner, index, values)
        if not all(isinstance(i, torch.Tensor) for i in index):
            return  # a range of slots: prefill's packing, whose ring `remember_prompt` writes
        bi, hi, si = torch.broadcast_tensors(*index)
        hit = self.rslot[bi, hi] == si[..., None].to(self.rslot.dtype)  # (..., R)
        has = hit.any(-1)
        if bool(has.any()):
            entry = hit.to(torch.int8).argmax(-1)
            self.recent[bi[has], hi[has], entry[has]] = values[has].to(self.recent.dtype)

    def append(self, index: tuple, slot: torch.Tensor, pos: torch.Tensor, values: torch.Tensor) -> None:
        """A decode step's new token of every row: quantized into its slots (`index`, as `assign` takes it) and
        remembered in the ring (`remember`: which also drops an entry naming the slot, so `assign`'s lookup of the
        entries naming the written slots is not needed)."""
        assign(self.inner, index, values)
        self.remember(slot, pos, values)

    def remember(self, slot: torch.Tensor, pos: torch.Tensor, values: torch.Tensor) -> None:
        """A decode step's new token of every row (pos (b,)) went into `slot` (b, h) with values (b, h, d): it takes
        ring entry pos % R (the token R positions older leaves the window), or sink entry R + pos when pos < S, and
        an entry naming the same slot (an evicted token's) is dropped."""
        b, h, _ = self.rslot.shape
        r, s = self.window, self.sinks
        self.rslot.masked_fill_(self.rslot == slot[..., None].to(self.rslot.dtype), -1)
        bi = torch.arange(b, device=slot.device)[:, None]
        hi = torch.arange(h, device=slot.device)[None, :]
        sink = pos < s if s else None
        entry = pos % r if s == 0 else torch.where(sink, r + pos.clamp(max=s - 1), pos % max(r, 1))
        entry = entry.view(b, 1).expand(b, h)
        slot, values = slot.to(self.rslot.dtype), values.to(self.recent.dtype)
        if not r:  # no window: a token past the sinks takes no entry (its row's write leaves the entry as it is)
            slot = torch.where(sink.view(b, 1), slot, self.rslot[bi, hi, entry])
            values = torch.where(sink.view(b, 1, 1), values, self.recent[bi, hi, entry])
        self.rslot[bi, hi, entry] = slot
        self.recent[bi, hi, entry] = values

    def remember_prompt(self, pos: torch.Tensor, values: torch.Tensor) -> None:
        """Prefill packed a prompt's kept tokens into the first slots: pos (b, h, m) their positions (-1: empty),
        values (b, h, m, d); the ring is reset to the kept tokens among each row's newest R positions and the sinks
        to those among its first S."""
        r, s = self.window, self.sinks
        self.rslot.fill_(-1)
        newest = pos.amax((1, 2), keepdim=True)  # (b, 1, 1): the row's newest position
        sink = (pos >= 0) & (pos < s)
        bi, hi, si = (sink | ((pos >= s) & (pos > newest - r))).nonzero(as_tuple=True)
        p = pos[bi, hi, si]
        entry = torch.where(p < s, r + p, p % max(r, 1))
        self.rslot[bi, hi, entry] = si.to(self.rslot.dtype)
        self.recent[bi, hi, entry] = values[bi, hi, si].to(self.recent.dtype)

    def expanded(self, dtype: torch.dtype) -> torch.Tensor:
        """The values (b, h, slots, d) in `dtype`: the quantized slots, the ring's exact values over theirs. No
        host sync: every entry writes one slot (an entry naming none writes slot 0 the value slot 0 ends with, so
        writes to a slot always agree)."""
        return self._with_ring(expand(self.inner, dtype), dtype, False)

    def expanded_stored(self, dtype: torch.dtype) -> tuple:
        """expanded, in the basis the inner form stores (codec.expand_stored): the ring's exact values are rotated
        into it when the inner form's tokens are rotated. -> (values (b, h, slots, d), rotated)."""
        x, rotated = expand_stored(self.inner, dtype)
        return self._with_ring(x, dtype, rotated), rotated

    def _with_ring(self, x: torch.Tensor, dtype: torch.dtype, rotated: bool) -> torch.Tensor:
        """x (b, h, slots, d) in `dtype` with the ring's exact values (rotated first if `rotated`) over their slots."""
        b, h, s, d = x.shape
        if s == 0:
            return x
        ok = (self.rslot >= 0) & (self.rslot < s)  # (b, h, R): the entry names a slot of x
        slot = torch.where(ok, self.rslot, 0).long()  # (b, h, R)
        names0 = ok & (slot == 0)
        e0 = names0.to(torch.int8).argmax(-1, keepdim=True)[..., None].expand(b, h, 1, d)  # (b, h, 1, d)
        exact = (rotate(self.recent) if rotated else self.recent).to(dtype)  # (b, h, R, d)
        end0 = torch.where(names0.any(-1)[..., None, None], exact.gather(2, e0), x[:, :, :1])
        values = torch.where(ok[..., None], exact, end0)  # (b, h, R, d)
        x = x.contiguous()  # expand's own fresh tensor: already
        x.view(-1, d).index_copy_(0, flat_slots(b, h, s, slot), values.reshape(-1, d))  # writes to a slot agree
        return x
