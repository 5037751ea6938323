"""The fused quantized-cache attention (compress/fused_attend.py, numba kernels) equals attention over the block
expanded (codec.expand_stored): logits and value mix for keys per channel with outliers, keys and values per token
in one or more groups, 2, 3, 4 and 8 bits, rotated or not, with the exact ring and sinks (exact or 8-bit), on whole
blocks and on the strided rows and slots that decode's segments cut; within a bound derived from fp32 rounding
(below). Then: the reader is chosen once, falls back to compress/attend.py without numba, and refuses a bad mode."""
from __future__ import annotations

import math
import sys

import pytest
import torch
from test_kv_attend import QUANTS, _block

from flexh2o.compress import attend, fused_attend
from flexh2o.compress.channel import ChannelKeys
from flexh2o.compress.codec import CompressedTensor, expand_stored
from flexh2o.compress.recent import Recent
from flexh2o.compress.rotation import Rotated, rotated_if
from flexh2o.kv.layout import CacheQuant

pytest.importorskip("numba")
pytestmark = pytest.mark.usefixtures("one_thread")

U = 2.0 ** -24  # fp32's unit roundoff
B, H, S, D, G = 3, 2, 24, 64, 2  # as test_kv_attend's blocks
MORE = QUANTS + [CacheQuant(4, 32, "channel", 8, 16, 4, True, 8), CacheQuant(8, 64, "token", 0, 2, 0, False),
                 CacheQuant(2, 16, "channel", 4, 0, 0, True), CacheQuant(3, 32, "token", 0, 0, 0, False)]


def _kernels():
    read = fused_attend.chosen("fused")
    assert read.name == "fused", read.why
    return read


def _magnitude(form) -> float:
    """The largest |value| any stored level or kept value of `form` stands for: per channel or group max(|lo|,
    |lo + levels * scale|) (every level lies between), the outliers' and the ring's values."""
    if isinstance(form, Recent):
        return max(_magnitude(form.inner), float(form.ring(torch.float32).abs().max()))
    if isinstance(form, Rotated):
        return _magnitude(form.inner)
    top = (1 << form.spec.bits) - 1
    if isinstance(form, ChannelKeys):
        scale, lo = form.calib[..., 0].float(), form.calib[..., 1].float()
        extra = float(form.exact_values().abs().max()) if form.spec.outliers else 0.0
    else:
        assert isinstance(form, CompressedTensor)
        scale, lo = form.meta[..., 0].float(), form.meta[..., 1].float()
        extra = 0.0
    return max(float(torch.maximum(lo.abs(), (lo + top * scale).abs()).max()), extra)


def _rotation_terms(q: CacheQuant) -> float:
    """Roundings a rotation (d x d, entries +-1/sqrt(block) with block <= d) adds to an output, in units of u times
    the magnitude: a d-term sum of values up to K/sqrt(block) each, at most d sqrt(d) u K, on either side."""
    return 2 * D * math.sqrt(D) if q.rotate else 0.0


@pytest.mark.parametrize("q", MORE, ids=lambda q: q.describe())
@pytest.mark.parametrize("cut", [(0, B, S), (1, 3, 17)], ids=["whole", "segment"])
def test_fused_read_equals_the_expanded_read_within_fp32_rounding(q, cut):
    """Logits: both reads sum the same terms q_c (scale_c lev_c + lo_c) (an outlier's (exact - middle) q_c on top),
    each at most 2K|q_c| (K = _magnitude), so M = 4K |q|_1 bounds their total with the outliers' (distinct
    channels). The expanded read rounds each key (2 roundings) and sums d products: (d + 2) u M; the fused read
    rounds q scale, sums d + outliers + 2 terms, each with at most 3 roundings: (d + n + 5) u M. Their difference
    is below (2d + n + 8) u M, plus a rotation's terms (the ring read in the model's basis on one side).
    Mix: each output sums over S slots p_t (scale lev + lo), each at most 2K p_t: the expanded read's roundings
    (2 a value, S in the sum) and the fused read's (p scale, S in each of two sums, the final add) stay below
    (2S + 8) u 2K sum(p), plus the rotation's."""
    read = _kernels()
    kf, vf = (attend.cut(f, *cut) for f in _block(q, torch.float32, seed=4))
    rows, used = cut[1] - cut[0], cut[2]
    query = torch.randn(rows, H, G, D, generator=torch.Generator().manual_seed(5))
    keys, rk = expand_stored(kf, torch.float32)
    values, _ = expand_stored(vf, torch.float32)
    qs = rotated_if(query, rk)
    want = torch.einsum("bhgd,bhsd->bhgs", qs, keys)
    got = read.logits(qs, kf)
    n = q.outliers if q.keys != "token" else 0
    bound = (2 * D + n + 8 + _rotation_terms(q)) * U * 4 * _magnitude(kf) * qs.abs().sum(-1, keepdim=True)
    assert ((got - want).abs() <= bound).all(), float(((got - want).abs() / bound).max())
    p = torch.softmax(want / 8, -1)
    want_v = torch.einsum("bhgs,bhsd->bhgd", p, values)
    got_v = read.mix(p, vf, torch.float32)
    bound = (2 * used + 8 + _rotation_terms(q)) * U * 2 * _magnitude(vf) * p.sum(-1, keepdim=True)
    assert ((got_v - want_v).abs() <= bound).all(), float(((got_v - want_v).abs() / bound).max())


