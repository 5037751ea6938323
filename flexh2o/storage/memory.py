"""Memory tiers: host memory (cpu tier, and the gpu tier on a CPU-only machine) and CUDA memory."""
from __future__ import annotations

from typing import Optional

import torch

from flexh2o.storage.base import Tier, nbytes_of, scatter_slots
from flexh2o.tensors import moved


class MemoryTier(Tier):
    """Tensors in memory on `device`. Loading to the same device and dtype returns the tensor itself (no copy)."""

    def __init__(self, name: str, device: torch.device, capacity: int, pin: bool = False):
        super().__init__(capacity)
        self.name = name
        self.device = torch.device(device)
        self.pin = pin and self.device.type == "cpu" and torch.cuda.is_available()

    def alloc(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        self._reserve(nbytes_of(shape, dtype))
        t = torch.empty(shape, dtype=dtype, device=self.device)
        return t.pin_memory() if self.pin else t

    def load(self, handle: torch.Tensor, device: torch.device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        self.bytes_loaded += handle.numel() * handle.element_size()
        return moved(handle, torch.device(device), dtype, non_blocking=True)

    def store(self, handle: torch.Tensor, tensor: torch.Tensor, slots: Optional[torch.Tensor] = None) -> None:
        if tensor.data_ptr() == handle.data_ptr() and tensor.dtype == handle.dtype:
            self.bytes_stored += _dirty_bytes(tensor, slots)
            return  # computed in place
        if slots is None:
            handle.copy_(tensor, non_blocking=True)
        else:
            scatter_slots(handle, tensor, slots)
        self.bytes_stored += _dirty_bytes(handle, slots)

    def free(self, handle: torch.Tensor) -> None:
        self._release(handle.numel() * handle.element_size())


def _dirty_bytes(t: torch.Tensor, slots: Optional[torch.Tensor]) -> int:
    if slots is None:
        return t.numel() * t.element_size()
    per_row = slots.shape[2] if slots.dim() == 3 else 1  # slots written per (row, head)
    return t.numel() // t.shape[2] * per_row * t.element_size()
