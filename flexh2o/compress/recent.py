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
With 8-bit entries (--cache-exact-bits 8: `ring_spec`) `recent` holds each entry quantized alone, in one group of d
at 8 bits (compress/codec.py's CompressedTensor: recent its uint8 levels, rmeta (b, h, R + S, 1, 2) its step and
minimum in dtype), in the model's basis: a window 8-bit instead of exact, at about half the bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flexh2o.compress.codec import CacheGroupSpec, CompressedTensor, quantize
from flexh2o.compress.form import PLAIN, CacheForm, as_form
from flexh2o.compress.rotation import rotate, unrotate
from flexh2o.tensors import flat_slots

RING_PARTS = ("recent", "rslot")  # and rmeta with 8-bit entries
ENTRY_NAMES = {"": "recent", "data": "recent", "meta": "rmeta"}  # the entries' form's parts -> the ring's names
RING_BITS = (0, 8)  # 0: entries in the storage dtype (exact); 8: each entry quantized alone at 8 bits


def check_ring_bits(bits: int) -> int:
    """bits if ring entries can be stored so (RING_BITS), else ValueError naming the flag."""
    if bits not in RING_BITS:
        raise ValueError(f"--cache-exact-bits {bits}: choose 8, or leave it out for the storage dtype")
    return bits


def ring_spec(bits: int, head_dim: int):
    """How ring entries are stored: None (exact, in the storage dtype) or one 8-bit group of head_dim per entry."""
    return CacheGroupSpec(bits, head_dim, -1) if check_ring_bits(bits) else None


@dataclass(frozen=True)
class RingSpec:
    """The exact ring's scheme spec (compress/form.py): the inner scheme's parts, then `window` + `sinks` entries
    per row and head, stored as `entries` says (None: the storage dtype; an 8-bit CacheGroupSpec: `ring_spec`)."""

    inner: object
    window: int
    sinks: int
    entries: object = None

    def form_parts(self, shape: tuple, dtype: torch.dtype) -> dict:
        b, h, _, d = shape
        ring = (b, h, self.window + self.sinks)
        out = dict(self.inner.form_parts(shape, dtype))
        for name, (sh, dt, _) in (self.entries or PLAIN).form_parts(ring + (d,), dtype).items():
            out[ENTRY_NAMES[name]] = (sh, dt, False)
        out["rslot"] = (ring, torch.int32, False)
        return out

    def build(self, tensors: dict, shape: tuple) -> "Recent":
        b, h, _, d = shape
        names = ("data", "meta") if self.entries else ("",)
        entries = (self.entries or PLAIN).build({n: tensors[ENTRY_NAMES[n]] for n in names},
                                                (b, h, self.window + self.sinks, d))
        return Recent(self.inner.build(tensors, shape), entries, tensors["rslot"], self.sinks)


