"""The quantized cache with a residual window (--cache-recent, compress/recent.py): the newest W tokens of each
sequence read exact, older ones quantized. Under every KV policy and on every cache placement (each policy on one,
h2o on all) the engine equals tests/reference_kv.py fed tests/reference_quant.py's quantize-dequantize with the same
window (query i reads token j exact when j > i - W); the layout, plan and cost model count the window's bytes.
merge is left out as in test_kv_quant.py (the reference merges exact values only; a merge into a slot inside the
window is checked on a block below)."""
from __future__ import annotations

import pytest
import torch

from flexh2o.compress.codec import assign, expand
from flexh2o.kv.cache import KVBlock
from flexh2o.kv.layout import DEFAULT_RECENT, CacheLayout, CacheQuant
from test_kv_equivalence import BUDGETS, COMBOS, _assert_matches, _rc, _ref_policy
from test_kv_quant import HEAD_DIM, _run, data, quant_reference  # noqa: F401 (fixtures)

RECENT = 3  # below every budget's slots (8), so the window is the engine's whole ring
CHANNEL = CacheQuant(4, HEAD_DIM, "channel", 2, RECENT)
_OPT = ["full", "local", "random", "streaming", "tova", "a2sf", "mean_attn", "vatp", "h2o_sinks", "mean_vnorm",
        "pyramid", "adakv"]
CASES = [("opt", "h2o", c) for c in COMBOS] + [("opt", p, COMBOS[i % len(COMBOS)]) for i, p in enumerate(_OPT)] + \
    [("llama", p, COMBOS[i * 2 % len(COMBOS)]) for i, p in enumerate(("h2o", "vatp"))]
WIDTHS = [CacheQuant(2, HEAD_DIM, "channel", 1, RECENT), CacheQuant(3, HEAD_DIM, "token", 0, RECENT),
          CacheQuant(8, HEAD_DIM, "channel", 0, RECENT)]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("model, policy, combo", [pytest.param(*c, id=f"{c[0]}-{c[1]}-{c[2][0]}") for c in CASES])
def test_engine_matches_reference_with_a_window(model, policy, combo, data, quant_reference, offload_dir):
    """Teacher-forced: the logits of all 33 steps of all 6 sequences, within 1e-4, and the kept counts."""
    _assert_matches(_run(model, policy, combo, CHANNEL, data, offload_dir), quant_reference(model, policy, CHANNEL),
                    BUDGETS[policy], _ref_policy(model, policy, BUDGETS[policy]))


@pytest.mark.parametrize("q", WIDTHS, ids=lambda q: f"{q.bits}bit-{q.keys}")
def test_window_at_every_width(q, data, quant_reference, offload_dir):
    """2, 3 and 8 bits, keys per channel and FlexGen's per token, h2o on the disk tier."""
    _assert_matches(_run("opt", "h2o", COMBOS[2], q, data, offload_dir), quant_reference("opt", "h2o", q),
                    BUDGETS["h2o"], _ref_policy("opt", "h2o", BUDGETS["h2o"]))


def test_the_window_moves_the_logits(data, quant_reference):
    """The comparison is sharp: the same cache with and without the window gives logits far apart."""
    from test_kv_equivalence import ATOL
    a = quant_reference("opt", "h2o", CHANNEL)
    b = quant_reference("opt", "h2o", CacheQuant(4, HEAD_DIM, "channel", 2))
    gap = max(float((x - y).abs().max()) for ra, rb in zip(a, b) for x, y in zip(ra.step_logits, rb.step_logits))
    assert gap > 100 * ATOL


def test_window_bytes_by_hand(offload_dir):
    """b 2, 3 KV heads, 10 slots, head_dim 64, fp16, 4 bits, 4 outliers, window 4: per row and head the calibration
    256 bytes plus K and V's rings, 4 x 64 x 2 bytes and 4 int32 slots each; a window over the slots is cut to them;
    the plan and the cost model count what the layout says."""
    lay = CacheLayout(2, 3, 10, 64, torch.float16, CacheQuant(4, 64, "channel", 4, 4))
    assert lay.kv_slot_bytes() == 44 + 36 and lay.kv_row_bytes() == 256 + 2 * (512 + 16)
    assert lay.nbytes == 60 * (44 + 36 + 12) + 6 * (256 + 2 * 528)
    assert CacheLayout(2, 3, 10, 64, torch.float16, CacheQuant(4, 64, "token", 0, 50)).kv_row_bytes() == \
        2 * 10 * (128 + 4)
    from flexh2o.planning.memory_plan import cache_block_bytes
    from flexh2o.tuning.hardware import Rates, load_profile
    from flexh2o.tuning.step_cost import StepCost
    rc = _rc("opt", "h2o", offload_dir, [100, 0, 100, 0]).with_(compress_cache=CHANNEL)
    lay = CacheLayout.of_run(rc)
    assert cache_block_bytes(rc) == lay.nbytes > cache_block_bytes(rc.with_(compress_cache=CacheQuant(
        4, HEAD_DIM, "channel", 2)))
    model = StepCost(rc, Rates.from_profile(load_profile("cpu_measured"), rc.compute))
    assert model.slot_kv == lay.kv_slot_bytes() + lay.kv_row_bytes()


