"""torch's int4 weight-only kernel fed by the codec equals the generic path (expand, then matmul) within bf16
rounding; the grouping it cannot express is refused."""
from __future__ import annotations

import pytest
import torch

from flexh2o.compress import CompressionSpec, dequantize, quantize
from flexh2o.compress.choice import PHASES, kernel_phases, probe
from flexh2o.compress import int4_order, kernels
from flexh2o.compress.codec import dequantize_into
from flexh2o.compress.kernels import (PackedWeight, codec_levels, expand_kernel_order, from_kernel_order, int4_linear,
                                      int4pack_from, kernel_available, to_kernel_order)
from flexh2o.models.common import linear

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


@pytest.mark.parametrize("shape", [(32, 64), (96, 256), (64, 128)])
def test_kernel_order_is_torchs_packing_and_inverts(shape):
    """to_kernel_order writes exactly what torch's converter writes (the same bytes, permuted); from_kernel_order
    gives the codec's data back; the kernel-order expansion equals dequantize bit for bit."""
    g = torch.Generator().manual_seed(shape[0])
    ct = quantize(torch.randn(shape, generator=g), CompressionSpec(4, 64 if shape[1] % 64 == 0 else 32, 1))
    ko = to_kernel_order(ct)
    levels = codec_levels(ct).reshape(shape).to(torch.int32)
    assert torch.equal(ko.data, torch._convert_weight_to_int4pack_for_cpu(levels, 1))
    assert ko.data.numel() == ct.data.numel()
    assert torch.equal(from_kernel_order(ko).data, ct.data)
    assert torch.equal(expand_kernel_order(ko, torch.empty(shape)), dequantize(ct, torch.float32))
    assert kernel_available("cpu")


