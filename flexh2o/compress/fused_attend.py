"""Decode attention over a quantized cache block, fused: the logits and the value mix taken straight from the
packed levels, slot by slot, by compiled kernels (compress/fused_kernels.py, numba), no block of levels or of
expanded values ever materialised. compress/attend.py's levels read casts every kept slot's levels to the compute
dtype (one block the size of the plain cache, a dozen passes) before its matmuls; here each slot's levels are
unpacked into a buffer of head_dim floats that the products read at once. The algebra is attend.py's:
  keys per channel     q.k[t] = (q * scale) . lev[t] + q . lo, plus each outlier's (exact - middle) q[c]
  per-token groups     q.k[t] = sum_G scale[t, G] (q_G . lev[t, G]) + lo[t, G] sum(q_G)
                       sum_t p[t] v[t, G] = sum_t (p[t] scale[t, G]) lev[t, G] + p[t] lo[t, G]
The exact ring (compress/recent.py) and the rotation are read as attend.py reads them, around the fused inner read;
fitted key levels, ragged groups and blocks off the CPU go to attend.py.

The reader is chosen once a process (`reader`): the fused one where numba imports, its kernels compile for this CPU
and a self-check on a small block agrees with attend.py's read; else attend.py's, with the reason. The environment
variable FLEXH2O_CACHE_KERNEL forces one: auto (the default), fused (an error when it cannot run) or torch.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional

import torch

from flexh2o.compress import attend, fused_check
from flexh2o.compress.channel import ChannelKeys
from flexh2o.compress.form import as_form
from flexh2o.compress.rotation import rotate, unrotate

ENV = fused_check.ENV
MODES = ("auto", "fused", "torch")


@dataclass(frozen=True)
class Reader:
    """How decode reads a quantized block: `name` fused or torch, `why` the reason, `kernels` the compiled CPU
    module; `gpu`: a block on a CUDA device is read by the Triton kernels where they run (compress/fused_triton.py)."""

    name: str
    why: str
    kernels: Optional[object] = None
    gpu: bool = False

    def logits(self, q: torch.Tensor, form) -> torch.Tensor:
        """q (b, h, g, d) in the form's stored basis -> q . k of every slot (b, h, g, slots) fp32 (attend.logits)."""
        if q.is_cuda and self.gpu and _triton(str(q.device)) is not None:
            return _triton(str(q.device)).logits(q, form)
        return attend.logits(q, form) if self.kernels is None else _logits(self.kernels, q, form)

    def mix(self, p: torch.Tensor, form, dtype: torch.dtype) -> torch.Tensor:
        """p (b, h, g, slots) fp32 -> sum over slots of p v (b, h, g, d) in `dtype` (attend.mix)."""
        if isinstance(form, torch.Tensor):
            return attend.mix(p, form, dtype)
        if p.is_cuda and self.gpu and _triton(str(p.device)) is not None:
            return _triton(str(p.device)).mix32(p, form).to(dtype)
        if self.kernels is None:
            return attend.mix(p, form, dtype)
        return _mix32(self.kernels, p, form).to(dtype)


PLAIN = Reader("torch", "a plain cache")  # what decode reads a plain block with (no kernels loaded)


def reader() -> Reader:
    """The reader of this process under FLEXH2O_CACHE_KERNEL (decided once for each value: `chosen`)."""
    return chosen(os.environ.get(ENV, "auto"))


def expected() -> bool:
    """Whether this process's decode is expected to read CPU blocks fused, asked without compiling anything (the cost
    model's question): FLEXH2O_CACHE_KERNEL not torch and numba importable. `reader` may still fall back (a kernel
    that disagrees), and says why when it does."""
    import importlib.util
    return os.environ.get(ENV, "auto") != "torch" and importlib.util.find_spec("numba") is not None


def reads_packed(quant, device, head_dim: int) -> bool:
    """Whether decode is expected to read a block quantized under `quant` (a CacheQuant, or None) on `device` with
    heads `head_dim` wide from its packed bytes, no expanded copy made: on the CPU, keys not fitted, head_dim in
    whole groups (a ragged tail takes the levels read: codec's whole_groups), the fused reader `expected`. The one
    answer the cost model (priced at the block's bytes) and the memory plan (no expanded block held) read."""
    return (quant is not None and torch.device(device).type == "cpu" and getattr(quant, "keys", "") != "fitted"
            and head_dim % quant.group_size == 0 and expected())