@pytest.mark.parametrize("q", MORE[:4], ids=lambda q: q.describe())
def test_a_bf16_query_is_read_as_its_fp32_value(q):
    """The fused read of the quantized slots widens a bf16 query and reads in fp32: the same as the fp32 read of
    the query rounded to bf16, to the last bit (one code path after the widening), and the mix's output is that
    fp32 mix rounded (the exact ring is read in the compute dtype, as compress/attend.py reads it: left out)."""
    read = _kernels()
    kf, vf = (f.inner for f in _block(q, torch.bfloat16, seed=6))
    query = rotated_if(torch.randn(B, H, G, D, generator=torch.Generator().manual_seed(7)), q.rotate)
    q16 = query.bfloat16()
    assert torch.equal(read.logits(q16, kf), read.logits(q16.float(), kf))
    p = torch.softmax(read.logits(q16, kf) / 8, -1)
    assert torch.equal(read.mix(p, vf, torch.bfloat16), read.mix(p, vf, torch.float32).bfloat16())


def test_the_fused_read_sees_levels_outliers_and_ring():
    """A kernel that skipped the outliers' corrections or the ring, or read one level one step off, would differ
    from the expanded read beyond the bound above in some logit: the test above would catch it."""
    read = _kernels()
    q = CacheQuant(4, 64, "channel", 8, 4, 2, False)  # outliers, ring and sinks; not rotated: the tightest bound
    kf, _ = _block(q, torch.float32)
    query = torch.randn(B, H, G, D, generator=torch.Generator().manual_seed(1))
    base = read.logits(query, kf)
    bound = (2 * D + 8 + 8) * U * 4 * _magnitude(kf) * query.abs().sum(-1, keepdim=True)

    def caught(other) -> bool:
        return bool(((other - base).abs() > bound).any())
    no_ring = read.logits(query, kf.inner)
    assert caught(no_ring)
    off = kf.inner.map(torch.clone)
    off.exact.zero_()
    assert caught(read.logits(query, Recent(off, kf.recent, kf.rslot, kf.sinks)))
    off = kf.inner.map(torch.clone)
    off.data[0, 0, 3, 0] ^= 1  # one level of one slot (not in the ring) one step away
    assert caught(read.logits(query, Recent(off, kf.recent, kf.rslot, kf.sinks)))


def test_the_reader_is_chosen_once_and_falls_back_without_numba(monkeypatch):
    """auto: the fused reader where numba runs, the same object every time (decided once); torch on request;
    without numba, attend.py's read with the reason (fused then refuses in one line); a bad mode is refused."""
    assert fused_attend.chosen("auto") is fused_attend.chosen("auto")
    monkeypatch.setenv(fused_attend.ENV, "torch")
    assert fused_attend.reader().name == "torch" and fused_attend.reader().kernels is None
    monkeypatch.setenv(fused_attend.ENV, "fast")
    with pytest.raises(ValueError, match="FLEXH2O_CACHE_KERNEL=fast: choose one of auto, fused, torch"):
        fused_attend.reader()
    monkeypatch.setitem(sys.modules, "numba", None)  # import numba raises ImportError
    fused_attend.chosen.cache_clear()
    try:
        fallback = fused_attend.chosen("auto")
        assert fallback.name == "torch" and "numba" in fallback.why
        with pytest.raises(ValueError, match="FLEXH2O_CACHE_KERNEL=fused: the fused kernels cannot run here"):
            fused_attend.chosen("fused")
    finally:
        fused_attend.chosen.cache_clear()
