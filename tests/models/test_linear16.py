"""models/common's products in a 16-bit dtype: by oneDNN where the CPU multiplies the dtype natively
(tensors.native_products), by F.linear elsewhere; either way within the dtype's rounding of the exact product, the
bias, relu and residual sum included."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flexh2o.models import common
from flexh2o.tensors import native_products

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_bf16_products_within_its_rounding(rows):
    g = torch.Generator().manual_seed(rows)
    x, w, b, res = (torch.randn(*s, generator=g).bfloat16() for s in ((rows, 1, 96), (40, 96), (40,), (rows, 1, 40)))
    exact = F.linear(x.double(), w.double(), b.double())  # (rows, 1, 40)
    mag = x.double().abs() @ w.double().abs().T + b.double().abs() + res.double().abs()
    # k = 96 products summed in fp32 in any order (96 fp32 eps), then at most two roundings to bf16 (the product
    # with its bias, the residual's sum, unfused: half a bf16 eps each) of values within `mag`
    bound = (96 * torch.finfo(torch.float32).eps + torch.finfo(torch.bfloat16).eps) * mag
    for got, want in ((common.linear(x, w, b), exact), (common.linear_relu(x, w, b), F.relu(exact)),
                      (common.linear_add(x, w, b, res), exact + res.double())):
        assert got.shape == (rows, 1, 40) and got.dtype == torch.bfloat16
        assert ((got.double() - want).abs() <= bound).all()


def test_onednn16_where_the_cpu_multiplies_the_dtype():
    x, w = torch.randn(4, 96).bfloat16(), torch.randn(40, 96).bfloat16()
    assert common.onednn16_fits(x, w) == (native_products(torch.bfloat16) and common.onednn_linear16(torch.bfloat16))
    assert not common.onednn16_fits(x.float(), w.float()) and not common.onednn16_fits(x, w.float())
    assert not common.onednn_linear16(torch.float16) or native_products(torch.float16)
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):  # the AVX2 path keeps F.linear
        assert not common.onednn16_fits(x, w)
