"""CUDA paths (streams, events, pinned cpu tier): the same tokens and logits as the CPU run. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from conftest import ragged_prompts
from flexh2o.config import ModelConfig
from flexh2o.engine import Engine
from flexh2o.kv.spec import KVSpec
from flexh2o.placement import Percent
from flexh2o.run_config import RunConfig

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
TINY = ModelConfig("tiny", "opt", hidden=64, num_layers=4, num_heads=4, ffn=256, vocab=1000, max_positions=128)


@pytest.mark.parametrize("percent", [[100, 0, 100, 0], [0, 100, 0, 100], [0, 0, 0, 0, 0, 0], [30, 30, 30, 30]])
@pytest.mark.parametrize("cpu_cache_compute", [False, True])
@pytest.mark.parametrize("policy", ["full", "h2o"])
def test_cuda_matches_cpu(tmp_path, percent, cpu_cache_compute, policy):
    from flexh2o.kv.policies import Budget
    prompts = ragged_prompts(4, 10, TINY.vocab, seed=1)
    outs = []
    for device, overlap in (("cpu", False), ("cuda", True)):
        rc = RunConfig(model=TINY, percent=Percent.parse(percent),
                       gpu_batch_size=2, num_gpu_batches=2, prompt_len=10, gen_len=6,
                       dtype=torch.float32, device=device, overlap=overlap, cpu_cache_compute=cpu_cache_compute,
                       kv=KVSpec(policy, Budget(3, 3) if policy == "h2o" else None), offload_dir=str(tmp_path))
        with Engine(rc) as eng:
            assert eng.tiers["cpu"].pin == (device == "cuda")
            outs.append(eng.generate(prompts, 6))
    assert torch.equal(outs[0].tokens, outs[1].tokens)
    torch.testing.assert_close(outs[0].last_logits, outs[1].last_logits, atol=1e-3, rtol=1e-3)
