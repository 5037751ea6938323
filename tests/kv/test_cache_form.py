"""A cache scheme is one module (a spec and a CacheForm, compress/form.py) plus its line in kv/layout.CacheQuant's
form_spec: a toy scheme written in this file only, which holds each K and V as twice its values, is counted by the
layout (parts, bytes), held by a block, written by prefill and decode, read and evicted through the protocol, stored
and loaded by the cache, and gives the plain cache's outputs and kept tokens."""
from __future__ import annotations

import pytest
import torch

from flexh2o.compress.form import CacheForm
from flexh2o.kv import attention
from flexh2o.kv.cache import KVBlock, KVCache
from flexh2o.kv.layout import CacheLayout, CacheQuant
from flexh2o.kv.policies import Budget
from flexh2o.kv.spec import make_policy
from flexh2o.storage.memory import MemoryTier

B, H, S, D, T = 2, 2, 8, 16, 7  # rows, KV heads, slots, head_dim, prompt tokens (more than the budget)


class Twice(CacheForm):
    """The toy form: one tensor holding 2 x each value (exact in fp32 both ways), read expanded."""

    def __init__(self, twice: torch.Tensor):
        self.twice = twice

    shape = property(lambda self: tuple(self.twice.shape))
    dtype = property(lambda self: self.twice.dtype)

    def tensors(self) -> dict:
        return {"twice": self.twice}

    def map(self, fn) -> "Twice":
        return Twice(fn(self.twice))

    def front(self, n: int) -> "Twice":
        return Twice(self.twice[:, :, :n])

    def assign(self, index, values) -> None:
        self.twice[index] = (values * 2).to(self.twice.dtype)

    def expanded(self, dtype) -> torch.Tensor:
        return (self.twice / 2).to(dtype)


class TwiceSpec:
    def form_parts(self, shape, dtype) -> dict:
        return {"twice": (tuple(shape), dtype, True)}

    def build(self, tensors, shape) -> Twice:
        return Twice(tensors["twice"])


@pytest.fixture
def twice(monkeypatch):
    monkeypatch.setattr(CacheQuant, "form_spec", lambda self, field, slots, head_dim: TwiceSpec())  # its one line
    return CacheLayout(B, H, S, D, torch.float32, CacheQuant())


def test_the_layout_counts_a_new_scheme_from_its_spec(twice):
    plain = CacheLayout(B, H, S, D, torch.float32)
    assert [p.key for p in twice.parts()] == ["k.twice", "v.twice", "pos", "score"]
    assert twice.nbytes == plain.nbytes and twice.kv_slot_bytes() == plain.kv_slot_bytes()


@pytest.mark.parametrize("policy", ["h2o", "mean_vnorm", "mean_keydiff"])
def test_a_new_scheme_runs_prefill_and_decode_as_the_plain_cache(twice, policy):
    """Twice holds the values exactly (x 2 and / 2 are exact in fp32) and is read expanded by the same einsums as a
    plain block whose policy scores (a policy that scores nothing runs the fused kernel on a plain block), so
    outputs, kept positions and scores are equal bit for bit; the policies read the values and the keys through it."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, n, T, D, generator=g) for n in (2 * H, H, H))
    pos = torch.arange(T).expand(B, T).clone()
    budget = Budget(4, 2)  # heavy tokens hold the 4 sinks of the policies that keep them
    blocks, outs = [], []
    for layout in (CacheLayout(B, H, S, D, torch.float32), twice):
        blk, pol = KVBlock.of_layout(layout, "cpu"), make_policy(policy, budget)
        out = [attention.prefill(q, k, v, pos, pol, 0, blk, 64)]
        for step in range(T, T + 3):
            qd, kd, vd = (torch.randn(B, n, 1, D, generator=torch.Generator().manual_seed(step)) for n in (2 * H, H, H))
            out.append(attention.decode(qd, kd, vd, torch.full((B,), step), blk, pol, 0))
        blocks.append(blk)
        outs.append(out)
    assert isinstance(blocks[1].v, Twice)
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert torch.equal(blocks[0].pos, blocks[1].pos) and torch.equal(blocks[0].score, blocks[1].score)
    assert torch.equal(blocks[0].v, blocks[1].v.expanded(torch.float32))


def test_the_cache_stores_and_loads_a_new_scheme(twice):
    tier = MemoryTier("cpu", "cpu", 1 << 20)
    cache = KVCache({"cpu": tier}, [["cpu"]], B, H, S, D, torch.float32, CacheQuant())
    try:
        blk = cache.load(0, 0, "cpu")
        x = torch.randn(B, H, S, D)
        blk.v.assign((slice(None),) * 3, x)
        cache.store(0, 0, blk)
        assert torch.equal(cache.load(0, 0, "cpu").v.expanded(torch.float32), x)
    finally:
        cache.close()
