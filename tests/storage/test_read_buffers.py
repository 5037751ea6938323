"""The disk tier's weight reads go into two reused aligned arenas (storage/read_buffers.py), one layer each: no
fresh buffer after the first two, and the tokens are those of the memory-resident run (the engine-vs-transformers
check across placements is tests/models/test_engine_opt.py)."""
from __future__ import annotations

import torch

from flexh2o.compress import CompressionSpec
from flexh2o.compress.kernels import PackedWeight
from flexh2o.config import ModelConfig
from flexh2o.engine import Engine
from flexh2o.placement import Percent
from flexh2o.run_config import RunConfig
from flexh2o.storage import read_buffers
from flexh2o.storage.disk import aligned_empty
from flexh2o.storage.read_buffers import ReadArenas
from flexh2o.weights.store import WeightStore
from flexh2o.units import ALIGN

# the tables larger than a decoder layer, as in every OPT (opt-125m: 80 MB against 14 MB)
TINY = ModelConfig("tiny", "opt", hidden=64, num_layers=3, num_heads=4, ffn=256, vocab=4096, max_positions=64)


def test_arenas_take_turns_and_a_busy_one_means_fresh_buffers():
    arenas = ReadArenas(3 * ALIGN)
    t0, (x, y) = arenas.lend([ALIGN, 2 * ALIGN])
    assert x.data_ptr() % ALIGN == 0 and y.data_ptr() == x.data_ptr() + ALIGN and y.numel() == 2 * ALIGN
    t1, (z,) = arenas.lend([3 * ALIGN])
    assert {t0, t1} == {0, 1} and arenas.held() == 6 * ALIGN
    t2, (w,) = arenas.lend([ALIGN])  # both lent: a fresh buffer, nothing shared
    assert t2 is None and arenas.fresh == 1 and not w.data_ptr() in (x.data_ptr(), z.data_ptr())
    arenas.give(t0)
    t3, (v,) = arenas.lend([ALIGN])
    assert t3 == t0 and v.data_ptr() == x.data_ptr()  # the arena of the first load again
    assert arenas.lend([4 * ALIGN])[0] is None  # larger than an arena


def _run(offload_dir, percent, prompts, monkeypatch, overlap=True):
    rc = RunConfig(model=TINY, percent=Percent.parse(percent), gpu_batch_size=2, prompt_len=6, gen_len=5,
                   dtype=torch.float32, offload_dir=offload_dir, overlap=overlap)
    fresh = []
    monkeypatch.setattr(read_buffers, "aligned_empty", lambda n: fresh.append(n) or aligned_empty(n))
    with Engine(rc) as eng:
        tokens = eng.generate(prompts, 5).tokens
        per_layer = [sum(eng.weights.handles[s.name].padded for s in eng.weights._streamed(layer))
                     for layer in range(len(eng.weights.specs))]
        assert eng.weights.reads.fresh == 0
    return tokens, fresh, per_layer


def test_streamed_weights_read_into_two_arenas(offload_dir, monkeypatch):
    """Every load of a disk-streamed run finds its arena free (the schedule frees a layer before it loads the one
    two after it), the two arenas are the largest layer's disk bytes each, and the tokens are the resident run's."""
    prompts = [[3, 9, 27, 81], [5, 25, 125]]
    for overlap in (True, False):
        tokens, fresh, per_layer = _run(offload_dir, [0, 0, 100, 0, 100, 0], prompts, monkeypatch, overlap)
        assert fresh == [max(per_layer)] * 2
    resident, fresh, per_layer = _run(offload_dir, [100, 0, 100, 0, 100, 0], prompts, monkeypatch)
    assert torch.equal(tokens, resident) and fresh == [] and max(per_layer) == 0


def _packed_run(offload_dir, percent, prompts, monkeypatch) -> tuple:
    """(tokens, PackedWeights loaded, those whose data and meta are views of a read arena, arena sizes made) of a
    run with 4-bit weights in the int4 kernel's order, run by the kernel at every phase."""
    rc = RunConfig(model=TINY, percent=Percent.parse(percent), gpu_batch_size=2, prompt_len=6, gen_len=5,
                   dtype=torch.float32, offload_dir=offload_dir, compress_weight=CompressionSpec(4, 64, 1),
                   weight_kernel="int4")
    made, seen, in_arena = [], [], []
    monkeypatch.setattr(read_buffers, "aligned_empty", lambda n: made.append(n) or aligned_empty(n))
    load = WeightStore.load_layer

    def inside(t: torch.Tensor, arenas) -> bool:
        return any(a is not None and a.data_ptr() <= t.data_ptr() < a.data_ptr() + a.numel() for a in arenas)

    def checked(store, *args, **kw):
        out = load(store, *args, **kw)
        for t in out[0].values():
            if isinstance(t, PackedWeight):
                seen.append(t)
                in_arena.append(inside(t.packed, store.reads.arenas) and inside(t.meta, store.reads.arenas))
        return out
    monkeypatch.setattr(WeightStore, "load_layer", checked)
    with Engine(rc) as eng:
        tokens = eng.generate(prompts, 5).tokens
        assert eng.weights.reads.fresh == 0
    return tokens, seen, in_arena, made


def test_packed_weights_are_read_into_the_arenas(offload_dir, monkeypatch):
    """4-bit weights homed on disk that come as PackedWeights (their read bytes used until the layer is released)
    are read into the two arenas with the plain ones, not into fresh buffers; the tokens are those of the same
    weights held in memory."""
    prompts = [[3, 9, 27, 81], [5, 25, 125]]
    tokens, seen, in_arena, made = _packed_run(offload_dir, [0, 0, 100, 0, 100, 0], prompts, monkeypatch)
    assert seen and all(in_arena) and len(made) == 2
    resident, seen, in_arena, made = _packed_run(offload_dir, [100, 0, 100, 0, 100, 0], prompts, monkeypatch)
    assert torch.equal(tokens, resident) and seen and not any(in_arena) and made == []
