"""Decode attention over ragged rows (a refilled batch): one masked call over every row unless that reads far more
slots than the rows' own segments; either way the result is attention over each row's own tokens."""
from __future__ import annotations

import torch

from flexh2o.kv import attention
from flexh2o.kv.cache import KVBlock
from flexh2o.kv.policies import Budget
from flexh2o.kv.spec import make_policy


def test_ragged_rows_take_one_call_and_one_long_row_keeps_its_segment():
    ragged = [(0, 3, 100), (3, 5, 140), (5, 6, 90)]  # 6 x 140 = 840 reads against 300 + 280 + 90 = 670
    assert attention.one_call_or(ragged) == [(0, 6, 140)]
    lopsided = [(0, 11, 100), (11, 12, 2000)]  # 12 x 2000 = 24000 against 1100 + 2000 = 3100
    assert attention.one_call_or(lopsided) == lopsided
    assert attention.one_call_or([(0, 4, 7)]) == [(0, 4, 7)]


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
