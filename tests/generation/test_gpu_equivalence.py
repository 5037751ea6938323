"""On CUDA: the engine's greedy tokens and last-step logits equal Hugging Face OPTForCausalLM (run on the CPU in
fp32 on the same weights) for two placements: all in GPU memory, and weights + cache in pinned CPU memory.
Skipped without CUDA; benchmarks/gpu_check.py runs it on the first GPU machine."""
from __future__ import annotations

import pytest
import torch

from conftest import hf_greedy, hf_opt, ragged_prompts
from flexh2o.config import ModelConfig
from flexh2o.engine import Engine
from flexh2o.placement import Percent
from flexh2o.run_config import RunConfig

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
TINY = ModelConfig("tiny", "opt", hidden=64, num_layers=4, num_heads=4, ffn=256, vocab=1000, max_positions=128)
GEN = 6


@pytest.mark.parametrize("percent", [[100, 0, 100, 0], [0, 100, 0, 100]])
def test_cuda_engine_matches_transformers(tmp_path, percent):
    prompts = ragged_prompts(4, 10, TINY.vocab, seed=2)
    rc = RunConfig(model=TINY, percent=Percent.parse(percent), gpu_batch_size=2, num_gpu_batches=2, prompt_len=10,
                   gen_len=GEN, dtype=torch.float32, compute_dtype=torch.float32, device="cuda",
                   offload_dir=str(tmp_path))
    with Engine(rc) as eng:
        weights = {k: v.detach().float().cpu().clone() for k, v in eng.weights.handles.items()}
        gen = eng.generate(prompts, GEN)
    model = hf_opt(TINY, weights)
    for i, p in enumerate(prompts):
        tokens, logits = hf_greedy(model, p, GEN)
        assert gen.tokens[i].tolist() == tokens, f"sequence {i}"
        torch.testing.assert_close(gen.last_logits[i].cpu(), logits, atol=1e-3, rtol=1e-3)
