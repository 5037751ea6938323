"""Decode attention over ragged rows (a refilled batch): one masked call over every row unless that reads far more
slots than the rows' own segments; either way the result is attention over each row's own tokens."""
from __future__ import annotations

import torch

from flexh2o.kv import attention, segments
from flexh2o.kv.cache import KVBlock
from flexh2o.kv.policies import Budget
from flexh2o.kv.spec import make_policy


def test_ragged_rows_take_one_call_and_one_long_row_keeps_its_segment():
    ragged = [(0, 3, 100), (3, 5, 140), (5, 6, 90)]  # 6 x 140 = 840 reads against 300 + 280 + 90 = 670
    assert segments.one_call_or(ragged) == [(0, 6, 140)]
    lopsided = [(0, 11, 100), (11, 12, 2000)]  # 12 x 2000 = 24000 against 1100 + 2000 = 3100
    assert segments.one_call_or(lopsided) == lopsided
    assert segments.one_call_or([(0, 4, 7)]) == [(0, 4, 7)]


def _block(extents, kv=2, slots=12, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    blk = KVBlock.empty(len(extents), kv, slots, d, torch.float32, "cpu")
    for row, e in enumerate(extents):
        blk.pos[row, :, :e] = torch.arange(e)
    blk.k.normal_(generator=g)
    blk.v.normal_(generator=g)
    return blk, g


def _want(q, k, v, blk, cur):
    """Each row alone over its own positions 0..cur (the new token at slot cur), dense softmax."""
    out = []
    for row in range(q.shape[0]):
        keys, vals = blk.k[row].clone(), blk.v[row].clone()
        keys[:, cur[row]], vals[:, cur[row]] = k[row, :, 0], v[row, :, 0]
        keys, vals = keys[:, :cur[row] + 1], vals[:, :cur[row] + 1]
        qg = q[row].view(keys.shape[0], -1, q.shape[-1])
        att = (torch.einsum("hgd,hsd->hgs", qg, keys) * q.shape[-1] ** -0.5).softmax(-1)
        out.append(torch.einsum("hgs,hsd->hgd", att, vals).reshape(-1, 1, q.shape[-1]))
    return torch.stack(out)


def test_one_call_over_ragged_rows_equals_each_row_alone():
    extents = [3, 9, 5, 5, 11, 2]  # a refilled batch: every row at its own position, in order (no eviction)
    for policy in ("full", "h2o"):
        blk, g = _block(extents)
        q, k, v = (torch.randn(6, n, 1, 8, generator=g) for n in (4, 2, 2))
        cur = torch.tensor(extents)
        want = _want(q, k, v, blk, cur.tolist())
        budget = None if policy == "full" else Budget(32, 32)  # no eviction: the budget exceeds every row
        out = attention.decode(q, k, v, cur, blk, make_policy(policy, budget), 0, evicts=policy != "full")
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_decode_segments_choose_as_the_merged_segments_do():
    g = torch.Generator().manual_seed(1)
    for trial in range(200):
        b = int(torch.randint(1, 16, (1,), generator=g))
        extents = torch.randint(1, 60 if trial % 2 else 600, (b,), generator=g).tolist()
        if trial % 5 == 0:
            extents = sorted(extents)  # runs of equal and rising extents, too
        blk, _ = _block(extents, slots=max(extents))
        want = segments.one_call_or(segments.used_segments(blk.pos, extents))
        assert segments.decode_segments(blk.pos, extents) == [tuple(s) for s in want]


def test_ragged_in_order_append_writes_each_row_at_its_position():
    extents = [3, 9, 5, 5, 11, 2]  # rows at their own positions: the flat index write
    blk, g = _block(extents)
    want = KVBlock(blk.k.clone(), blk.v.clone(), blk.pos.clone(), blk.score.clone())
    blk.score.uniform_(generator=g)
    want.score.copy_(blk.score)
    k, v = torch.randn(6, 2, 8, generator=g), torch.randn(6, 2, 8, generator=g)
    cur = torch.tensor(extents)
    slot = blk.append(k, v, cur, in_order=True, at=extents)
    for row, p in enumerate(extents):  # the reference: each row's slot p written by hand
        want.k[row, :, p], want.v[row, :, p] = k[row], v[row]
        want.pos[row, :, p], want.score[row, :, p] = p, 0.0
    for name in ("k", "v", "pos", "score"):
        assert torch.equal(getattr(blk, name), getattr(want, name)), name
    assert torch.equal(slot, cur.view(-1, 1).expand(6, 2))


def test_layers_of_a_step_share_what_one_step_rows_makes():
    """Two layers' blocks decoded with one StepRows (as LayerCompute hands every layer of a step): each equals its
    rows alone, and the segments, mask and flat write index were made once for both."""
    from flexh2o.kv.step_rows import StepRows
    extents = [3, 9, 5, 5, 11, 2]
    step, made = StepRows(list(extents)), []
    original = step.made
    step.made = lambda key, make: original(key, lambda: made.append(key[0]) or make())
    for layer in range(2):
        blk, g = _block(extents, seed=layer)
        q, k, v = (torch.randn(6, n, 1, 8, generator=g) for n in (4, 2, 2))
        cur = torch.tensor(extents)
        want = _want(q, k, v, blk, extents)
        out = attention.decode(q, k, v, cur, blk, make_policy("full", None), layer, evicts=False, at=step)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        assert blk.pos[torch.arange(6), 0, cur].tolist() == extents  # the new token in its slot
    assert sorted(made) == ["flat", "mask", "segments"]
