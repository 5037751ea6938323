"""Matmul weights converted on use (weights/on_use.py): an OnUseWeight's product equals the weight converted whole
(bit-equal within one chunk, within the dot products' bound across chunks), the one ChunkBuffer is reused and
never shared by two matmuls at once, an engine whose cap only fits weights converted on use chooses them, its loads
copy what the plan reserves, and it generates the logits of the same run converting whole layers."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flexh2o.compress.choice import PHASES
from flexh2o.config import ModelConfig
from flexh2o.engine import Engine
from flexh2o.models import common
from flexh2o.models.common import StoredWeight
from flexh2o.placement import Percent
from flexh2o.planning.memory_plan import plan_memory
from flexh2o.run_config import RunConfig
from flexh2o.weights.forms import WeightForms
from flexh2o.weights.on_use import ChunkBuffer, OnUseWeight

from test_stored_form import SMALL_CHUNK, U32, _dot_bound

# decoder layers larger than the embedding layer (whose lookups convert whole), as in a real model: (4 h^2 + 2 h f)
# fp32 elements a decoder layer (590 KB), its tables (vocab + positions) 82 KB
MID = ModelConfig("mid", "opt", hidden=64, num_layers=2, num_heads=4, ffn=1024, vocab=256, max_positions=64)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("storage", [torch.bfloat16, torch.float16])
def test_one_chunk_is_the_product_of_the_weight_converted_whole(storage):
    """A weight of one chunk or less: converted whole into the buffer, then the same F.linear: bit-equal."""
    g = torch.Generator().manual_seed(0)
    w, bias = torch.randn(96, 64, generator=g).to(storage), torch.randn(96, generator=g)
    x = torch.randn(2, 5, 64, generator=g)  # (b, t, K)
    got = OnUseWeight(w, torch.float32, ChunkBuffer(96 * 64 * 4)).linear(x, bias)
    assert got.shape == (2, 5, 96) and torch.equal(got, F.linear(x, w.float(), bias))


@pytest.mark.parametrize("rows", [1, 7, 130])
def test_chunks_equal_one_call_up_to_the_sum_order(monkeypatch, rows):
    """Across chunks (SMALL_CHUNK: 40 rows of 64 in fp32; 1001 rows end in a short chunk): within _dot_bound of
    one F.linear on the converted weight, plus one rounding of the bias add; the buffer is the one ChunkBuffer's,
    made once and reused by the next call."""
    monkeypatch.setattr(common, "STORED_CHUNK_BYTES", SMALL_CHUNK)
    g = torch.Generator().manual_seed(1)
    w, bias = torch.randn(1001, 64, generator=g).to(torch.bfloat16), torch.randn(1001, generator=g)
    x = torch.randn(rows, 64, generator=g)
    chunks = ChunkBuffer(SMALL_CHUNK)
    got = OnUseWeight(w, torch.float32, chunks).linear(x, bias)
    ref = F.linear(x, w.float(), bias)
    slack = _dot_bound(x, w.float()) + (ref.double().abs() * U32 * 2)  # the bias add: |s + b| u more
    assert got.shape == (rows, 1001) and ((got - ref).double().abs() <= slack).all()
    first = chunks.buf.data_ptr()
    OnUseWeight(w, torch.float32, chunks).linear(x, bias)
    assert chunks.buf.data_ptr() == first and chunks.buf.numel() == SMALL_CHUNK


def test_a_second_taker_gets_its_own_buffer():
    """While the buffer is lent, another matmul's rows are a buffer of its own (never the lent one)."""
    chunks = ChunkBuffer(64 * 4)
    with chunks.rows(8, 8, torch.float32, "cpu") as a:
        with chunks.rows(8, 8, torch.float32, "cpu") as b:
            assert a.data_ptr() == chunks.buf.data_ptr() and b.data_ptr() != a.data_ptr()
    with chunks.rows(4, 8, torch.bfloat16, "cpu") as c:
        assert c.data_ptr() == chunks.buf.data_ptr() and c.shape == (4, 8)


