"""Merging evicted values (the merge policy): the policy answers where each evicted value goes (the kept token of the
most similar key, ties to the older position) and with what weight (the accumulated attention); kv/cache.py writes
the weighted means, re-quantizing a compressed slot and storing the merged slot home with the appended one.
Engine-vs-reference on every placement: tests/kv/test_kv_equivalence.py (the reference replays the merges into the
values every later query reads); lanes: tests/eval/test_eval_lanes.py."""
from __future__ import annotations

import torch

from flexh2o.compress import CompressionSpec, dequantize, quantize
from flexh2o.compress.codec import assign, expand
from flexh2o.kv.cache import KVBlock, merged_values
from flexh2o.kv.policies import Budget
from flexh2o.kv.policies.merge import most_similar_kept
from flexh2o.kv.spec import make_policy
from flexh2o.storage.base import scatter_slots


def _row(values, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).view(1, 1, -1)


def test_merged_values_are_mass_weighted_means():
    v = torch.tensor([[1.0, 0.0], [0.0, 1.0], [3.0, 3.0], [5.0, 1.0]]).view(1, 1, 4, 2)
    target = _row([-1, 0, 0, -1], torch.int64)  # slots 1 and 2 merge into slot 0
    mass = _row([2.0, 1.0, 1.0, 7.0])
    got, changed = merged_values(v, target, mass)
    assert changed[0, 0].tolist() == [True, False, False, False]
    torch.testing.assert_close(got[0, 0, 0], torch.tensor([(2 * 1 + 0 + 3) / 4, (0 + 1 + 3) / 4]))
    assert torch.equal(got[0, 0, 1:], v[0, 0, 1:])  # sources and the rest unchanged (the cache then frees sources)


def test_most_similar_kept_token_ties_go_to_the_older():
    keys = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.0, 1.0], [1.0, 0.1], [3.0, 0.0]]).view(1, 1, 5, 2)
    pos = _row([4, 1, 2, 3, 0], torch.int64)  # slots 0, 1 and 4 hold the same direction: positions 4, 1, 0
    evict = _row([False, False, False, True, False], torch.bool)
    assert most_similar_kept(pos, keys, evict)[0, 0].tolist() == [-1, -1, -1, 4, -1]  # position 0 (slot 4)
    evict = _row([False, True, False, True, False], torch.bool)  # two sources (prefill): each alone
    assert most_similar_kept(pos, keys, evict)[0, 0].tolist() == [-1, 4, -1, 4, -1]
    plan, mass = make_policy("merge", Budget(2, 2), 0).merge_plan(pos, _row([1.0] * 5), keys, evict)
    assert torch.equal(plan, most_similar_kept(pos, keys, evict)) and torch.equal(mass, _row([1.0] * 5))


def test_compressed_block_requantizes_the_merged_slot():
    spec = CompressionSpec(4, 8, -1)
    g = torch.Generator().manual_seed(0)
    blk = KVBlock.empty(1, 2, 4, 8, torch.float32, "cpu", spec)
    vals = torch.randn(1, 2, 4, 8, generator=g)
    assign(blk.v, (slice(None),) * 3, vals)
    blk.pos[:] = torch.arange(4)
    blk.written = torch.tensor([[3, 1]])  # (b, kv): the slots the step's append wrote
    stored = expand(blk.v, torch.float32)
    target = torch.tensor([[[-1, -1, 0, -1], [-1, -1, -1, -1]]])  # head 0: slot 2 into slot 0; head 1: nothing
    mass = torch.tensor([[[1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 1.0, 1.0]]])
    blk.merge(target, mass)
    want = (1.0 * stored[0, 0, 0] + 3.0 * stored[0, 0, 2]) / 4.0
    requant = dequantize(quantize(want.view(1, 8), spec, torch.float32), torch.float32)[0]
    got = expand(blk.v, torch.float32)
    torch.testing.assert_close(got[0, 0, 0], requant, atol=0, rtol=0)
    assert torch.equal(got[0, 0, 1:], stored[0, 0, 1:]) and torch.equal(got[0, 1], stored[0, 1])
    assert blk.written.tolist() == [[[3, 0], [1, 1]]]  # the merged slot is stored home too


def test_scatter_slots_writes_every_listed_slot():
    src, dst = torch.randn(2, 3, 5, 4), torch.zeros(2, 3, 5, 4)
    slots = torch.tensor([[[0, 4], [1, 1], [2, 3]], [[4, 4], [0, 2], [3, 1]]])  # (b, h, 2)
    scatter_slots(dst, src, slots)
    for b in range(2):
        for h in range(3):
            for s in range(5):
                want = src[b, h, s] if s in slots[b, h].tolist() else torch.zeros(4)
                assert torch.equal(dst[b, h, s], want), (b, h, s)
