"""A quantized K or V stored in a rotated basis (`--cache-rotate`, after QuaRot): every token is multiplied by a
Hadamard matrix H along head_dim before it is calibrated and quantized, and by H's transpose after it is
dequantized, so what attention and the policies read is in the model's own basis (H is orthonormal). A key's outlier
channels (RoPE's slow pairs, a few channels far larger than the rest) and a value's outliers are spread over every
channel of the rotated token, so per-channel key ranges calibrated on the prompt fit the tokens generated after it,
and a value's group range is not set by one channel. It costs no byte: H is a constant.

H is Sylvester's Hadamard matrix scaled by 1 / sqrt(n) for a head_dim n that is a power of 2; any other head_dim
(Phi-3's 96) takes a block diagonal of such matrices, one per power of 2 in its binary expansion (96 = 64 + 32),
largest first: still orthonormal, each block spreading the outliers of its own channels.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from flexh2o.compress.form import CacheForm


@functools.lru_cache(maxsize=16)
def _hadamard(d: int, device: str) -> torch.Tensor:
    """The (d, d) fp32 rotation of the module docstring on `device`, made once (read only: never written in place)."""
    if d < 1:
        raise ValueError(f"head_dim {d}: a rotation needs at least one channel")
    blocks, rest = [], d
    while rest:
        n = 1 << (rest.bit_length() - 1)  # the largest power of 2 left
        h = torch.ones(1, 1)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
        blocks.append(h / math.sqrt(n))
        rest -= n
    return torch.block_diag(*blocks).to(device)


def hadamard(d: int, device: str) -> torch.Tensor:
    """The (d, d) fp32 rotation H of head_dim d on `device` (read only)."""
    return _hadamard(d, device)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x (..., d) in fp32 times H: in the rotated basis."""
    return x.float() @ _hadamard(x.shape[-1], str(x.device))


def rotate_step(x: torch.Tensor) -> torch.Tensor:
    """rotate for a decode step's tokens (..., d): on the CPU where the cache kernels run, by one thread in numba
    (compress/fused_quant_kernels.py's fast Walsh-Hadamard transform, as compress/fused_step.py's one-call write
    rotates: torch's product this small waited on its thread pool's wake-up, about 0.3-1.4 ms a call on 2 busy
    cores); else rotate. The same product within fp32 rounding (summed in another order)."""
    from flexh2o.compress import fused_write  # (it reads compress/fused_attend.py's reader, which imports this)
    kn = fused_write.kernels() if x.device.type == "cpu" else None
    if kn is None:
        return rotate(x)
    d = x.shape[-1]
    xf = x.float().reshape(-1, d).contiguous()  # (N, d)
    out = torch.empty_like(xf)
    kn.rotate_rows(xf.numpy(), _hadamard(d, "cpu").numpy(), out.numpy())
    return out.view(x.shape)


def unrotate(x: torch.Tensor) -> torch.Tensor:
    """x (..., d) fp32 in the rotated basis times H^T: back in the model's basis."""
    return x @ _hadamard(x.shape[-1], str(x.device)).T


def rotated_if(x: torch.Tensor, rotated: bool) -> torch.Tensor:
    """Queries x (..., d) in the basis the keys were read in (codec.expand_stored): rotated when they are."""
    return rotate(x).to(x.dtype) if rotated else x


def unrotated_if(x: torch.Tensor, rotated: bool) -> torch.Tensor:
    """Attention's output x (..., d) back in the model's basis when it was made of rotated values."""
    return unrotate(x.float()).to(x.dtype) if rotated else x


@dataclass(frozen=True)
class RotatedSpec:
    """The rotated scheme's spec (compress/form.py): the inner scheme's parts, holding its tokens rotated."""

    inner: object

    def form_parts(self, shape: tuple, dtype: torch.dtype) -> dict:
        return self.inner.form_parts(shape, dtype)

    def build(self, tensors: dict, shape: tuple) -> "Rotated":
        return Rotated(self.inner.build(tensors, shape))


@dataclass
class Rotated(CacheForm):
    """A quantized form (`inner`: a CompressedTensor or compress/channel.py's ChannelKeys) that holds its tokens
    rotated (module docstring); a cache form (compress/form.py) in the model's basis, read in its stored one."""

    inner: object
    rotated = True

    @property
    def dtype(self) -> torch.dtype:
        return self.inner.dtype

    @property
    def shape(self) -> tuple:
        return self.inner.shape

    @property
    def spec(self):
        return self.inner.spec

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes

    def tensors(self) -> dict:
        return self.inner.tensors()

    def map(self, fn) -> "Rotated":
        """fn applied to every part (indexing of rows or heads, .to(device))."""
        return Rotated(self.inner.map(fn))

    def step_parts(self):
        """CacheForm.step_parts: the inner form's, rotated."""
        inner = self.inner.step_parts()
        return None if inner is None else (inner[0], inner[1], True, inner[3])

    def front(self, n: int) -> "Rotated":
        """The first n slots."""
        return Rotated(self.inner.front(n))

    def calibrate(self, k: torch.Tensor, valid: torch.Tensor) -> None:
        """Per-channel keys: their scales from the rotated prompt keys (a per-token form needs nothing)."""
        self.inner.calibrate(rotate(k), valid)

    def assign(self, index: tuple, values: torch.Tensor) -> None:
        """self[index] = values (..., d): rotated, then quantized as the inner form does (by compress/fused_write.py's
        kernels where they run: the same bytes)."""
        from flexh2o.compress import fused_write  # (it reads compress/fused_attend.py's reader, which imports this)
        x = rotate(values)
        if not fused_write.assign(self.inner, index, x):
            self.inner.assign(index, x)

    def append(self, index: tuple, slot: torch.Tensor, pos: torch.Tensor, values: torch.Tensor) -> None:
        """A decode step's new token of every row (values (b, h, d)): rotated by `rotate_step`, written as assign."""
        from flexh2o.compress import fused_write
        x = rotate_step(values)
        if not fused_write.assign(self.inner, index, x):
            self.inner.assign(index, x)

    def expanded(self, dtype: torch.dtype) -> torch.Tensor:
        """The tokens (b, h, slots, d) in `dtype`, dequantized (fp32) and rotated back."""
        return unrotate(self.inner.expanded(torch.float32)).to(dtype)

    def expanded_stored(self, dtype: torch.dtype) -> tuple:
        """(the tokens (b, h, slots, d) in `dtype`, dequantized in fp32 and left in the rotated basis, True): see
        codec.expand_stored."""
        return self.inner.expanded(torch.float32).to(dtype), True

    def logits(self, q: torch.Tensor, read) -> torch.Tensor:
        """q in the rotated basis: the inner form's read."""
        return self.inner.logits(q, read)

    def mix32(self, p: torch.Tensor, read) -> torch.Tensor:
        return self.inner.mix32(p, read)
