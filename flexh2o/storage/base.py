"""The one interface every tier implements: gpu, cpu and disk are interchangeable homes for tensors."""
from __future__ import annotations

from typing import Optional

import torch


class TierError(RuntimeError):
    """A tier cannot do what the run asks (full, or its storage failed under the run); the message is one line
    naming the tier, the place and the fix."""


class TierFullError(TierError):
    """Raised when an allocation would pass a tier's capacity (the pre-flight plan should prevent it)."""


class Tier:
    """A home for tensors with an enforced capacity and byte counters.

    alloc(shape, dtype) -> handle      reserve space (contents undefined)
    load(handle, device, dtype) -> t   the tensor on the compute side; no copy when already there
    store(handle, tensor, slots=None)  write back (all, or only `slots`: index along dim 2)
    write_from(handle, chunks)         write consecutive flat pieces (a tensor too large to build whole)
    free(handle)                       release the space
    close()                            release everything (and, for disk, remove the files)
    """

    name = "tier"

    def __init__(self, capacity: int):
        self.capacity = int(capacity)
        self.used = 0
        self.peak = 0
        self.bytes_loaded = 0
        self.bytes_stored = 0

    def _reserve(self, nbytes: int) -> None:
        if self.used + nbytes > self.capacity:
            raise TierFullError(f"{self.name} tier is full: {self.used + nbytes} bytes needed, "
                                f"{self.capacity} available (raise --{self.name}-mem)")
        self.used += nbytes
        self.peak = max(self.peak, self.used)

    def _release(self, nbytes: int) -> None:
        self.used -= nbytes

    def charge(self, nbytes: int) -> None:
        """Count a working buffer (not enforced: the pre-flight plan sized it) so the peak is reported honestly."""
        self.used += nbytes
        self.peak = max(self.peak, self.used)

    def refund(self, nbytes: int) -> None:
        self.used -= nbytes

    def alloc(self, shape: tuple, dtype: torch.dtype):
        raise NotImplementedError

    def load(self, handle, device: torch.device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        raise NotImplementedError

    def store(self, handle, tensor: torch.Tensor, slots: Optional[torch.Tensor] = None) -> None:
        raise NotImplementedError

    def write_from(self, handle, chunks) -> None:
        """Fill a handle from consecutive flat pieces; the default copies each into a flat view of the handle."""
        flat, start = handle.view(-1), 0
        for c in chunks:
            flat[start:start + c.numel()].copy_(c)
            start += c.numel()

    def free(self, handle) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of `t` as a flat uint8 tensor (no copy when `t` is contiguous)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def nbytes_of(shape: tuple, dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= int(d)
    return n


def scatter_slots(dst: torch.Tensor, src: torch.Tensor, slots: torch.Tensor) -> None:
    """dst[b, h, slots[b, h], ...] = src[b, h, slots[b, h], ...] for tensors shaped (b, h, s, ...); slots (b, h) or
    (b, h, n) for n slots per row."""
    slots = slots if slots.dim() == 3 else slots[..., None]  # (b, h, n)
    idx = slots.view(*slots.shape, *([1] * (src.dim() - 3)))
    idx = idx.expand(*slots.shape, *src.shape[3:]).to(src.device)
    picked = torch.gather(src, 2, idx)
    dst.scatter_(2, idx.to(dst.device), picked.to(dst.device, dst.dtype))
