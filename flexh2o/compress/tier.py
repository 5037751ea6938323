"""A tier that keeps tensors compressed in another tier: they are stored, counted and moved compressed, and
expanded only on the compute side (after the move)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from flexh2o.compress.codec import CompressedTensor, CompressionSpec, dequantize, dequantize_into, quantize
from flexh2o.compress.int4_order import row_block
from flexh2o.compress.kernels import PackedWeight, expand_kernel_order, from_kernel_order, to_kernel_order


@dataclass(frozen=True)
class CompressedHandle:
    """The inner tier's handles of one tensor's data and meta, and the tensor's logical shape and storage dtype."""

    data: object
    meta: object
    shape: tuple
    dtype: torch.dtype


SLAB_BYTES = 32 << 20  # fp32 bytes of input quantized at once: the codec's intermediates are a few times that


def quantize_slabs(x: torch.Tensor, spec: CompressionSpec, dtype: torch.dtype) -> CompressedTensor:
    """quantize(x, spec, dtype), a slab of whole groups at a time along a dimension that is not grouped, so that the
    codec's fp32 intermediates stay near SLAB_BYTES whatever the tensor's size (equal to quantizing it whole: groups
    never span slabs). opt-1.3b's 50272 x 2048 embedding quantized whole took the process to 1.8 GiB."""
    d = spec.dim(x.dim())
    if x.dim() < 2 or x.numel() * 4 <= SLAB_BYTES:
        return quantize(x, spec, dtype)
    s = 0 if d != 0 else 1  # the slab dimension; the data's index of it shifts by one past d (groups, packed)
    step = max(1, SLAB_BYTES * x.shape[s] // (x.numel() * 4))
    parts = [quantize(x.narrow(s, i, min(step, x.shape[s] - i)), spec, dtype) for i in range(0, x.shape[s], step)]
    return CompressedTensor(torch.cat([p.data for p in parts], s if s < d else s + 1),
                            torch.cat([p.meta for p in parts], s), parts[0].length, spec)


def slab_rows(shape: tuple, spec: CompressionSpec, block: int = 1) -> Optional[int]:
    """Rows a slab of a (N, K) weight grouped along K holds when it is stored a slab at a time (SLAB_BYTES of fp32
    input, in whole blocks of `block` rows, at least one), or None where the tensor is not stored so (another rank,
    or grouped along N: gathered whole). The memory plan reads it with block 1, the most rows."""
    if len(shape) != 2 or spec.dim(2) != 1:
        return None
    return max(1, SLAB_BYTES // (4 * int(shape[1])) // block) * block


def _row_slabs(chunks: Iterable[torch.Tensor], shape: tuple, rows: int):
    """Consecutive flat pieces of a (N, K) tensor regathered as (rows, K) slabs (the last one shorter) in one
    buffer reused for every slab: each is to be used before the next is asked for."""
    n, k = (int(d) for d in shape)
    buf, fill, done = None, 0, 0
    for c in chunks:
        c = c.reshape(-1)
        if buf is None:
            buf = torch.empty(min(rows, n) * k, dtype=c.dtype, device=c.device)
        pos = 0
        while pos < c.numel():
            if done + fill >= n * k:
                raise ValueError(f"write_from: more than {n * k} values for a tensor of shape {tuple(shape)}")
            take = min(buf.numel() - fill, c.numel() - pos, n * k - done - fill)
            buf[fill:fill + take] = c[pos:pos + take]
            fill, pos = fill + take, pos + take
            if fill == min(buf.numel(), n * k - done):
                yield buf[:fill].view(-1, k)
                done, fill = done + fill, 0
    if done != n * k:
        raise ValueError(f"write_from: {done + fill} values for a tensor of shape {tuple(shape)}")


class CompressedTier:
    """The Tier interface over `inner` (gpu, cpu or disk), every tensor compressed under `spec`. Capacity, bytes
    loaded and stored are the inner tier's, so they count compressed bytes."""

    def __init__(self, inner, spec: CompressionSpec):
        self.inner, self.spec = inner, spec

    @property
    def name(self) -> str:
        return self.inner.name

    def alloc(self, shape: tuple, dtype: torch.dtype) -> CompressedHandle:
        (ds, ddt), (ms, mdt) = self.spec.layout(shape, dtype)
        data = self.inner.alloc(ds, ddt)
        try:
            meta = self.inner.alloc(ms, mdt)
        except BaseException:
            self.inner.free(data)
            raise
        return CompressedHandle(data, meta, tuple(int(s) for s in shape), dtype)

    def load_compressed(self, handle: CompressedHandle, device, bufs: Optional[tuple] = None) -> CompressedTensor:
        """The compressed tensor on `device` (moved compressed). bufs: (data, meta) read buffers for a disk inner
        tier (storage/read_buffers.py); the result is then a view of them where it is already on `device`."""
        data, meta = (self.inner.load(h, device) if b is None else self.inner.load(h, device, None, b)
                      for h, b in zip((handle.data, handle.meta), bufs or (None, None)))
        return CompressedTensor(data, meta, handle.shape[self.spec.dim(len(handle.shape))], self.spec)

    def load(self, handle: CompressedHandle, device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Moved compressed to `device`, then expanded there into `dtype` (default the storage dtype)."""
        return self.expand(self.load_compressed(handle, device), dtype or handle.dtype)

    def expand(self, ct: CompressedTensor, dtype: torch.dtype) -> torch.Tensor:
        """A tensor loaded by load_compressed, expanded into `dtype`."""
        return dequantize(ct, dtype)

    def expand_into(self, ct: CompressedTensor, out: torch.Tensor) -> torch.Tensor:
        """A tensor loaded by load_compressed, expanded into `out` (a reused buffer of its shape)."""
        return dequantize_into(ct, out)

    def store(self, handle: CompressedHandle, tensor, slots: Optional[torch.Tensor] = None) -> None:
        """Write a tensor (quantized here) or a CompressedTensor; `slots` as the inner tier's (dimension 2). A whole
        (N, K) weight grouped along K is quantized and written a slab of rows at a time (`_put`)."""
        rows = self.slab_rows(handle.shape) if slots is None and not isinstance(tensor, CompressedTensor) else None
        if rows is not None:
            self._put(handle, (tensor[i:i + rows] for i in range(0, handle.shape[0], rows)))
            return
        ct = tensor if isinstance(tensor, CompressedTensor) else quantize_slabs(tensor, self.spec, handle.dtype)
        self._write(handle, ct, slots)

    def _write(self, handle: CompressedHandle, ct: CompressedTensor, slots: Optional[torch.Tensor]) -> None:
        self.inner.store(handle.data, ct.data, slots)
        self.inner.store(handle.meta, ct.meta, slots)

    def write_from(self, handle: CompressedHandle, chunks: Iterable[torch.Tensor]) -> None:
        """Consecutive flat pieces of the whole tensor. A (N, K) weight grouped along K: gathered a slab of rows
        at a time and each slab quantized and written as it fills (`_put`: the weight never exists whole, in any
        form); any other: gathered whole into one buffer (groups span pieces), then quantized a slab at a time."""
        rows = self.slab_rows(handle.shape)
        if rows is not None:
            self._put(handle, _row_slabs(chunks, handle.shape, rows))
            return
        flat, at = None, 0
        for c in chunks:
            if flat is None:
                flat = torch.empty(math.prod(handle.shape), dtype=c.dtype, device=c.device)
            flat[at:at + c.numel()] = c.reshape(-1)
            at += c.numel()
        if flat is None or at != flat.numel():
            raise ValueError(f"write_from: {at} values for a tensor of shape {handle.shape}")
        self.store(handle, flat.view(handle.shape))

    def slab_rows(self, shape: tuple) -> Optional[int]:
        """Rows of the slabs `_put` writes a tensor of `shape` by (module function slab_rows)."""
        return slab_rows(shape, self.spec)

    def _put(self, handle: CompressedHandle, slabs: Iterable[torch.Tensor]) -> None:
        """Quantize consecutive slabs of whole rows one at a time, streaming each one's data bytes to the inner
        tier (its write_from) as it is made; the meta, a few bytes a group, is joined and stored after them. The
        bytes written are those of quantizing the tensor whole: groups never span rows."""
        metas = []

        def data():
            for x in slabs:
                ct = quantize(x, self.spec, handle.dtype)
                metas.append(ct.meta)
                yield self._ordered(ct).reshape(-1)
        self.inner.write_from(handle.data, data())
        self.inner.store(handle.meta, torch.cat(metas, 0))

    def _ordered(self, ct: CompressedTensor) -> torch.Tensor:
        """A quantized slab's data as the inner tier keeps it (the codec's order here)."""
        return ct.data

    def free(self, handle: CompressedHandle) -> None:
        self.inner.free(handle.data)
        self.inner.free(handle.meta)


class KernelOrderTier(CompressedTier):
    """A CompressedTier for (N, K) weights grouped along K whose data is kept in the int4 kernel's order (the same
    bytes, permuted at store time: compress/kernels.py). Loads hand the compute side either the kernel's form
    (`pack`) or the expanded weight (`expand_into` a reused buffer, or `expand`)."""

    def _write(self, handle: CompressedHandle, ct: CompressedTensor, slots: Optional[torch.Tensor]) -> None:
        super()._write(handle, CompressedTensor(self._ordered(ct), ct.meta, ct.length, ct.spec), slots)

    def _ordered(self, ct: CompressedTensor) -> torch.Tensor:
        """Kernel order in the codec's data shape."""
        return to_kernel_order(ct).data.view(ct.data.shape)

    def slab_rows(self, shape: tuple) -> Optional[int]:
        """Whole blocks of the kernel's order a slab (a slab's kernel order is then the same bytes as the whole
        weight's there; the last, shorter block only ever ends the last slab)."""
        return slab_rows(shape, self.spec, row_block())

    def load_compressed(self, handle: CompressedHandle, device, bufs: Optional[tuple] = None) -> CompressedTensor:
        """The kernel-order tensor on `device`: data (N, K / 2), meta (N, groups, 2)."""
        ct = super().load_compressed(handle, device, bufs)
        return CompressedTensor(ct.data.view(handle.shape[0], -1), ct.meta, ct.length, ct.spec)

    def pack(self, ct: CompressedTensor, dtype: torch.dtype, kernel: bool = True,
             scales: Optional[torch.Tensor] = None, lazy: bool = False) -> PackedWeight:
        """A tensor loaded by load_compressed in the kernel's form (scales and zeros derived from scale, minimum,
        unless kept ones are given; lazy: at the kernel's first product, PackedWeight.from_stored), its results in
        `dtype`; multiplied by the kernel, or (kernel False) expanded a few row blocks at a time."""
        return PackedWeight.from_stored(ct, dtype, kernel, scales, lazy)

    def expand(self, ct: CompressedTensor, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(from_kernel_order(ct), dtype)

    def expand_into(self, ct: CompressedTensor, out: torch.Tensor) -> torch.Tensor:
        return expand_kernel_order(ct, out)