def _capped(percent: str, offload_dir: str) -> tuple:
    """(MID in bf16 computed in fp32 capped at the gpu tier of its plan converting on use at both phases, the
    same run uncapped)."""
    rc = RunConfig(model=MID, percent=Percent.parse(percent.split()), gpu_batch_size=2, num_gpu_batches=2,
                   prompt_len=8, gen_len=3, dtype=torch.bfloat16, compute_dtype=torch.float32,
                   offload_dir=offload_dir)
    on_use = WeightForms.of_run(rc).with_on_use(PHASES)
    cap = plan_memory(rc, forms=on_use).total("gpu")
    return rc.with_(gpu_mem=cap), rc


@pytest.mark.parametrize("percent", ["0 100 100 0", "0 0 100 0", "30 30 30 30"])
def test_the_plan_reserves_what_on_use_loads_copy(offload_dir, percent):
    """At a cap that only weights converted on use fit, the engine's forms convert them on use at both phases (one
    phase alone leaves the other's layers converted whole); per layer and phase, the bytes a load charges plus the
    head's transient chunk (and read chunks) are the plan's figure, every multiplied matrix comes as an OnUseWeight
    (the embedding's lookups converted whole, MID's tables being under a chunk), and the ChunkBuffer is the
    plan's chunk_buffer_bytes, charged once."""
    rc, free = _capped(percent, offload_dir)
    assert plan_memory(free, forms=WeightForms.planned(free)).total("gpu") > rc.gpu_mem  # whole layers do not fit
    with Engine(rc) as eng:
        forms, homes = eng.forms, rc.placement.weights
        assert forms.on_use == frozenset(PHASES) and eng.plan.overflow() is None
        for phase in PHASES:
            want = forms.compute_side_bytes(homes, phase)
            passing = forms.transient_bytes(homes, phase)
            for layer, specs in enumerate(homes.layer_specs):
                tensors, copied = eng.weights.load_layer(layer, torch.device("cpu"), torch.float32, phase)
                on_use = {s.name for s in specs if isinstance(tensors[s.name], OnUseWeight)}
                stored = {s.name for s in specs if type(tensors[s.name]) is not OnUseWeight
                          and isinstance(tensors[s.name], StoredWeight)}
                assert on_use == {s.name for s in specs if len(s.shape) == 2 and s.name not in stored
                                  and not (layer == 0 and "embed" in s.name)}, (phase, layer)
                assert copied + passing[layer] == want[layer], (phase, layer)
                eng.weights.release(tensors)
        eng.generate([[5, 6, 7]] * 4, 3)
        assert eng.weights.chunks.buf.numel() == forms.chunk_buffer_bytes(homes) == 1024 * 64 * 4  # fc1's (1024, 64)
        assert eng.tiers["gpu"].peak <= rc.gpu_mem


@pytest.mark.parametrize("percent", ["0 100 100 0", "0 0 100 0"])
def test_on_use_generates_the_logits_of_whole_layers(offload_dir, percent):
    """The capped run (weights converted on use) and the uncapped one (whole layers converted at each load): every
    MID weight fits one chunk, so each matmul is the same F.linear on the same converted values: bit-equal logits
    and tokens."""
    rc, free = _capped(percent, offload_dir)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12], [2, 3, 4, 5], [6, 7, 8, 9]]
    runs = []
    for r in (rc, free):
        with Engine(r) as eng:
            runs.append((eng.forms.on_use, eng.generate(prompts, 3, record_logits=True)))
    (capped_use, capped), (free_use, whole) = runs
    assert capped_use == frozenset(PHASES) and free_use == frozenset() and len(capped.step_logits) == 3
    assert torch.equal(torch.as_tensor(capped.tokens), torch.as_tensor(whole.tokens))
    assert all(torch.equal(a, b) for a, b in zip(capped.step_logits, whole.step_logits))
