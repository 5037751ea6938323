"""The vocabulary projection in slices of the weight's rows (models/common.head_linear) equals one F.linear call."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flexh2o.models import common
from flexh2o.models.common import head_linear


@pytest.mark.parametrize("rows", [1, 7, 67])
def test_sliced_head_equals_one_call(rows):
    dtype = torch.float32
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(3001, 576, generator=g).to(dtype)  # 3001 rows: the last slice is short
    x = torch.randn(rows, 1, 576, generator=g).to(dtype)
    assert w.shape[0] > common.HEAD_CHUNK_BYTES // (576 * w.element_size())  # more than one slice
    out = head_linear(x, w)
    assert out.shape == (rows, 1, 3001) and out.dtype == dtype
    # the same dot products, summed in the order the kernel picks per shape: within fp32 rounding of one call
    scale = (x.float().abs() @ w.float().abs().T).max().item()
    torch.testing.assert_close(out.float(), F.linear(x, w).float(), rtol=0, atol=1e-6 * scale)


def test_slices_follow_the_byte_limit(monkeypatch):
    monkeypatch.setattr(common, "onednn_linear", lambda: False)  # the slices are the path where oneDNN is not
    shapes = []
    real = F.linear
    monkeypatch.setattr(common.F, "linear", lambda x, w, b=None: shapes.append(tuple(w.shape)) or real(x, w, b))
    head_linear(torch.zeros(2, 8), torch.zeros(100, 8))  # 3.2 KB: one call
    assert shapes == [(100, 8)]
    shapes.clear()
    monkeypatch.setattr(common, "HEAD_CHUNK_BYTES", 40 * 8 * 4)  # 40 rows of 8 fp32 per slice
    assert head_linear(torch.ones(2, 8), torch.ones(100, 8)).shape == (2, 100)
    assert shapes == [(40, 8), (40, 8), (20, 8)]
    shapes.clear()
    out = head_linear(torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(100, 8, dtype=torch.bfloat16))
    assert shapes == [(100, 8)] and out.dtype == torch.bfloat16  # a bf16 head is one call (slicing was slower)
