"""Decode attention read from a quantized block's levels (compress/attend.py) equals attention over the block
expanded (codec.expand_stored): the logits q.k of every slot and the probability-weighted values, for keys per
channel (with outliers), keys and values per token, at every width, with and without the rotation, the exact
ring of the newest tokens and the sinks, on rows and slots cut as decode's segments cut them; in fp32 within float
noise, in bf16 no further from the fp64 truth than the expanded read."""
from __future__ import annotations

import pytest
import torch

from flexh2o.compress import attend
from flexh2o.compress.codec import assign, expand_stored
from flexh2o.compress.rotation import rotated_if
from flexh2o.kv.layout import CacheLayout, CacheQuant

B, H, S, D, G = 3, 2, 24, 64, 2  # rows, KV heads, slots, head_dim, query heads a KV head
QUANTS = [CacheQuant(b, 64, "channel", 8, 4, 2, True) for b in (2, 3, 4, 8)] + [
    CacheQuant(4, 64, "channel", 8, 0, 0, False), CacheQuant(3, 64, "channel", 0, 4, 0, False),
    CacheQuant(4, 32, "token", 0, 4, 2, False), CacheQuant(4, 64, "token", 0, 0, 0, True),
    CacheQuant(2, 32, "token", 0, 0, 2, True), CacheQuant(3, 64, "fitted", 4, 4, 2, True)]


