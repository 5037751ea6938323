"""Keys quantized per channel with scales calibrated on the prompt (after KVQuant's per-channel keys and outliers).

Keys have outlier channels: one scale per token (FlexGen's groups along head_dim) spends the levels on them. Here
each (row, KV head, channel) gets its own minimum and scale, set once from the prompt's keys at prefill
(`calibrate`); every token, prompt or generated, is then quantized alone with them (clamped to the calibrated
range), so a token fills one slot and an evicted slot is rewritten in place. Per token, the `outliers` values whose
quantization error is largest are kept exact (their channel index and value), which also catches a generated token
that leaves the prompt's range. With `fitted` levels (KVQuant's non-uniform datatype) each channel's 2**bits levels
are not evenly spaced but fitted to the prompt's values of that channel (1-D k-means, `fit_levels`), and a value
takes its nearest level.

Layout of keys (b, h, slots, d) stored as `dtype` (the parts a tier holds, compress/channel's ChannelSpec.parts):
  data   uint8 (b, h, slots, d * bits / 8)   levels packed as compress/bits.py says (an outlier's: the middle one)
  index  uint8 (b, h, slots, outliers)       channels kept exact (int16 when d > 256), in decreasing error
  exact  dtype (b, h, slots, outliers)       their values; with `fp8` uint8: their fp8 (e4m3) bit patterns, the
                                             values clamped to +-448 (--cache-exact-bits 8)
  calib  dtype (b, h, d, 2)                  [..., 0] scale, [..., 1] minimum (per row and head: not per slot);
         dtype (b, h, d, 2**bits)            fitted: the levels, ascending
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from flexh2o.compress.bits import PACKABLE, pack, packed_width, unpack
from flexh2o.compress.codec import _round_down, _round_up
from flexh2o.compress.form import CacheForm

SLOT_PARTS = ("data", "index", "exact")  # indexed by slot at dimension 2; calib is per row and head
FP8_MAX = 448.0  # the largest finite fp8 e4m3 value: fp8 outliers are clamped to it
FP8_CLAMPED = ("--cache-exact-bits 8: this model's keys reach beyond +-448, fp8's range: such values kept as outliers "
               "are clamped; drop --cache-exact-bits 8 (or keep --cache-rotate on, which spreads them) for this model")
FIT_ROUNDS = 25  # k-means rounds of fitted levels (from evenly spaced ones; SmolLM2's keys settle well before)


@dataclass(frozen=True)
class ChannelSpec:
    """bits (2, 3, 4 or 8) a key value; outliers: values per token kept exact (0 to head_dim); fitted: each
    channel's levels fitted to the prompt (k-means) instead of evenly spaced between its minimum and maximum;
    fp8: the outliers' values stored in 8 bits (fp8 e4m3) instead of the storage dtype."""

    bits: int = 4
    outliers: int = 4
    fitted: bool = False
    fp8: bool = False  # the outliers' values stored as fp8 (e4m3) instead of the storage dtype

    def __post_init__(self):
        if self.bits not in PACKABLE:
            raise ValueError(f"--compress-bits {self.bits}: choose one of {', '.join(map(str, PACKABLE))}")
        if self.outliers < 0:
            raise ValueError(f"--key-outliers must be 0 or more (got {self.outliers})")

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    @property
    def calib_width(self) -> int:
        """Values of `calib` per channel: (scale, minimum), or the 2**bits fitted levels."""
        return 1 << self.bits if self.fitted else 2

    def parts(self, shape: tuple, dtype: torch.dtype) -> dict:
        """name -> (shape, dtype) of each stored part of keys of `shape` (b, h, slots, d) stored as `dtype`."""
        b, h, s, d = (int(x) for x in shape)
        if self.outliers > d:
            raise ValueError(f"--key-outliers {self.outliers} exceeds head_dim {d}")
        n = self.outliers
        return {"data": ((b, h, s, packed_width(d, self.bits)), torch.uint8),
                "index": ((b, h, s, n), torch.uint8 if d <= 256 else torch.int16),
                "exact": ((b, h, s, n), torch.uint8 if self.fp8 else dtype),
                "calib": ((b, h, d, self.calib_width), dtype)}

    def form_parts(self, shape: tuple, dtype: torch.dtype) -> dict:
        """The per-channel keys' scheme spec (compress/form.py): parts, each with whether it is written by slot."""
        return {n: (s, dt, n in SLOT_PARTS) for n, (s, dt) in self.parts(shape, dtype).items()}

    def build(self, tensors: dict, shape: tuple) -> "ChannelKeys":
        return ChannelKeys(tensors["data"], tensors["index"], tensors["exact"], tensors["calib"], self)


