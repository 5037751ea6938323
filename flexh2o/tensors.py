"""Small tensor helpers: moved(), a tensor on a device in a dtype, without a dispatcher call when it is there
already; flat_slots(), the flat index of (row, head, slot) entries of a (b, h, s, ...) cache tensor; row_extents(),
each row's slots up to its last used one (read by the cache, attention and the policies alike);
native_products(), whether this CPU multiplies a dtype by its own AVX-512 kernels.

A no-op `Tensor.to` still costs a trip through torch's dispatcher (a few microseconds); a decode step of a
memory-resident model asked for ~400 of them (every weight, cache field and query, every layer), a third of its
aten calls against plain transformers."""
from __future__ import annotations

import functools
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


@functools.lru_cache(maxsize=None)
def native_products(dtype: torch.dtype) -> bool:
    """Whether this process's CPU matmuls in `dtype` run by kernels of that dtype at AVX-512 width (decided once a
    dtype): fp32 anywhere; a 16-bit dtype where ATen's kernels are AVX-512 (not held to AVX2 by
    ATEN_CPU_CAPABILITY) and oneDNN says it has kernels for the dtype (torch.ops.mkldnn._is_mkldnn_bf16_supported,
    _is_mkldnn_fp16_supported). Elsewhere a 16-bit product may crawl (fp16 on an AVX2 Zen 3: 0.87 GFLOP/s)."""
    if dtype == torch.float32:
        return True
    supported = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}
    check = getattr(torch.ops.mkldnn, supported.get(dtype, ""), None) if torch.backends.mkldnn.is_available() else None
    return bool(check is not None and torch.backends.cpu.get_cpu_capability().startswith("AVX512") and check())
