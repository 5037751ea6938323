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
from flexh2o.compress.codec import CompressedTensor, expand_stored, first_slots
from flexh2o.compress.recent import Recent
from flexh2o.compress.rotation import Rotated, rotate, unrotate

HIGH = -0x0F0F0F10  # 0xF0F0F0F0 as int32: the high nibble of each byte of a word
LOW = 0x0F0F0F0F  # the low nibble of each byte
TOPS = -0x7F7F7F80  # 0x80808080: the top bit of each byte


def is_rotated(form) -> bool:
    """Whether `form` holds its tokens rotated (read them with a rotated query; rotate the output back)."""
    if isinstance(form, Recent):
        return is_rotated(form.inner)
    return isinstance(form, Rotated)


def cut(form, r0: int, r1: int, used: int):
    """Rows r0:r1 and the first `used` slots of a plain K or V (b, h, slots, d) or of a quantized form."""
    if isinstance(form, torch.Tensor):
        return form[r0:r1, :, :used]
    rows = form if (r0, r1) == (0, form.shape[0]) else form.map(lambda t: t[r0:r1])
    return first_slots(rows, used)


def logits(q: torch.Tensor, form) -> torch.Tensor:
    """q (b, h, g, d) in the compute dtype and the form's stored basis -> q . k of every slot (b, h, g, slots) fp32."""
    if isinstance(form, torch.Tensor):
        return torch.einsum("bhgd,bhsd->bhgs", q, form).float()
    if isinstance(form, Recent):
        return ring_logits(q, form, logits)
    if isinstance(form, Rotated):
        return logits(q, form.inner)
    if isinstance(form, ChannelKeys) and not form.spec.fitted:
        return _channel_logits(q, form)
    if whole_groups(form):
        return _group_logits(q, form)
    return logits(q, expand_stored(form, q.dtype)[0])


def mix(p: torch.Tensor, form, dtype: torch.dtype) -> torch.Tensor:
    """p (b, h, g, slots) fp32 -> sum over slots of p v (b, h, g, d) in `dtype`, in the form's stored basis. A
    quantized form's products are taken in fp32: a level product's rounding scales with its token's whole range,
    not with the value, so in bf16 a small channel of a token with a wide range would lose its few bits."""
    if isinstance(form, torch.Tensor):
        return torch.einsum("bhgs,bhsd->bhgd", p.to(dtype), form)
    return _mix32(p, form).to(dtype)


def _mix32(p: torch.Tensor, form) -> torch.Tensor:
    if isinstance(form, Recent):
        return ring_mix(p, form, _mix32)
    if isinstance(form, Rotated):
        return _mix32(p, form.inner)
    if whole_groups(form):
        return _group_mix(p, form)
    return torch.einsum("bhgs,bhsd->bhgd", p, expand_stored(form, torch.float32)[0])


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


def whole_groups(form) -> bool:
    """Whether `form` is a CompressedTensor of whole groups along head_dim (no ragged tail): the levels read's."""
    return (isinstance(form, CompressedTensor) and form.data.dim() == 5 and form.spec.dim(4) == 3
            and form.data.shape[3] * form.spec.group_size == form.length)


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


def _ring(r: Recent, slots: int) -> torch.Tensor:
    """The slot of each ring entry (b, h, E), `slots` where it names none of the first `slots`."""
    ok = (r.rslot >= 0) & (r.rslot < slots)
    return torch.where(ok, r.rslot, slots).long()


def ring_logits(q: torch.Tensor, r: Recent, inner_logits) -> torch.Tensor:
    """logits over a form with its exact ring: `inner_logits(q, r.inner)` (this module's or a fused reader's) with
    the ring's slots' logits replaced by the exact keys'."""
    inner = inner_logits(q, r.inner)  # (b, h, g, s)
    b, h, g, s = inner.shape
    slot = _ring(r, s)
    qm = unrotate(q.float()).to(q.dtype) if is_rotated(r.inner) else q  # qH . kH = q . k: the ring in its own basis
    e = torch.matmul(qm, r.ring(q.dtype).transpose(-1, -2)).float()  # (b, h, g, E)
    out = torch.cat([inner, inner.new_zeros(b, h, g, 1)], -1)  # the last column takes the entries naming no slot
    out.scatter_(-1, slot[:, :, None].expand(b, h, g, slot.shape[-1]), e)
    return out[..., :s]


def ring_mix(p: torch.Tensor, r: Recent, inner_mix32) -> torch.Tensor:
    """The fp32 value mix over a form with its exact ring: the ring's slots' probabilities moved onto its exact
    values, `inner_mix32(p, r.inner)` (this module's or a fused reader's) over the rest."""
    b, h, g, s = p.shape
    slot = _ring(r, s)
    idx = slot[:, :, None].expand(b, h, g, slot.shape[-1])
    rest = torch.cat([p, p.new_zeros(b, h, g, 1)], -1)
    held = rest.gather(-1, idx)  # (b, h, g, E): the probability of each entry's slot (0: none)
    rest.scatter_(-1, idx, 0.0)
    exact = torch.matmul(held, r.ring(torch.float32))  # (b, h, g, d), in the model's basis
    return inner_mix32(rest[..., :s], r.inner) + (rotate(exact) if is_rotated(r.inner) else exact)