@dataclass
class ChannelKeys(CacheForm):
    """Keys stored per channel (module docstring), a cache form (compress/form.py); `calib` is shared by every slot
    of a row and head."""

    data: torch.Tensor
    index: torch.Tensor
    exact: torch.Tensor
    calib: torch.Tensor
    spec: ChannelSpec

    @property
    def dtype(self) -> torch.dtype:
        return self.calib.dtype

    @property
    def shape(self) -> tuple:
        return tuple(self.data.shape[:3]) + (self.calib.shape[2],)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.index, self.exact, self.calib))

    def tensors(self) -> dict:
        return {"data": self.data, "index": self.index, "exact": self.exact, "calib": self.calib}

    def step_parts(self):
        """CacheForm.step_parts: evenly spaced levels with fp32 outliers and scales, on the CPU."""
        ok = (not self.spec.fitted and not self.spec.fp8 and self.exact.dtype == torch.float32
              and self.calib.dtype == torch.float32 and self.index.dtype in (torch.uint8, torch.int16)
              and all(t.device.type == "cpu" for t in (self.data, self.index, self.exact, self.calib)))
        return (self, "channel", False, None) if ok else None

    def map(self, fn: Callable) -> "ChannelKeys":
        """fn applied to every part (indexing of rows or heads, .to(device))."""
        return ChannelKeys(fn(self.data), fn(self.index), fn(self.exact), fn(self.calib), self.spec)

    def front(self, n: int) -> "ChannelKeys":
        """The first n slots (calibration unchanged)."""
        return ChannelKeys(self.data[:, :, :n], self.index[:, :, :n], self.exact[:, :, :n], self.calib, self.spec)

    def calibrate(self, k: torch.Tensor, valid: torch.Tensor) -> None:
        """Set every row's and head's per-channel minimum and scale from keys k (b, h, t, d) over the tokens marked
        in valid (b, h, t): the minimum rounded down and the scale up to the storage dtype, so each key of the
        prompt is within half a step of its level (a row with no valid token gets scale 0, minimum 0). Fitted:
        the levels of `fit_levels`, rounded to the storage dtype. With fp8 outliers, a prompt key beyond +-448
        warns (once a process, Python's default filter) that such values are clamped when kept as outliers."""
        if self.spec.fp8 and bool((k.float().abs() * valid[..., None]).amax() > FP8_MAX):
            warnings.warn(FP8_CLAMPED, RuntimeWarning, stacklevel=2)
        if self.spec.fitted:
            self.calib.copy_(fit_levels(k, valid, 1 << self.spec.bits))
            return
        kf, ok = k.float(), valid[..., None]
        lo = torch.where(ok, kf, float("inf")).amin(2)  # (b, h, d)
        hi = torch.where(ok, kf, float("-inf")).amax(2)
        empty = ~valid.any(-1, keepdim=True)  # (b, h, 1)
        lo, hi = lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)
        lo_s = _round_down(lo, self.dtype)
        scale = _round_up((hi - lo_s.float()) / self.spec.levels, self.dtype)
        self.calib.copy_(torch.stack([scale, lo_s], -1))

    def assign(self, index: tuple, values: torch.Tensor) -> None:
        """self[index] = values, quantized: index selects (row, head, slot) as tensors or slices, values (..., d)
        the keys of those slots in any float dtype."""
        calib = self.calib[index[0], index[1]]  # (..., d, 2) per row and head
        if values.dim() == calib.dim():  # a range of slots per row and head: one calibration for all of them
            calib = calib.unsqueeze(-3)
        data, idx, exact = quantize_token(values, calib, self.spec, self.dtype)
        if self.spec.fp8:
            exact = exact.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        self.data[index], self.index[index], self.exact[index] = data, idx.to(self.index.dtype), exact

    def logits(self, q: torch.Tensor, read) -> torch.Tensor:
        """Evenly spaced levels: the reader's read of them; fitted ones: expanded."""
        return super().logits(q, read) if self.spec.fitted else read.channel_logits(q, self)

    def kernel_assign(self, index: tuple, values: torch.Tensor, write) -> bool:
        return write.channel_assign(self, index, values)

    def exact_values(self) -> torch.Tensor:
        """The outliers' values (b, h, slots, outliers) in fp32 (from their fp8 bit patterns with `fp8`)."""
        return (self.exact.view(torch.float8_e4m3fn) if self.spec.fp8 else self.exact).float()

    def expanded(self, dtype: torch.dtype) -> torch.Tensor:
        """The keys (b, h, slots, d) in `dtype`; arithmetic in fp32."""
        d = self.calib.shape[2]
        q = unpack(self.data, self.spec.bits, d)  # (b, h, s, d)
        if self.spec.fitted:
            lv = self.calib.float().unsqueeze(2)  # (b, h, 1, d, n)
            x = lv.expand(*q.shape, lv.shape[-1]).gather(-1, q.long().unsqueeze(-1)).squeeze(-1)
        else:
            scale, lo = (self.calib[..., i].float().unsqueeze(2) for i in (0, 1))  # (b, h, 1, d)
            x = q.float().mul_(scale).add_(lo)
        if self.spec.outliers:
            x.scatter_(-1, self.index.long(), self.exact_values())
        return x.to(dtype)


