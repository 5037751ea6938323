"""The disk tier's weight reads go into two reused aligned arenas (storage/read_buffers.py), one layer each: no
fresh buffer after the first two, and the tokens are those of the memory-resident run (the engine-vs-transformers
check across placements is tests/models/test_engine_opt.py)."""
from __future__ import annotations

import torch

from flexh2o.config import ModelConfig
from flexh2o.engine import Engine
from flexh2o.placement import Percent
from flexh2o.run_config import RunConfig
from flexh2o.storage import read_buffers
from flexh2o.storage.disk import aligned_empty
from flexh2o.storage.read_buffers import ReadArenas
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
