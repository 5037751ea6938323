"""Each model family, from a tiny checkpoint transformers wrote (tests/family_models.py): flexh2o-convert's output
greedy-decodes 40/33-token left-padded prompts with transformers' own tokens and logits (fp32), with the weights
in memory and on disk; sliding windows shorter than the prompt (Mistral, Qwen2's upper layers, Gemma's local
layers) included. H2O on a windowed GQA family (Mistral) and on one with q/k norms (Qwen3) equals
tests/reference_kv.py; the cache of an all-windowed model holds min(window, context) slots."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import family_models as fm  # noqa: E402
import reference_kv as ref  # noqa: E402
from test_llama import hf_step_logits  # noqa: E402  (the one reference forward pass over prompt + tokens)
from flexh2o.engine import Engine  # noqa: E402
from flexh2o.kv.policies import Budget  # noqa: E402
from flexh2o.kv.spec import KVSpec  # noqa: E402
from flexh2o.placement import Percent  # noqa: E402
from flexh2o.run_config import RunConfig  # noqa: E402
from flexh2o.weights.convert import convert  # noqa: E402

LENS = [40, 33]
GEN = 8
PLACES = {"memory": [100, 0, 100, 0, 100, 0], "weights-on-disk": [0, 0, 100, 0, 100, 0]}
ATOL = RTOL = 1e-4

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(2)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in LENS]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """name -> (transformers model, converted checkpoint path, ModelConfig), built once per name."""
    cache = {}

    def get(name: str):
        if name not in cache:
            model = fm.hf_model(name)
            root = tmp_path_factory.mktemp(name)
            src = fm.save(model, str(root / "hf"))
            result = convert(src, str(root / "ckpt"), dtype="float32")
            cache[name] = (model, str(root / "ckpt"), result.config)
        return cache[name]
    return get


def _generate(cfg, ckpt: str, prompts: list, percent: list, tmp_path, kv: KVSpec = KVSpec()):
    rc = RunConfig(model=cfg, percent=Percent.parse(percent), gpu_batch_size=2, num_gpu_batches=1,
                   prompt_len=max(LENS), gen_len=GEN, dtype=torch.float32, path=ckpt, kv=kv,
                   offload_dir=str(tmp_path))
    with Engine(rc) as eng:
        return eng.generate(prompts, GEN, record_logits=True, kept_stats=True)


@pytest.mark.parametrize("place", list(PLACES))
@pytest.mark.parametrize("name", list(fm.hf_configs()))
def test_greedy_tokens_equal_transformers(name, place, family, prompts, tmp_path):
    model, ckpt, cfg = family(name)
    gen = _generate(cfg, ckpt, prompts, PLACES[place], tmp_path)
    want = hf_step_logits(model, prompts, gen.tokens)
    steps = torch.stack(gen.step_logits, 1)
    assert steps.abs().max() > 1.0  # not a degenerate model
    torch.testing.assert_close(steps, want, atol=ATOL, rtol=RTOL)
    assert torch.equal(gen.tokens, want.argmax(-1)), "greedy tokens differ from transformers"


def test_what_conversion_read(family):
    """The facts each family adds reached the ModelConfig (a lost one would still have to fail the logits)."""
    got = {name: family(name)[2] for name in ("llama3", "mistral", "qwen2", "qwen2-window", "qwen3", "gemma2",
                                              "gemma3")}
    assert (got["llama3"].rope_type, got["llama3"].rope_factor, got["llama3"].rope_original_max) == ("llama3", 8, 64)
    assert got["mistral"].family == "mistral" and [got["mistral"].window(i) for i in range(3)] == [fm.WINDOW] * 3
    assert got["qwen2"].attn_bias and got["qwen2"].window(0) is None
    assert [got["qwen2-window"].window(i) for i in range(3)] == [None, fm.WINDOW, fm.WINDOW]
    assert got["qwen3"].qk_norm and got["qwen3"].head_dim == 32
    g2, g3 = got["gemma2"], got["gemma3"]
    assert [g2.window(i) for i in range(3)] == [fm.WINDOW, None, fm.WINDOW]
    assert (g2.attn_softcap, g2.final_softcap, g2.query_scalar) == (4.0, 8.0, 24.0)
    assert g3.qk_norm and g3.local_rope_theta == 3000.0 and (g3.rope_type, g3.rope_theta) == ("linear", 50000.0)


def test_window_changes_the_tokens(family, prompts, tmp_path):
    """Sanity check of the comparison: the Mistral checkpoint run without its window gives other logits."""
    from dataclasses import replace
    model, ckpt, cfg = family("mistral")
    gen = _generate(replace(cfg, sliding_window=None), ckpt, prompts, PLACES["memory"], tmp_path)
    want = hf_step_logits(model, prompts, gen.tokens)
    assert (torch.stack(gen.step_logits, 1) - want).abs().max() > 1e-2


def test_window_caps_the_cache(family):
    """An all-windowed model's cache holds min(window, context) slots, and min(budget + 1, window) under a
    policy; a model with full layers (Gemma) holds the policy's."""
    cfg = family("mistral")[2]
    full = RunConfig(model=cfg, percent=Percent.parse(PLACES["memory"]), gpu_batch_size=2, prompt_len=40, gen_len=8)
    assert full.cache_slots() == fm.WINDOW
    assert full.with_(kv=KVSpec("h2o", Budget(3, 3))).cache_slots() == 7
    assert full.with_(prompt_len=8, gen_len=4).cache_slots() == 12
    gemma = family("gemma2")[2]
    assert RunConfig(model=gemma, percent=Percent.parse(PLACES["memory"]), gpu_batch_size=2, prompt_len=40,
                     gen_len=8).cache_slots() == 48


def _ref_weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name, budget", [("mistral", Budget(5, 3)), ("mistral", Budget(10, 10)),
                                          ("qwen3", Budget(5, 3)), ("qwen2-window", Budget(4, 4))],
                         ids=["mistral-8", "mistral-20", "qwen3-8", "qwen2-window-8"])
def test_h2o_equals_reference(name, budget, family, prompts, tmp_path):
    """Greedy H2O: the engine's tokens, logits of every step and kept counts equal the keep-mask reference,
    whose sliding window drops what the next query cannot see before the policy chooses."""
    model, ckpt, cfg = family(name)
    gen = _generate(cfg, ckpt, prompts, PLACES["weights-on-disk"], tmp_path, KVSpec("h2o", budget))
    policy = ref.RefPolicy("h2o", budget.heavy, budget.recent)
    w = _ref_weights(model)
    refs = [ref.generate(cfg, w, p, GEN, policy) for p in prompts]
    for i, r in enumerate(refs):
        assert gen.tokens[i].tolist() == r.tokens, f"sequence {i}: tokens differ"
        for step in range(GEN):
            torch.testing.assert_close(gen.step_logits[step][i], r.step_logits[step], atol=ATOL, rtol=RTOL)
    for layer, n in gen.kept.items():
        assert n == max(len(kept) for r in refs for kept in r.kept[layer]), f"layer {layer} kept count"


@pytest.mark.parametrize("name", ["mistral", "qwen3"])
def test_reference_full_equals_transformers(name, family, prompts):
    """The reference itself (policy full, its window) gives transformers' logits on an unpadded prompt."""
    model, _, cfg = family(name)
    r = ref.generate(cfg, _ref_weights(model), prompts[0], 4, ref.RefPolicy("full"))
    want = hf_step_logits(model, prompts[:1], torch.tensor([r.tokens]))[0]
    torch.testing.assert_close(torch.stack(r.step_logits), want, atol=ATOL, rtol=RTOL)
