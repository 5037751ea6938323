"""A decode step's one-query attention in bf16 (kv/sdpa.sdpa): by two matmuls where the CPU multiplies bf16
natively, over a cache block's strided slices in heap-sized row chunks (or kv/one_query_native.py's C code reading
them in place, where it runs), else torch's fused kernel; all within the bound bf16's roundings allow of the exact
attention."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flexh2o.kv import sdpa as attn
from flexh2o.tensors import native_products

pytestmark = pytest.mark.usefixtures("one_thread")


def _case(b=5, h=3, t=11, slots=16, d=64):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, 1, d, generator=g).bfloat16()
    k, v = (torch.randn(b, h, slots, d, generator=g).bfloat16()[:, :, :t] for _ in range(2))  # a block's slices
    return q, k, v


def _bound(q, k, v):
    """|got - exact| allowed: logits rounded to bf16 (u = 2^-8 of each |q.k| / sqrt(d) at most) move each
    probability by a factor within exp(+-2 max), the probabilities rounded to bf16 (u) mix |v|, the output is
    rounded (u), fp32 sums of d and T terms besides."""
    u, d = torch.finfo(torch.bfloat16).eps / 2, q.shape[-1]
    q, k, v = q.double(), k.double(), v.double()
    delta = u * (q @ k.transpose(-1, -2)).abs().amax(-1, keepdim=True) * d ** -0.5  # (b, h, 1, 1)
    p = F.scaled_dot_product_attention(q, k, v)  # (b, h, 1, d)
    mixed = (q @ k.transpose(-1, -2) * d ** -0.5).softmax(-1) @ v.abs()  # (b, h, 1, d)
    fp32 = (d + k.shape[-2]) * torch.finfo(torch.float32).eps
    return p, (torch.expm1(2 * delta) * (1 + u) + u + fp32) * mixed + u * p.abs()


@pytest.mark.parametrize("rows", [None, 2])
def test_bf16_one_query_within_its_rounding(monkeypatch, rows):
    q, k, v = _case()
    if rows is not None:  # chunks of 2 rows (2, 2, 1): every chunk's slices copied as they are
        monkeypatch.setattr(attn, "CPU_WORKSPACE", rows * k[0].numel() * k.element_size())
    exact, bound = _bound(q, k, v)
    for got in (attn.one_query(q, k, v), attn.by_matmuls(q, k, v), attn.sdpa(q, k, v),
                F.scaled_dot_product_attention(q, k, v)):
        assert got.shape == q.shape and got.dtype == torch.bfloat16
        assert ((got.double() - exact).abs() <= bound).all()


def test_sdpa_takes_one_query_where_bf16_is_native():
    q, k, v = _case()
    want = attn.one_query(q, k, v) if native_products(torch.bfloat16) else F.scaled_dot_product_attention(q, k, v)
    assert torch.equal(attn.sdpa(q, k, v), want)