def _block(q: CacheQuant, dtype: torch.dtype, seed: int = 0) -> tuple:
    """(K form, V form) of a (B, H, S, D) block holding S tokens of keys with outlier channels and an offset,
    values with a few large channels; the ring holds each row's newest and first positions."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H, S, D, generator=g) + torch.linspace(-2, 3, D)
    k[..., 5] *= 8
    v = torch.randn(B, H, S, D, generator=g) * torch.where(torch.arange(D) % 17 == 0, 6.0, 1.0)
    forms = CacheLayout(B, H, S, D, dtype, q).empty("cpu")
    pos = torch.arange(S).expand(B, H, S).clone()
    pos[1, :, S - 3:] = -1  # a row holding fewer tokens: its ring names none of its last slots
    for form, x in ((forms["k"], k), (forms["v"], v)):
        if hasattr(form, "calibrate"):
            form.calibrate(x, torch.ones(B, H, S, dtype=torch.bool))
        assign(form, (slice(None), slice(None), slice(0, S)), x)
        if hasattr(form, "remember_prompt"):
            form.remember_prompt(pos, x)
    return forms["k"], forms["v"]


@pytest.mark.parametrize("q", QUANTS, ids=lambda q: q.describe())
@pytest.mark.parametrize("cut", [(0, B, S), (1, 3, 17)], ids=["whole", "segment"])
def test_levels_read_equals_the_expanded_read_fp32(q, cut):
    kf, vf = (attend.cut(f, *cut) for f in _block(q, torch.float32))
    rows = cut[1] - cut[0]
    query = torch.randn(rows, H, G, D, generator=torch.Generator().manual_seed(1))
    keys, rk = expand_stored(kf, torch.float32)
    values, rv = expand_stored(vf, torch.float32)
    assert attend.is_rotated(kf) == rk and attend.is_rotated(vf) == rv == q.rotate
    qs = rotated_if(query, rk)
    want = torch.einsum("bhgd,bhsd->bhgs", qs, keys)
    got = attend.logits(qs, kf)
    torch.testing.assert_close(got, want, atol=2e-5 * want.abs().max().item(), rtol=0)
    p = torch.softmax(want / 8, -1)
    torch.testing.assert_close(attend.mix(p, vf, torch.float32), torch.einsum("bhgs,bhsd->bhgd", p, values),
                               atol=2e-5 * values.abs().max().item(), rtol=0)


def test_the_levels_read_sees_the_ring_and_the_outliers():
    """Without the ring's exact values and the outliers' corrections the logits differ far beyond the tolerance
    above: the test above would catch a read that skipped them."""
    q = QUANTS[2]
    kf, vf = _block(q, torch.float32)
    query = torch.randn(B, H, G, D, generator=torch.Generator().manual_seed(1))
    keys, _ = expand_stored(kf, torch.float32)
    qs = rotated_if(query, True)
    want = torch.einsum("bhgd,bhsd->bhgs", qs, keys)
    inner = attend.logits(qs, kf.inner)  # no ring
    assert (inner - want).abs().max() > 100 * 2e-5 * want.abs().max()
    no_outliers = kf.inner.inner.map(torch.clone)
    no_outliers.exact.zero_()
    assert (attend.logits(qs, no_outliers) - inner).abs().max() > 100 * 2e-5 * want.abs().max()


@pytest.mark.parametrize("q", QUANTS, ids=lambda q: q.describe())
def test_levels_read_in_bf16_is_no_worse_than_the_expanded_read(q):
    """The compute dtype bf16: both reads' error against fp64 attention over the fp32 expansion; the levels read
    may not be more than 1.5x the expanded read's (at most) and both stay within bf16's precision."""
    k32, v32 = _block(q, torch.float32, seed=2)
    kb, vb = _block(q, torch.bfloat16, seed=2)
    query = torch.randn(B, H, G, D, generator=torch.Generator().manual_seed(3))
    keys, rk = expand_stored(kb, torch.bfloat16)
    values, _ = expand_stored(vb, torch.bfloat16)
    qs = rotated_if(query, rk)
    truth_k = torch.einsum("bhgd,bhsd->bhgs", qs.double(), expand_stored(kb, torch.float32)[0].double())
    old = torch.einsum("bhgd,bhsd->bhgs", qs.bfloat16(), keys).double()
    new = attend.logits(qs.bfloat16(), kb).double()
    assert (new - truth_k).abs().max() <= 1.5 * (old - truth_k).abs().max() + 1e-6
    assert (new - truth_k).abs().max() < 2 ** -6 * truth_k.abs().max()
    p = torch.softmax(truth_k.float() / 8, -1)
    truth_v = torch.einsum("bhgs,bhsd->bhgd", p.double(), expand_stored(vb, torch.float32)[0].double())
    old = torch.einsum("bhgs,bhsd->bhgd", p.bfloat16(), values).double()
    new = attend.mix(p, vb, torch.bfloat16).double()
    assert (new - truth_v).abs().max() <= 1.5 * (old - truth_v).abs().max() + 1e-6
    assert (new - truth_v).abs().max() < 2 ** -6 * truth_v.abs().max()


def test_outliers_are_the_stable_sorts_first_and_hold_the_middle_level():
    """compress/channel.largest picks what a stable descending sort's first n are, ties to the lower channel (the
    reference's rule), on errors with many ties and zeros; and a quantized key's outlier channels hold the middle
    level, which the levels read relies on."""
    from flexh2o.compress.bits import unpack
    from flexh2o.compress.channel import ChannelSpec, largest, quantize_token
    g = torch.Generator().manual_seed(5)
    err = torch.randint(0, 4, (6, 7, 64), generator=g).float() / 4  # values 0, 0.25, 0.5, 0.75: ties everywhere
    for n in (1, 4, 8, 64):
        want = torch.sort(err, dim=-1, descending=True, stable=True).indices[..., :n]
        assert torch.equal(largest(err, n), want), n
    x = torch.randn(5, 3, 64, generator=g) * torch.where(torch.arange(64) % 9 == 0, 10.0, 1.0)
    calib = torch.stack([torch.full((64,), 0.3), torch.full((64,), -2.0)], -1).expand(5, 3, 64, 2)
    for bits in (2, 3, 4, 8):
        data, idx, _ = quantize_token(x, calib, ChannelSpec(bits, 8), torch.float32)
        levels = unpack(data, bits, 64)
        assert (levels.gather(-1, idx) == 1 << (bits - 1)).all(), bits