@functools.lru_cache(maxsize=4)
def chosen(mode: str) -> Reader:
    """The reader for `mode` (MODES); ValueError for another mode, or for fused where the kernels cannot run."""
    if mode not in MODES:
        raise ValueError(f"{ENV}={mode}: choose one of {', '.join(MODES)}")
    if mode == "torch":
        return Reader("torch", f"{ENV}=torch")
    try:
        kernels, why = fused_check.load(_self_check)
    except Exception as e:  # numba missing or broken, no threading layer, a kernel that disagrees: attend.py
        if mode == "fused":
            raise ValueError(f"{ENV}=fused: the fused kernels cannot run here ({e}); unset it or use torch") from e
        return Reader("torch", f"fused kernels unavailable ({type(e).__name__}: {e})", gpu=True)
    return Reader("fused", why, kernels, gpu=True)


@functools.lru_cache(maxsize=8)
def _triton(device: str):
    """compress/fused_triton.py where Triton imports and its kernels agree with attend.py on `device`, else None
    (decided once a process and device; never asked on the CPU path)."""
    try:
        from flexh2o.compress import fused_triton
        return fused_triton if fused_triton.available(device) else None
    except Exception:  # no Triton, no compiler for it, a kernel that fails: attend.py's read on the device
        return None


def _self_check(kn) -> None:
    """The fused read of a small block of every key and value scheme equals attend.py's within fp32 noise (the
    tests check the arithmetic; this catches a kernel miscompiled or unsupported on this CPU)."""
    from flexh2o.compress.fused_check import small_form

    gen = torch.Generator().manual_seed(0)
    b, h, s, d = 2, 2, 5, 32
    for bits, keys in ((4, "channel"), (3, "token"), (2, "channel"), (8, "token")):
        x = torch.randn(b, h, s, d, generator=gen)
        k, v = small_form(keys, bits, x), small_form("token", bits, x)
        q = torch.randn(b, h, 3, d, generator=gen)
        p = torch.softmax(torch.randn(b, h, 3, s, generator=gen), -1)
        pairs = ((_logits(kn, q, k), attend.logits(q, k)),
                 (_mix32(kn, p, v), attend.mix(p, v, torch.float32)))
        for got, want in pairs:
            if not torch.allclose(got, want, rtol=0, atol=1e-4 * (1 + float(want.abs().max()))):
                raise RuntimeError(f"the fused kernels disagree with the levels read ({bits}-bit {keys})")


def _cpu(*ts) -> bool:
    return all(t.device.type == "cpu" for t in ts)


class _FusedLevels(attend.LevelsRead):
    """The levels read of the compiled kernels `kn` for a block on the CPU (compress/form.py's forms ask for it);
    elsewhere attend.py's."""

    def __init__(self, kn):
        self.kn = kn

    def channel_logits(self, q: torch.Tensor, k: ChannelKeys) -> torch.Tensor:
        return _channel_logits(self.kn, q, k) if _cpu(q, k.data) else super().channel_logits(q, k)

    def group_logits(self, q: torch.Tensor, x) -> torch.Tensor:
        return _group_logits(self.kn, q, x) if _cpu(q, x.data) else super().group_logits(q, x)

    def group_mix(self, p: torch.Tensor, x) -> torch.Tensor:
        return _group_mix(self.kn, p, x) if _cpu(p, x.data) else super().group_mix(p, x)

    def ring_logits(self, q: torch.Tensor, r, inner_logits) -> torch.Tensor:
        if not _cpu(q, r.rslot):
            return super().ring_logits(q, r, inner_logits)
        return _ring_logits(self.kn, q, r, inner_logits)

    def ring_mix(self, p: torch.Tensor, r, inner_mix32) -> torch.Tensor:
        return _ring_mix(self.kn, p, r, inner_mix32) if _cpu(p, r.rslot) else super().ring_mix(p, r, inner_mix32)


def _ring_logits(kn, q: torch.Tensor, r, inner_logits) -> torch.Tensor:
    """recent.ring_logits with the ring's slots' logits written by one kernel over the inner read's: each from the
    exact keys and the query rotated back to their basis, in fp32."""
    out = inner_logits(q, r.inner).contiguous()  # (b, h, g, s) fp32
    qf = q.float()
    qm = (unrotate(qf) if r.inner.rotated else qf).contiguous()  # (b, h, g, d)
    kn.ring_logits(qm.numpy(), r.ring(torch.float32).numpy(), r.rslot.numpy(), out.numpy())
    return out


def _ring_mix(kn, p: torch.Tensor, r, inner_mix32) -> torch.Tensor:
    """recent.ring_mix with the ring's share split off by one kernel: the rest mixed by the inner read, the exact
    values' share (model basis) rotated into the inner form's basis and added."""
    b, h, g, s = p.shape
    ring = r.ring(torch.float32)  # (b, h, E, d)
    rest, exact = torch.empty(b, h, g, s), torch.empty(b, h, g, ring.shape[-1])
    kn.ring_split(p.float().numpy(), ring.numpy(), r.rslot.numpy(), rest.numpy(), exact.numpy())
    return inner_mix32(rest, r.inner) + (rotate(exact) if r.inner.rotated else exact)


