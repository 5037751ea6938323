"""The engine's greedy tokens and last-step logits equal Hugging Face OPTForCausalLM on the same weights."""
from __future__ import annotations

import pytest
import torch

from conftest import hf_greedy, hf_opt, ragged_prompts
from flexh2o.config import ModelConfig, from_name
from flexh2o.engine import Engine
from flexh2o.kv.spec import KVSpec
from flexh2o.placement import Percent
from flexh2o.run_config import RunConfig

TINY = ModelConfig("tiny", "opt", hidden=64, num_layers=4, num_heads=4, ffn=256, vocab=1000, max_positions=128)
TINY_350M = ModelConfig("tiny-350m", "opt", hidden=64, num_layers=3, num_heads=4, ffn=256, vocab=1000,
                        max_positions=128, word_embed_dim=32, norm_before=False)
PLACEMENTS = {"gpu": [100, 0, 100, 0], "cpu": [0, 100, 0, 100], "disk": [0, 0, 0, 0, 0, 0],
              "mixed": [30, 30, 30, 30, 30, 30]}
GEN = 6


def _reference(cfg, prompts, gen_len, seed=0):
    """Weights from an all-memory engine run, then HF greedy per unpadded prompt."""
    rc = RunConfig(model=cfg, percent=Percent.parse([100, 0, 100, 0]), gpu_batch_size=len(prompts), prompt_len=8,
                   gen_len=gen_len, dtype=torch.float32, seed=seed)
    with Engine(rc) as eng:
        weights = {k: v.clone() for k, v in eng.weights.handles.items()}
    model = hf_opt(cfg, weights)
    return [hf_greedy(model, p, gen_len) for p in prompts]


@pytest.fixture(scope="module")
def tiny_ref():
    prompts = ragged_prompts(6, 12, TINY.vocab, seed=1)
    return prompts, _reference(TINY, prompts, GEN)


def _run(cfg, prompts, offload_dir, percent, gbs, nb, **kw):
    rc = RunConfig(model=cfg, percent=Percent.parse(percent), gpu_batch_size=gbs, num_gpu_batches=nb,
                   prompt_len=max(map(len, prompts)), gen_len=GEN, dtype=torch.float32, offload_dir=offload_dir, **kw)
    with Engine(rc) as eng:
        return eng.generate(prompts, GEN, kept_stats=True)


