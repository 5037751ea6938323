"""A decode step's attention over a quantized block in one compiled call (compress/fused_decode_kernels.py, numba):
the query's rotation, the logits from the key levels, outliers and exact ring, the softmax, the value mix from the
value levels and the ring, and the output's rotation back, for every (row, KV head) pair in one parallel region.
compress/fused_attend.py's reader runs the same arithmetic as five kernels with about 30 torch ops and four small
matmuls between them, each a pass that wakes the thread pool; on 2 busy cores those, not the levels' reads, were
most of a layer's attention.

It takes the default scheme's forms (`fits`): keys per channel with evenly spaced levels and values per token in
whole groups, both rotated or neither, with or without an exact ring (exact or 8-bit entries), on the CPU. Any other
form, or a machine where the kernel does not load or disagrees with the reader on a small block (`kernel`), is read
by fused_attend.py's reader as before.
"""
from __future__ import annotations

import functools
from typing import Optional

import numpy as np
import torch

from flexh2o.compress import fused_attend, fused_step, qread_native
from flexh2o.compress.channel import ChannelKeys
from flexh2o.compress.codec import CompressedTensor
from flexh2o.compress.form import CacheForm
from flexh2o.compress.recent import Recent
from flexh2o.compress.rotation import Rotated, hadamard


def _parts(form) -> tuple:
    """(the levels form inside `form`, whether it is rotated, its Recent ring or None)."""
    ring = form if isinstance(form, Recent) else None
    inner = form.inner if ring is not None else form
    rotated = isinstance(inner, Rotated)
    return (inner.inner if rotated else inner), rotated, ring


def fits(keys, values, q: torch.Tensor) -> bool:
    """Whether the one-call read takes keys and values of these forms with query q (module docstring)."""
    if not (isinstance(keys, CacheForm) and isinstance(values, CacheForm)) or q.device.type != "cpu":
        return False
    (k, rk, _), (v, rv, _) = _parts(keys), _parts(values)
    return (isinstance(k, ChannelKeys) and not k.spec.fitted and isinstance(v, CompressedTensor)
            and v.whole_groups() and rk == rv and k.data.device.type == "cpu" and v.data.device.type == "cpu")


@functools.lru_cache(maxsize=1)
def kernel():
    """The compiled kernel module, checked once a process on a small block (`_check`); None where it cannot run."""
    try:
        from flexh2o.compress.kernel_cache import kernel_cache
        with kernel_cache():  # numba's cache keyed by every kernel file's source (compress/kernel_cache.py)
            from flexh2o.compress import fused_decode_kernels
        _check(lambda q, keys, values, pos: _numba(fused_decode_kernels, q, keys, values, pos, None, True))
        return fused_decode_kernels
    except Exception:  # no numba, a compile failure or a disagreement: fused_attend.py's reader reads the block
        return None


@functools.lru_cache(maxsize=8)
def _rotation(d: int) -> tuple:
    """(H, H^T) of head_dim d as contiguous fp32 numpy arrays (read only)."""
    h = hadamard(d, "cpu")
    return h.contiguous().numpy(), h.T.contiguous().numpy()


@functools.lru_cache(maxsize=8)
def _orders(d: int, kbits: int, size: int, vbits: int) -> tuple:
    """(the keys' phase order of d channels at kbits, a value group's channel order of `size` at vbits) as int64
    numpy arrays, made once (read only)."""
    return fused_attend.phase_order(d, kbits).numpy(), fused_attend.channel_order(size, vbits).numpy()


def _ring(ring, like: torch.Tensor) -> tuple:
    """The ring's entries (b, h, E, d) fp32 in the model's basis and their slots (b, h, E) int32 (E = 0: none)."""
    if ring is None:
        b, h = like.shape[:2]
        return torch.zeros(b, h, 0, like.shape[-1]), torch.zeros(b, h, 0, dtype=torch.int32)
    return ring.ring(torch.float32), ring.rslot


def attend(kn, q: torch.Tensor, keys, values, pos: torch.Tensor, softcap, want: bool) -> tuple:
    """q (b, h, g, d) in the compute dtype, model basis; keys, values: a segment's cut forms (`fits`), their slot
    count `used`; pos (b, h, >= used) -> (out (b, h, g, d) in q's dtype, model basis; the probabilities summed over
    g (b, h, used) fp32 when `want`, else None)."""
    lib = native()
    if lib is not None and native_takes(keys, values, q, pos):
        return _native(lib, q, keys, values, pos, softcap, want)
    return _numba(kn, q, keys, values, pos, softcap, want)


def _numba(kn, q: torch.Tensor, keys, values, pos: torch.Tensor, softcap, want: bool) -> tuple:
    """attend's read by the numba kernel."""
    args, psum, out = _read_args(q, keys, values, pos, softcap, want)
    fused_attend._threads(kn)
    kn.attend(*args)
    return out.to(q.dtype), (psum if want else None)