@pytest.mark.parametrize("order", int4_order.ROW_ORDERS)
@pytest.mark.parametrize("rows", [32, 64, 96, 160])
def test_every_cpu_order_inverts_and_expands_exactly(monkeypatch, order, rows):
    """Each order torch may write (blocks of 32 rows on AVX2, 64 on AVX-512 with a last block of 32 rows in pairs,
    blocks of 32 rows in pairs in its generic build), whichever this CPU has: the permutation inverts, the expansion
    equals dequantize bit for bit, lookups equal the expanded table (the last, shorter block included), and the
    packing is the documented one, byte by byte."""
    monkeypatch.setattr(int4_order, "torch_order", lambda: order)
    block = order.block
    g = torch.Generator().manual_seed(rows + block + order.paired)
    ct = quantize(torch.randn(rows, 128, generator=g), CompressionSpec(4, 64, 1))
    ko = to_kernel_order(ct)
    assert torch.equal(from_kernel_order(ko).data, ct.data)
    table = expand_kernel_order(ko, torch.empty(rows, 128))
    assert torch.equal(table, dequantize(ct, torch.float32))
    ids = torch.tensor([[rows - 1, 0, min(33, rows - 1)], [rows - 32, 31, rows - 1]])
    assert torch.equal(PackedWeight.from_stored(ko).rows(ids), torch.nn.functional.embedding(ids, table))
    levels, data = codec_levels(ct).reshape(rows, 128), ko.data.reshape(-1)
    whole = rows - rows % block
    cells = [(0, 0), (1, 5), (block // 2, 3), (whole - 1, 127), (rows - 1, 64), (rows - 2, 1), (whole, 9)]
    for r, k in [(r, k) for r, k in cells if 0 <= r < rows]:
        if r < whole and not order.paired:  # a whole block: (K, block / 2) bytes, rows j and j + block / 2 in one
            b, j = divmod(r, block)
            byte, high = data[b * block * 64 + k * block // 2 + j % (block // 2)], j >= block // 2
        elif r < whole:  # a whole block in pairs: (K, block / 2) bytes, rows 2i and 2i + 1 in one
            b, j = divmod(r, block)
            byte, high = data[b * block * 64 + k * block // 2 + j // 2], j % 2 == 1
        else:  # the last block: (K, rows / 2) bytes, two consecutive rows in one
            j, last = r - whole, rows - whole
            byte, high = data[whole * 64 + k * last // 2 + j // 2], j % 2 == 1
        assert int(byte >> 4 if high else byte & 0xF) == int(levels[r, k])


@pytest.mark.parametrize("spec,shape", [(CompressionSpec(4, 64, 0), (130, 64)), (CompressionSpec(4, 64, 1), (8, 128)),
                                        (CompressionSpec(8, 32, -1), (3, 2, 5, 64)),
                                        (CompressionSpec(4, 16, 1), (4, 40))])
def test_dequantize_into_a_reused_buffer_equals_dequantize(spec, shape):
    g = torch.Generator().manual_seed(len(shape))
    ct = quantize(torch.randn(shape, generator=g).bfloat16(), spec)
    out = torch.full(shape, float("nan"))
    assert dequantize_into(ct, out) is out
    assert torch.equal(out, dequantize(ct, torch.float32))


@pytest.mark.parametrize("rows", [1, 5, 300])
def test_packed_weight_linear_equals_the_generic_path(rows):
    """PackedWeight.linear (what the model calls) with a bias, fp32 in and out, equals expand + F.linear within the
    kernel's bf16 rounding (activations, scales, zeros and output)."""
    g = torch.Generator().manual_seed(rows)
    ct = to_kernel_order(quantize(torch.randn(64, 192, generator=g) * 0.05, CompressionSpec(4, 64, 1)))
    x, bias = torch.randn(2, rows, 192, generator=g), torch.randn(64, generator=g)
    got = linear(x, PackedWeight.from_stored(ct), bias)
    want = linear(x, expand_kernel_order(ct, torch.empty(64, 192)), bias)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=float(want.abs().max()) * 2 ** -6, rtol=2 ** -6)
    assert (got - want).abs().max() > 0  # really the kernel (bf16), not the dense path


@pytest.mark.parametrize("blocks_at_once, dtype", [(1, torch.float32), (3, torch.float32), (64, torch.bfloat16)])
def test_packed_weight_expanded_block_by_block_is_the_generic_path(monkeypatch, blocks_at_once, dtype):
    """A PackedWeight with kernel False (the head where the kernel does not run) expands a few row blocks at a time
    and multiplies them in x's dtype: the generic path's result (fp32: to float rounding of the split matmul)."""
    from flexh2o.compress import kernels
    monkeypatch.setattr(kernels, "ROWS_ELEMENTS", blocks_at_once * kernels.row_block() * 192)
    g = torch.Generator().manual_seed(blocks_at_once)
    ct = to_kernel_order(quantize(torch.randn(160, 192, generator=g) * 0.05, CompressionSpec(4, 64, 1)))
    x, bias = torch.randn(2, 7, 192, generator=g).to(dtype), torch.randn(160, generator=g).to(dtype)
    got = linear(x, PackedWeight.from_stored(ct, dtype, kernel=False), bias)
    want = linear(x, expand_kernel_order(ct, torch.empty(160, 192)).to(dtype), bias)
    assert got.dtype == dtype and got.shape == want.shape
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(got, want, atol=tol * float(want.abs().max()), rtol=tol)


def test_probe_times_both_paths_per_phase():
    f32 = dict.fromkeys(PHASES, torch.float32)
    times = probe((64, 128), {"prefill": 64, "decode": 2}, CompressionSpec(4, 64, 1), f32)
    assert set(times) == set(PHASES) and all(t[p] > 0 for t in times.values() for p in ("int4", "generic"))
    assert kernel_phases("int4", (64, 128), {}, CompressionSpec(4, 64, 1), f32) == dict.fromkeys(PHASES, 1)
    with pytest.raises(ValueError, match="--weight-kernel"):
        kernel_phases("fast", (64, 128), {}, CompressionSpec(4, 64, 1), f32)


@pytest.mark.parametrize("blocks_at_once", [1, 2, 8])
def test_packed_weight_rows_equal_the_expanded_table(monkeypatch, blocks_at_once):
    """Embedding lookups from a PackedWeight expand only the row blocks they need, a few blocks at a time (the
    buffer the memory plan reserves), exactly as the generic path."""
    from flexh2o.compress import kernels
    monkeypatch.setattr(kernels, "ROWS_ELEMENTS", blocks_at_once * kernels.row_block() * 64)
    g = torch.Generator().manual_seed(5)
    ct = to_kernel_order(quantize(torch.randn(128, 64, generator=g), CompressionSpec(4, 64, 1)))
    ids = torch.tensor([[3, 100, 3], [127, 0, 64]])
    table = expand_kernel_order(ct, torch.empty(128, 64))
    assert torch.equal(PackedWeight.from_stored(ct).rows(ids), torch.nn.functional.embedding(ids, table))
    block = kernels.row_block()
    assert kernels.rows_buffer_bytes((128, 64)) == min(128 // block, blocks_at_once) * block * 64 * 4


@pytest.mark.parametrize("meta_dtype", [torch.float16, torch.float32])  # Q4_0/Q4_1 blocks; Q4_K's fp32
def test_kernel_scales_and_zeros_from_the_stored_meta(meta_dtype):
    g = torch.Generator().manual_seed(3)
    n, groups = 96, 18
    meta = (torch.randn(n, groups, 2, generator=g) * torch.tensor([0.01, 1.0])).to(meta_dtype)
    before = meta.clone()
    scale, lo = meta[..., 0].float(), meta[..., 1].float()
    want = torch.stack([scale, lo + 8 * scale], -1).to(torch.bfloat16).transpose(0, 1)  # (groups, n, 2)
    got = kernels.kernel_scales(meta)
    assert got.shape == (groups, n, 2) and got.dtype == torch.bfloat16 and got.is_contiguous()
    assert torch.equal(got, want)
    assert torch.equal(meta, before)  # the stored meta is never written
