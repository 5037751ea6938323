"""A decode step's attention over a quantized block in one compiled call (compress/fused_decode.py) equals attention
over the block expanded (codec.expand_stored: the query rotated by torch, logits, 1/sqrt(d), soft-cap, empty slots
masked, softmax, value mix, output rotated back), and the probabilities it sums over the query heads equal the
expanded read's, within a bound derived from fp32 rounding (below); for keys per channel with outliers and values
in whole groups at 2, 3, 4 and 8 bits, rotated or not, with the exact ring and sinks (exact or 8-bit), on whole
blocks and on the strided rows and slots decode's segments cut, through the C read where it builds and through the
numba kernel. Forms it does not take are declined (`fits`)."""
from __future__ import annotations

import pytest
import torch
from test_kv_attend import QUANTS, _block
from test_kv_fused import MORE, U, _magnitude

from flexh2o.compress import attend, fused_decode
from flexh2o.compress.codec import expand_stored
from flexh2o.compress.recent import Recent
from flexh2o.compress.rotation import rotated_if, unrotated_if
from flexh2o.kv.layout import CacheQuant
from flexh2o.kv.sdpa import capped

pytest.importorskip("numba")
pytestmark = pytest.mark.usefixtures("one_thread")

B, H, S, D, G = 3, 2, 24, 64, 2  # as test_kv_attend's blocks
FITS = [q for q in dict.fromkeys(QUANTS + MORE) if q.keys == "channel"]


@pytest.fixture(params=["c", "numba"], autouse=True)
def reader(request, monkeypatch):
    """Each test through the C read (compress/qread_native.py, where it builds and takes the form) and through the
    numba kernel (fused_decode.native() None: as on a machine with no compiler)."""
    if request.param == "numba":
        monkeypatch.setattr(fused_decode, "native", lambda: None)
    elif fused_decode.native() is None:
        pytest.skip("the C read does not build here: the numba kernel reads")
    return request.param


def _kernel():
    kn = fused_decode.kernel()
    assert kn is not None, "the one-call decode kernel failed to load or its self-check"
    return kn


def _expanded(query, kf, vf, pos, softcap):
    """The expanded read: (output (b, h, g, d) model basis, probabilities (b, h, g, s)), fp32."""
    keys, rotated = expand_stored(kf, torch.float32)
    values, _ = expand_stored(vf, torch.float32)
    qs = rotated_if(query, rotated)
    att = capped(torch.einsum("bhgd,bhsd->bhgs", qs, keys) * D ** -0.5, softcap)
    p = att.masked_fill((pos < 0)[:, :, None], float("-inf")).softmax(-1)
    return unrotated_if(torch.einsum("bhgs,bhsd->bhgd", p, values), rotated), p


def _bounds(query, kf, vf, used: int, n: int) -> tuple:
    """(Delta (b, h, g, 1): how far the kernel's scaled logits may lie from the expanded read's, E (b, h, g, d): the
    part of the output's bound not from the probabilities, per unit of the probabilities' relative error eps: the
    bound is eps * A + E, returned as (Delta, A, E)); derived in test_one_call_equals_the_expanded_read's docstring."""
    keys, rotated = expand_stored(kf, torch.float32)
    values, _ = expand_stored(vf, torch.float32)
    hmax = D ** -0.5 if rotated else 1.0  # the largest |H| entry (D a power of 2: one block)
    mk = keys.abs().amax(2, keepdim=True)  # (b, h, 1, d): each channel's largest |key|, stored basis
    mm = kf.expanded(torch.float32).abs().amax(2, keepdim=True)  # the same in the model's basis
    mv = values.abs().amax(2, keepdim=True)  # the values', stored basis
    qs = rotated_if(query, rotated)
    t1, t2 = (qs.abs() * mk).sum(-1, keepdim=True), (query.abs() * mm).sum(-1, keepdim=True)
    q1, qs1 = query.abs().sum(-1, keepdim=True), qs.abs().sum(-1, keepdim=True)
    logit = (2 * D + n + 8) * 2 * t1 + D * t2
    if rotated:
        logit = logit + 2 * D * hmax * q1 * mk.sum(-1, keepdim=True) + D * hmax * qs1 * mm.sum(-1, keepdim=True)
    mix = (2 * used + 8) * U * 2 * mv  # (b, h, 1, d), stored basis
    if not rotated:
        return logit * U * D ** -0.5, mv, mix + D * U * mv
    spread = hmax * mv.sum(-1, keepdim=True)  # a stored channel's error reaches every model channel times hmax
    return logit * U * D ** -0.5, spread, hmax * mix.sum(-1, keepdim=True) + 2 * D * U * spread


