"""CUDA paths added after tests/generation/test_cuda.py: a request job that refills finished rows, the quantized cache (keys per
channel and FlexGen's per-token groups) and 4-bit weights give the CPU run's tokens on CUDA, on every cache tier.
Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from flexh2o.batch.run import run_requests
from flexh2o.batch.stopping import StopRule
from flexh2o.compress.codec import CompressionSpec
from flexh2o.config import ModelConfig
from flexh2o.engine import Engine
from flexh2o.kv.layout import CacheQuant
from flexh2o.kv.policies import Budget
from flexh2o.kv.spec import KVSpec
from flexh2o.placement import Percent
from flexh2o.requests import Request
from flexh2o.run_config import RunConfig

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
TINY = ModelConfig("tiny-cuda-jobs", "llama", hidden=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn=128,
                   vocab=300, max_positions=128, tie_embeddings=False)
HEAD_DIM = TINY.hidden // TINY.num_heads
PLACES = {"gpu": [100, 0, 100, 0], "cache on cpu": [100, 0, 0, 100], "cache on disk": [100, 0, 0, 0],
          "weights on cpu": [0, 100, 100, 0]}
QUANTS = {"plain": None, "channel": CacheQuant(4, HEAD_DIM, "channel", 2), "token": CacheQuant(4, HEAD_DIM, "token")}
PROMPT, GEN = 9, 8


def _requests() -> list:
    g = torch.Generator().manual_seed(3)
    lens, gens = torch.randint(1, PROMPT + 1, (7,), generator=g), torch.randint(1, GEN + 1, (7,), generator=g)
    return [Request(str(i), tuple(torch.randint(4, TINY.vocab, (int(n),), generator=g).tolist()), max_new_tokens=int(m))
            for i, (n, m) in enumerate(zip(lens, gens))]


def _rc(device: str, place: str, policy: str, offload_dir: str, **kw) -> RunConfig:
    return RunConfig(model=TINY, percent=Percent.parse(PLACES[place]), gpu_batch_size=2, num_gpu_batches=2,
                     prompt_len=PROMPT, gen_len=GEN, dtype=torch.float32, device=device, offload_dir=offload_dir,
                     kv=KVSpec(policy, Budget(3, 2) if policy == "h2o" else None), **kw)


@pytest.mark.parametrize("quant", list(QUANTS))
@pytest.mark.parametrize("place", list(PLACES))
@pytest.mark.parametrize("policy", ["full", "h2o"])
def test_refill_job_on_cuda_equals_cpu(tmp_path, policy, place, quant):
    reqs = _requests()
    got = {}
    for device in ("cpu", "cuda"):
        rc = _rc(device, place, policy, str(tmp_path), compress_cache=QUANTS[quant])
        stats = run_requests(rc, reqs, StopRule(), warmup=False)
        got[device] = {r.id: (r.token_ids, r.finish_reason) for r in stats.results}
    assert sorted(got["cuda"]) == [r.id for r in reqs]
    assert got["cuda"] == got["cpu"], (policy, place, quant)


@pytest.mark.parametrize("place", ["gpu", "weights on cpu"])
def test_4bit_weights_on_cuda_equal_cpu(tmp_path, place):
    prompts = [list(r.prompt_ids) for r in _requests()[:4]]
    outs = []
    for device in ("cpu", "cuda"):
        rc = _rc(device, place, "h2o", str(tmp_path), compress_weight=CompressionSpec(4, 32, 0),
                 weight_kernel="generic")
        with Engine(rc) as eng:
            outs.append(eng.generate(prompts, GEN))
    assert torch.equal(outs[0].tokens, outs[1].tokens)
    torch.testing.assert_close(outs[0].last_logits, outs[1].last_logits.cpu(), atol=1e-3, rtol=1e-3)
