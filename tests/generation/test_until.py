"""generate(stop_when=...) ends a run between steps: the schedule is cut after whole steps (schedule/until.py), the
tokens up to there equal an uncut run's, and the tiers hold after it what they held before (prefetched weights
freed)."""
from __future__ import annotations

import torch

from flexh2o.config import ModelConfig
from flexh2o.engine import Engine
from flexh2o.placement import Percent
from flexh2o.run_config import RunConfig
from flexh2o.schedule.plan import COMPUTE, block_schedule
from flexh2o.schedule.until import until

TINY = ModelConfig("tiny-until", "opt", hidden=32, num_layers=2, num_heads=2, ffn=64, vocab=300, max_positions=64)


def test_until_cuts_after_whole_steps():
    full = list(block_schedule(6, 4, 2, lambda layer: 1 <= layer <= 2))
    emitted = []

    def stop() -> bool:
        return len(emitted) >= 3
    cut = []
    for op in until(full, stop):
        cut.append(op)
        if op.kind == COMPUTE and op.layer == 3 and op.batch == 1:
            emitted.append(op.step)  # the head of the last batch: a step's tokens are out
    computes = [(op.step, op.layer, op.batch) for op in cut if op.kind == COMPUTE]
    assert computes == [(op.step, op.layer, op.batch) for op in full if op.kind == COMPUTE and op.step < 3]
    assert cut == full[:len(cut)]


def test_generate_stops_early_and_frees(offload_dir):
    rc = RunConfig(model=TINY, percent=Percent.parse([0, 100, 0, 100]), gpu_batch_size=2, num_gpu_batches=2,
                   prompt_len=6, gen_len=8, dtype=torch.float32, offload_dir=offload_dir)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [20, 21], [30, 31, 32, 33]]
    with Engine(rc) as eng:
        whole = eng.generate(prompts, 8)
        used = {name: t.used for name, t in eng.tiers.items()}
        steps = []
        cut = eng.generate(prompts, 8, on_step=steps.append, stop_when=lambda: len(steps) >= 3)
        assert {name: t.used for name, t in eng.tiers.items()} == used
    assert steps == [0, 1, 2]
    assert torch.equal(cut.tokens[:, :3], whole.tokens[:, :3]) and not cut.tokens[:, 3:].any()