@pytest.mark.parametrize("q", FITS, ids=lambda q: q.describe())
@pytest.mark.parametrize("cut", [(0, B, S), (1, 3, 17)], ids=["whole", "segment"])
@pytest.mark.parametrize("softcap", [None, 2.0], ids=["uncapped", "capped"])
def test_one_call_equals_the_expanded_read_within_fp32_rounding(q, cut, softcap):
    """With u fp32's unit roundoff, per channel c the largest |key| Mk_c (stored basis), Mm_c (model basis), |value|
    Mv_c, the query q (model basis) and qs (stored): logits: each read sums d + n + 4 terms (levels, minimum,
    outliers) each at most 2 |qs_c| Mk_c (a stored value is two roundings from its level) with 3 roundings each:
    (2d + n + 8) u 2 sum |qs_c| Mk_c for both; the ring's exact keys read in the model's basis, d u sum |q_c| Mm_c.
    Rotated, each rotation sums d products with entries of at most hmax = 1/sqrt(d): the query's (kernel and torch:
    2 d u hmax |q|_1 per channel, times sum Mk) and the ring's keys rotated by the expanded read (d u hmax
    |qs|_1 sum Mm). Scaled by 1/sqrt(d): Delta (a cap, tanh's slope at most 1, shrinks it). Logits apart by at
    most Delta move each probability by a factor of at most e^(2 Delta) - 1 <= 2.1 Delta, and exp, the sum over
    `used` slots and the division round it by (used + 4) u more: eps. The output per stored channel: eps Mv_c from
    the probabilities, (2 used + 8) u 2 Mv_c from the mix's roundings (test_kv_fused's), d u Mv_c the ring's share
    added in another basis; rotated back, every stored channel's error reaches each model channel times hmax, and
    the rotation back rounds by d u hmax sum Mv on either side."""
    kn = _kernel()
    kf, vf = (attend.cut(f, *cut) for f in _block(q, torch.float32, seed=4))
    assert fused_decode.fits(kf, vf, torch.zeros(1))
    rows, used = cut[1] - cut[0], cut[2]
    pos = torch.arange(S).expand(B, H, S).clone()
    pos[1, :, S - 3:] = -1  # as _block's: row 1 holds 3 fewer tokens
    pos = pos[cut[0]:cut[1], :, :used]
    query = torch.randn(rows, H, G, D, generator=torch.Generator().manual_seed(5)) * 3
    want, p = _expanded(query, kf, vf, pos, softcap)
    got, psum = fused_decode.attend(kn, query, kf, vf, pos, softcap, True)
    delta, a, e = _bounds(query, kf, vf, used, q.outliers)
    eps = 2.1 * delta + (used + 4) * U  # (rows, H, G, 1): each probability's relative error
    bound = eps * a + e
    assert ((got - want).abs() <= bound).all(), float(((got - want).abs() / bound).max())
    sum_bound = (eps * p).sum(2) + G * U  # the sum over G query heads of probabilities within eps, plus its adds
    assert ((psum - p.sum(2)).abs() <= sum_bound).all(), float(((psum - p.sum(2)).abs() / sum_bound).max())


def _caught(q: CacheQuant):
    """(the block of `q`, a function telling whether the one-call read of other forms in its place leaves the
    bound above somewhere)."""
    kn = _kernel()
    kf, vf = _block(q, torch.float32)
    pos = torch.arange(S).expand(B, H, S)
    query = torch.randn(B, H, G, D, generator=torch.Generator().manual_seed(1)) * 3
    want, _ = _expanded(query, kf, vf, pos, None)
    delta, a, e = _bounds(query, kf, vf, S, q.outliers)
    bound = (2.1 * delta + (S + 4) * U) * a + e

    def caught(keys, values) -> bool:
        return bool(((fused_decode.attend(kn, query, keys, values, pos, None, False)[0] - want).abs() > bound).any())
    return kf, vf, caught


def test_the_one_call_sees_levels_outliers_ring_and_rotation():
    """The bound above catches a kernel that skipped either ring or the outliers' values, or read one level one step
    off (not rotated: the tightest bound, as in tests/kv/test_kv_fused.py), or read rotated keys unrotated."""
    kf, vf, caught = _caught(CacheQuant(4, 64, "channel", 8, 4, 2, False))
    assert not caught(kf, vf)
    assert caught(kf.inner, vf) and caught(kf, vf.inner)
    off = kf.inner.map(torch.clone)
    off.exact.mul_(2)
    assert caught(Recent(off, kf.recent, kf.rslot, kf.sinks), vf)
    off = vf.inner.map(torch.clone)
    off.data[0, 0, 3] ^= 1  # one level of one slot (not in the ring) one step away
    assert caught(kf, Recent(off, vf.recent, vf.rslot, vf.sinks))
    kf, vf, caught = _caught(CacheQuant(4, 64, "channel", 8, 4, 2, True))
    assert not caught(kf, vf)
    assert caught(Recent(kf.inner.inner, kf.recent, kf.rslot, kf.sinks), vf)


@pytest.mark.parametrize("q", [q for q in QUANTS if q.keys != "channel"], ids=lambda q: q.describe())
def test_forms_it_does_not_take_are_declined(q):
    """Keys per token or with fitted levels go to compress/fused_attend.py's reader (decode's _scored)."""
    kf, vf = _block(q, torch.float32)
    assert not fused_decode.fits(kf, vf, torch.zeros(1))
    assert not fused_decode.fits(torch.zeros(B, H, S, D), torch.zeros(B, H, S, D), torch.zeros(1))
