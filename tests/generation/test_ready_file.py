"""$FLEXH2O_READY_FILE: a generate() call appends '<pid> decode' once, after its first decode op, and nothing before;
unset, the compute handler is left as it is. The fault tests wait on this line (tests/readiness.py)."""
from __future__ import annotations

import os

import torch

from flexh2o.generation.ready import ENV, announcing_decode
from flexh2o.schedule.plan import COMPUTE, Op
from readiness import decoding_pids
from tiny_models import tiny_opt


def _op(step: int) -> Op:
    return Op(COMPUTE, step=step, layer=1, batch=0)


def test_unset_leaves_the_handler_as_it_is(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)

    def compute(op):
        return None
    assert announcing_decode(compute) is compute


def test_one_line_after_the_first_decode_op_only(monkeypatch, tmp_path):
    path = tmp_path / "ready"
    monkeypatch.setenv(ENV, str(path))
    seen = []

    def compute(op):
        seen.append((op.step, path.exists()))  # the line is written after the op, never before it
    handler = announcing_decode(compute)
    for step in (0, 0, 1, 1, 2):
        handler(_op(step))
    assert seen == [(0, False), (0, False), (1, False), (1, True), (2, True)]
    assert path.read_text() == f"{os.getpid()} decode\n"


def test_a_generate_call_announces_its_decode(monkeypatch, tmp_path):
    """The engine's own Run wraps its compute handler: a real generate() of 3 tokens writes the line once, and a
    generate() of one token (prefill only) writes none."""
    from flexh2o.engine import Engine
    from flexh2o.run_config import RunConfig
    path = tmp_path / "ready"
    monkeypatch.setenv(ENV, str(path))
    rc = RunConfig(model=tiny_opt(), gpu_batch_size=2, prompt_len=4, gen_len=3, dtype=torch.float32,
                   compute_dtype=torch.float32, offload_dir=str(tmp_path / "off"))
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12]]
    with Engine(rc) as eng:
        eng.generate(prompts, gen_len=1)
        assert not path.exists()
        eng.generate(prompts, gen_len=3)
    assert decoding_pids(path) == {os.getpid()} and len(path.read_text().splitlines()) == 1
