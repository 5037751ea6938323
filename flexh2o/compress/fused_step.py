"""A decode step's new token written into a quantized block by one compiled call (compress/fused_quant_kernels.py's
step_put, numba): the free slot, both rotations, the keys per channel with their outliers, the values' groups, both
exact rings, and the slot's position and score. kv/cache.py's KVBlock.append asks here first (and kv/decode.py, where
the rows hold their tokens in order, hands `write_args` to compress/fused_decode.py's step_attend, which writes and
reads in one call); where the call does not apply (`parts` is None) the block's forms write themselves as before
(compress/fused_write.py's separate kernels, or the torch code). What it stores equals the separate kernels' bit for
bit (the same per-token bodies).

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
from flexh2o.compress.form import as_form
from flexh2o.compress.rotation import hadamard

F32 = torch.float32


def kernel():
    """The write kernels' module (step_put among them) where compress/fused_write.py's kernels run (the same switch
    and self-check), else None."""
    return fused_write.kernels()


def parts(keys, values, pos: torch.Tensor, score: torch.Tensor) -> Optional[tuple]:
    """((keys' levels form, rotated, ring), (values' ...)) where the one call writes these forms and a block's pos
    (int64) and score (fp32) (module docstring), else None. Each form says what it offers (CacheForm.step_parts:
    decided by its own scheme, no ladder of types here)."""
    if pos.dtype != torch.int64 or score.dtype != F32 or pos.device.type != "cpu" or score.device.type != "cpu":
        return None
    k, v = as_form(keys).step_parts(), as_form(values).step_parts()
    if k is None or v is None or k[1] != "channel" or v[1] != "group":
        return None
    return (k[0], k[2], k[3]), (v[0], v[2], v[3])


def _ring_args(ring, b: int, h: int, d: int) -> tuple:
    if ring is None:
        return (torch.empty(b, h, 0, dtype=torch.int32).numpy(), torch.empty(b, h, 0, d).numpy(), 0, 0)
    rslot, recent, window, sinks = ring
    return rslot.numpy(), recent.numpy(), window, sinks


def write_args(found: tuple, pos: torch.Tensor, score: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               cur_pos: torch.Tensor, in_order: bool) -> tuple:
    """(step_put's arguments for the new token k, v (b, h, d) of each row at positions cur_pos (b,) into the forms
    `found` (`parts`) and pos / score (b, h, S), the slots (b, h) int64 it writes them into)."""
    (kf, rotk, ringk), (vf, rotv, ringv) = found
    b, h, d = k.shape
    slot = torch.empty(b, h, dtype=torch.int64)
    hk = hadamard(d, "cpu").numpy() if rotk or rotv else torch.zeros(1, 1).numpy()
    return (k.to(F32).contiguous().numpy(), v.to(F32).contiguous().numpy(),
            cur_pos.to(torch.int64).contiguous().numpy(), in_order, hk, rotk, hk, rotv, pos.numpy(), score.numpy(),
            slot.numpy(), kf.data.numpy(), kf.index.numpy(), kf.exact.numpy(), kf.calib.numpy(), kf.spec.bits,
            vf.data.numpy(), vf.meta.numpy(), vf.spec.bits, *_ring_args(ringk, b, h, d),
            *_ring_args(ringv, b, h, d)), slot


def append(kn, found: tuple, pos: torch.Tensor, score: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           cur_pos: torch.Tensor, in_order: bool) -> torch.Tensor:
    """k, v (b, h, d) of a step's new token of each row at positions cur_pos (b,) into the forms `found` (`parts`)
    and pos / score (b, h, S), in place -> the slots written (b, h) int64 (in order: each row's position, else its
    first empty slot)."""
    args, slot = write_args(found, pos, score, k, v, cur_pos, in_order)
    kn.step_put(*args)
    return slot
