"""Refill (generation/refill.py): rows that finish take the next queued request inside the block schedule. Every
request's tokens equal the same request run alone through the plain engine (one row, no refill), for every KV
policy, with the cache in memory and on disk, plain and quantized; greedy and seeded sampling; and the refill run
takes fewer steps than FlexGen's fixed batches over the same requests."""
from __future__ import annotations

import pytest
import torch

from flexh2o.batch.run import run_requests
from flexh2o.batch.stopping import StopRule
from flexh2o.config import ModelConfig
from flexh2o.engine import Engine
from flexh2o.kv.layout import CacheQuant
from flexh2o.kv.policies import Budget
from flexh2o.kv.spec import KVSpec
from flexh2o.placement import Percent
from flexh2o.requests import Request
from flexh2o.run_config import RunConfig
from flexh2o.sampling import Sampler

TINY = ModelConfig("tiny-refill", "llama", hidden=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn=128, vocab=300,
                   max_positions=128, tie_embeddings=False)
BUDGETS = {"full": None, "h2o": Budget(3, 2), "random": Budget(3, 2), "local": Budget(0, 6),
           "streaming": Budget(0, 6), "tova": Budget(0, 5), "a2sf": Budget(3, 2), "mean_attn": Budget(3, 2),
           "vatp": Budget(4, 2), "h2o_sinks": Budget(4, 2), "mean_vnorm": Budget(4, 2), "pyramid": Budget(4, 2),
           "adakv": Budget(3, 2), "merge": Budget(3, 2)}
PLACES = {"memory": [100, 0, 100, 0], "disk": [100, 0, 0, 0]}
PROMPT, GEN = 9, 8


def _requests() -> list:
    g = torch.Generator().manual_seed(1)
    lens, gens = torch.randint(1, PROMPT + 1, (6,), generator=g), torch.randint(1, GEN + 1, (6,), generator=g)
    reqs = [Request(str(i), tuple(torch.randint(4, TINY.vocab, (int(n),), generator=g).tolist()), max_new_tokens=int(m))
            for i, (n, m) in enumerate(zip(lens, gens))]
    reqs[4] = Request("4", reqs[4].prompt_ids, max_new_tokens=GEN, temperature=0.9, seed=7)  # a sampled row
    return reqs


def _rc(policy: str, place: str, b: int, nb: int, offload_dir: str, quant=None) -> RunConfig:
    return RunConfig(model=TINY, percent=Percent.parse(PLACES[place]), gpu_batch_size=b, num_gpu_batches=nb,
                     prompt_len=PROMPT, gen_len=GEN, dtype=torch.float32, offload_dir=offload_dir,
                     kv=KVSpec(policy, BUDGETS[policy], num_sinks=2), compress_cache=quant)


def _alone(policy: str, reqs: list, offload_dir: str, quant=None) -> dict:
    """Each request alone: one row, the plain generate()."""
    with Engine(_rc(policy, "memory", 1, 1, offload_dir, quant)) as eng:
        return {r.id: eng.generate([list(r.prompt_ids)], r.max_new_tokens,
                                   Sampler(r.temperature, r.top_p, r.seed)).tokens[0].tolist() for r in reqs}


def _check(policy: str, offload_dir: str, quant=None, places=tuple(PLACES)) -> None:
    reqs = _requests()
    want = _alone(policy, reqs, offload_dir, quant)
    for place in places:
        rc = _rc(policy, place, 2, 2, offload_dir, quant)
        got = run_requests(rc, reqs, StopRule(), warmup=False)
        assert {r.id: r.token_ids for r in got.results} == want, (policy, place)
        if place == "memory" and policy == "full":
            fixed = run_requests(rc, reqs, StopRule(), warmup=False, refill=False)
            assert got.steps < fixed.steps and got.rounds == 1 < fixed.rounds  # rows were really refilled


@pytest.mark.parametrize("policy", sorted(BUDGETS))
def test_refill_equals_each_request_alone(policy, offload_dir):
    _check(policy, offload_dir)


@pytest.mark.parametrize("policy", ["full", "h2o"])
@pytest.mark.parametrize("keys", ["channel", "token"])
def test_refill_quantized_cache(policy, keys, offload_dir):
    _check(policy, offload_dir, CacheQuant(4, 16, keys), places=("disk",))