@dataclass
class Recent(CacheForm):
    """A quantized form (`inner`: a CompressedTensor or ChannelKeys, maybe Rotated) and its exact ring (module
    docstring), a cache form (compress/form.py); recent a plain tensor, or a CompressedTensor with 8-bit entries."""

    inner: object
    recent: object
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
    def rotated(self) -> bool:
        return self.inner.rotated

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes + self.recent.nbytes + self.rslot.nbytes  # a tensor's or a CompressedTensor's

    def map(self, fn) -> "Recent":
        """fn applied to every part (indexing of rows or heads, .to(device))."""
        return Recent(self.inner.map(fn), as_form(self.recent).map(fn).held(), fn(self.rslot), self.sinks)

    def tensors(self) -> dict:
        return {**self.inner.tensors(), **self.ring_tensors()}

    def step_parts(self):
        """CacheForm.step_parts: the inner form's with this ring, where its entries are fp32 (not 8-bit)."""
        inner = self.inner.step_parts()
        exact = isinstance(self.recent, torch.Tensor) and self.recent.dtype == torch.float32 \
            and self.rslot.dtype == torch.int32 and self.recent.device.type == "cpu"
        return (*inner[:3], (self.rslot, self.recent, self.window, self.sinks)) if inner and exact else None

    def ring_tensors(self) -> dict:
        """The ring's parts (name -> tensor): recent and rslot, and rmeta with 8-bit entries."""
        entries = as_form(self.recent).tensors()
        return {**{ENTRY_NAMES[n]: t for n, t in entries.items()}, "rslot": self.rslot}

    def ring(self, dtype: torch.dtype) -> torch.Tensor:
        """The entries' values (b, h, R + S, d) in `dtype`, in the model's basis."""
        return as_form(self.recent).expanded(dtype)

    def _write(self, bi, hi, entry, values: torch.Tensor, keep=None) -> None:
        """Ring entries [bi, hi, entry] = values (..., d); where `keep` (broadcast to the index) is False the entry
        stays as it is."""
        if isinstance(self.recent, CompressedTensor):
            ct = quantize(values, self.recent.spec, self.recent.dtype)
            parts = ((self.recent.data, ct.data), (self.recent.meta, ct.meta))
        else:
            parts = ((self.recent, values.to(self.recent.dtype)),)
        for dst, new in parts:
            if keep is not None:
                new = torch.where(keep.view(keep.shape + (1,) * (new.dim() - keep.dim())), new, dst[bi, hi, entry])
            dst[bi, hi, entry] = new

    def front(self, n: int) -> "Recent":
        """The first n slots (the ring unchanged: entries naming a later slot are not read)."""
        return Recent(self.inner.front(n), self.recent, self.rslot, self.sinks)

    def calibrate(self, k: torch.Tensor, valid: torch.Tensor) -> None:
        self.inner.calibrate(k, valid)

    def assign(self, index: tuple, values: torch.Tensor) -> None:
        """self[index] = values: quantized into the slots, and exact into the ring entries that name them (a merge
        rewriting a value still in the window)."""
        self.inner.assign(index, values)
        if not all(isinstance(i, torch.Tensor) for i in index):
            return  # a range of slots: prefill's packing, whose ring `remember_prompt` writes
        bi, hi, si = torch.broadcast_tensors(*index)
        hit = self.rslot[bi, hi] == si[..., None].to(self.rslot.dtype)  # (..., R)
        has = hit.any(-1)
        if bool(has.any()):
            entry = hit.to(torch.int8).argmax(-1)
            self._write(bi[has], hi[has], entry[has], values[has])

    def append(self, index: tuple, slot: torch.Tensor, pos: torch.Tensor, values: torch.Tensor) -> None:
        """A decode step's new token of every row: quantized into its slots (`index`, as `assign` takes it) and
        remembered in the ring (`remember`: which also drops an entry naming the slot, so `assign`'s lookup of the
        entries naming the written slots is not needed)."""
        self.inner.append(index, slot, pos, values)
        self.remember(slot, pos, values)

    def remember(self, slot: torch.Tensor, pos: torch.Tensor, values: torch.Tensor) -> None:
        """A decode step's new token of every row (pos (b,)) went into `slot` (b, h) with values (b, h, d): it takes
        ring entry pos % R (the token R positions older leaves the window), or sink entry R + pos when pos < S, and
        an entry naming the same slot (an evicted token's) is dropped."""
        from flexh2o.compress import fused_write  # (it reads compress/fused_attend.py's reader, which imports this)
        b, h, _ = self.rslot.shape
        r, s = self.window, self.sinks
        if fused_write.ring_put(self.rslot, self.recent, slot, pos, r, s, values):  # one kernel, the same writes
            return
        self.rslot.masked_fill_(self.rslot == slot[..., None].to(self.rslot.dtype), -1)
        bi = torch.arange(b, device=slot.device)[:, None]
        hi = torch.arange(h, device=slot.device)[None, :]
        sink = pos < s if s else None
        entry = pos % r if s == 0 else torch.where(sink, r + pos.clamp(max=s - 1), pos % max(r, 1))
        entry = entry.view(b, 1).expand(b, h)
        slot = slot.to(self.rslot.dtype)
        keep = None
        if not r:  # no window: a token past the sinks takes no entry (its row's write leaves the entry as it is)
            keep = sink.view(b, 1).expand(b, h)
            slot = torch.where(keep, slot, self.rslot[bi, hi, entry])
        self.rslot[bi, hi, entry] = slot
        self._write(bi, hi, entry, values, keep)

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
        self._write(bi, hi, entry, values[bi, hi, si])

    def expanded(self, dtype: torch.dtype) -> torch.Tensor:
        """The values (b, h, slots, d) in `dtype`: the quantized slots, the ring's exact values over theirs. No
        host sync: every entry writes one slot (an entry naming none writes slot 0 the value slot 0 ends with, so
        writes to a slot always agree)."""
        return self._with_ring(self.inner.expanded(dtype), dtype, False)

    def expanded_stored(self, dtype: torch.dtype) -> tuple:
        """expanded, in the basis the inner form stores (codec.expand_stored): the ring's exact values are rotated
        into it when the inner form's tokens are rotated. -> (values (b, h, slots, d), rotated)."""
        x, rotated = self.inner.expanded_stored(dtype)
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
        exact = self.ring(self.dtype)
        exact = (rotate(exact) if rotated else exact).to(dtype)  # (b, h, R, d)
        end0 = torch.where(names0.any(-1)[..., None, None], exact.gather(2, e0), x[:, :, :1])
        values = torch.where(ok[..., None], exact, end0)  # (b, h, R, d)
        x = x.contiguous()  # expand's own fresh tensor: already
        x.view(-1, d).index_copy_(0, flat_slots(b, h, s, slot), values.reshape(-1, d))  # writes to a slot agree
        return x

    def logits(self, q: torch.Tensor, read) -> torch.Tensor:
        """The inner form's logits with the ring's slots' replaced by the exact keys' (the reader's ring_logits:
        compress/attend.py's is `ring_logits` below)."""
        return read.ring_logits(q, self, lambda q, inner: inner.logits(q, read))

    def mix32(self, p: torch.Tensor, read) -> torch.Tensor:
        """The ring's slots' probabilities on its exact values, the inner form's mix over the rest (the reader's
        ring_mix: compress/attend.py's is `ring_mix` below)."""
        return read.ring_mix(p, self, lambda p, inner: inner.mix32(p, read))


