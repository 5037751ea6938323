"""Decode attention read straight from a quantized cache form, none of its slots expanded.

Expanding a quantized block each step (unpack, cast to fp32, scale, shift, outliers over their channels, the exact
ring over its slots, cast to the compute dtype) costs about a dozen passes over every kept slot; attention then
reads the expanded copy once. Both quantized forms are affine in their levels, so attention can read the levels:
  keys per channel (compress/channel.py)   k[t, c] = scale[c] lev[t, c] + lo[c]
      q.k[t] = (q * scale) . lev[t] + q . lo, plus each outlier's (exact - its level's value) times q there;
  per-token groups (compress/codec.py)     x[t, G, c] = scale[t, G] lev[t, G, c] + lo[t, G]
      q.k[t] = sum over groups G of scale[t, G] (q_G . lev[t, G]) + lo[t, G] sum(q_G),
      sum_t p[t] v[t, G] = (p * scale[:, G]) . lev[:, G] + p . lo[:, G];
so the levels are only unpacked (`_Levels`) and cast to the compute dtype (at 4 bits the two nibbles of a byte are
split as whole int32 words, even channels from the low nibbles and odd ones from the high, and read against the
query's even and odd channels: no interleaving pass). An outlier channel holds the middle level
(compress/channel.py), so its exact value only replaces the middle's term. The exact ring (compress/recent.py)
replaces its slots' logits by the exact keys' and moves its slots' probabilities onto the exact values, read in the
model's basis (the query rotated back, the ring's output rotated: a few rows, not the ring's entries). A rotated
form (compress/rotation.py) is read in its stored basis: the caller rotates the query and rotates the output back
(`is_rotated`). Fitted key levels and forms with ragged groups are expanded as before (`expand_stored`). Arithmetic:
the level products in the compute dtype for keys (levels below 256 are exact in bf16 and fp16), in fp32 for values
(`mix`); scales, minimums and corrections in fp32.
"""
from __future__ import annotations

import torch

from flexh2o.compress.bits import unpack
from flexh2o.compress.channel import ChannelKeys
from flexh2o.compress.codec import CompressedTensor
from flexh2o.compress.form import as_form
from flexh2o.compress.recent import ring_logits, ring_mix

HIGH = -0x0F0F0F10  # 0xF0F0F0F0 as int32: the high nibble of each byte of a word
LOW = 0x0F0F0F0F  # the low nibble of each byte
TOPS = -0x7F7F7F80  # 0x80808080: the top bit of each byte


class LevelsRead:
    """The torch read of a quantized form's levels (module docstring), as a cache form asks for it
    (compress/form.py: CacheForm.logits and mix32 call channel_logits, group_logits, group_mix, and the exact
    ring's form ring_logits, ring_mix around its inner form's read); a fused reader overrides what it runs."""

    def ring_logits(self, q: torch.Tensor, r, inner_logits) -> torch.Tensor:
        return ring_logits(q, r, inner_logits)

    def ring_mix(self, p: torch.Tensor, r, inner_mix32) -> torch.Tensor:
        return ring_mix(p, r, inner_mix32)

    def channel_logits(self, q: torch.Tensor, k: ChannelKeys) -> torch.Tensor:
        return _channel_logits(q, k)

    def group_logits(self, q: torch.Tensor, x: CompressedTensor) -> torch.Tensor:
        return _group_logits(q, x)

    def group_mix(self, p: torch.Tensor, x: CompressedTensor) -> torch.Tensor:
        return _group_mix(p, x)


TORCH = LevelsRead()


def is_rotated(form) -> bool:
    """Whether `form` holds its tokens rotated (read them with a rotated query; rotate the output back)."""
    return as_form(form).rotated


def cut(form, r0: int, r1: int, used: int):
    """Rows r0:r1 and the first `used` slots of a plain K or V (b, h, slots, d) or of a quantized form."""
    return as_form(form).cut(r0, r1, used).held()


def logits(q: torch.Tensor, form) -> torch.Tensor:
    """q (b, h, g, d) in the compute dtype and the form's stored basis -> q . k of every slot (b, h, g, slots) fp32."""
    return as_form(form).logits(q, TORCH)


def mix(p: torch.Tensor, form, dtype: torch.dtype) -> torch.Tensor:
    """p (b, h, g, slots) fp32 -> sum over slots of p v (b, h, g, d) in `dtype`, in the form's stored basis. A
    quantized form's products are taken in fp32: a level product's rounding scales with its token's whole range,
    not with the value, so in bf16 a small channel of a token with a wide range would lose its few bits."""
    return as_form(form).mix(p, dtype, TORCH)


