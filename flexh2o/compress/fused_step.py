"""A decode step's new token written into a quantized block by one compiled call (compress/fused_quant_kernels.py's
step_put, numba): the free slot, both rotations, the keys per channel with their outliers, the values' groups, both
exact rings, and the slot's position and score. kv/cache.py's KVBlock.append asks here first; where the call does not
apply (`parts` is None) the block's forms write themselves as before (compress/fused_write.py's separate kernels,
or the torch code). What it stores equals the separate kernels' bit for bit (the same per-token bodies).

It takes the default scheme's forms on the CPU: keys per channel with evenly spaced levels and outliers in the
storage dtype, values per token in whole groups, each rotated or not, each with an exact ring in the storage dtype
or none, where that dtype (the scales, minimums, outliers and ring entries) is fp32; anything else (fitted levels,
fp8 outliers, 8-bit ring entries, 16-bit storage, another device, FLEXH2O_CACHE_KERNEL=torch) is written by the
forms.
"""
from __future__ import annotations

from typing import Optional

import torch

from flexh2o.compress import fused_write
from flexh2o.compress.channel import ChannelKeys
from flexh2o.compress.codec import CompressedTensor
from flexh2o.compress.form import CacheForm
from flexh2o.compress.recent import Recent
from flexh2o.compress.rotation import Rotated, hadamard

F32 = torch.float32


def kernel():
    """The write kernels' module (step_put among them) where compress/fused_write.py's kernels run (the same switch
    and self-check), else None."""
    return fused_write.kernels()


def _unwrapped(form) -> tuple:
    """(the levels form, whether rotated, the ring's (rslot, entries, window, sinks) or None)."""
    ring = None
    if isinstance(form, Recent):
        ring, form = (form.rslot, form.recent, form.window, form.sinks), form.inner
    rotated = isinstance(form, Rotated)
    return (form.inner if rotated else form), rotated, ring


def _ring_ok(ring) -> bool:
    return ring is None or (isinstance(ring[1], torch.Tensor) and ring[1].dtype == F32 and ring[0].dtype == torch.int32)


def parts(keys, values, pos: torch.Tensor, score: torch.Tensor) -> Optional[tuple]:
    """((keys' levels form, rotated, ring), (values' ...)) where the one call writes these forms and a block's pos
    (int64) and score (fp32) (module docstring), else None."""
    if not (isinstance(keys, CacheForm) and isinstance(values, CacheForm)) or pos.dtype != torch.int64 or \
            score.dtype != F32 or pos.device.type != "cpu" or score.device.type != "cpu":
        return None
    (k, rk, ringk), (v, rv, ringv) = _unwrapped(keys), _unwrapped(values)
    if not (isinstance(k, ChannelKeys) and isinstance(v, CompressedTensor)):
        return None
    ok = (not k.spec.fitted and not k.spec.fp8 and k.exact.dtype == F32 and k.calib.dtype == F32
          and k.index.dtype in (torch.uint8, torch.int16) and v.whole_groups() and v.meta.dtype == F32
          and _ring_ok(ringk) and _ring_ok(ringv)
          and all(t.device.type == "cpu" for t in (k.data, k.index, k.exact, k.calib, v.data, v.meta)))
    return ((k, rk, ringk), (v, rv, ringv)) if ok else None


def _ring_args(ring, b: int, h: int, d: int) -> tuple:
    if ring is None:
        return (torch.empty(b, h, 0, dtype=torch.int32).numpy(), torch.empty(b, h, 0, d).numpy(), 0, 0)
    rslot, recent, window, sinks = ring
    return rslot.numpy(), recent.numpy(), window, sinks


def append(kn, found: tuple, pos: torch.Tensor, score: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           cur_pos: torch.Tensor, in_order: bool) -> torch.Tensor:
    """k, v (b, h, d) of a step's new token of each row at positions cur_pos (b,) into the forms `found` (`parts`)
    and pos / score (b, h, S), in place -> the slots written (b, h) int64 (in order: each row's position, else its
    first empty slot)."""
    (kf, rotk, ringk), (vf, rotv, ringv) = found
    b, h, d = k.shape
    slot = torch.empty(b, h, dtype=torch.int64)
    hk = hadamard(d, "cpu").numpy() if rotk or rotv else torch.zeros(1, 1).numpy()
    kn.step_put(k.to(F32).contiguous().numpy(), v.to(F32).contiguous().numpy(),
                cur_pos.to(torch.int64).contiguous().numpy(), in_order, hk, rotk, hk, rotv, pos.numpy(),
                score.numpy(), slot.numpy(), kf.data.numpy(), kf.index.numpy(), kf.exact.numpy(),
                kf.calib.numpy(), kf.spec.bits, vf.data.numpy(), vf.meta.numpy(), vf.spec.bits,
                *_ring_args(ringk, b, h, d), *_ring_args(ringv, b, h, d))
    return slot
