"""What the quantized cache keeps exact, stored in 8 bits (--cache-exact-bits 8): per-channel keys' outliers as fp8
(e4m3), the window's and the sinks' entries each quantized alone at 8 bits. Under policies that keep and that evict,
rotated and not, on every cache placement, the engine equals tests/reference_kv.py fed tests/reference_quant.py's
quantize-dequantize (its fp8 through torch's e4m3 conversion, its 8-bit window per token over the whole head); the
layout counts the 8-bit parts' bytes; the flag is validated and printed back."""
from __future__ import annotations

import warnings

import pytest
import torch

from flexh2o.cli.compress_flags import add_compression_flags, compression_specs
from flexh2o.kv.layout import CacheLayout, CacheQuant
from test_kv_equivalence import ATOL, BUDGETS, COMBOS, _assert_matches, _ref_policy
from test_kv_quant import HEAD_DIM, _run, data, quant_reference  # noqa: F401 (fixtures)
from test_kv_rotate import ROTATE_ATOL

EXACT8 = CacheQuant(3, HEAD_DIM, "channel", 2, 3, 2, True, 8)  # window 3 and 2 sinks below every budget's 8 slots
CASES = [("opt", "h2o", c, EXACT8) for c in COMBOS] + \
    [("opt", p, COMBOS[i % len(COMBOS)], EXACT8) for i, p in enumerate(("full", "mean_keydiff", "vatp", "tova"))] + \
    [("opt", "h2o", COMBOS[2], CacheQuant(4, HEAD_DIM, "token", 0, 3, 0, False, 8)),
     ("opt", "h2o", COMBOS[1], CacheQuant(3, HEAD_DIM, "fitted", 2, 0, 0, False, 8)),
     ("llama", "h2o", COMBOS[2], EXACT8)]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("model, policy, combo, q", [pytest.param(
    *c, id=f"{c[0]}-{c[1]}-{c[2][0]}-{c[3].keys}") for c in CASES])
def test_engine_matches_reference_with_8bit_exact_parts(model, policy, combo, q, data, quant_reference, offload_dir):
    """Teacher-forced: the logits of every step of every sequence within the suite's tolerance (test_kv_rotate's for
    a rotated cache: its near-half roundings), and the kept counts; a sequence up to the first step that reads a
    level the reference rounded within float noise of a half (mean_keydiff's sequence 2 from step 21 on the suite's
    data: a 3-bit key level 2.4e-7 of a step from a half, which the engine on torch's AVX2 and AVX-512 paths rounds
    the other way; its logits then move apart by up to 1.1e-2 by step 26, over twice the rotated cache's 5e-3)."""
    _assert_matches(_run(model, policy, combo, q, data, offload_dir), quant_reference(model, policy, q),
                    BUDGETS[policy], _ref_policy(model, policy, BUDGETS[policy]),
                    atol=ROTATE_ATOL if q.rotate else ATOL)


def test_8bit_exact_parts_move_the_logits(data, quant_reference):
    """The comparison is sharp: the same cache with its exact parts in the storage dtype gives logits 2.6e-3 apart,
    26x the tolerance the unrotated cases are held to."""
    a = quant_reference("opt", "h2o", CacheQuant(3, HEAD_DIM, "channel", 2, 3, 2, False, 8))
    b = quant_reference("opt", "h2o", CacheQuant(3, HEAD_DIM, "channel", 2, 3, 2, False))
    gap = max(float((x - y).abs().max()) for ra, rb in zip(a, b) for x, y in zip(ra.step_logits, rb.step_logits))
    assert gap > 10 * ATOL


def test_8bit_exact_parts_bytes_by_hand():
    """b 2, 3 KV heads, 10 slots, head_dim 64, fp16, 4 bits, 4 outliers, window 4: a slot's keys hold 32 bytes of
    levels, 4 outlier channels and 4 fp8 values (40; 44 with fp16 outliers), its values 32 + 4; per row and head the
    calibration 256 bytes plus K and V's rings: 4 entries of 64 levels, an fp16 step and minimum, an int32 slot."""
    lay = CacheLayout(2, 3, 10, 64, torch.float16, CacheQuant(4, 64, "channel", 4, 4, 0, False, 8))
    assert lay.kv_slot_bytes() == 40 + 36
    assert lay.kv_row_bytes() == 256 + 2 * 4 * (64 + 4 + 4)
    assert lay.nbytes == 60 * (40 + 36 + 12) + 6 * (256 + 2 * 4 * 72)
    ring = {p.name: p for p in lay.field_parts("k")}
    assert ring["recent"].dtype == torch.uint8 and ring["exact"].dtype == torch.uint8


