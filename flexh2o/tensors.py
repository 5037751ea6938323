"""Small tensor helpers: moved(), a tensor on a device in a dtype, without a dispatcher call when it is there
already; flat_slots(), the flat index of (row, head, slot) entries of a (b, h, s, ...) cache tensor; row_extents(),
each row's slots up to its last used one (read by the cache, attention and the policies alike).

A no-op `Tensor.to` still costs a trip through torch's dispatcher (a few microseconds); a decode step of a
memory-resident model asked for ~400 of them (every weight, cache field and query, every layer), a third of its
aten calls against plain transformers."""
from __future__ import annotations

from typing import Optional

import torch


def moved(t: torch.Tensor, device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None,
          non_blocking: bool = False) -> torch.Tensor:
    """t itself when it already lives on `device` (None: its own) in `dtype` (None: its own), else t.to(...)."""
    if (device is None or t.device == device) and (dtype is None or t.dtype == dtype):
        return t
    return t.to(device=device if device is not None else t.device, dtype=dtype or t.dtype, non_blocking=non_blocking)


def flat_slots(b: int, h: int, s: int, slot: torch.Tensor) -> torch.Tensor:
    """slot (b, h[, ...]) or (b, 1[, ...]) int64, each a slot of its row and head -> (n,) indexes into a contiguous
    (b, h, s, ...) tensor seen as (b * h * s, ...), in slot's order (broadcast over heads): one index_copy_ writes
    them all, where advanced indexing or a 16-bit scatter_ costs several times more on the CPU."""
    base = torch.arange(0, b * h * s, s, device=slot.device).view(b, h, *(1,) * (slot.dim() - 2))
    return (base + slot).reshape(-1)


def row_extents(pos: torch.Tensor) -> list:
    """pos (b, h, s) -> per row, its slots up to the last one any of its heads uses (the whole width off the CPU:
    reading it would make the host wait for the device)."""
    b, s = pos.shape[0], pos.shape[-1]
    if pos.device.type != "cpu":
        return [s] * b
    used = (pos >= 0).any(1)  # (b, s)
    last = s - used.flip(-1).to(torch.int8).argmax(-1)  # one past the last used slot (s when none is used)
    return torch.where(used.any(-1), last, 0).tolist()
