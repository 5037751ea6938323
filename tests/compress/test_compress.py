"""The group-wise codec: every value within half a step of its group's level, constant groups exact, ragged tails
padded (never truncated), each storage dtype, FlexGen's 4.5 bits a value, and compressed files on the disk tier
read back byte for byte."""
from __future__ import annotations

import pytest
import torch

from flexh2o.compress import CompressionSpec, dequantize, quantize, stored_bytes

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
EPS = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 2.0 ** -23}


def _groups(x: torch.Tensor, spec: CompressionSpec) -> list:
    """The values of every group of x (the tail group shorter), as flat fp32 tensors."""
    d = spec.dim(x.dim())
    xt = x.float().movedim(d, -1)  # (..., n)
    return [part.reshape(-1, part.shape[-1]) for part in xt.split(spec.group_size, -1)]


def _assert_half_step(x: torch.Tensor, y: torch.Tensor, spec: CompressionSpec) -> None:
    """|x - y| <= (max - min) / levels / 2 per group, plus the rounding of the 16-bit scale and minimum."""
    eps, moved = EPS[x.dtype], False
    for xs, ys in zip(_groups(x, spec), _groups(y, spec)):
        lo, hi = xs.min(-1, keepdim=True).values, xs.max(-1, keepdim=True).values  # (rows, 1)
        step = (hi - lo) / spec.levels
        slack = eps * (step * (spec.levels + 1) + lo.abs()) + 1e-30
        err = (xs - ys).abs()
        assert (err <= step / 2 + slack).all(), float((err - step / 2 - slack).max())
        moved |= bool((err > step / 4).any())
    assert moved, "rounding must actually move values"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape,dim", [((256, 48), 0), ((3, 2, 5, 64), -1), ((130, 7), 0), ((2, 3, 4, 70), -1),
                                       ((6, 100, 5), 1)])
def test_within_half_a_step(dtype, bits, shape, dim):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 3 + 1).to(dtype)
    spec = CompressionSpec(bits, 64, dim)
    ct = quantize(x, spec)
    y = dequantize(ct, torch.float32)
    assert y.shape == x.shape and ct.shape == tuple(x.shape) and ct.dtype == dtype
    _assert_half_step(x, y, spec)
    assert dequantize(ct).dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
def test_constant_groups_are_exact(dtype):
    spec = CompressionSpec(4, 8, -1)
    values = torch.tensor([0.0, -3.25, 1e-3, 7.0, 0.1], dtype=dtype)  # 0.1 is not exact in any of them: still kept
    x = values[:, None, None].expand(5, 3, 8).contiguous()  # every group constant
    ct = quantize(x, spec)
    assert torch.equal(dequantize(ct), x)
    assert (ct.meta[..., 0] == 0).all()  # scale 0: no division by zero happened
    mixed = torch.cat([x, torch.randn(5, 3, 8).to(dtype)], -1)  # constant and varying groups side by side
    assert torch.equal(dequantize(quantize(mixed, spec))[..., :8], x)


@pytest.mark.parametrize("bits", [4, 8])
def test_ragged_tail_is_padded_not_truncated(bits):
    spec = CompressionSpec(bits, 64, 0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64 + 10, 3, generator=g)
    x[64:] = x[64:] * 0.01 + 5.0  # the tail lies far from the rest: a padding with zeros would widen its range
    ct = quantize(x, spec)
    assert ct.data.shape == (2, 32 * bits // 4, 3) and ct.shape == (74, 3)
    y = dequantize(ct)
    tail_step = (x[64:].max(0).values - x[64:].min(0).values) / spec.levels
    assert ((y[64:] - x[64:]).abs() <= tail_step / 2 + 1e-6).all()  # the tail group's own range, not widened
    _assert_half_step(x, y, spec)


def test_two_values_per_byte_and_the_bytes_of_a_tensor():
    spec = CompressionSpec(4, 64, 0)
    ct = quantize(torch.randn(128, 10).half(), spec)
    assert ct.data.dtype == torch.uint8 and ct.data.numel() == 128 * 10 // 2
    assert ct.nbytes == stored_bytes((128, 10), torch.float16, spec) == 128 * 10 // 2 + 2 * 10 * 2 * 2
    assert stored_bytes((4096, 4096), torch.float16, spec) / stored_bytes((4096, 4096), torch.float16) == 4.5 / 16
    assert stored_bytes((4096, 4096), torch.float16, CompressionSpec(8, 64)) / (4096 * 4096) == 1 + 4 / 64
    assert stored_bytes((65, 2), torch.float16, spec) == stored_bytes((128, 2), torch.float16, spec)  # padded
    q = quantize(torch.arange(16.0).view(16, 1).expand(16, 2).contiguous(), CompressionSpec(4, 16, 0))
    assert q.data[0, :, 0].tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]  # low nibble first


def test_map_slices_leading_dimensions():
    spec = CompressionSpec(4, 64, -1)
    x = torch.randn(4, 2, 6, 64)
    ct = quantize(x, spec)
    part = ct.map(lambda t: t[1:3])
    assert part.shape == (2, 2, 6, 64)
    assert torch.equal(dequantize(part), dequantize(ct)[1:3])


@pytest.mark.parametrize("kw", [{"bits": 3}, {"bits": 16}, {"group_size": 7}, {"group_size": 0}])
def test_bad_spec_is_refused(kw):
    with pytest.raises(ValueError, match="compress"):
        CompressionSpec(**kw)


def test_compressed_file_on_disk_reads_back_identically(tmp_path):
    from flexh2o.storage.disk import DiskTier
    spec = CompressionSpec(4, 64, 0)
    ct = quantize(torch.randn(200, 33).to(torch.bfloat16), spec)
    (ds, ddt), (ms, mdt) = spec.layout((200, 33), torch.bfloat16)
    tier = DiskTier(str(tmp_path / "run"), 1 << 30)
    try:
        data, meta = tier.alloc(ds, ddt), tier.alloc(ms, mdt)
        tier.store(data, ct.data)
        tier.store(meta, ct.meta)
        assert tier.used == ct.nbytes
        back = (tier.load(data, torch.device("cpu")), tier.load(meta, torch.device("cpu")))
        assert torch.equal(back[0], ct.data) and torch.equal(back[1], ct.meta)
    finally:
        tier.close()
    assert not (tmp_path / "run").exists()
