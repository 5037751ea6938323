"""Keys per channel (prompt-calibrated scales, outliers exact) and values per token at 2, 3, 4 and 8 bits: under
every KV policy and on every cache placement (each policy on one, h2o on all) the engine equals tests/reference_kv.py fed tests/reference_quant.py's
own quantize-dequantize of the K/V (written apart from flexh2o/compress). merge is left out as in
test_compress_cache.py (the reference merges exact values only; test_kv_layout.py checks a merge on a block)."""
from __future__ import annotations

import pytest
import torch

import reference_kv as ref
import reference_quant as rq
from flexh2o.kv.layout import CacheQuant
from flexh2o.sampling import TeacherForcer
from test_kv_equivalence import BUDGETS, COMBOS, GEN, LENS, MODELS, POLICIES, _assert_matches, _engine, _rc, \
    _ref_policy

HEAD_DIM = 16
CHANNEL = CacheQuant(4, HEAD_DIM, "channel", 2)  # 2 of a token's 16 key values exact
# every policy on OPT, each on one placement in turn (h2o on all four); three on grouped-KV Llama
_OPT = [p for p in POLICIES if p not in ("merge", "h2o")]
CASES = [("opt", "h2o", c) for c in COMBOS] + [("opt", p, COMBOS[i % len(COMBOS)]) for i, p in enumerate(_OPT)] + \
    [("llama", p, COMBOS[i * 2 % len(COMBOS)]) for i, p in enumerate(("h2o", "tova", "adakv"))]
BITS = [(CacheQuant(b, HEAD_DIM, keys, n), p) for b in (2, 3, 8) for keys, n in (("channel", 2), ("token", 0))
        for p in ("h2o",)] + [(CacheQuant(4, HEAD_DIM, "channel", 0), "full")] + \
    [(CacheQuant(b, HEAD_DIM, "fitted", 2), "h2o") for b in (2, 3, 4)] + [(CacheQuant(3, HEAD_DIM, "fitted", 0), "full")]

pytestmark = pytest.mark.usefixtures("one_thread")


def ref_quant(q: CacheQuant, margins: list = None, ties: set = None) -> tuple:
    """The reference's (keys, values) quantize-dequantize for `q` (margins: see reference_quant; not recorded for
    fitted levels, whose nearest-level choice has no .5 boundary). ties: a set that collects the tokens with a level
    near a rounding half (reference_quant.first_unsure_step)."""
    in_fp8 = q.exact_bits == 8
    keys = {"channel": lambda: rq.per_channel(q.bits, q.outliers, margins, in_fp8, ties=ties),
            "token": lambda: rq.per_token(q.bits, q.group_size, margins, ties),
            "fitted": lambda: rq.per_channel_fitted(q.bits, q.outliers, in_fp8=in_fp8)}[q.keys]()
    values = rq.per_token(q.bits, q.group_size, margins, ties)
    if q.rotate:
        keys, values = rq.rotated(keys), rq.rotated(values)
    return rq.recent(keys, values, q.recent, q.sinks, rq.per_token(8, None, margins) if q.exact_bits else None)


