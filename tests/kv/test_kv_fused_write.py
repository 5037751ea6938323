"""The write kernels of the quantized cache (compress/fused_write.py, numba) store what the torch code stores, bit
for bit: keys per channel with their outliers (channel.quantize_token), values in per-token groups
(codec.quantize), the exact ring's entries (Recent.remember), at 2, 3, 4 and 8 bits in fp32, bf16 and fp16 storage;
and fp32 values dequantized from the kernels' groups equal tests/reference_quant.py's per_token exactly (the same
fp32 operations: min, (max - min) / levels, round((x - min) / step), level * step + min, with nothing to round to
the storage dtype). Exact equality is the bound: the kernels run each torch operation in the same order in fp32,
without fastmath. Then: the kernels do not run under FLEXH2O_CACHE_KERNEL=torch or off the CPU."""
from __future__ import annotations

import pytest
import torch
from reference_quant import per_channel, per_token

from flexh2o.compress import fused_attend, fused_write
from flexh2o.compress.channel import ChannelKeys, ChannelSpec, quantize_token
from flexh2o.compress.codec import CacheGroupSpec, dequantize, quantize
from flexh2o.compress.recent import Recent

pytest.importorskip("numba")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.fixture(scope="module")
def kn():
    fused_attend.chosen("fused")  # numba's threading layer set as the fused reader sets it
    got = fused_write._loaded("auto")
    assert got is not None, "the write kernels failed their self-check"
    return got


def _keys(gen, shape, dtype):
    """Keys with a few wide channels, and a calibration from their first half (the rest clamps sometimes)."""
    x = torch.randn(shape, generator=gen) * (1 + 4 * (torch.arange(shape[-1]) % 7 == 0))
    first = x[..., : shape[-2] // 2, :]
    calib = torch.stack([(first.amax(-2) - first.amin(-2)) / 15, first.amin(-2)], -1)  # (..., d, 2)
    return x.to(dtype), calib.to(dtype)


@pytest.fixture(params=("one thread", "threads"))
def threads(request, monkeypatch):
    """Each kernel's one-thread build, and its build over numba's threads (what a prompt's many tokens take)."""
    monkeypatch.setattr(fused_write, "PARALLEL_FROM", 0 if request.param == "threads" else 1 << 60)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", (2, 3, 4, 8))
@pytest.mark.parametrize("outliers", (0, 1, 8))
def test_channel_keys_equal_torch(kn, threads, dtype, bits, outliers):
    gen = torch.Generator().manual_seed(bits * 10 + outliers)
    x, calib = _keys(gen, (3, 2, 40, 64), dtype)
    spec = ChannelSpec(bits, outliers)
    for xs, cs in ((x, calib[:, :, None]), (x[:, :, 5], calib)):  # a range of slots; one slot a row and head
        got, want = fused_write.channel_token(xs, cs, spec, dtype), quantize_token(xs, cs, spec, dtype)
        assert got is not None
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", (2, 3, 4, 8))
@pytest.mark.parametrize("group", (16, 32, 64))
def test_groups_equal_torch(kn, threads, dtype, bits, group):
    gen = torch.Generator().manual_seed(bits + group)
    x = (torch.randn(3, 2, 17, 64, generator=gen) * 3).to(dtype)
    x[0, 0, 0, :group] = 1.5  # a constant group: scale 0
    spec = CacheGroupSpec(bits, group, -1)
    got, want = fused_write.group_quant(x, spec, dtype), quantize(x, spec, dtype)
    assert got is not None and got.length == want.length
    assert torch.equal(got.data, want.data) and torch.equal(got.meta, want.meta)


@pytest.mark.parametrize("bits", (2, 3, 4, 8))
def test_groups_equal_reference(kn, bits):
    gen = torch.Generator().manual_seed(bits)
    x = torch.randn(9, 3, 64, generator=gen)  # (T, kv, d), reference_quant's shape
    got = dequantize(fused_write.group_quant(x, CacheGroupSpec(bits, 32, -1), torch.float32), torch.float32)
    assert torch.equal(got, per_token(bits, 32)(x, 9))


@pytest.mark.parametrize("bits,outliers", ((2, 4), (3, 0), (4, 8), (8, 1)))
def test_channel_keys_equal_reference(kn, bits, outliers):
    """Keys (T, kv, d) calibrated on the first 12 tokens, then every token written by the kernel, read back (fp32)."""
    gen = torch.Generator().manual_seed(bits + outliers)
    x = torch.randn(20, 3, 32, generator=gen) * (1 + 3 * (torch.arange(32) % 5 == 0))
    spec = ChannelSpec(bits, outliers)
    shape = (1, 3, 20, 32)
    keys = ChannelKeys(*(torch.zeros(sh, dtype=dt) for sh, dt in spec.parts(shape, torch.float32).values()), spec)
    k = x.transpose(0, 1)[None]  # (1, kv, T, d)
    keys.calibrate(k, torch.arange(20).expand(1, 3, 20) < 12)
    assert fused_write.assign(keys, (slice(None), slice(None), slice(0, 20)), k)
    assert torch.equal(keys.expanded(torch.float32)[0].transpose(0, 1), per_channel(bits, outliers)(x, 12))


def _ring(window, sinks, dtype):
    b, h, d = 3, 2, 8
    rslot = torch.full((b, h, window + sinks), -1, dtype=torch.int32)
    return Recent(None, torch.zeros(b, h, window + sinks, d, dtype=dtype), rslot, sinks)


@pytest.mark.parametrize("window,sinks", ((4, 0), (4, 2), (0, 3), (1, 1)))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_ring_equal_torch(kn, monkeypatch, window, sinks, dtype):
    gen = torch.Generator().manual_seed(window * 4 + sinks)
    fast, slow = _ring(window, sinks, dtype), _ring(window, sinks, dtype)
    steps = []
    for step in range(9):  # rows at different positions, slots reused (an evicted token's)
        pos = torch.tensor([step, step + 2, 2 * step])
        slot = torch.randint(0, 6, (3, 2), generator=gen)
        steps.append((slot, pos, torch.randn(3, 2, 8, generator=gen)))
    for slot, pos, values in steps:
        assert fused_write.ring_put(fast.rslot, fast.recent, slot, pos, window, sinks, values)
    monkeypatch.setattr(fused_write, "kernels", lambda: None)  # the torch code
    for step in steps:
        slow.remember(*step)
    assert torch.equal(fast.rslot, slow.rslot) and torch.equal(fast.recent, slow.recent)


def test_kernels_off_under_torch_mode_and_off_the_cpu(kn, monkeypatch):
    x, calib = _keys(torch.Generator().manual_seed(0), (2, 2, 4, 32), torch.float32)
    spec = ChannelSpec(4, 2)
    monkeypatch.setenv(fused_attend.ENV, "torch")
    assert fused_write.kernels() is None
    assert fused_write.channel_token(x, calib[:, :, None], spec, torch.float32) is None
    monkeypatch.setenv(fused_attend.ENV, "auto")
    meta = torch.empty(2, 2, 4, 32, device="meta")
    assert fused_write.group_quant(meta, CacheGroupSpec(4, 32, -1), torch.float32) is None
    assert fused_write.channel_token(x, calib[:, :, None], ChannelSpec(4, 2, fitted=True), torch.float32) is None
