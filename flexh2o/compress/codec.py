"""Group-wise asymmetric min/max quantization (FlexGen's scheme): 2, 3, 4 or 8 bits a value (2 and 3: the KV cache), groups of `group_size`
values along one dimension, a scale (the step between levels) and a minimum per group.

Layout of a tensor of shape S grouped along dimension d (n = S[d], g = ceil(n / group_size) groups):
  data  uint8, S[:d] + (g, group_size * bits / 8) + S[d+1:]   packed as compress/bits.py says (4 bits: low nibble first)
  meta  the storage dtype, S[:d] + (g,) + S[d+1:] + (2,)       [..., 0] = scale, [..., 1] = minimum
Every dimension before d keeps its index, so a KV cache grouped along head_dim (the last) still has its slots at
dimension 2 and one slot is written as one slot. A ragged tail is padded with copies of the last value (never
truncated; the padding never changes a group's min or max). The minimum is rounded down and the scale up to the
storage dtype, so every value is within half a step of its level; a constant group has scale 0 and is exact.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, ClassVar, Optional

import torch

from flexh2o.compress.bits import PACKABLE, pack, packed_width, unpack
from flexh2o.compress.defaults import DEFAULT_BITS, DEFAULT_GROUP
from flexh2o.compress.form import CacheForm, as_form

BITS = (4, 8)  # weights (and FlexGen's cache); a cache's CacheGroupSpec also takes 2 and 3


@dataclass(frozen=True)
class CompressionSpec:
    """bits (2, 3, 4 or 8) a value, values per group, the grouped dimension (negative counts from the end), and the
    dtype of the scales and minimums (None: the tensor's storage dtype; a checkpoint's own blocks keep theirs)."""

    bits: int = DEFAULT_BITS
    group_size: int = DEFAULT_GROUP
    group_dim: int = 0
    scale_dtype: Optional[torch.dtype] = None
    allowed: ClassVar[tuple] = BITS

    def __post_init__(self):
        if self.bits not in self.allowed:
            raise ValueError(f"--compress-bits {self.bits}: choose {', '.join(map(str, self.allowed))}")
        if self.group_size < 2 or (self.group_size * self.bits) % 8:
            raise ValueError(f"--compress-group-size {self.group_size}: use a number of values, at least 2, whose "
                             f"{self.bits}-bit levels fill whole bytes (a multiple of {8 // _gcd8(self.bits)})")

    @property
    def levels(self) -> int:
        """The largest quantized level (15 at 4 bits)."""
        return (1 << self.bits) - 1

    def along(self, dim: int) -> "CompressionSpec":
        return replace(self, group_dim=dim)

    def for_weight(self, name: Optional[str]) -> Optional["CompressionSpec"]:
        """The spec of the 2+-dimensional weight `name` (a checkpoint's kept blocks have their own: kept.py)."""
        return self

    def dim(self, ndim: int) -> int:
        """The grouped dimension of an ndim-dimensional tensor, as a non-negative index."""
        if not -ndim <= self.group_dim < ndim:
            raise ValueError(f"cannot group dimension {self.group_dim} of a {ndim}-dimensional tensor")
        return self.group_dim % ndim

    def layout(self, shape: tuple, dtype: torch.dtype) -> tuple:
        """((data shape, torch.uint8), (meta shape, dtype)) of a tensor of `shape` stored as `dtype`."""
        shape = tuple(int(s) for s in shape)
        d = self.dim(len(shape))
        groups = -(-shape[d] // self.group_size)
        data = shape[:d] + (groups, packed_width(self.group_size, self.bits)) + shape[d + 1:]
        meta = shape[:d] + (groups,) + shape[d + 1:] + (2,)
        return (data, torch.uint8), (meta, self.scale_dtype or dtype)


@dataclass(frozen=True)
class CacheGroupSpec(CompressionSpec):
    """A CompressionSpec of KV cache values (or FlexGen's keys), grouped along head_dim: 2 and 3 bits allowed too.
    The grouped cache scheme's spec (compress/form.py's FormSpec): data and meta, each written slot by slot."""

    allowed: ClassVar[tuple] = PACKABLE

    def form_parts(self, shape: tuple, dtype: torch.dtype) -> dict:
        (ds, ddt), (ms, mdt) = self.layout(shape, dtype)
        return {"data": (ds, ddt, True), "meta": (ms, mdt, True)}

    def build(self, tensors: dict, shape: tuple) -> "CompressedTensor":
        return CompressedTensor(tensors["data"], tensors["meta"], int(shape[-1]), self)


def stored_parts(shape: tuple, dtype: torch.dtype, spec: Optional[CompressionSpec] = None) -> tuple:
    """Bytes of each stored tensor (one file on the disk tier) of a tensor of `shape` and storage `dtype`: (plain,)
    or (data, meta) under `spec`."""
    if spec is None:
        return (_numel(shape) * dtype.itemsize,)
    return tuple(_numel(s) * dt.itemsize for s, dt in spec.layout(shape, dtype))


def stored_bytes(shape: tuple, dtype: torch.dtype, spec: Optional[CompressionSpec] = None) -> int:
    """Bytes a tensor of `shape` and storage `dtype` takes in a tier: plain, or compressed under `spec`."""
    return sum(stored_parts(shape, dtype, spec))


def weight_spec(shape: tuple, spec: Optional[CompressionSpec], name: Optional[str] = None) -> Optional[CompressionSpec]:
    """How the weight `name` of `shape` is stored under --compress-weight's `spec`: 2+ dimensions grouped along the
    spec's dimension (0: FlexGen's group_dim 0; 1: the input dimension, the int4 kernel's), or as a checkpoint's own
    blocks (spec.for_weight); 1-D weights (biases, norms) stay plain, as in FlexGen."""
    return spec.for_weight(name) if spec is not None and len(shape) > 1 else None


def _numel(shape: tuple) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


@dataclass
class CompressedTensor(CacheForm):
    """A compressed tensor: `data` and `meta` as in the module docstring; `length` = original size of the grouped
    dimension. Slicing dimensions before the grouped one works on data and meta alike (see `map`). Grouped along
    head_dim (the last dimension of a (b, h, slots, d) block) it is the grouped KV cache form (compress/form.py)."""

    data: torch.Tensor
    meta: torch.Tensor
    length: int
    spec: CompressionSpec

    @property
    def dtype(self) -> torch.dtype:
        return self.meta.dtype

    @property
    def shape(self) -> tuple:
        d = self.spec.dim(self.data.dim() - 1)
        s = tuple(self.data.shape)
        return s[:d] + (self.length,) + s[d + 2:]

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.meta.numel() * self.meta.element_size()

    def map(self, fn: Callable) -> "CompressedTensor":
        """fn applied to data and meta (indexing of leading dimensions, .to(device), ...)."""
        return CompressedTensor(fn(self.data), fn(self.meta), self.length, self.spec)

    # ---- as a cache form (grouped along head_dim): compress/form.py --------------------------------------------
    def tensors(self) -> dict:
        return {"data": self.data, "meta": self.meta}

    def front(self, n: int) -> "CompressedTensor":
        return self.map(lambda t: t[:, :, :n])

    def assign(self, index: tuple, values: torch.Tensor) -> None:
        ct = quantize(values, self.spec, self.dtype)
        self.data[index] = ct.data
        self.meta[index] = ct.meta

    def expanded(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self, dtype)

    def whole_groups(self) -> bool:
        """Grouped along head_dim of a block in whole groups (no ragged tail): what a levels read takes."""
        return self.data.dim() == 5 and self.spec.dim(4) == 3 and self.data.shape[3] * self.spec.group_size == \
            self.length

    def step_parts(self):
        """CacheForm.step_parts: whole groups along head_dim with fp32 scales and minimums, on the CPU."""
        ok = self.whole_groups() and self.meta.dtype == torch.float32 and self.data.device.type == "cpu" \
            and self.meta.device.type == "cpu"
        return (self, "group", False, None) if ok else None

    def logits(self, q: torch.Tensor, read) -> torch.Tensor:
        return read.group_logits(q, self) if self.whole_groups() else super().logits(q, read)

    def mix32(self, p: torch.Tensor, read) -> torch.Tensor:
        return read.group_mix(p, self) if self.whole_groups() else super().mix32(p, read)

    def kernel_assign(self, index: tuple, values: torch.Tensor, write) -> bool:
        return write.group_assign(self, index, values)


def quantize(x: torch.Tensor, spec: CompressionSpec, dtype: Optional[torch.dtype] = None) -> CompressedTensor:
    """x (any float dtype) -> CompressedTensor whose scale and minimum are stored as spec.scale_dtype, else `dtype`
    (default x.dtype)."""
    dtype = spec.scale_dtype or dtype or x.dtype
    d, n, size = spec.dim(x.dim()), x.shape[spec.dim(x.dim())], spec.group_size
    groups = -(-n // size)
    xf = x.float()
    if groups * size != n:  # pad with copies of the last value: min and max unchanged
        xf = xf.index_select(d, torch.arange(groups * size, device=x.device).clamp_(max=n - 1))
    g = xf.view(x.shape[:d] + (groups, size) + x.shape[d + 1:])  # (..., groups, size, ...)
    lo = _round_down(g.amin(d + 1), dtype)  # (..., groups, ...)
    scale = _round_up((g.amax(d + 1) - lo.float()) / spec.levels, dtype)
    lo_f, scale_f = lo.float().unsqueeze(d + 1), scale.float().unsqueeze(d + 1)
    q = ((g - lo_f) / torch.where(scale_f > 0, scale_f, 1.0)).round_().clamp_(0, spec.levels).to(torch.uint8)
    if spec.bits == 4:
        pairs = q.view(x.shape[:d] + (groups, size // 2, 2) + x.shape[d + 1:])
        q = pairs.select(d + 2, 0) | (pairs.select(d + 2, 1) << 4)  # (..., groups, size / 2, ...)
    elif spec.bits != 8:
        q = pack(q.movedim(d + 1, -1), spec.bits).movedim(-1, d + 1)  # (..., groups, size * bits / 8, ...)
    return CompressedTensor(q.contiguous(), torch.stack([scale, lo], -1), n, spec)


def dequantize(ct: CompressedTensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The expanded tensor (ct.shape) in `dtype` (default the storage dtype); arithmetic in fp32."""
    spec, data = ct.spec, ct.data
    d = spec.dim(data.dim() - 1)
    groups = data.shape[d]
    if spec.bits == 4:
        q = torch.stack([data & 0xF, data >> 4], d + 2)  # (..., groups, size / 2, 2, ...)
        q = q.view(data.shape[:d + 1] + (spec.group_size,) + data.shape[d + 2:])
    elif spec.bits != 8:
        q = unpack(data.movedim(d + 1, -1), spec.bits, spec.group_size).movedim(-1, d + 1)
    else:
        q = data
    scale, lo = (ct.meta[..., i].float().unsqueeze(d + 1) for i in (0, 1))  # contiguous copies: fast broadcasts
    x = q.float().mul_(scale).add_(lo)  # (..., groups, size, ...)
    x = x.view(data.shape[:d] + (groups * spec.group_size,) + data.shape[d + 2:])
    if groups * spec.group_size != ct.length:
        x = x.narrow(d, 0, ct.length).contiguous()
    return x.to(dtype or ct.dtype)


def dequantize_into(ct: CompressedTensor, out: torch.Tensor) -> torch.Tensor:
    """dequantize(ct, out.dtype) written into `out` (ct.shape), reusing its memory: levels copied straight into
    it, then scaled and shifted in place (fp32 arithmetic when out is fp32, as dequantize)."""
    spec, data = ct.spec, ct.data
    d = spec.dim(data.dim() - 1)
    groups = data.shape[d]
    if (out.dtype != torch.float32 or groups * spec.group_size != ct.length or not out.is_contiguous()
            or spec.bits not in (4, 8)):
        return out.copy_(dequantize(ct, out.dtype))
    g = out.view(data.shape[:d] + (groups, spec.group_size) + data.shape[d + 2:])  # (..., groups, size, ...)
    if spec.bits == 4:
        pairs = g.view(data.shape[:d + 1] + (spec.group_size // 2, 2) + data.shape[d + 2:])
        pairs.select(d + 2, 0).copy_(data & 0xF)
        pairs.select(d + 2, 1).copy_(data >> 4)
    else:
        g.copy_(data)
    scale, lo = (ct.meta[..., i].unsqueeze(d + 1) for i in (0, 1))
    g.mul_(scale).add_(lo)
    return out


def _gcd8(bits: int) -> int:
    """The largest power of two dividing both `bits` and 8."""
    return bits & -bits if bits & -bits < 8 else 8


def _round_down(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 v -> the largest `dtype` value <= v."""
    r = v.to(dtype)
    return torch.where(r.float() > v, torch.nextafter(r, torch.full_like(r, float("-inf"))), r)


def _round_up(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 v -> the smallest `dtype` value >= v."""
    r = v.to(dtype)
    return torch.where(r.float() < v, torch.nextafter(r, torch.full_like(r, float("inf"))), r)


def expand(x, dtype: torch.dtype) -> torch.Tensor:
    """A block's K or V (a plain tensor or a cache form, compress/form.py) as a plain tensor in `dtype`."""
    return as_form(x).expanded(dtype)


def expand_stored(x, dtype: torch.dtype) -> tuple:
    """(x expanded, False), or for a form that holds its tokens rotated (compress/rotation.py) (its tokens still in
    the rotated basis, True): attention reads either basis alike when its query is rotated too and its output
    rotated back (q.k = qH.kH and sum p v = (sum p vH) H^T, H orthonormal), one token per row instead of every slot
    rotated back each step."""
    return as_form(x).expanded_stored(dtype)


def first_slots(x, n: int):
    """The first n slots (dimension 2) of a block's K or V, in its own form (a plain tensor: itself at n slots)."""
    return as_form(x).front(n).held()


def assign(dst, index, values: torch.Tensor) -> None:
    """dst[index] = values for a block's K or V, stored as its form holds them (quantized for a quantized one)."""
    as_form(dst).assign(index, values)


def empty_like_layout(shape: tuple, dtype: torch.dtype, spec: Optional[CompressionSpec], device) -> object:
    """A zero tensor of `shape`, or a CompressedTensor of zeros when `spec` is given."""
    if spec is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    (ds, ddt), (ms, mdt) = spec.layout(shape, dtype)
    return CompressedTensor(torch.zeros(ds, dtype=ddt, device=device), torch.zeros(ms, dtype=mdt, device=device),
                            int(shape[spec.dim(len(shape))]), spec)
