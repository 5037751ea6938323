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