def quantize_token(x: torch.Tensor, calib: torch.Tensor, spec: ChannelSpec, dtype: torch.dtype) -> tuple:
    """Keys x (..., d) with their calibration (..., d, 2) -> (packed levels (..., d * bits / 8), outlier channels
    (..., n) int64, their exact values (..., n) in `dtype`): levels clamped to [0, 2**bits - 1]; the outliers are
    the n channels of largest error, ties to the lower channel, and hold the middle level 2**(bits - 1) (evenly
    spaced levels; fitted ones keep their nearest)."""
    xf = x.float()
    if spec.fitted:
        lv = calib.float().expand(*xf.shape, calib.shape[-1])  # (..., d, n)
        q = nearest_level(lv, xf.unsqueeze(-1))
        err = (lv.gather(-1, q).squeeze(-1) - xf).abs()
        q = q.squeeze(-1)
    else:
        scale, lo = calib[..., 0].float(), calib[..., 1].float()
        q = ((xf - lo) / torch.where(scale > 0, scale, 1.0)).round_().clamp_(0, spec.levels)
        err = (q * scale + lo - xf).abs()
    idx = largest(err, spec.outliers)
    if not spec.fitted:  # an outlier's level is never read as its value: the middle one, which a read of the
        q.scatter_(-1, idx, float(1 << (spec.bits - 1)))  # centred levels (compress/attend.py) adds as zero
    return pack(q.to(torch.uint8), spec.bits), idx, xf.gather(-1, idx).to(dtype)


def largest(err: torch.Tensor, n: int) -> torch.Tensor:
    """The channels of the n largest errors err (..., d) (>= 0) in decreasing order, ties to the lower channel (a
    stable descending sort's first n): one top-k over keys that are unique and order as (error, -channel) do, the
    errors' fp32 bits (monotonic for non-negative floats) times d plus d - 1 - channel; a sort of every channel is
    3-4x slower."""
    d = err.shape[-1]
    key = err.float().view(torch.int32).long() * d + (d - 1 - torch.arange(d, device=err.device))
    return torch.topk(key, n, dim=-1).indices


def fit_levels(k: torch.Tensor, valid: torch.Tensor, n: int, rounds: int = FIT_ROUNDS) -> torch.Tensor:
    """Keys k (b, h, t, d), valid (b, h, t) -> each row's, head's and channel's n levels (b, h, d, n), ascending:
    1-D k-means over the valid tokens' values of the channel, from n levels evenly spaced at the centres of n equal
    bins between their minimum and maximum; each round every value takes its nearest level (halfway: the lower) and
    every level with a value becomes the mean of its values (in fp64), one without keeps its place. A row and head
    with no valid token gets levels 0."""
    x = k.double().transpose(2, 3)  # (b, h, d, t)
    w = valid[:, :, None, :].expand_as(x).double()
    ok = w > 0
    lo = torch.where(ok, x, float("inf")).amin(-1, keepdim=True)
    hi = torch.where(ok, x, float("-inf")).amax(-1, keepdim=True)
    empty = ~ok.any(-1, keepdim=True)
    lo, hi = lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)
    c = lo + (hi - lo) * (torch.arange(n, dtype=torch.float64, device=k.device) + 0.5) / n  # (b, h, d, n)
    for _ in range(rounds):
        a = nearest_level(c, x)
        total = torch.zeros_like(c).scatter_add_(-1, a, x * w)
        count = torch.zeros_like(c).scatter_add_(-1, a, w)
        c = torch.where(count > 0, total / count.clamp_min(1.0), c)
    return c.sort(-1).values


def nearest_level(levels: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """levels (..., n) ascending, x (..., m) -> the index of each value's nearest level (..., m) int64; a value
    halfway between two levels takes the lower."""
    return torch.searchsorted((levels[..., 1:] + levels[..., :-1]).mul_(0.5).contiguous(), x.contiguous())
