"""torch's int4 weight-only kernel fed by the codec equals the generic path (expand, then matmul) within bf16
rounding; the grouping it cannot express is refused."""
from __future__ import annotations

import pytest
import torch

from flexh2o.compress import CompressionSpec, dequantize, quantize
from flexh2o.compress.kernels import int4_linear, int4pack_from

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 4, 64])
def test_int4_kernel_equals_expand_then_matmul(group, rows):
    g = torch.Generator().manual_seed(group + rows)
    w = (torch.randn(96, 256, generator=g) * 0.05).bfloat16()
    ct = quantize(w, CompressionSpec(4, group, 1))
    x = torch.randn(2, rows, 256, generator=g).bfloat16()
    packed, scales_zeros = int4pack_from(ct)
    got = int4_linear(x, packed, group, scales_zeros).float()
    want = x.float() @ dequantize(ct, torch.float32).T  # (2, rows, 96), exact products of the rounded inputs
    scale = want.abs().max()
    torch.testing.assert_close(got, want, atol=float(scale) * 2 ** -7, rtol=2 ** -7)  # bf16 output rounding
    plain = x.float() @ w.float().T
    assert (want - plain).abs().max() > 10 * float(scale) * 2 ** -8  # quantization is visible: not a plain matmul


def test_kernel_refuses_flexgen_dim0_groups():
    ct = quantize(torch.randn(64, 128), CompressionSpec(4, 64, 0))
    with pytest.raises(ValueError, match="input dimension"):
        int4pack_from(ct)