def _ring(r: Recent, slots: int) -> torch.Tensor:
    """The slot of each ring entry (b, h, E), `slots` where it names none of the first `slots`."""
    ok = (r.rslot >= 0) & (r.rslot < slots)
    return torch.where(ok, r.rslot, slots).long()


def ring_logits(q: torch.Tensor, r: Recent, inner_logits) -> torch.Tensor:
    """logits over a form with its exact ring: `inner_logits(q, r.inner)` (a reader's) with the ring's slots'
    logits replaced by the exact keys'."""
    inner = inner_logits(q, r.inner)  # (b, h, g, s)
    b, h, g, s = inner.shape
    slot = _ring(r, s)
    qm = unrotate(q.float()).to(q.dtype) if r.inner.rotated else q  # qH . kH = q . k: the ring in its own basis
    e = torch.matmul(qm, r.ring(q.dtype).transpose(-1, -2)).float()  # (b, h, g, E)
    out = torch.cat([inner, inner.new_zeros(b, h, g, 1)], -1)  # the last column takes the entries naming no slot
    out.scatter_(-1, slot[:, :, None].expand(b, h, g, slot.shape[-1]), e)
    return out[..., :s]


def ring_mix(p: torch.Tensor, r: Recent, inner_mix32) -> torch.Tensor:
    """The fp32 value mix over a form with its exact ring: the ring's slots' probabilities moved onto its exact
    values, `inner_mix32(p, r.inner)` (a reader's) over the rest."""
    b, h, g, s = p.shape
    slot = _ring(r, s)
    idx = slot[:, :, None].expand(b, h, g, slot.shape[-1])
    rest = torch.cat([p, p.new_zeros(b, h, g, 1)], -1)
    held = rest.gather(-1, idx)  # (b, h, g, E): the probability of each entry's slot (0: none)
    rest.scatter_(-1, idx, 0.0)
    exact = torch.matmul(held, r.ring(torch.float32))  # (b, h, g, d), in the model's basis
    return inner_mix32(rest[..., :s], r.inner) + (rotate(exact) if r.inner.rotated else exact)
