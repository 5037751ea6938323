"""Pipeline stages on local gloo ranks: greedy tokens and last logits equal the single-process engine (which the
engine tests hold equal to transformers), for OPT and Llama, full and h2o, several placements, one GPU batch and
as many as stages (pipelined)."""
from __future__ import annotations

import os

import pytest
import torch

from conftest import ragged_prompts
from dist_util import run_ranks
from flexh2o.config import ModelConfig
from flexh2o.engine import Engine
from flexh2o.kv.policies.base import Budget
from flexh2o.kv.spec import KVSpec
from flexh2o.placement import Percent
from flexh2o.run_config import RunConfig

OPT = ModelConfig("tiny", "opt", hidden=64, num_layers=4, num_heads=4, ffn=256, vocab=1000, max_positions=128)
LLAMA = ModelConfig("tinyl", "llama", hidden=64, num_layers=4, num_heads=4, num_kv_heads=2, ffn=128, vocab=1000,
                    max_positions=128, tie_embeddings=False)
PLACEMENTS = {"gpu": [100, 0, 100, 0], "cpu": [0, 100, 0, 100], "disk": [0, 0, 0, 0, 0, 0],
              "mixed": [30, 30, 30, 30, 30, 30]}
GEN = 5
H2O = KVSpec("h2o", Budget(2, 2))

# (model, policy, placement, GPU batches per stage count or 1, overlap, --stage-layers)
CASES = {2: [(OPT, "full", "gpu", 1, True, None), (OPT, "full", "mixed", "stages", True, None),
             (OPT, "h2o", "disk", "stages", False, "1,3"), (OPT, "h2o", "cpu", 1, True, None),
             (LLAMA, "full", "mixed", "stages", True, "3,1"), (LLAMA, "h2o", "gpu", 1, False, None),
             (LLAMA, "h2o", "mixed", 4, True, None)],
         3: [(OPT, "full", "mixed", "stages", True, None), (OPT, "h2o", "gpu", 1, True, "2,1,1"),
             (LLAMA, "h2o", "disk", "stages", True, None), (LLAMA, "full", "cpu", 5, False, "1,1,2")]}


def _config(case, world, offload_dir):
    cfg, policy, placement, nb, overlap, _ = case
    nb = world if nb == "stages" else nb
    return RunConfig(model=cfg, percent=Percent.parse(PLACEMENTS[placement]), gpu_batch_size=2, num_gpu_batches=nb,
                     prompt_len=10, gen_len=GEN, dtype=torch.float32, overlap=overlap,
                     kv=H2O if policy == "h2o" else KVSpec(), offload_dir=offload_dir)


def _prompts(rc):
    return ragged_prompts(rc.num_seqs, 10, rc.model.vocab, seed=rc.num_gpu_batches)


def _stage_worker(rank, world, cases, offload_dir):
    from flexh2o.pipeline.group import StageGroup
    from flexh2o.pipeline.job import preflight, stage_generate
    group = StageGroup.start("cpu", 30.0)
    out = []
    for case in cases:
        rc = _config(case, world, offload_dir)
        stage, src = preflight(group, rc, case[-1])
        with Engine(src) as eng:
            gen, link = stage_generate(eng, group, stage, _prompts(rc), GEN, 30.0)
        last = (gen.tokens.tolist(), gen.last_logits.numpy(), link.sent_bytes)
        out.append(last if stage.is_last else link.sent_bytes)
    return out  # plain lists and arrays: tensors would travel as shared memory of a process about to exit


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    """world -> (offload dir, every rank's results): each world size's cases run once, in one process group."""
    done: dict = {}

    def results(world):
        if world not in done:
            offload_dir = str(tmp_path_factory.mktemp(f"offload{world}"))
            out = run_ranks(_stage_worker, world, CASES[world], offload_dir, timeout=120)
            assert all(status == "ok" for status, _ in out), out
            assert not os.listdir(offload_dir), "offload files left behind"
            done[world] = offload_dir, out
        return done[world]
    return results


@pytest.mark.parametrize("world,i", [(w, i) for w in CASES for i in range(len(CASES[w]))])
def test_stages_equal_the_single_process_engine(staged, world, i, one_thread):
    offload_dir, results = staged(world)
    rc = _config(CASES[world][i], world, offload_dir)
    with Engine(rc) as eng:
        ref = eng.generate(_prompts(rc), GEN)
    tokens, logits, _ = results[-1][1][i]
    tokens, logits = torch.tensor(tokens), torch.from_numpy(logits)
    assert torch.equal(tokens, ref.tokens)
    torch.testing.assert_close(logits, ref.last_logits, atol=1e-5, rtol=1e-5)
    b, t, h = rc.gpu_batch_size, 10, rc.model.hidden  # hidden states per link: the prompt, then one token a step
    for rank in range(world - 1):
        assert results[rank][1][i] == rc.num_gpu_batches * b * h * 4 * (t + GEN - 1)
    assert tokens.shape == (rc.num_seqs, GEN) and torch.isfinite(logits).all()


def _refusal_worker(rank, world, split):
    from flexh2o.pipeline.group import StageGroup
    from flexh2o.pipeline.job import Refusal, preflight
    group = StageGroup.start("cpu", 30.0)
    try:
        preflight(group, _config(CASES[2][0], world, "/nonexistent"), split)
    except Refusal as e:
        return str(e)
    return None


@pytest.mark.parametrize("world,split,needle", [(2, "3,3", "sum to the 4 decoder layers"),
                                                (3, "2,2", "names 2 stages but 3 ranks run"),
                                                (2, "x", "integers")])
def test_a_bad_stage_split_is_refused_on_every_rank(world, split, needle):
    out = run_ranks(_refusal_worker, world, split, timeout=60)
    assert all(status == "ok" and value and needle in value for status, value in out), out
    assert len({value for _, value in out}) == 1  # the same line everywhere