def seeded_data(seed: int) -> tuple:
    """(prompts of the LENS lengths, forced tokens (len(LENS), GEN)) drawn from `seed`."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 1000, (n,), generator=g).tolist() for n in LENS]
    return prompts, torch.randint(4, 1000, (len(LENS), GEN), generator=g)


@pytest.fixture(scope="module")
def data():
    return seeded_data(3)


def quant_references(tmp_path_factory, data):
    """(model, policy, CacheQuant) -> one RefGeneration per prompt of `data` (each with its unsure_from), cached;
    `.margin` of the same arguments: the smallest distance of a level the reference's quantizers rounded from a
    rounding half (over every call of the run: reference_quant.near_half)."""
    cache, weights, margins = {}, {}, {}
    prompts, forced = data

    def get(model: str, policy: str, q: CacheQuant) -> list:
        if model not in weights:
            with _engine(_rc(model, "full", str(tmp_path_factory.mktemp("w")))) as eng:
                weights[model] = {k: v.clone() for k, v in eng.weights.handles.items()}
        if (model, policy, q) not in cache:
            pol = _ref_policy(model, policy, BUDGETS[policy])
            seen = margins[model, policy, q] = []
            cache[model, policy, q] = [_generate(model, weights[model], p, forced[i].tolist(), pol, q, seen)
                                       for i, p in enumerate(prompts)]
        return cache[model, policy, q]

    def margin(model: str, policy: str, q: CacheQuant) -> float:
        get(model, policy, q)
        return min(margins[model, policy, q])
    get.margin = margin
    return get


def _generate(model: str, weights: dict, prompt: list, forced: list, pol, q: CacheQuant, margins: list):
    """One sequence's RefGeneration under `q`, its unsure_from set from the levels it rounded near a half."""
    ties = set()
    r = ref.generate(MODELS[model], weights, prompt, GEN, pol, forced, ref_quant(q, margins, ties))
    r.unsure_from = rq.first_unsure_step(ties, len(prompt), q.recent, q.sinks)
    return r


@pytest.fixture(scope="module")
def quant_reference(tmp_path_factory, data):
    return quant_references(tmp_path_factory, data)


def _run(model, policy, combo, q, data, offload_dir):
    prompts, forced = data
    _, percent, overlap, ccc, batching, chunk = combo
    rc = _rc(model, policy, offload_dir, percent, overlap, ccc, batching, chunk).with_(compress_cache=q)
    with _engine(rc) as eng:
        return eng.generate(prompts, GEN, sampler=TeacherForcer(forced), record_logits=True, kept_stats=True)


@pytest.mark.parametrize("model, policy, combo", [pytest.param(*c, id=f"{c[0]}-{c[1]}-{c[2][0]}") for c in CASES])
def test_engine_matches_reference_with_channel_keys(model, policy, combo, data, quant_reference, offload_dir):
    """Teacher-forced: the logits of all 33 steps of all 6 sequences, within 1e-4, and the kept counts."""
    gen = _run(model, policy, combo, CHANNEL, data, offload_dir)
    _assert_matches(gen, quant_reference(model, policy, CHANNEL), BUDGETS[policy],
                    _ref_policy(model, policy, BUDGETS[policy]))


@pytest.mark.parametrize("q, policy", [pytest.param(q, p, id=f"{q.bits}bit-{q.keys}-{q.outliers}-{p}")
                                       for q, p in BITS])
def test_engine_matches_reference_at_every_width(q, policy, data, quant_reference, offload_dir):
    """2, 3 and 8 bits, keys per channel (evenly spaced and fitted levels) and per token (FlexGen's), and no
    outliers, on the disk tier."""
    gen = _run("opt", policy, COMBOS[2], q, data, offload_dir)
    _assert_matches(gen, quant_reference("opt", policy, q), BUDGETS[policy],
                    _ref_policy("opt", policy, BUDGETS[policy]))


def test_fitted_levels_move_the_logits(data, quant_reference):
    """The fitted-levels comparison is sharp too: evenly spaced and fitted levels give logits far apart."""
    from test_kv_equivalence import ATOL
    a = quant_reference("opt", "h2o", CacheQuant(3, HEAD_DIM, "fitted", 2))
    b = quant_reference("opt", "h2o", CacheQuant(3, HEAD_DIM, "channel", 2))
    gap = max(float((x - y).abs().max()) for ra, rb in zip(a, b) for x, y in zip(ra.step_logits, rb.step_logits))
    assert gap > 100 * ATOL


def test_channel_keys_move_the_logits(data, quant_reference):
    """The comparison is sharp: per-channel and per-token keys, and exact ones, give logits far apart."""
    from test_kv_equivalence import ATOL
    token = CacheQuant(4, HEAD_DIM, "token")
    a, b = quant_reference("opt", "h2o", CHANNEL), quant_reference("opt", "h2o", token)
    gap = max(float((x - y).abs().max()) for ra, rb in zip(a, b) for x, y in zip(ra.step_logits, rb.step_logits))
    assert gap > 100 * ATOL
