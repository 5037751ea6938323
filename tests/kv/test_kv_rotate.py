"""K and V quantized in a Hadamard-rotated basis (--cache-rotate, compress/rotation.py): the engine equals
tests/reference_kv.py fed tests/reference_quant.py's own rotation (its Hadamard matrix written entry by entry) around
its quantize-dequantize, for every key scheme and width on the disk tier and under every KV policy on the placements
in turn; the rotation itself is orthonormal, costs no byte and changes what a quantized cache gives back.

Logits are compared within ROTATE_ATOL, not the suite's 1e-4: a rotated value is a sum over every channel, which
the engine and the reference add in different orders, and rotation spreads values evenly over the levels, so the
reference rounds some level within float noise of a rounding half on most data (the suite's seed-3 data: 1.5e-7 of
a step at 2 bits; over seeds 11-22 the smallest margins were 0 to 1.7e-6), which the engine may round the other way:
one value one step apart, which moved later logits by up to 3.1e-3 (2 bits) and 2.4e-3 (3 bits) under h2o here.
No rotation at all moves them by 0.038 (test_the_rotation_moves_the_logits asserts over 5x ROTATE_ATOL); tokens and
kept counts are compared exactly. The quantizers themselves are compared exactly, on data of their own whose levels
all lie at least NEAR_HALF from a half (test_the_rotated_quantizers_equal_the_reference).
A flip can move them further (mean_keydiff under --cache-exact-bits 8, whose ranks read the keys: 1.1e-2), so each
sequence is compared only up to the first step that reads a level the reference rounded within float noise of a
half (reference_quant.first_unsure_step; test_kv_equivalence._assert_matches).
"""
from __future__ import annotations

import pytest
import torch

import reference_quant as rq
from flexh2o.compress.codec import assign, expand
from flexh2o.compress.rotation import _hadamard, rotate, unrotate
from flexh2o.kv.cache import KVBlock
from flexh2o.kv.layout import CacheLayout, CacheQuant
from test_kv_equivalence import BUDGETS, COMBOS, POLICIES, _assert_matches, _ref_policy
from test_kv_quant import HEAD_DIM, _run, data, quant_reference, ref_quant  # noqa: F401

QUANT_SEED = 0  # the quantizer test's data: every level it rounds at least NEAR_HALF from a half
NEAR_HALF = 1e-5  # in steps: 3x the engine's and the reference's distance where the suite's data met a near tie
ROTATE_ATOL = 5e-3  # on the logits (the module docstring); the suite's own tolerance is 1e-4
BITS = [(CacheQuant(b, HEAD_DIM, "channel", 2, rotate=True), "h2o") for b in (2, 3, 4)] + \
    [(CacheQuant(3, HEAD_DIM, "token", 0, rotate=True), "h2o"),
     (CacheQuant(3, HEAD_DIM, "fitted", 2, rotate=True), "h2o"),
     (CacheQuant(3, HEAD_DIM, "channel", 0, rotate=True), "full")]
ROTATED = CacheQuant(3, HEAD_DIM, "channel", 2, 4, 2, True)  # a window of the newest 4 and 2 sinks exact too
# every policy but merge (the reference merges exact values only, as in test_kv_quant.py) on OPT, each on one
# placement in turn; two on grouped-KV Llama
CASES = [("opt", p, COMBOS[i % len(COMBOS)]) for i, p in enumerate(p for p in POLICIES if p != "merge")] + \
    [("llama", p, COMBOS[(2 * i + 1) % len(COMBOS)]) for i, p in enumerate(("h2o", "tova"))]

pytestmark = pytest.mark.usefixtures("one_thread")


def _check(model, policy, combo, q, data, quant_reference, offload_dir):
    _assert_matches(_run(model, policy, combo, q, data, offload_dir), quant_reference(model, policy, q),
                    BUDGETS[policy], _ref_policy(model, policy, BUDGETS[policy]), atol=ROTATE_ATOL)


@pytest.mark.parametrize("q, policy", [pytest.param(q, p, id=f"{q.bits}bit-{q.keys}-{q.outliers}-{p}")
                                       for q, p in BITS])
def test_engine_matches_reference_rotated_at_every_width(q, policy, data, quant_reference, offload_dir):
    """Teacher-forced on the disk tier: the logits of every step of every sequence, and the kept counts."""
    _check("opt", policy, COMBOS[2], q, data, quant_reference, offload_dir)


@pytest.mark.parametrize("model, policy, combo", [pytest.param(*c, id=f"{c[0]}-{c[1]}-{c[2][0]}") for c in CASES])
def test_engine_matches_reference_rotated_under_every_policy(model, policy, combo, data, quant_reference,
                                                             offload_dir):
    """3 bits, keys per channel with 2 outliers, the newest 4 and the first 2 tokens exact, rotated."""
    _check(model, policy, combo, ROTATED, data, quant_reference, offload_dir)


def test_the_rotation_moves_the_logits(quant_reference):
    """The comparison is sharp: the same cache rotated and not gives logits far apart."""
    a = quant_reference("opt", "h2o", ROTATED)
    b = quant_reference("opt", "h2o", CacheQuant(3, HEAD_DIM, "channel", 2, 4, 2))
    gap = max(float((x - y).abs().max()) for ra, rb in zip(a, b) for x, y in zip(ra.step_logits, rb.step_logits))
    assert gap > 5 * ROTATE_ATOL  # 0.038 here


