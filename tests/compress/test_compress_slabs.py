"""A weight quantized a slab at a time (compress/tier.py quantize_slabs, what CompressedTier.store and write_from
run) equals it quantized whole (compress/codec.py quantize): groups never span slabs, for either grouped dimension,
padded groups and the int4 kernel's order included."""
import pytest
import torch

from flexh2o.compress import tier as tier_mod
from flexh2o.compress.codec import CompressionSpec, quantize
from flexh2o.compress.tier import CompressedTier, quantize_slabs
from flexh2o.storage.memory import MemoryTier


@pytest.mark.parametrize("group_dim", [0, 1])
@pytest.mark.parametrize("shape", [(300, 200), (130, 96), (3, 70, 64)])
@pytest.mark.parametrize("bits", [4, 8])
def test_slabs_equal_the_whole(monkeypatch, group_dim, shape, bits):
    monkeypatch.setattr(tier_mod, "SLAB_BYTES", 4096)  # many slabs, a ragged last one
    spec = CompressionSpec(bits, 64, group_dim)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float32).to(torch.bfloat16)
    whole, slabs = quantize(x, spec, torch.bfloat16), quantize_slabs(x, spec, torch.bfloat16)
    assert torch.equal(whole.data, slabs.data) and torch.equal(whole.meta, slabs.meta)
    assert whole.length == slabs.length


def test_write_from_gathers_pieces_and_refuses_a_short_tensor(monkeypatch):
    monkeypatch.setattr(tier_mod, "SLAB_BYTES", 4096)
    spec = CompressionSpec(4, 64, 1)
    tier = CompressedTier(MemoryTier("cpu", torch.device("cpu"), 1 << 30), spec)
    x = torch.randn(200, 128).to(torch.bfloat16)
    h = tier.alloc(tuple(x.shape), torch.bfloat16)
    tier.write_from(h, list(x.reshape(-1).split(1000)))
    ref = quantize(x, spec, torch.bfloat16)
    got = tier.load_compressed(h, torch.device("cpu"))
    assert torch.equal(got.data, ref.data) and torch.equal(got.meta, ref.meta)
    with pytest.raises(ValueError, match="values for a tensor of shape"):
        tier.write_from(tier.alloc((200, 128), torch.bfloat16), list(x.reshape(-1)[:999].split(500)))


def _kernel_tiers(tmp_path):
    """A 4-bit kernel-order tier over host memory and over the disk (direct I/O or its fallback)."""
    from flexh2o.compress.tier import KernelOrderTier
    from flexh2o.storage.disk import DiskTier
    spec = CompressionSpec(4, 64, 1)
    return [KernelOrderTier(MemoryTier("cpu", torch.device("cpu"), 1 << 30), spec),
            KernelOrderTier(DiskTier(str(tmp_path), 1 << 30), spec)]


@pytest.mark.parametrize("order", [0, 1, 2])  # int4_order.ROW_ORDERS: torch's AVX2, AVX-512 and generic orders
@pytest.mark.parametrize("rows", [32 * 7, 32 * 3 + 64])  # in blocks of 64: a last, shorter block of 32
def test_kernel_order_by_slabs_equals_the_whole(tmp_path, monkeypatch, rows, order):
    """write_from and store of a (N, K) weight quantize and write it a slab of whole kernel blocks at a time
    (KernelOrderTier.slab_rows): the bytes kept are those of the weight quantized whole and put in kernel order,
    in each of the orders torch's kernel may take on a CPU."""
    from flexh2o.compress import int4_order
    from flexh2o.compress.int4_order import row_block
    from flexh2o.compress.kernels import to_kernel_order
    monkeypatch.setattr(int4_order, "torch_order", lambda: int4_order.ROW_ORDERS[order])
    monkeypatch.setattr(tier_mod, "SLAB_BYTES", 4 * 128 * 40)  # 40 rows of fp32 input: one block a slab
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    ref = to_kernel_order(quantize(x, CompressionSpec(4, 64, 1), torch.bfloat16))
    for tier in _kernel_tiers(tmp_path):
        assert tier.slab_rows(tuple(x.shape)) == row_block()
        for put in (lambda h: tier.write_from(h, list(x.reshape(-1).split(999))), lambda h: tier.store(h, x)):
            h = tier.alloc(tuple(x.shape), torch.bfloat16)
            put(h)
            got = tier.load_compressed(h, torch.device("cpu"))
            assert torch.equal(got.data, ref.data) and torch.equal(got.meta, ref.meta)
            tier.free(h)
        tier.inner.close()


def test_write_from_by_slabs_refuses_a_long_or_short_tensor(tmp_path, monkeypatch):
    monkeypatch.setattr(tier_mod, "SLAB_BYTES", 4 * 128 * 32)
    x = torch.randn(96, 128).to(torch.bfloat16)
    for tier in _kernel_tiers(tmp_path):
        for wrong in (torch.cat([x.reshape(-1), x.reshape(-1)[:5]]), x.reshape(-1)[:-5]):
            with pytest.raises(ValueError, match="values for a tensor of shape"):
                tier.write_from(tier.alloc((96, 128), torch.bfloat16), list(wrong.split(1000)))
        tier.inner.close()
