"""A refilled row's prefill where prefill and decode steps take different weight forms (generation/refill.py's
_prefill_form): bf16 storage decoded in bf16 while prefill computes in fp32 (RunConfig.compute_at), and 4-bit
weights whose decode runs the int4 kernel while prefill expands them (Engine.kernel). Each request's tokens equal
the same request run alone, whose prompt the plain engine prefills in the prefill form."""
from __future__ import annotations

import pytest
import torch

from flexh2o.planning import weight_forms
from flexh2o.batch.run import run_requests
from flexh2o.batch.stopping import StopRule
from flexh2o.compress import CompressionSpec
from flexh2o.config import ModelConfig
from flexh2o.engine import Engine
from flexh2o.kv.policies import Budget
from flexh2o.kv.spec import KVSpec
from flexh2o.placement import Percent
from flexh2o.requests import Request
from flexh2o.run_config import RunConfig

TINY = ModelConfig("tiny-forms", "llama", hidden=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn=128, vocab=256,
                   max_positions=128, tie_embeddings=False)
PROMPT, GEN = 12, 10
F32, BF16 = torch.float32, torch.bfloat16
FORMS = {"bf16-decode": dict(dtype=BF16, compute_dtype=F32, decode_dtype=BF16),
         "int4-decode": dict(dtype=F32, compress_weight=CompressionSpec(4, 64, 1))}
BUDGETS = {"full": None, "h2o": Budget(3, 3)}

pytestmark = pytest.mark.usefixtures("one_thread")


def _requests() -> list:
    g = torch.Generator().manual_seed(11)
    lens, gens = torch.randint(2, PROMPT + 1, (10,), generator=g), torch.randint(1, GEN + 1, (10,), generator=g)
    return [Request(str(i), tuple(torch.randint(4, TINY.vocab, (int(n),), generator=g).tolist()), max_new_tokens=int(m))
            for i, (n, m) in enumerate(zip(lens, gens))]


def _rc(form: str, policy: str, b: int, nb: int, offload_dir: str) -> RunConfig:
    return RunConfig(model=TINY, percent=Percent.parse([100, 0, 100, 0]), gpu_batch_size=b, num_gpu_batches=nb,
                     prompt_len=PROMPT, gen_len=GEN, offload_dir=offload_dir, kv=KVSpec(policy, BUDGETS[policy]),
                     **FORMS[form])


@pytest.fixture
def int4_decode_only(monkeypatch):
    """Decode runs the int4 kernel, prefill the expanded weights (what --weight-kernel auto picks where the
    kernel pays only at decode's few rows)."""
    monkeypatch.setattr(weight_forms, "kernel_phases", lambda *a, **k: {"prefill": False, "decode": True})


@pytest.mark.parametrize("policy", sorted(BUDGETS))
@pytest.mark.parametrize("form", sorted(FORMS))
def test_refilled_rows_prefill_in_the_prefill_form(form, policy, offload_dir, request):
    if form == "int4-decode":
        request.getfixturevalue("int4_decode_only")
    reqs = _requests()
    with Engine(_rc(form, policy, 1, 1, offload_dir)) as eng:
        assert eng.rc.compute_at(0) != eng.rc.compute_at(1) or eng.kernel["prefill"] != eng.kernel["decode"]
        want = {r.id: eng.generate([list(r.prompt_ids)], r.max_new_tokens).tokens[0].tolist() for r in reqs}
    got = run_requests(_rc(form, policy, 2, 2, offload_dir), reqs, StopRule(), warmup=False)
    assert got.rounds == 1 and {r.id: r.token_ids for r in got.results} == want