def step_attend(kn, write: tuple, q: torch.Tensor, keys, values, pos: torch.Tensor, softcap, want: bool) -> tuple:
    """A decode step's write and `attend` in one call (the C code's qstep where `native` runs, else the numba
    kernel's step_attend; both write the numba kernel's bytes): write, compress/fused_step.py's write_args of the
    block's new token (the block's parts whole); the rest as attend's, the parts cut to the slots read (they must
    hold the slots written). -> attend's (out, probabilities summed or None)."""
    lib = native()
    if lib is not None and native_takes(keys, values, q, pos):  # each pair written (the numba kernel's bytes), read
        return _native(lib, q, keys, values, pos, softcap, want, write)
    args, psum, out = _read_args(q, keys, values, pos, softcap, want)
    fused_attend._threads(kn)
    kn.step_attend(*write, *args)
    return out.to(q.dtype), (psum if want else None)


@functools.lru_cache(maxsize=1)
def native():
    """compress/qread_native.py's library for torch's instruction set where it builds and its read of a small
    block equals fused_attend.py's torch read within fp32 noise (`_check`); None otherwise (the numba kernel
    reads)."""
    lib = qread_native.library()
    if lib is None:
        return None
    try:
        _check(lambda q, keys, values, pos: _native(lib, q, keys, values, pos, None, True), 64, 2)
    except RuntimeError:
        return None
    return lib


def native_takes(keys, values, q: torch.Tensor, pos: torch.Tensor) -> bool:
    """Whether the C read takes these forms (`fits` already holds) and positions."""
    (k, _, _), (v, _, _) = _parts(keys), _parts(values)
    return pos.dtype == torch.int64 and qread_native.takes(k, v, q.shape[-1])


def _native(lib, q: torch.Tensor, keys, values, pos: torch.Tensor, softcap, want: bool,
            write: Optional[tuple] = None) -> tuple:
    """attend's read by the C code (compress/qread_native.py), each pair written first where `write` is given."""
    (k, rot, kring), (v, _, vring) = _parts(keys), _parts(values)
    rk, sk = _ring(kring, q)
    rv, sv = _ring(vring, q)
    hm = hadamard(q.shape[-1], "cpu") if rot else None
    out, psum = qread_native.attend(lib, q.float().contiguous(), k, v, (rk, sk, rv, sv), hm, pos, softcap, want,
                                    write)
    return out.to(q.dtype), psum


def _read_args(q: torch.Tensor, keys, values, pos: torch.Tensor, softcap, want: bool) -> tuple:
    """(the kernel's arguments of attend, the summed probabilities' and the output's tensors)."""
    (k, rot, kring), (v, _, vring) = _parts(keys), _parts(values)
    b, h, g, d = q.shape
    used, size = k.data.shape[2], v.spec.group_size
    hm, ht = _rotation(d) if rot else (np.zeros((1, 1), np.float32),) * 2
    rk, sk = _ring(kring, q)
    rv, sv = _ring(vring, q)
    psum = torch.empty(b, h, used) if want else torch.empty(1, 1, used)
    out = torch.empty(b, h, g, d)
    kph, vorder = _orders(d, k.spec.bits, size, v.spec.bits)
    return (q.float().contiguous().numpy(), hm, ht, rot, kph, *fused_attend._flat(k.data), k.index.numpy(),
            k.exact_values().numpy(), k.calib.float().numpy(), k.spec.bits, vorder, *fused_attend._flat(v.data),
            v.meta.float().numpy(), v.spec.bits, pos.numpy(), rk.numpy(), sk.numpy(), rv.numpy(), sv.numpy(),
            d ** -0.5, float(softcap or 0.0), want, psum.numpy(), out.numpy()), psum, out


def _check(read, d: int = 32, groups: int = 2) -> None:
    """read(q, keys, values, pos) -> (out, psum) of a small block (keys per channel with outliers, values in
    `groups` groups, 4 bits, head dimension d) equals fused_attend.py's torch read (logits, softmax, mix) within
    fp32 noise; RuntimeError otherwise."""
    from flexh2o.compress import attend as levels
    from flexh2o.compress.fused_check import small_form

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 2, 5, d, generator=gen)
    keys, values = small_form("channel", 4, x), small_form("token", 4, x, groups)
    q = torch.randn(2, 2, 3, d, generator=gen)
    pos = torch.arange(5).expand(2, 2, 5).clone()
    pos[0, 0, 1] = -1
    att = (levels.logits(q, keys) * d ** -0.5).masked_fill((pos < 0)[:, :, None], float("-inf")).softmax(-1)
    want, want_sum = levels.mix(att, values, torch.float32), att.sum(2)
    got, got_sum = read(q, keys, values, pos)
    for a, w in ((got, want), (got_sum, want_sum)):
        if not torch.allclose(a, w, rtol=0, atol=1e-4 * (1 + float(w.abs().max()))):
            raise RuntimeError("the one-call decode kernel disagrees with the levels read")