def _logits(kn, q: torch.Tensor, form) -> torch.Tensor:
    return as_form(form).logits(q, _FusedLevels(kn))


def _mix32(kn, p: torch.Tensor, form) -> torch.Tensor:
    return as_form(form).mix32(p, _FusedLevels(kn))


@functools.lru_cache(maxsize=64)
def phase_order(n: int, bits: int) -> torch.Tensor:
    """The channel at each position of phase order (compress/fused_kernels.py) of n values at `bits` (read only)."""
    per = 8 if bits == 3 else 8 // bits  # values a unit
    units = n // per
    i = torch.arange(n)
    return (i % units) * per + i // units


def _in_groups(x: torch.Tensor, groups: int, bits: int) -> torch.Tensor:
    """x (..., d) fp32 -> each of its `groups` groups along d in phase order (..., d), contiguous."""
    size = x.shape[-1] // groups
    return x.unflatten(-1, (groups, size))[..., phase_order(size, bits)].flatten(-2).contiguous()


def _threads(kn) -> None:
    kn.numba.set_num_threads(max(1, min(torch.get_num_threads(), kn.numba.config.NUMBA_NUM_THREADS)))


def _flat(data: torch.Tensor) -> tuple:
    """Packed data (b, h, s, [groups,] width) uint8 -> (its bytes as one flat array from its first, the element
    strides of row, head and slot, the width of one group): each slot's groups contiguous, one after another."""
    w = data.shape[-1]
    if data.stride(-1) != 1 or (data.dim() == 5 and data.stride(3) != w):
        data = data.contiguous()
    span = 1 + sum((n - 1) * st for n, st in zip(data.shape, data.stride()))
    return (data.as_strided((span,), (1,)).numpy(),) + tuple(data.stride()[:3]) + (w,)


def _channel_logits(kn, q: torch.Tensor, k: ChannelKeys) -> torch.Tensor:
    b, h, g, d = q.shape
    bits = k.spec.bits
    qf = q.float().contiguous()  # (b, h, g, d)
    scale, lo = k.calib[..., 0].float()[:, :, None], k.calib[..., 1].float()[:, :, None]  # (b, h, 1, d)
    qs = _in_groups(qf * scale, 1, bits)
    c0 = (qf * lo).sum(-1, keepdim=True)  # (b, h, g, 1)
    middle = (lo + (1 << (bits - 1)) * scale).contiguous()  # (b, h, 1, d): an outlier's stored level's value
    out = torch.empty(b, h, g, k.data.shape[2])
    _threads(kn)
    kn.channel_logits(qs.numpy(), c0.numpy(), qf.numpy(), middle.numpy(), *_flat(k.data), k.index.numpy(),
                      k.exact_values().numpy(), bits, out.numpy())
    return out


def _scales(x) -> tuple:
    """A CompressedTensor's scales and minimums (b, h, s, groups), fp32 and contiguous."""
    return tuple(x.meta[..., i].float().contiguous().numpy() for i in (0, 1))


def _group_logits(kn, q: torch.Tensor, x) -> torch.Tensor:
    b, h, g, d = q.shape
    groups, bits = x.data.shape[3], x.spec.bits
    qf = q.float()
    qp = _in_groups(qf, groups, bits)
    qsum = qf.unflatten(-1, (groups, d // groups)).sum(-1).contiguous()  # (b, h, g, groups)
    out = torch.empty(b, h, g, x.data.shape[2])
    _threads(kn)
    kn.group_logits(qp.numpy(), qsum.numpy(), *_flat(x.data), *_scales(x), bits, out.numpy())
    return out


def _group_mix(kn, p: torch.Tensor, x) -> torch.Tensor:
    b, h, g, _ = p.shape
    groups, bits, size = x.data.shape[3], x.spec.bits, x.spec.group_size
    out = torch.empty(b, h, g, groups, size)  # each group in phase order
    _threads(kn)
    kn.group_mix(p.float().numpy(), *_flat(x.data), *_scales(x), bits, out.view(b, h, g, groups * size).numpy())
    return out[..., channel_order(size, bits)].flatten(-2)


@functools.lru_cache(maxsize=64)
def channel_order(n: int, bits: int) -> torch.Tensor:
    """The position in phase order of each channel of n values at `bits` (phase_order's inverse; read only)."""
    return torch.argsort(phase_order(n, bits))
