"""Decode attention on one KV block (no engine): H2O's scores accumulate in fp32 over an fp16 cache, and only the
used slots of each row segment are read, with the same result as attention over the whole masked block."""
from __future__ import annotations

import pytest
import torch

from flexh2o.kv import attention, segments
from flexh2o.kv.cache import KVBlock
from flexh2o.kv.policies import Budget
from flexh2o.kv.spec import make_policy

pytestmark = pytest.mark.usefixtures("one_thread")


def test_decode_scores_accumulate_in_fp32():
    """Scores near 2000 differing by a quarter: fp16 (spacing 1 there) would see a tie and evict the older token;
    fp32 scores evict the one that really received less attention. The cache itself is stored in fp16."""
    blk = KVBlock.empty(1, 1, 3, 2, torch.float16, "cpu")  # (b, kv, slots, d)
    blk.pos[0, 0, :2] = torch.tensor([0, 1])
    blk.score[0, 0, :2] = 2000.0
    blk.k[0, 0, 0] = torch.tensor([1.0, 0.0])  # position 0 gets twice the attention of position 1 and the new one
    q = torch.tensor([2 ** 0.5 * float(torch.log(torch.tensor(2.0))), 0.0]).view(1, 1, 1, 2)  # (b, n, 1, d)
    new = torch.zeros(1, 1, 1, 2)
    attention.decode(q, new, new, torch.tensor([2]), blk, make_policy("h2o", Budget(1, 1)), 0)
    assert sorted(blk.pos[0, 0].tolist()) == [-1, 0, 2]  # position 1 (2000.25) evicted, not 0 (2000.5)
    assert blk.score.dtype == torch.float32


def test_decode_attention_skips_the_unused_slots_of_each_row_segment():
    """Rows whose last used slot is the same form one segment, read only up to that slot; the result equals
    attention over the whole block with the empty slots masked."""
    pos = torch.full((4, 2, 6), -1, dtype=torch.long)  # (b, kv, slots)
    pos[0, :, :2] = pos[1, :, :2] = torch.arange(2)
    pos[2, 0, :4], pos[3, 1, 3] = torch.arange(4), 7  # rows 2, 3 use 4 slots (row 3 only in head 1)
    assert segments.used_segments(pos) == [(0, 2, 2), (2, 4, 4)]
    many = torch.arange(6).repeat(9, 2, 1)
    for row in range(9):
        many[row, :, row % 2 + 4:] = -1  # alternating 4 and 5 used slots: 9 runs, one over MAX_SEGMENTS
    assert segments.MAX_SEGMENTS == 8
    assert segments.used_segments(many) == [(0, 2, 5)] + [(r, r + 1, r % 2 + 4) for r in range(2, 9)]
    # the merge that adds the fewest slot reads goes first: 10 rows padded by 1 slot, not 1 row by 399
    assert segments.merged_runs([(0, 10, 100), (10, 11, 101), (11, 12, 500)], 2) == [(0, 11, 101), (11, 12, 500)]
    assert segments.merged_runs([(0, 3, 7)], 1) == [(0, 3, 7)]
    g = torch.Generator().manual_seed(0)
    blk = KVBlock.empty(4, 2, 6, 8, torch.float32, "cpu")
    blk.pos.copy_(pos)
    blk.k.normal_(generator=g)
    blk.v.normal_(generator=g)
    q, k, v = (torch.randn(4, n, 1, 8, generator=g) for n in (4, 2, 2))
    want_k, want_v = blk.k.clone(), blk.v.clone()
    out = attention.decode(q, k, v, torch.tensor([2, 2, 4, 8]), blk, make_policy("full", None), 0)
    slot = blk.written  # (b, kv) where the new token went
    want_k[torch.arange(4)[:, None], torch.arange(2), slot] = k[:, :, 0]
    want_v[torch.arange(4)[:, None], torch.arange(2), slot] = v[:, :, 0]
    att = torch.einsum("bhgd,bhsd->bhgs", q.view(4, 2, 2, 8), want_k) * 8 ** -0.5
    att = att.masked_fill((blk.pos < 0)[:, :, None], float("-inf")).softmax(-1)
    want = torch.einsum("bhgs,bhsd->bhgd", att, want_v).reshape(4, 4, 1, 8)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=0)
