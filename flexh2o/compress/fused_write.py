"""Writing a quantized cache's stored form in one pass: the keys per channel with their outliers, the per-token
groups of values and the exact ring's entries by compiled kernels (compress/fused_quant_kernels.py, numba) instead
of a dozen torch ops each (a decode step's new token: each op's thread wake-up costs more than its work; a
prompt's tokens: the outliers' top-k and the passes of the levels). The results equal the torch code's bit for bit
(compress/channel.py's quantize_token, compress/codec.py's quantize, compress/recent.py's remember).

The kernels run unless FLEXH2O_CACHE_KERNEL=torch (compress/fused_attend.py's switch), where numba loads and a
self-check here agrees with the torch code; each function returns None where they do not apply (another device,
fitted levels, ragged groups, 8-bit ring entries), and the caller runs the torch code.
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch

from flexh2o.compress import fused_check
from flexh2o.compress.channel import FP8_MAX, ChannelKeys
from flexh2o.compress.codec import CompressedTensor, _round_down, _round_up
from flexh2o.compress.form import as_form

PARALLEL_FROM = 1 << 17  # values written at once from which the kernels run on numba's threads (a decode step's
# new tokens, 32 rows x 12 heads x 64 values, run on the calling thread: waking the pool costs more than they do)


def kernels():
    """The write kernels module, or None under FLEXH2O_CACHE_KERNEL=torch, without numba, or where they fail their
    self-check (decided once a process and mode; numba's threads set up as the fused reader sets them)."""
    return _loaded(os.environ.get(fused_check.ENV, "auto"))


@functools.lru_cache(maxsize=4)
def _loaded(mode: str):
    if mode == "torch":
        return None
    try:
        fused_check.load(lambda kn: None)  # numba's thread-safe threading layer and passive threads, once
        from flexh2o.compress.kernel_cache import kernel_cache
        with kernel_cache():  # numba's cache keyed by every kernel file's source (compress/kernel_cache.py)
            from flexh2o.compress import fused_quant_kernels as kn
        _self_check(kn)
        return kn
    except Exception:  # numba missing or broken, a kernel that fails or disagrees: the torch code writes the cache
        return None


def _self_check(kn) -> None:
    """The kernels' keys and values of a small random block equal the torch code's (a kernel miscompiled here)."""
    from flexh2o.compress.channel import ChannelSpec, quantize_token
    from flexh2o.compress.codec import CacheGroupSpec, quantize

    gen = torch.Generator().manual_seed(0)
    for bits in (2, 3, 4, 8):
        x = torch.randn(3, 5, 32, generator=gen)
        calib = torch.stack([x.std(1) / 4, x.amin(1)], -1)[:, None]  # (3, 1, 32, 2): some values clamp
        spec = ChannelSpec(bits, 4)
        got, want = _channel(kn, x, calib, spec, torch.float32), quantize_token(x, calib, spec, torch.float32)
        cspec = CacheGroupSpec(bits, 16, -1)
        pairs = list(zip(got, want))
        for dtype in (torch.float32, torch.bfloat16):  # one pass; rounded to the storage dtype by torch
            got_v, want_v = _groups(kn, x, cspec, dtype), quantize(x, cspec, dtype)
            pairs += [(got_v.data, want_v.data), (got_v.meta, want_v.meta)]
        if not all(torch.equal(a, b) for a, b in pairs):
            raise RuntimeError(f"the write kernels disagree with the torch code at {bits} bits")


def channel_token(x: torch.Tensor, calib: torch.Tensor, spec, dtype: torch.dtype) -> Optional[tuple]:
    """compress/channel.py's quantize_token(x, calib, spec, dtype) by the kernel, or None where it does not run:
    x (..., d), calib (..., d, 2) with x's leading shape, or with 1 in x's slot dimension (a range of slots)."""
    if spec.fitted or x.device.type != "cpu" or calib.device.type != "cpu":
        return None
    lead, d = tuple(x.shape[:-1]), x.shape[-1]
    cl = tuple(calib.shape[:-2])
    per = 1 if cl == lead else (lead[-1] if cl == lead[:-1] + (1,) else 0)
    kn = kernels() if per else None
    if kn is None:
        return None
    return _channel(kn, x, calib, spec, dtype)


def _channel(kn, x: torch.Tensor, calib: torch.Tensor, spec, dtype: torch.dtype) -> tuple:
    lead, d = tuple(x.shape[:-1]), x.shape[-1]
    n = spec.outliers
    xf = x.float().reshape(-1, d).contiguous()  # (N, d)
    cf = calib.float().reshape(-1, d, 2).contiguous()  # (N / per, d, 2)
    per = xf.shape[0] // cf.shape[0]
    data = torch.empty(xf.shape[0], d * spec.bits // 8, dtype=torch.uint8)
    index = torch.empty(xf.shape[0], n, dtype=torch.int64)
    exact = torch.empty(xf.shape[0], n)
    quant = _pick(kn, "channel_quant", xf.numel())
    quant(xf.numpy(), cf.numpy(), per, spec.bits, data.numpy(), index.numpy(), exact.numpy())
    return data.view(lead + (-1,)), index.view(lead + (n,)), exact.view(lead + (n,)).to(dtype)


def group_quant(x: torch.Tensor, spec, dtype: torch.dtype) -> Optional[CompressedTensor]:
    """compress/codec.py's quantize(x, spec, dtype) for groups along the last dimension of x, by the kernels; None
    where they do not run (another device, another grouped dimension, a ragged group)."""
    d = x.shape[-1]
    if x.device.type != "cpu" or spec.dim(x.dim()) != x.dim() - 1 or d % spec.group_size:
        return None
    kn = kernels()
    return None if kn is None else _groups(kn, x, spec, dtype)


def _groups(kn, x: torch.Tensor, spec, dtype: torch.dtype) -> CompressedTensor:
    dtype = spec.scale_dtype or dtype
    lead, d = tuple(x.shape[:-1]), x.shape[-1]
    groups = d // spec.group_size
    xf = x.float().reshape(-1, d).contiguous()  # (N, d)
    data = torch.empty(xf.shape[0], groups, spec.group_size * spec.bits // 8, dtype=torch.uint8)
    if dtype == torch.float32:  # nothing to round to the storage dtype: one pass
        meta = torch.empty(xf.shape[0], groups, 2)
        _pick(kn, "group_quant32", xf.numel())(xf.numpy(), spec.bits, data.numpy(), meta.numpy())
        return CompressedTensor(data.view(lead + data.shape[1:]), meta.view(lead + meta.shape[1:]), d, spec)
    span = torch.empty(xf.shape[0], groups, 2)
    _pick(kn, "group_minmax", xf.numel())(xf.numpy(), spec.group_size, span.numpy())
    lo = _round_down(span[..., 0], dtype)  # (N, groups), as codec.quantize rounds them
    scale = _round_up((span[..., 1] - lo.float()) / spec.levels, dtype)
    levels = _pick(kn, "group_levels", xf.numel())
    levels(xf.numpy(), lo.float().contiguous().numpy(), scale.float().contiguous().numpy(), spec.bits, data.numpy())
    meta = torch.stack([scale, lo], -1)
    return CompressedTensor(data.view(lead + data.shape[1:]), meta.view(lead + meta.shape[1:]), d, spec)


def assign(dst, index: tuple, values: torch.Tensor) -> bool:
    """dst[index] = values quantized (codec.assign's write) by the kernels, where the form has a kernel write of its
    own (it says which: CacheForm.kernel_assign): True when done here, False where the caller writes."""
    return as_form(dst).kernel_assign(index, values, WRITE)


class KernelWrite:
    """The kernels' writes a cache form asks for (CacheForm.kernel_assign): True when written, False where they do
    not run (the caller writes with the torch code)."""

    def channel_assign(self, dst: ChannelKeys, index: tuple, values: torch.Tensor) -> bool:
        """Keys per channel (ChannelKeys.assign's steps: the rows' calibration, fp8 outliers)."""
        return _assign_keys(dst, index, values)

    def group_assign(self, dst: CompressedTensor, index: tuple, values: torch.Tensor) -> bool:
        """A CompressedTensor grouped along its last dimension, on the CPU (codec.quantize's groups)."""
        if dst.data.device.type != "cpu":
            return False
        ct = group_quant(values, dst.spec, dst.dtype)
        if ct is None:
            return False
        dst.data[index] = ct.data
        dst.meta[index] = ct.meta
        return True


WRITE = KernelWrite()  # holds nothing: the kernels are looked up at each write (`kernels`)


def _assign_keys(dst: ChannelKeys, index: tuple, values: torch.Tensor) -> bool:
    """ChannelKeys.assign with quantize_token's kernel (the same steps: the rows' calibration, fp8 outliers)."""
    calib = dst.calib[index[0], index[1]]  # (..., d, 2) per row and head
    if values.dim() == calib.dim():  # a range of slots per row and head: one calibration for all of them
        calib = calib.unsqueeze(-3)
    got = channel_token(values, calib, dst.spec, dst.dtype)
    if got is None:
        return False
    data, idx, exact = got
    if dst.spec.fp8:
        exact = exact.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    dst.data[index], dst.index[index], dst.exact[index] = data, idx.to(dst.index.dtype), exact
    return True


def ring_put(rslot: torch.Tensor, recent, slot: torch.Tensor, pos: torch.Tensor, window: int, sinks: int,
             values: torch.Tensor) -> bool:
    """compress/recent.py's remember for a ring of entries in the storage dtype on the CPU: rslot (b, h, E),
    recent (b, h, E, d), slot (b, h), pos (b,), values (b, h, d); True when done here, False otherwise."""
    if not isinstance(recent, torch.Tensor) or recent.device.type != "cpu" or not recent.is_contiguous():
        return False
    kn = kernels()
    if kn is None or rslot.dtype != torch.int32:
        return False
    b, h, e, _ = recent.shape
    vals = values.to(recent.dtype).contiguous().view(torch.uint8).view(b, h, -1)  # (b, h, d * itemsize)
    raw = recent.view(torch.uint8).view(b, h, e, vals.shape[-1])  # the entries' bytes
    kn.ring_put(rslot.numpy(), raw.numpy(), slot.to(torch.int32).contiguous().numpy(),
                pos.to(torch.int64).contiguous().numpy(), window, sinks, vals.numpy())
    return True


def _pick(kn, name: str, values: int):
    """Kernel `name` over numba's threads (as many as torch uses) for PARALLEL_FROM values or more, else its
    one-thread build."""
    if values < PARALLEL_FROM:
        return getattr(kn, name + "_1")
    kn.numba.set_num_threads(max(1, min(torch.get_num_threads(), kn.numba.config.NUMBA_NUM_THREADS)))
    return getattr(kn, name)