@pytest.mark.parametrize("keys, outliers", [("channel", 2), ("token", 0), ("fitted", 2)])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_the_rotated_quantizers_equal_the_reference(keys, outliers, bits):
    """A block's rotated K and V, calibrated on a 12-token prompt and written token by token (decode's appends),
    read back equal to the reference's rotation around its own quantize-dequantize, at the suite's tolerance."""
    g = torch.Generator().manual_seed(QUANT_SEED)
    t, prompt, kv, d = 20, 12, 2, 16
    k, v = torch.randn(2, t, kv, d, generator=g).unbind(0)  # (T, kv, d) as the reference takes them
    k[..., 3] *= 8  # an outlier channel
    q = CacheQuant(bits, d, keys, outliers, rotate=True)
    margins = []
    keys_ref, values_ref = ref_quant(q, margins)[:2]  # rotated, as q says
    want = {"k": keys_ref(k, prompt), "v": values_ref(v, prompt)}
    if keys != "fitted":
        assert min(margins) > NEAR_HALF, f"a level {min(margins):.1e} from a rounding half: pick another QUANT_SEED"
    blk = KVBlock.empty(1, kv, t, d, torch.float32, "cpu", q)
    kb, vb = (x.permute(1, 0, 2)[None] for x in (k, v))  # (1, kv, T, d)
    blk.calibrate(kb[:, :, :prompt], torch.ones(1, kv, prompt, dtype=torch.bool))
    assign(blk.k, (slice(None), slice(None), slice(0, prompt)), kb[:, :, :prompt])
    assign(blk.v, (slice(None), slice(None), slice(0, prompt)), vb[:, :, :prompt])
    blk.pos[:, :, :prompt] = torch.arange(prompt)  # the prompt's slots are taken: appends go after them
    for i in range(prompt, t):
        blk.append(kb[:, :, i], vb[:, :, i], torch.tensor([i]))
    for f, x in (("k", blk.k), ("v", blk.v)):
        got = expand(x, torch.float32)[0].permute(1, 0, 2)
        torch.testing.assert_close(got, want[f], atol=1e-5, rtol=1e-5, msg=lambda m: f"{f}: {m}")


@pytest.mark.parametrize("d", [16, 64, 96, 128])
def test_the_rotation_is_the_references_hadamard_and_orthonormal(d):
    """Sylvester's recursion (block diagonal past a power of 2, Phi-3's 96) equals the reference's entry-by-entry
    matrix; it is orthonormal, so rotating and rotating back gives the tokens again."""
    h = _hadamard(d, "cpu")
    assert torch.equal(h, rq.rotation(d))
    torch.testing.assert_close(h @ h.T, torch.eye(d), atol=1e-6, rtol=0)
    x = torch.randn(5, d, generator=torch.Generator().manual_seed(d))
    torch.testing.assert_close(unrotate(rotate(x)), x, atol=1e-5, rtol=0)


def test_a_rotated_block_counts_the_same_bytes_and_reads_back_close():
    """Rotation adds no stored part (the plan's bytes are unchanged); an outlier channel the per-token values spend
    their 3 bits on is spread, so the rotated block reads the ordinary channels back closer."""
    plain, rot = (CacheLayout(2, 3, 8, 64, torch.float32, CacheQuant(3, 64, "token", 0, rotate=r))
                  for r in (False, True))
    assert rot.parts() == plain.parts() and rot.nbytes == plain.nbytes
    g = torch.Generator().manual_seed(0)
    v = torch.randn(2, 3, 8, 64, generator=g)
    v[..., 5] *= 40  # one outlier channel
    errs = {}
    for r in (False, True):
        blk = KVBlock.empty(2, 3, 8, 64, torch.float32, "cpu", CacheQuant(3, 64, "token", 0, rotate=r))
        assign(blk.v, (slice(None), slice(None), slice(0, 8)), v)
        got = expand(blk.v, torch.float32)
        errs[r] = float((got - v)[..., torch.arange(64) != 5].abs().mean())
    assert errs[True] < 0.5 * errs[False], errs


@pytest.mark.parametrize("keys", ["channel", "token"])
def test_a_rotated_block_read_in_its_own_basis_is_the_model_basis_read_rotated(keys):
    """Decode reads a rotated block without rotating every slot back (codec.expand_stored: the query is rotated, the
    output rotated back): the stored-basis read, ring and sinks included, is the model-basis read times H, and one
    decode step over it equals attention over the model-basis read."""
    from flexh2o.compress.codec import expand_stored
    from flexh2o.kv import attention
    from flexh2o.kv.spec import make_policy
    g = torch.Generator().manual_seed(3)
    b, h, s, d = 2, 3, 12, 64
    blk = KVBlock.empty(b, h, s, d, torch.float32, "cpu", CacheQuant(3, 64, keys, 4, recent=4, sinks=2, rotate=True))
    k, v = torch.randn(b, h, s - 1, d, generator=g), torch.randn(b, h, s - 1, d, generator=g)
    pos = torch.arange(s - 1).expand(b, s - 1)
    attention._pack(k, v, pos[:, None].expand(b, h, s - 1), torch.zeros(b, h, s - 1),
                    torch.ones(b, h, s - 1, dtype=torch.bool), blk)
    for x in (blk.k, blk.v):
        stored, rotated = expand_stored(x, torch.float32)
        assert rotated
        torch.testing.assert_close(stored, rotate(expand(x, torch.float32)), atol=1e-5, rtol=0)
    q, kn, vn = (torch.randn(b, n, 1, d, generator=g) for n in (h, h, h))
    cur = torch.full((b,), s - 1)
    out = attention.decode(q, kn, vn, cur, blk, make_policy("full", None), 0, evicts=False)
    keys_now, values_now = expand(blk.k, torch.float32), expand(blk.v, torch.float32)  # the new token included
    att = (q @ keys_now.transpose(-1, -2) * d ** -0.5).softmax(-1)
    torch.testing.assert_close(out, att @ values_now, atol=1e-5, rtol=0)
