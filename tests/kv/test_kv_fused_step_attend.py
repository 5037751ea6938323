"""A decode step over a quantized block whose rows hold their tokens in order writes the new token and reads the
attention in one compiled call (compress/fused_decode.py's step_attend, taken by kv/decode.py's DecodePath): what it
stores equals the one-call write's (KVBlock.append, compress/fused_step.py) bit for bit, and what it reads equals the
one-call read's (fused_decode.attend) over the block so written, also exactly: the write is the same compiled
routine (put_pair, no fastmath) and the read of each (row, head) pair the same compiled function (_pair, not inlined,
of the same argument types), so the same operations run in the same order. Probabilities summed over the query heads
(a scoring policy's) likewise. Blocks it does not take (rows out of order) keep the separate write and read."""
from __future__ import annotations

import copy

import pytest
import torch
from test_kv_fused_step import B, H, SCHEMES, _block, _equal

from flexh2o.compress import fused_attend, fused_decode, fused_step
from flexh2o.compress.form import as_form
from flexh2o.kv.decode import DecodePath
from flexh2o.kv.policies import FullPolicy
from flexh2o.kv.step_rows import StepRows

pytest.importorskip("numba")


@pytest.fixture(scope="module", autouse=True)
def kernels():
    fused_attend.chosen("fused")
    assert fused_decode.kernel() is not None and fused_step.kernel() is not None


def _filled(q, d: int, seed: int, at: list):
    """A block of B rows calibrated, then written in order up to each row's position in `at` (rows differ)."""
    blk = _block(q, d, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    for step in range(max(at)):
        cur = torch.tensor([min(step, p - 1) for p in at])  # a row done rewrites its last slot: still in order
        blk.append(*(torch.randn(B, H, d, generator=gen) * 2 for _ in range(2)), cur, True)
    return blk, gen


@pytest.mark.parametrize("q", SCHEMES, ids=lambda q: f"{q.bits}b-o{q.outliers}-r{q.recent}-s{q.sinks}-rot{q.rotate}")
@pytest.mark.parametrize("d", (64, 96))
def test_one_call_step_equals_the_one_call_write_then_read(q, d, monkeypatch):
    at = [5, 7, 3]  # each row's new position (its slot)
    blk, gen = _filled(q, d, q.bits * 5 + d, at)
    twin = copy.deepcopy(blk)
    qry, k, v = (torch.randn(B, H, 1, d, generator=gen) for _ in range(3))
    cur = torch.tensor(at)
    calls = []
    step_attend = fused_decode.step_attend
    monkeypatch.setattr(fused_decode, "step_attend", lambda *a: calls.append(1) or step_attend(*a))
    out = DecodePath.of(None, None, False, True)(qry, k, v, cur, blk, FullPolicy(), 0, StepRows(at))
    assert calls == [1]  # the one call took it
    assert torch.equal(twin.append(k[:, :, 0], v[:, :, 0], cur, True), blk.written)
    _equal(blk, twin)
    top = max(at) + 1
    keys, values = (as_form(x).front(top) for x in (twin.k, twin.v))
    want, _ = fused_decode.attend(fused_decode.kernel(), qry, keys, values, twin.pos[:, :, :top], None, False)
    assert torch.equal(out, want)


@pytest.mark.parametrize("q", SCHEMES[:2], ids=("rotated", "not-rotated"))
def test_the_summed_probabilities_equal_the_one_call_reads(q):
    at, d = [4, 4, 6], 64
    blk, gen = _filled(q, d, 11, at)
    twin = copy.deepcopy(blk)
    qry = torch.randn(B, H, 2, d, generator=gen)  # two query heads a KV head
    k, v = (torch.randn(B, H, d, generator=gen) for _ in range(2))
    cur, top = torch.tensor(at), max(at) + 1
    found = fused_step.parts(blk.k, blk.v, blk.pos, blk.score)
    write, slot = fused_step.write_args(found, blk.pos, blk.score, k, v, cur, True)
    keys, values = (as_form(x).front(top) for x in (blk.k, blk.v))
    out, psum = fused_decode.step_attend(fused_decode.kernel(), write, qry, keys, values, blk.pos[:, :, :top], 30.0,
                                         True)
    assert torch.equal(slot, twin.append(k, v, cur, True))
    _equal(blk, twin)
    keys, values = (as_form(x).front(top) for x in (twin.k, twin.v))
    want, want_sum = fused_decode.attend(fused_decode.kernel(), qry, keys, values, twin.pos[:, :, :top], 30.0, True)
    assert torch.equal(out, want) and torch.equal(psum, want_sum)


def test_rows_out_of_order_keep_the_separate_write_and_read(monkeypatch):
    blk, gen = _filled(SCHEMES[0], 64, 3, [4, 4, 4])
    monkeypatch.setattr(fused_decode, "step_attend", lambda *a: pytest.fail("rows out of order took the one call"))
    qry, k, v = (torch.randn(B, H, 1, 64, generator=gen) for _ in range(3))
    path = DecodePath.of(None, None, True, True)  # a run that evicts: its rows are not in order
    out = path(qry, k, v, torch.tensor([4, 4, 4]), blk, FullPolicy(), 0)
    assert out.shape == qry.shape and bool(torch.isfinite(out).all())
    assert blk.pos[:, :, 4].eq(4).all()  # the new token written by the separate write
