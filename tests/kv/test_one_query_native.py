"""kv/one_query_native.py's C one-query attention over a cache block's strided slices, fp32 and bf16, against the
exact attention (fp64) within the bound each dtype's arithmetic allows; and kv/sdpa.one_query takes it where it runs
(elsewhere, e.g. under ATEN_CPU_CAPABILITY=avx2, the matmuls)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flexh2o.kv import one_query_native as native
from flexh2o.kv import sdpa as attn

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not native.available(), reason="the C code does not run here (no AVX-512)")]


def _case(dtype, b=5, h=3, g=1, t=11, slots=16, d=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, g, d, generator=gen).to(dtype)
    k, v = ((torch.randn(b, h, slots, d, generator=gen) * 2).to(dtype)[:, :, :t] for _ in range(2))  # slices
    return q, k, v


def _bound(q, k, v):
    """(exact, |got - exact| allowed). bf16: logits rounded to bf16 (u = 2^-8 of each |q.k| / sqrt(d)) move each
    probability by a factor within exp(+-2 max), the probabilities rounded (u) mix |v|, the output rounded (u).
    Both: fp32 sums of d products (d eps of |q|.|k| / sqrt(d) on a logit, as many again in the bound's exp(2 x)),
    exp within 2 ulp and the normalisation (8 eps), the value mix of T terms (T eps of the mix of |v|)."""
    u = torch.finfo(torch.bfloat16).eps / 2 if q.dtype == torch.bfloat16 else 0.0
    eps, d, t = torch.finfo(torch.float32).eps, q.shape[-1], k.shape[-2]
    q, k, v = q.double(), k.double(), v.double()
    sums = (q.abs() @ k.abs().transpose(-1, -2)).amax(-1, keepdim=True) * d ** -0.5  # (b, h, g, 1)
    delta = u * (q @ k.transpose(-1, -2)).abs().amax(-1, keepdim=True) * d ** -0.5 + d * eps * sums
    exact = F.scaled_dot_product_attention(q, k, v)  # (b, h, g, d)
    mixed = (q @ k.transpose(-1, -2) * d ** -0.5).softmax(-1) @ v.abs()  # (b, h, g, d)
    return exact, (torch.expm1(2 * delta) * (1 + u) + u + (t + 8) * eps) * mixed + u * exact.abs()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [{}, {"t": 1}, {"t": 40, "slots": 48}, {"d": 128, "t": 17}, {"d": 80},
                                   {"g": 4, "t": 33, "slots": 40}])
def test_attend_within_its_rounding(dtype, shape):
    q, k, v = _case(dtype, **shape)
    assert native.takes(q, k, v)
    exact, bound = _bound(q, k, v)
    got = native.attend(q, k, v)
    assert got.shape == q.shape and got.dtype == dtype and got.is_contiguous()
    assert ((got.double() - exact).abs() <= bound).all()


def test_attend_reads_strided_queries_and_broadcast_heads_as_the_dense_ones():
    q, k, v = _case(torch.bfloat16, b=4, h=1, t=9)
    wide = torch.randn(4, 6, 1, 64).bfloat16()[:, ::2]  # (4, 3, 1, 64), a stride between heads
    want = native.attend(wide.contiguous(), k.expand(4, 3, 9, 64).contiguous(), v.expand(4, 3, 9, 64).contiguous())
    assert torch.equal(native.attend(wide, k.expand(4, 3, 9, 64), v.expand(4, 3, 9, 64)), want)


def test_one_query_takes_the_c_code_and_keeps_the_matmuls_apart():
    q, k, v = _case(torch.bfloat16)
    assert torch.equal(attn.one_query(q, k, v), native.attend(q, k, v))
    exact, bound = _bound(q, k, v)
    assert ((attn.by_matmuls(q, k, v).double() - exact).abs() <= bound).all()


def test_takes_refuses_what_the_c_code_does_not_read():
    q, k, v = _case(torch.bfloat16, d=72)  # not a multiple of 16
    assert not native.takes(q, k, v)
    q, k, v = _case(torch.float16)
    assert not native.takes(q, k, v)
    q, k, v = _case(torch.float32)
    assert not native.takes(q, k.transpose(-1, -2), v)  # the head dimension not contiguous


def test_without_the_library_one_query_runs_the_matmuls(monkeypatch):
    """No C compiler (or a library that does not load): `available` is False and kv/sdpa keeps its matmuls."""
    monkeypatch.setattr(native, "_library", lambda: None)
    native.available.cache_clear()
    try:
        q, k, v = _case(torch.bfloat16)
        assert not native.takes(q, k, v)
        assert torch.equal(attn.one_query(q, k, v), attn.by_matmuls(q, k, v))
    finally:
        monkeypatch.undo()
        native.available.cache_clear()