def _filled(q: CacheQuant, n: int = 6):
    """A block of 1 row, 1 head, 8 slots holding positions 0..n-1 (the prompt 0..3, then decode appends)."""
    torch.manual_seed(0)
    blk = KVBlock.empty(1, 1, 8, 8, torch.float32, "cpu", q)
    from flexh2o.kv.attention import _pack
    k, v = torch.randn(1, 1, n, 8), torch.randn(1, 1, n, 8)
    pos = torch.arange(4).view(1, 1, 4)
    _pack(k[:, :, :4], v[:, :, :4], pos, torch.zeros(1, 1, 4), torch.ones(1, 1, 4, dtype=torch.bool), blk)
    for t in range(4, n):
        blk.append(k[:, :, t], v[:, :, t], torch.tensor([t]))
    return blk, k, v


def test_newest_exact_older_quantized_and_an_evicted_slot_leaves_the_ring():
    q = CacheQuant(2, 8, "channel", 0, 3)
    blk, k, v = _filled(q)
    plain, _, _ = _filled(CacheQuant(2, 8, "channel", 0))
    got, quant = expand(blk.k, torch.float32)[0, 0], expand(plain.k, torch.float32)[0, 0]
    assert torch.equal(got[3:6], k[0, 0, 3:6]) and torch.equal(got[:3], quant[:3])
    assert not torch.equal(quant[3:6], k[0, 0, 3:6])
    blk.evict(torch.tensor([False, False, False, False, True, False, False, False]).view(1, 1, 8))
    new = torch.randn(1, 1, 8)
    blk.append(new, new, torch.tensor([6]))  # into freed slot 4; position 3 leaves the window
    got = expand(blk.v, torch.float32)[0, 0]
    assert torch.equal(got[4], new[0, 0]) and torch.equal(got[5], v[0, 0, 5])
    assert torch.equal(got[3], expand(plain.v, torch.float32)[0, 0, 3])


def test_a_merge_into_a_slot_in_the_window_stays_exact():
    """Values rewritten in place (a merge): exact in the window, quantized (and close) outside it."""
    blk, k, v = _filled(CacheQuant(4, 8, "token", 0, 3))
    merged = torch.randn(2, 8)
    assign(blk.v, (torch.tensor([0, 0]), torch.tensor([0, 0]), torch.tensor([5, 1])), merged)
    got = expand(blk.v, torch.float32)[0, 0]
    assert torch.equal(got[5], merged[0]) and torch.equal(got[4], v[0, 0, 4])
    assert not torch.equal(got[1], merged[1]) and torch.allclose(got[1], merged[1], atol=0.3)


def test_mission_dry_run_counts_the_window(capsys):
    """The mission's --dry-run with --compress-cache: the default window's bytes cost batch against no window, and the
    batch stays well above the plain cache's."""
    from flexh2o.cli import run as cli

    def batch(extra):
        assert cli.main(["--model", "opt-30b", "--percent", "0", "100", "100", "0", "--hh-ratio", "0.2",
                         "--gpu-mem", "16GB", "--cpu-mem", "200GB", "--dtype", "float16", "--dry-run"] + extra) == 0
        out = capsys.readouterr().out
        line = [ln for ln in out.splitlines() if ln.startswith("largest --gpu-batch-size")][0]
        return out, {k: int(v) for k, v in (p.split() for p in line.split(": ")[1].split(", "))}
    _, plain = batch([])
    out, window = batch(["--compress-cache"])
    _, none = batch(["--compress-cache", "--cache-recent", "0"])
    assert f"newest {DEFAULT_RECENT} tokens exact" in out
    for policy in ("h2o", "full"):
        assert 1.5 * plain[policy] < window[policy] < none[policy], (plain, window, none)
