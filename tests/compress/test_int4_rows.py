"""compress/int4_rows.py's product of activations and a 4-bit weight read from its packed bytes (the int4 kernel's
order of this CPU, whole row blocks and a last paired one) equals the dequantized weight times the activations
within fp32 accumulation, for each product this CPU runs (the fp32 one on any AVX2 CPU, the bf16 dot product on an
AVX512-BF16 one), and PackedWeight.linear takes it where it is chosen."""
from __future__ import annotations

import pytest
import torch

from flexh2o.compress import int4_rows
from flexh2o.compress.codec import CompressionSpec, dequantize, quantize
from flexh2o.compress.kernels import PackedWeight, from_kernel_order, kernel_available, to_kernel_order

U = 2.0 ** -24  # fp32's unit roundoff


def _kinds() -> list:
    lib = int4_rows._library()
    if lib is None or not kernel_available("cpu") or torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        return []
    return [k for k in (1, 2) if k <= lib.mm4_kind(int(k == 2))]


KINDS = _kinds()


@pytest.mark.skipif(not KINDS, reason="no C compiler, no AVX2, or torch's int4 kernel missing here")
@pytest.mark.parametrize("use", [1, 2])
@pytest.mark.parametrize("shape, group", [((96, 256), 64), ((160, 128), 32), ((64, 512), 256)])
@pytest.mark.parametrize("rows", [1, 7, 16, 19])
@pytest.mark.parametrize("meta_dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_product_equals_the_dequantized_weight_times_x(use, shape, group, rows, meta_dtype):
    _check(use, shape, group, rows, meta_dtype, 1.0)


@pytest.mark.parametrize("use", [1, 2])
def test_subnormal_fp16_meta_is_read_exactly(use):
    """Scales under fp16's smallest normal (6.1e-5) are subnormal in an fp16 meta: read as the codec reads them."""
    _check(use, (64, 128), 64, 3, torch.float16, 1e-4)


def _check(use, shape, group, rows, meta_dtype, magnitude):
    if use not in KINDS:
        pytest.skip("no C compiler or AVX2, torch's int4 kernel missing, or this CPU has no AVX512-BF16")
    gen = torch.Generator().manual_seed(rows + group)
    w = torch.randn(shape, generator=gen) * magnitude
    ct = to_kernel_order(quantize(w, CompressionSpec(4, group, 1), meta_dtype))
    w = dequantize(from_kernel_order(ct), torch.float32).double()  # (N, K), the codec's own expansion
    x = torch.randn(rows, shape[1], generator=gen)
    if use == 2:
        x = x.bfloat16()  # the bf16 dot product multiplies bf16 activations, as torch's int4 kernel does
    got = int4_rows.product(x, ct.data, ct.meta, group, use).double()
    want = x.double() @ w.t()
    # A group's sum of x times its levels is gs fused multiply-adds in fp32 (one rounding each), then scaled and the
    # minimum times x's group sum (gs additions) added to the output by two more: at most gs + 2 G + 2 <= K + 4
    # roundings, each within u of a partial sum bounded by sum_k |x_k| (|level_k scale| + |minimum|); and
    # |level scale| <= |w| + |minimum|.
    minimum = ct.meta[..., 1].double().abs().repeat_interleave(group, 1)  # (N, K)
    bound = (shape[1] + 4) * U * (x.double().abs() @ (w.abs() + 2 * minimum).t())
    assert ((got - want).abs() <= bound).all()


@pytest.mark.skipif(not KINDS, reason="no C compiler, no AVX2, or torch's int4 kernel missing here")
def test_packed_weight_linear_takes_the_product_where_chosen(monkeypatch):
    """Where the measurement chooses it, PackedWeight.linear returns the product's result in x's dtype (plus the
    bias); where it does not, torch's kernel's."""
    gen = torch.Generator().manual_seed(1)
    ct = to_kernel_order(quantize(torch.randn(96, 256, generator=gen), CompressionSpec(4, 64, 1), torch.bfloat16))
    x, bias = torch.randn(4, 256, generator=gen), torch.randn(96, generator=gen)
    pw = PackedWeight.from_stored(ct)
    for faster in (True, False):
        monkeypatch.setattr(int4_rows, "_faster", lambda *args, faster=faster: faster)
        assert int4_rows.chosen(x, ct.data, 64) is faster
        want = (int4_rows.product(x, ct.data, ct.meta, 64) if faster else
                torch._weight_int4pack_mm_for_cpu(x.bfloat16(), ct.data, 64, pw.scales_zeros).float()) + bias
        assert torch.equal(pw.linear(x, bias), want)


def test_weights_the_product_does_not_take_are_never_chosen():
    """A weight of rows not a multiple of 32, or a group over 256, stays with torch's kernel."""
    x = torch.randn(2, 512)
    assert not int4_rows.chosen(x, torch.zeros(48, 256, dtype=torch.uint8), 64)
    assert not int4_rows.chosen(x, torch.zeros(64, 256, dtype=torch.uint8), 512)
