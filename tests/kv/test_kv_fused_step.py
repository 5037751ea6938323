"""A decode step's write into a quantized block by one compiled call (compress/fused_step.py, KVBlock.append) stores
what the forms' own writes store, bit for bit: the separate write kernels (compress/fused_write.py: the same
per-token bodies, the same rotation) for every scheme it takes, and the torch code where nothing is rotated (the
kernels equal it bit for bit: tests/kv/test_kv_fused_write.py). Exact equality is the bound: the same fp32
operations in the same order, without fastmath. Read back, a block written token by token equals
tests/reference_quant.py's per-channel keys and per-token values with the newest tokens exact, also exactly (the
reference's fp32 operations, nothing rounded to a storage dtype). The rotation (a fast Walsh-Hadamard transform) is
within fp32 rounding of the reference's matrix product: each output a sum of d terms +-x_k / sqrt(n), whose error
is at most (log2(n) + 3) units of roundoff times the sum of their magnitudes (log2(n) rounded additions, one
rounded multiplication, the scale's own rounding). Forms it does not take are written by the forms, and it is off under
FLEXH2O_CACHE_KERNEL=torch."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from reference_quant import FP32_UNIT, per_channel, per_token, rotation

from flexh2o.compress import fused_attend, fused_step, fused_write
from flexh2o.compress.form import as_form
from flexh2o.kv.cache import KVBlock
from flexh2o.kv.layout import CacheQuant

pytest.importorskip("numba")
B, H, SLOTS = 3, 2, 9


@pytest.fixture(scope="module", autouse=True)
def kn():
    fused_attend.chosen("fused")  # numba's threading layer set as the fused reader sets it
    assert fused_step.kernel() is not None, "the write kernels failed their self-check"


def _block(q: CacheQuant, d: int, seed: int) -> KVBlock:
    blk = KVBlock.empty(B, H, SLOTS, d, torch.float32, "cpu", q)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randn(B, H, 6, d, generator=gen) * (1 + 3 * (torch.arange(d) % 5 == 0))
    blk.calibrate(prompt, torch.ones(B, H, 6, dtype=torch.bool))
    return blk


def _steps(d: int, seed: int, in_order: bool) -> list:
    """(k, v, positions, slots to free after the step) of 14 steps: rows at different positions; out of order,
    random slots freed (some rows then full: their token takes slot 0, as KVBlock.append's search gives)."""
    gen = torch.Generator().manual_seed(seed + 1)
    out = []
    for step in range(14 if not in_order else SLOTS):
        k, v = (torch.randn(B, H, d, generator=gen) * 2 for _ in range(2))
        cur = torch.tensor([step, step + 3, 2 * step]) if not in_order else torch.full((B,), step)
        free = torch.rand(B, H, SLOTS, generator=gen) < (0.0 if in_order else 0.15)
        out.append((k, v, cur, free))
    return out


def _write(blk: KVBlock, steps: list, in_order: bool) -> list:
    slots = []
    for k, v, cur, free in steps:
        slots.append(blk.append(k, v, cur, in_order).clone())
        blk.evict(free)
    return slots


def _equal(a: KVBlock, b: KVBlock) -> None:
    for x, y in ((a.k, b.k), (a.v, b.v)):
        tx, ty = as_form(x).tensors(), as_form(y).tensors()
        assert tx.keys() == ty.keys()
        for name in tx:
            assert torch.equal(tx[name], ty[name]), name
    assert torch.equal(a.pos, b.pos) and torch.equal(a.score, b.score)


SCHEMES = [CacheQuant(4, 32, "channel", 8, 3, 2, True), CacheQuant(4, 32, "channel", 8, 3, 2, False),
           CacheQuant(2, 16, "channel", 1, 0, 0, True), CacheQuant(3, 32, "channel", 0, 4, 0, False),
           CacheQuant(8, 32, "channel", 4, 0, 3, True), CacheQuant(4, 32, "channel", 2, 2, 0, False)]


@pytest.mark.parametrize("in_order", (False, True))
@pytest.mark.parametrize("q", SCHEMES, ids=lambda q: f"{q.bits}b-o{q.outliers}-r{q.recent}-s{q.sinks}-rot{q.rotate}")
@pytest.mark.parametrize("d", (64, 96))
def test_one_call_equals_the_forms_writes(q, d, in_order, monkeypatch):
    blk = _block(q, d, q.bits * 7 + d)
    assert fused_step.parts(blk.k, blk.v, blk.pos, blk.score) is not None
    steps = _steps(d, q.bits + d, in_order)
    forms, torch_code = copy.deepcopy(blk), copy.deepcopy(blk)
    got = _write(blk, steps, in_order)
    monkeypatch.setattr(fused_step, "kernel", lambda: None)  # the forms write themselves: the separate kernels
    assert all(torch.equal(a, b) for a, b in zip(got, _write(forms, steps, in_order)))
    _equal(blk, forms)
    if not q.rotate:  # the torch code rotates by a matrix product: compared where nothing is rotated
        monkeypatch.setattr(fused_write, "kernels", lambda: None)
        assert all(torch.equal(a, b) for a, b in zip(got, _write(torch_code, steps, in_order)))
        _equal(blk, torch_code)


@pytest.mark.parametrize("bits,outliers,group", ((2, 4, 16), (3, 0, 32), (4, 8, 32), (8, 1, 64)))
def test_a_block_written_token_by_token_reads_back_as_the_reference(bits, outliers, group):
    """Keys (T, kv, d) calibrated on the first 4 tokens, every token then written by a decode step in order; read
    back (fp32): the newest `window` tokens exact, the rest the reference's quantize-dequantize."""
    window, T, d = 3, SLOTS, 64
    gen = torch.Generator().manual_seed(bits + outliers)
    x = torch.randn(T, H, d, generator=gen) * (1 + 3 * (torch.arange(d) % 5 == 0))  # keys; values: x * 0.7
    blk = KVBlock.empty(1, H, T, d, torch.float32, "cpu", CacheQuant(bits, group, "channel", outliers, window))
    blk.calibrate(x.transpose(0, 1)[None], torch.arange(T).expand(1, H, T) < 4)
    for t in range(T):
        blk.append(x[t][None], 0.7 * x[t][None], torch.tensor([t]), True)
    keys = as_form(blk.k).expanded(torch.float32)[0].transpose(0, 1)  # (T, kv, d)
    values = as_form(blk.v).expanded(torch.float32)[0].transpose(0, 1)
    want_k, want_v = per_channel(bits, outliers)(x, 4), per_token(bits, group)(0.7 * x, T)
    want_k[-window:], want_v[-window:] = x[-window:], 0.7 * x[-window:]
    assert torch.equal(keys, want_k) and torch.equal(values, want_v)


@pytest.mark.parametrize("d", (32, 64, 96, 128))
def test_the_rotation_is_within_fp32_rounding_of_the_reference(d):
    kn = fused_write.kernels()
    x = torch.randn(50, d, generator=torch.Generator().manual_seed(d)) * 3
    got = torch.empty_like(x)
    kn.rotate_rows(x.numpy(), fused_step.hadamard(d, "cpu").numpy(), got.numpy())
    h = rotation(d).double()
    want = x.double() @ h
    # units of roundoff: log2 of the largest block's additions, its one multiplication, and two for the scale
    # itself (H's entry is 1 / sqrt(n) divided in fp32, the reference's rounded once from fp64)
    units = math.ceil(math.log2(d)) + 1 + 2
    bound = units * FP32_UNIT * (x.double().abs() @ h.abs())
    assert bool(((got.double() - want).abs() <= bound).all())


@pytest.mark.parametrize("q,dtype", [(CacheQuant(4, 32, "fitted", 2, 3), torch.float32),
                                     (CacheQuant(4, 32, "channel", 2, 3, exact_bits=8), torch.float32),
                                     (CacheQuant(4, 32, "token", 0, 3), torch.float32),
                                     (CacheQuant(4, 32, "channel", 2, 3, 1, True), torch.bfloat16)])
def test_forms_it_does_not_take_write_themselves(q, dtype, monkeypatch):
    blk = KVBlock.empty(B, H, SLOTS, 64, dtype, "cpu", q)
    assert fused_step.parts(blk.k, blk.v, blk.pos, blk.score) is None
    plain = KVBlock.empty(B, H, SLOTS, 64, torch.float32, "cpu", None)
    assert fused_step.parts(plain.k, plain.v, plain.pos, plain.score) is None
    monkeypatch.setenv(fused_attend.ENV, "torch")
    assert fused_step.kernel() is None
