"""models/common's products on whichever path this CPU takes (oneDNN on AVX-512, MKL elsewhere): linear, linear_relu
and linear_add equal F.linear's, and rowwise chunks a residual with its rows."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flexh2o.models import common


def _case(rows: int, bias: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 1, 96, generator=g)  # (b, t, k)
    w = torch.randn(40, 96, generator=g)  # (n, k)
    b = torch.randn(40, generator=g) if bias else None
    res = torch.randn(rows, 1, 40, generator=g)  # (b, t, n)
    # k = 96 products summed in any order the kernel picks, then the bias and the residual: each output within
    # (k + 2) fp32 roundings of the sum of the magnitudes
    scale = x.abs() @ w.abs().T + (b.abs() if bias else 0) + res.abs()
    return x, w, b, res, 98 * torch.finfo(torch.float32).eps * scale


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("bias", [True, False])
def test_products_equal_f_linear(rows, bias):
    x, w, b, res, bound = _case(rows, bias, rows)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())  # (rows, 1, 40)
    for got, want in ((common.linear(x, w, b), ref), (common.linear_relu(x, w, b), F.relu(ref)),
                      (common.linear_add(x, w, b, res), ref + res.double())):
        assert got.shape == (rows, 1, 40) and got.dtype == torch.float32
        assert ((got.double() - want).abs() <= bound.double()).all()


def test_linear_add_keeps_a_strided_residual():
    x, w, b, res, bound = _case(5, True, 0)
    strided = torch.randn(40, 5).T[:, None, :]  # (5, 1, 40), not contiguous: the unfused sum
    got = common.linear_add(x, w, b, strided)
    assert ((got - (strided + F.linear(x, w, b))).abs() <= bound).all()


def test_rowwise_chunks_the_residual_with_its_rows(monkeypatch):
    x, w, b, res, bound = _case(7, True, 1)
    whole = common.rowwise(lambda r, s: common.linear_add(r, w, b, s), x, 40, res)
    monkeypatch.setattr(common, "MLP_ELEMENTS", 3 * 40)  # 3 rows a chunk: 3, 3, 1
    calls = []
    chunked = common.rowwise(lambda r, s: calls.append(r.shape[0]) or common.linear_add(r, w, b, s), x, 40, res)
    assert calls == [3, 3, 1] and chunked.shape == whole.shape == (7, 1, 40)
    assert ((chunked - whole).abs() <= 2 * bound).all()  # each row the same sum, by a kernel of another shape


def test_onednn_only_for_fp32():
    x, w, b, _, _ = _case(4, True, 2)
    assert not common.onednn_fits(x.bfloat16(), w.bfloat16())
    assert common.onednn_fits(x, w) == common.onednn_linear()