def _specs(*flags):
    import argparse
    p = argparse.ArgumentParser()
    add_compression_flags(p)
    return compression_specs(p.parse_args(list(flags)))


def test_the_flag():
    """--cache-exact-bits 8 reaches the CacheQuant and is printed back; without --compress-cache, or on a cache that
    keeps nothing exact, it is refused naming the fix."""
    from types import SimpleNamespace

    from flexh2o.tuning.search import compression_flags
    _, q = _specs("--compress-cache", "--compress-bits", "3", "--cache-exact-bits", "8")
    assert q.exact_bits == 8 and q.key_spec.fp8
    assert "--cache-exact-bits 8" in compression_flags(SimpleNamespace(compress_weight=None, compress_cache=q))
    with pytest.raises(ValueError, match="--cache-exact-bits 8 sets the quantized KV cache"):
        _specs("--cache-exact-bits", "8")
    with pytest.raises(ValueError, match="keeps nothing exact"):
        _specs("--compress-cache", "--cache-keys", "token", "--key-outliers", "0", "--cache-recent", "0",
               "--cache-sinks", "0", "--cache-exact-bits", "8")


def test_ring_entries_are_8bit_copies_and_follow_merges_and_evictions():
    """On a block (1 row, 1 head, 8 slots, head_dim 8, window 3): the newest 3 tokens read their own 8-bit copy (one
    step and minimum each: within half a step of exact, not exact), older ones the 4-bit levels; a merge into a
    window slot rewrites its 8-bit copy; an evicted slot's entry goes, and the new token takes the ring."""
    from flexh2o.compress.codec import assign, expand
    from test_kv_recent import _filled
    blk, k, v = _filled(CacheQuant(4, 8, "token", 0, 3, 0, False, 8))
    plain, _, _ = _filled(CacheQuant(4, 8, "token", 0))
    got, quant = expand(blk.k, torch.float32)[0, 0], expand(plain.k, torch.float32)[0, 0]
    exact = k[0, 0, 3:6]
    step = (exact.amax(-1, keepdim=True) - exact.amin(-1, keepdim=True)) / 255
    assert torch.equal(got[:3], quant[:3]) and not torch.equal(got[3:6], exact)
    assert bool(((got[3:6] - exact).abs() <= step / 2 + 1e-6).all())
    assert float((quant[3:6] - exact).abs().max()) > 4 * float((got[3:6] - exact).abs().max())
    merged = torch.randn(1, 8)
    assign(blk.v, (torch.tensor([0]), torch.tensor([0]), torch.tensor([5])), merged)
    got_v = expand(blk.v, torch.float32)[0, 0, 5]
    assert float((got_v - merged[0]).abs().max()) <= float(merged.amax() - merged.amin()) / 510 + 1e-6
    blk.evict(torch.tensor([False, False, False, False, True, False, False, False]).view(1, 1, 8))
    new = torch.randn(1, 1, 8)
    blk.append(new, new, torch.tensor([6]))  # into freed slot 4; position 3 leaves the window
    got = expand(blk.k, torch.float32)[0, 0]
    assert torch.equal(got[3], quant[3]) and float((got[4] - new[0, 0]).abs().max()) < 0.02


def test_keys_beyond_fp8_range_warn_and_are_clamped():
    """A prompt key beyond fp8's +-448 warns at calibration (what fp8 outliers cannot hold); the outlier reads back
    clamped to 448, the in-range ones as fp8 holds them."""
    from flexh2o.compress.channel import ChannelKeys, ChannelSpec
    spec = ChannelSpec(4, 1, fp8=True)
    parts = spec.parts((1, 1, 2, 8), torch.float32)
    keys = ChannelKeys(*(torch.zeros(s, dtype=dt) for s, dt in (parts[n] for n in ("data", "index", "exact",
                                                                                    "calib"))), spec)
    k = torch.zeros(1, 1, 2, 8)
    k[0, 0, 1, 3] = 1000.0
    k[0, 0, 0, 5] = 3.3
    with pytest.warns(RuntimeWarning, match="beyond \\+-448"):
        keys.calibrate(k, torch.ones(1, 1, 2, dtype=torch.bool))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # in range: no warning
        keys.calibrate(torch.zeros(1, 1, 1, 8), torch.ones(1, 1, 1, dtype=torch.bool))  # every level 0: both
    keys.assign((slice(None), slice(None), slice(0, 2)), k)  # large values become their token's one outlier
    got = keys.expanded(torch.float32)[0, 0]
    assert float(got[1, 3]) == 448.0 and float(got[0, 5]) == 3.25