class _Levels:
    """The levels of packed data (..., slots, bytes) of n values a slot as `parts`: (channels, levels (..., slots,
    m), unit) triples covering the n channels, level = unit * part + mid. At 4 bits the parts are the odd channels
    (high nibbles) and the even ones (low nibbles) of whole int32 words, each masked in place (no interleaving
    pass); else every channel in order. `centred` (for products rounded to bf16 or fp16): mid is half the levels'
    count and the parts are int8, so a product is the deviation from the middle of the range, not the range's whole
    offset, which cancelled against the minimum's term would leave the small result with few bits; a nibble is then
    moved to its byte's top half with its top bit flipped, 16 (level - 8) as int8. Else mid 0: the levels as uint8
    (a high nibble as 16 level), for fp32 products."""

    def __init__(self, data: torch.Tensor, bits: int, n: int, centred: bool):
        self.mid = 1 << (bits - 1) if centred else 0
        if bits == 4 and data.shape[-1] % 4 == 0 and _viewable(data):
            w = data.view(torch.int32)
            if centred:
                self.parts = [(slice(1, None, 2), ((w & HIGH) ^ TOPS).view(torch.int8), 1 / 16),
                              (slice(0, None, 2), (((w << 4) & HIGH) ^ TOPS).view(torch.int8), 1 / 16)]
            else:
                self.parts = [(slice(1, None, 2), (w & HIGH).view(torch.uint8), 1 / 16),
                              (slice(0, None, 2), (w & LOW).view(torch.uint8), 1.0)]
        else:
            lev = unpack(data, bits, n)
            if centred:
                lev = (lev + (128 - self.mid)).bitwise_xor_(0x80).view(torch.int8)
            self.parts = [(slice(None), lev, 1.0)]


def _viewable(t: torch.Tensor) -> bool:
    """Whether uint8 t reads as int32 words along its last dimension."""
    return t.stride(-1) == 1 and t.storage_offset() % 4 == 0 and all(s % 4 == 0 for s in t.stride()[:-1])


def _channel_logits(q: torch.Tensor, k: ChannelKeys) -> torch.Tensor:
    d = k.calib.shape[2]
    scale, lo = k.calib[..., 0].float()[:, :, None], k.calib[..., 1].float()[:, :, None]  # (b, h, 1, d)
    lv = _Levels(k.data, k.spec.bits, d, centred=q.dtype != torch.float32)
    qf = q.float()
    qs = qf * scale
    out = sum(torch.matmul((qs[..., c] * unit).to(q.dtype), part.to(q.dtype).transpose(-1, -2)).float()
              for c, part, unit in lv.parts)
    out = out + (qf * (lo + lv.mid * scale)).sum(-1, keepdim=True)  # the term of a level `mid`
    if k.spec.outliers:  # each outlier's exact value in place of its level's, the middle one (compress/channel.py)
        b, h, s, n = k.index.shape
        flat = k.index.view(b, h, 1, s * n).long()
        middle = lo + (1 << (k.spec.bits - 1)) * scale  # (b, h, 1, d)
        delta = k.exact_values().view(b, h, 1, s * n) - middle.gather(-1, flat)  # (b, h, 1, s n)
        out = out + (qf.gather(-1, flat.expand(b, h, q.shape[2], s * n)) * delta).view(b, h, -1, s, n).sum(-1)
    return out


def _group_logits(q: torch.Tensor, x: CompressedTensor) -> torch.Tensor:
    b, h, g, d = q.shape
    groups, size = x.data.shape[3], x.spec.group_size
    scale, lo = x.meta[..., 0].float(), x.meta[..., 1].float()  # (b, h, s, G)
    lv = _Levels(x.data, x.spec.bits, size, centred=q.dtype != torch.float32)
    qv = q.view(b, h, g, groups, size)
    if groups == 1:  # one group a token (the default): plain matmuls
        dots = sum(torch.matmul(q[..., c].contiguous(), part[..., 0, :].to(q.dtype).transpose(-1, -2)).float()
                   [..., None] * unit for c, part, unit in lv.parts)
    else:
        dots = sum(torch.einsum("bhgGc,bhsGc->bhgsG", qv[..., c], part.to(q.dtype)).float() * unit
                   for c, part, unit in lv.parts)
    sums = qv.float().sum(-1)  # (b, h, g, G)
    middle = lo + lv.mid * scale
    return (dots * scale[:, :, None] + middle[:, :, None] * sums[:, :, :, None]).sum(-1)


def _group_mix(p: torch.Tensor, x: CompressedTensor) -> torch.Tensor:
    b, h, g, s = p.shape
    groups, size = x.data.shape[3], x.spec.group_size
    scale, lo = x.meta[..., 0].float(), x.meta[..., 1].float()  # (b, h, s, G)
    lv = _Levels(x.data, x.spec.bits, size, centred=False)
    ps = p[..., None] * scale[:, :, None]  # (b, h, g, s, G)
    out = torch.empty(b, h, g, groups, size, device=p.device)
    for c, part, unit in lv.parts:
        if groups == 1:  # one group a token (the default): a plain matmul
            out[..., 0, c] = torch.matmul(ps[..., 0] * unit, part[..., 0, :].float())
        else:
            out[..., c] = torch.einsum("bhgsG,bhsGc->bhgGc", ps * unit, part.float())
    out += torch.matmul(p, lo)[..., None]  # each group's minimum
    return out.view(b, h, g, groups * size)