def _assert_same(gen, ref):
    for i, (tokens, logits) in enumerate(ref):
        assert gen.tokens[i].tolist() == tokens, f"sequence {i}"
        torch.testing.assert_close(gen.last_logits[i], logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
# overlap off in the slow run: off equals on bit for bit (test_overlap_identical_outputs, in the default run)
@pytest.mark.parametrize("overlap", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_matches_hf_across_placements(tiny_ref, offload_dir, placement, overlap):
    prompts, ref = tiny_ref
    gen = _run(TINY, prompts, offload_dir, PLACEMENTS[placement], 2, 3, overlap=overlap)
    _assert_same(gen, ref)


def test_cpu_cache_compute(tiny_ref, offload_dir):
    prompts, ref = tiny_ref
    _assert_same(_run(TINY, prompts, offload_dir, [0, 100, 0, 100], 3, 2, cpu_cache_compute=True), ref)


def test_opt_350m_layout(offload_dir):
    prompts = ragged_prompts(4, 10, TINY_350M.vocab, seed=2)
    ref = _reference(TINY_350M, prompts, GEN)
    _assert_same(_run(TINY_350M, prompts, offload_dir, [30, 30, 30, 30], 2, 2), ref)


@pytest.mark.slow
def test_opt_125m_real_shape(offload_dir):
    cfg = from_name("opt-125m")
    prompts = ragged_prompts(2, 16, cfg.vocab, seed=3)
    rc = RunConfig(model=cfg, percent=Percent.parse([0, 100, 100, 0]), gpu_batch_size=2, prompt_len=16, gen_len=4,
                   dtype=torch.float32, offload_dir=offload_dir)
    with Engine(rc) as eng:
        weights = {k: v.clone() for k, v in eng.weights.handles.items()}
        gen = eng.generate(prompts, 4)
    model = hf_opt(cfg, weights)
    for i, p in enumerate(prompts):
        tokens, logits = hf_greedy(model, p, 4)
        assert gen.tokens[i].tolist() == tokens
        torch.testing.assert_close(gen.last_logits[i], logits, atol=1e-4, rtol=1e-4)


def test_overlap_identical_outputs(offload_dir):
    prompts = ragged_prompts(4, 9, TINY.vocab, seed=4)
    a = _run(TINY, prompts, offload_dir, [20, 30, 40, 30], 2, 2, overlap=True)
    b = _run(TINY, prompts, offload_dir, [20, 30, 40, 30], 2, 2, overlap=False)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.last_logits, b.last_logits)


def test_dummy_weights_are_seeded_and_not_degenerate(offload_dir):
    prompts = ragged_prompts(2, 8, TINY.vocab, seed=5)
    a = _run(TINY, prompts, offload_dir, [100, 0, 100, 0], 2, 1, seed=7)
    b = _run(TINY, prompts, offload_dir, [0, 0, 0, 0], 2, 1, seed=7)  # drawn straight into the disk tier
    c = _run(TINY, prompts, offload_dir, [100, 0, 100, 0], 2, 1, seed=8)
    assert torch.equal(a.last_logits, b.last_logits)
    assert not torch.equal(a.last_logits, c.last_logits)
    assert a.last_logits.std() > 0.01 and torch.isfinite(a.last_logits).all()


def test_save_pretrained_round_trip_through_convert_and_run(tmp_path, offload_dir):
    """transformers save_pretrained -> flexh2o-convert -> flexh2o-run --path: the same greedy tokens as HF."""
    import json

    from transformers import OPTConfig, OPTForCausalLM

    from flexh2o.cli import convert as convert_cli, run as cli
    torch.manual_seed(0)
    model = OPTForCausalLM(OPTConfig(vocab_size=500, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                                     num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32))
    model.eval().save_pretrained(tmp_path / "hf")
    assert convert_cli.main([str(tmp_path / "hf"), str(tmp_path / "conv"), "--dtype", "float32"]) == 0
    prompts = ragged_prompts(3, 7, 500, seed=9)
    (tmp_path / "p.json").write_text(json.dumps(prompts))
    out = tmp_path / "out.json"
    assert cli.main(["--path", str(tmp_path / "conv"), "--prompt-file", str(tmp_path / "p.json"), "--gen-len", "5",
                     "--dtype", "float32", "--percent", "0", "0", "50", "0", "--offload-dir", offload_dir,
                     "--output-file", str(out), "--no-warmup"]) == 0
    got = [r["tokens"] for r in json.loads(out.read_text())]
    assert got == [hf_greedy(model, p, 5)[0] for p in prompts]


@pytest.mark.parametrize("rows", [1, 2])
def test_prefill_in_sub_batches(tiny_ref, offload_dir, rows):
    """Prefill split into sub-batches of `rows` sequences: the same tokens and logits as HF (full cache), and
    H2O's kept sets unchanged."""
    from flexh2o.kv.policies import Budget
    prompts, ref = tiny_ref
    _assert_same(_run(TINY, prompts, offload_dir, [30, 30, 30, 30], 3, 2, prefill_batch=rows), ref)
    whole = _run(TINY, prompts, offload_dir, [0, 100, 0, 100], 3, 2, kv=KVSpec("h2o", Budget(2, 2)))
    split = _run(TINY, prompts, offload_dir, [0, 100, 0, 100], 3, 2, kv=KVSpec("h2o", Budget(2, 2)),
                 prefill_batch=rows)
    assert torch.equal(whole.tokens, split.tokens) and whole.kept == split.kept
    torch.testing.assert_close(whole.last_logits, split.last_logits, atol=1e-5, rtol=1e-5)


def test_prefill_rows_bound_the_plan():
    from flexh2o.planning.memory_plan import plan_memory
    rc = RunConfig(model=from_name("opt-1.3b"), percent=Percent.parse([0, 100, 100, 0]),
                   gpu_batch_size=64, prompt_len=512,
                   gen_len=32)
    assert rc.prefill_rows() < 64
    small = plan_memory(rc).bytes["gpu"]["buffers"]
    big = plan_memory(rc.with_(prefill_batch=64)).bytes["gpu"]["buffers"]
    assert small < big


def test_cpu_prefill_sub_batches_keep_each_buffer_under_the_mmap_threshold():
    """On the CPU a sub-batch is the most prompts whose per-token buffers (prompt x hidden in the compute dtype)
    stay under glibc's mmap threshold, so they are reused from the heap; on CUDA the six together stay near
    PREFILL_BYTES; one prompt at least, the batch at most."""
    from flexh2o.run_config import PREFILL_BYTES
    from flexh2o.storage.freed_memory import MAPPED_FROM
    for name, t, dtype in (("opt-125m", 512, torch.bfloat16), ("opt-125m", 512, torch.float32),
                           ("opt-125m", 64, torch.bfloat16), ("opt-1.3b", 512, torch.bfloat16)):
        rc = RunConfig(model=from_name(name), gpu_batch_size=64, prompt_len=t, gen_len=8, dtype=dtype)
        buffer = t * rc.model.hidden * dtype.itemsize
        rows = rc.prefill_rows()
        assert rows * buffer < MAPPED_FROM and ((rows + 1) * buffer >= MAPPED_FROM or rows == 64), (name, t, rows)
        gpu = rc.with_(device="cuda").prefill_rows()
        assert gpu == max(1, min(64, PREFILL_BYTES // (6 * buffer))), (name, t, gpu)
    assert RunConfig(model=from_name("opt-30b"), gpu_batch_size=8, prompt_len=512).prefill_rows() == 1  # 7 MiB each
    assert RunConfig(model=from_name("opt-125m"), gpu_batch_size=3, prompt_len=16).prefill_rows() == 3
