"""The layout of one (layer, GPU batch) KV cache block: every tensor it stores, with shape, dtype and bytes.

The one place that says what a block holds; the cache allocates, loads and stores these parts, and the memory
plan, the cost model and the evaluations count their bytes from here. A block of b rows, h KV heads, s slots and
head_dim d, stored as `dtype`:
  k, v     plain (b, h, s, d) `dtype`; or quantized under a CacheQuant: values per token (FlexGen's groups along
           head_dim: data + meta, compress/codec.py), keys per token as well (FlexGen's scheme, keys "token") or per
           channel with scales calibrated on the prompt (keys "channel": data, index, exact, calib;
           compress/channel.py) or with levels fitted to the prompt (keys "fitted": the same parts, calib holding
           each channel's 2**bits levels); `rotate`: either form holds its tokens times a Hadamard matrix
           (compress/rotation.py's Rotated: the same parts, in the rotated basis); with `recent` R > 0 both also
           keep a ring of their newest R tokens exact (recent, rslot; compress/recent.py), R = min(recent, slots);
           `exact_bits` 8: the ring's entries 8-bit (recent uint8 + rmeta) and per-channel keys' outliers fp8
           (CacheQuant: kv/cache_quant.py, with each choice's flag)
  pos      int64 (b, h, s): the token a slot holds (-1: empty)
  score    fp32 (b, h, s): the policy's accumulated attention
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from flexh2o.compress.defaults import (DEFAULT_KEYS, DEFAULT_OUTLIERS, DEFAULT_RECENT,  # noqa: F401  (re-exported)
                                       DEFAULT_ROTATE, DEFAULT_SINKS, KEY_SCHEMES)
from flexh2o.compress.form import PLAIN, as_form
from flexh2o.kv.cache_quant import CacheQuant  # noqa: F401  (re-exported: how the cache is quantized, its flags)

FIELDS = ("k", "v", "pos", "score")


@dataclass(frozen=True)
class Part:
    """One stored tensor of a block: field (k, v, pos, score), its part name ("" when the field is one plain
    tensor), shape, dtype; sparse: written slot by slot after a decode append (K/V parts indexed by slot)."""

    field: str
    name: str
    shape: tuple
    dtype: torch.dtype
    sparse: bool

    @property
    def key(self) -> str:
        """The part's name in a block's handles: the field ("k", "pos") or field.part ("k.data")."""
        return f"{self.field}.{self.name}" if self.name else self.field

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= int(s)
        return n


@dataclass(frozen=True)
class CacheLayout:
    """One block's layout (module docstring); quant None: K and V plain."""

    batch: int
    heads: int
    slots: int
    head_dim: int
    dtype: torch.dtype
    quant: Optional[CacheQuant] = None

    @staticmethod
    def of_run(rc, layer: Optional[int] = None) -> "CacheLayout":
        """The layout of a RunConfig's blocks of decoder layer `layer` (its GPU batch, the model's KV heads, the
        layer's slots: RunConfig.layer_slots); layer None: the largest layer's."""
        return CacheLayout._of_run(rc, rc.cache_slots() if layer is None else rc.layer_slots()[layer])

    @staticmethod
    def layers_of_run(rc) -> tuple:
        """The layout of each decoder layer's blocks (a windowed layer's hold fewer slots), equal ones shared."""
        slots = rc.layer_slots()
        by_slots = {s: CacheLayout._of_run(rc, s) for s in set(slots)}
        return tuple(by_slots[s] for s in slots)

    @staticmethod
    def layer_bytes_of_run(rc) -> tuple:
        """Bytes of one block of each decoder layer (layers_of_run's, each distinct layout sized once)."""
        layouts = CacheLayout.layers_of_run(rc)
        sizes = {lay: lay.nbytes for lay in set(layouts)}
        return tuple(sizes[lay] for lay in layouts)

    @staticmethod
    def _of_run(rc, slots: int) -> "CacheLayout":
        cfg = rc.model
        return CacheLayout(rc.gpu_batch_size, cfg.kv_heads, slots, cfg.head_dim, rc.dtype,
                           CacheQuant.of(rc.compress_cache))

    @property
    def kv_shape(self) -> tuple:
        return (self.batch, self.heads, self.slots, self.head_dim)

    def form_spec(self, field: str):
        """The scheme spec of K ("k") or V ("v") (compress/form.py): plain, or as the run's CacheQuant says."""
        return PLAIN if self.quant is None else self.quant.form_spec(field, self.slots, self.head_dim)

    def field_parts(self, field: str) -> tuple:
        """The Parts of one field (K or V: its form's parts, a quantized one's ring last)."""
        if field in ("pos", "score"):
            dtype = torch.int64 if field == "pos" else torch.float32
            return (Part(field, "", self.kv_shape[:3], dtype, False),)
        parts = self.form_spec(field).form_parts(self.kv_shape, self.dtype)
        return tuple(Part(field, n, s, dt, sparse) for n, (s, dt, sparse) in parts.items())

    def parts(self) -> tuple:
        """Every stored tensor of the block, field by field."""
        return tuple(p for f in FIELDS for p in self.field_parts(f))

    @property
    def nbytes(self) -> int:
        """Bytes of the whole block in its tier."""
        return sum(p.nbytes for p in self.parts())

    def kv_slot_bytes(self) -> int:
        """K and V bytes of one token of one KV head (the parts stored slot by slot)."""
        kv = sum(p.nbytes for f in ("k", "v") for p in self.field_parts(f) if p.sparse)
        return kv // (self.batch * self.heads * self.slots)

    def kv_row_bytes(self) -> int:
        """K and V bytes of one row and KV head that no slot owns (a per-channel key calibration; else 0)."""
        kv = sum(p.nbytes for f in ("k", "v") for p in self.field_parts(f) if not p.sparse)
        return kv // (self.batch * self.heads)

    def expanded_bytes(self, dtype: torch.dtype) -> int:
        """K and V of the block expanded into `dtype` (what attention reads when storage differs from compute)."""
        b, h, s, d = self.kv_shape
        return 2 * b * h * s * d * dtype.itemsize

    def read_bytes(self, compute: torch.dtype, packed: bool) -> int:
        """What a decode step holds to read K and V of the block, besides its logits: an expanded copy in `compute`
        where stored in another dtype, or quantized and read by compress/attend.py's levels read (which holds less
        than that at once); a quantized block read from its packed bytes (`packed`: compress/fused_attend.py's
        reads_packed, the one decision) holds only fp32 copies of its small parts stored in another dtype (scales,
        calibration, exact ring and outliers; an fp32 part and the slot indices, index and rslot, are read as
        stored)."""
        if self.quant is None:
            return self.expanded_bytes(compute) if self.dtype != compute else 0
        if not packed:
            return self.expanded_bytes(compute)
        return sum(p.nbytes // p.dtype.itemsize * 4 for f in ("k", "v") for p in self.field_parts(f)
                   if p.name not in ("data", "index", "rslot") and p.dtype != torch.float32)

    def policy_copy_bytes(self, keys: bool, values: bool) -> int:
        """The fp32 keys and/or values an eviction policy reads (kv/decode.py's evict: as_form(...).expanded): a
        copy of each unless the block stores that field as plain fp32."""
        b, h, s, d = self.kv_shape
        if self.quant is None and self.dtype == torch.float32:
            return 0
        return (int(keys) + int(values)) * b * h * s * d * 4

    # ---- the block's tensors ----------------------------------------------------------------------------------
    def assemble(self, field: str, tensors: dict):
        """A field's object from its parts' tensors (name -> tensor): a tensor, or K's or V's cache form."""
        if field in ("pos", "score"):
            return tensors[""]
        return self.form_spec(field).build(tensors, self.kv_shape)

    @staticmethod
    def split(obj) -> dict:
        """A field's object -> its parts' tensors (name -> tensor), as assemble takes them."""
        return as_form(obj).tensors()

    def empty(self, device) -> dict:
        """field -> a fresh object of the block on `device` (zeros; pos and a ring's slots -1)."""
        out = {}
        for f in FIELDS:
            out[f] = self.assemble(f, {p.name: torch.full(p.shape, -1 if p.key in ("pos", f"{f}.rslot") else 0,
                                                          dtype=p.dtype, device=device)
                                       for p in self.field_parts(f)})
        return out
