"""Llama family: the engine's logits and greedy tokens equal transformers' LlamaForCausalLM built from the same
weights (tiny random config with grouped KV heads, fp32), across weight/cache placements and overlap on/off,
with left-padded prompts of unequal length, tied and untied embeddings."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from flexh2o.config import ModelConfig  # noqa: E402
from flexh2o.engine import Engine  # noqa: E402
from flexh2o.kv.spec import KVSpec  # noqa: E402
from flexh2o.sampling import TeacherForcer  # noqa: E402
from flexh2o.placement import Percent  # noqa: E402
from flexh2o.run_config import RunConfig  # noqa: E402
from flexh2o.weights.format import CheckpointWriter  # noqa: E402

ATOL = 1e-4
GEN_LEN = 6
ROPE_THETA = 5000.0  # not the default, so a lost rope_theta would show
PROMPT_LENS = [7, 12, 3, 10]  # 2 GPU batches x 2 sequences, unequal: left padding inside each batch
PLACEMENTS = {  # name: --percent (weights gpu/cpu, cache gpu/cpu, activations gpu/cpu)
    "gpu": [100, 0, 100, 0, 100, 0],
    "cpu": [0, 100, 0, 100, 0, 100],
    "disk": [0, 0, 0, 0, 0, 0],
    "mixed": [30, 30, 30, 30, 50, 25],
    "w-disk-c-gpu": [0, 0, 100, 0, 100, 0],
    "w-gpu-c-disk": [100, 0, 0, 0, 100, 0],
}


pytestmark = pytest.mark.usefixtures("one_thread")


def _configs(tied: bool) -> tuple:
    hf = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA}, attn_implementation="eager",
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    ours = ModelConfig("tinyl-tied" if tied else "tinyl", "llama", hidden=64, num_layers=3, num_heads=4,
                       num_kv_heads=2, ffn=128, vocab=1000, max_positions=256, tie_embeddings=tied, norm_eps=1e-6,
                       rope_theta=ROPE_THETA, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return hf, ours


def _hf_model(hf_cfg) -> torch.nn.Module:
    """Random weights larger than the default init, so attention is peaked and logits are far from uniform."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def reference(request, tmp_path_factory) -> dict:
    """The HF model, a converted checkpoint of its weights, and its logits on prompts + the engine's own tokens."""
    hf_cfg, cfg = _configs(request.param)
    model = _hf_model(hf_cfg)
    ckpt = str(tmp_path_factory.mktemp("ckpt") / cfg.name)
    with CheckpointWriter(ckpt, cfg, "float32") as w:
        for name, t in model.state_dict().items():
            if name in w.specs:
                w.add(name, t)
            else:
                assert name == "lm_head.weight" and cfg.tie_embeddings, name
        w.finish()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, cfg.vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
    return {"model": model, "cfg": cfg, "ckpt": ckpt, "prompts": prompts}


def hf_step_logits(model, prompts: list, tokens: torch.Tensor) -> torch.Tensor:
    """Logits (n, gen_len, vocab) HF gives at each generation step, reading prompt + tokens[:, :-1] in one
    left-padded forward pass with an attention mask and matching position ids."""
    n, gen = tokens.shape
    t = max(len(p) for p in prompts)
    ids = torch.zeros(n, t + gen - 1, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, t - len(p):t] = torch.tensor(p)
        mask[i, t - len(p):] = 1
    ids[:, t:] = tokens[:, :-1]
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits  # (n, t + gen - 1, vocab)
    return out[:, t - 1:].float()


def _run(ref: dict, percent: list, overlap: bool, tmp_path, **kw):
    cfg, prompts = ref["cfg"], ref["prompts"]
    rc = RunConfig(model=cfg, percent=Percent.parse(percent), gpu_batch_size=2, num_gpu_batches=2,
                   prompt_len=max(PROMPT_LENS), gen_len=GEN_LEN, dtype=torch.float32, overlap=overlap, path=ref["ckpt"],
                   offload_dir=str(tmp_path), gpu_mem=64 << 20, cpu_mem=64 << 20, disk_mem=64 << 20, **kw)
    with Engine(rc) as eng:
        return eng.generate(prompts, GEN_LEN, record_logits=True, kept_stats=True)


def _check(ref: dict, gen) -> None:
    steps = torch.stack(gen.step_logits, 1)  # (n, gen_len, vocab)
    want = hf_step_logits(ref["model"], ref["prompts"], gen.tokens)
    assert steps.abs().max() > 1.0  # not a degenerate, near-uniform model
    torch.testing.assert_close(steps, want, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(gen.last_logits, want[:, -1], atol=ATOL, rtol=1e-4)
    assert torch.equal(gen.tokens, want.argmax(-1)), "greedy tokens differ from transformers"


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_logits_match_transformers(reference, placement, overlap, tmp_path):
    _check(reference, _run(reference, PLACEMENTS[placement], overlap, tmp_path))


def test_cpu_cache_compute_matches(reference, tmp_path):
    gen = _run(reference, [50, 50, 0, 100, 100, 0], True, tmp_path, cpu_cache_compute=True)
    _check(reference, gen)


def test_hf_greedy_generate_agrees(reference, tmp_path):
    """transformers' own generate() (left-padded batch, KV cache) picks the engine's greedy tokens."""
    gen = _run(reference, PLACEMENTS["mixed"], True, tmp_path)
    prompts, t = reference["prompts"], max(PROMPT_LENS)
    ids = torch.zeros(len(prompts), t, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, t - len(p):], mask[i, t - len(p):] = torch.tensor(p), 1
    with torch.no_grad():
        out = reference["model"].generate(input_ids=ids, attention_mask=mask, max_new_tokens=GEN_LEN,
                                          min_new_tokens=GEN_LEN, do_sample=False, pad_token_id=0)
    assert torch.equal(out[:, t:], gen.tokens)


@pytest.mark.parametrize("policy", ["h2o", "local", "streaming", "random"])
def test_budget_covering_everything_equals_full(reference, policy, tmp_path):
    """A budget that holds every token never evicts: each policy then gives transformers' logits too."""
    from flexh2o.kv.policies import Budget
    total = max(PROMPT_LENS) + GEN_LEN
    gen = _run(reference, PLACEMENTS["mixed"], True, tmp_path, kv=KVSpec(policy, Budget(total, total)))
    _check(reference, gen)


def test_eviction_changes_logits(reference, tmp_path):
    """Sanity check of the comparison itself: a small H2O budget must move the logits away from transformers'."""
    from flexh2o.kv.policies import Budget
    gen = _run(reference, PLACEMENTS["gpu"], True, tmp_path, kv=KVSpec("h2o", Budget(2, 2)))
    assert max(gen.kept.values()) <= 4
    want = hf_step_logits(reference["model"], reference["prompts"], gen.tokens)
    assert (torch.stack(gen.step_logits, 1) - want).abs().max() > 1e-2


@pytest.mark.parametrize("policy", ["full", "h2o"])
def test_teacher_forcing_sampler_equals_forced_logits(reference, policy, tmp_path):
    """flexh2o-eval scores logits in a sampler (no (steps, n, vocab) tensor kept): same numbers as forced +
    record_logits, with two GPU batches."""
    from flexh2o.eval.common import EvalModel, forced_run
    from flexh2o.kv.policies import Budget
    cfg, prompts = reference["cfg"], reference["prompts"]
    g = torch.Generator().manual_seed(3)
    targets = torch.randint(3, cfg.vocab, (len(prompts), GEN_LEN), generator=g)
    budget = Budget(2, 3) if policy == "h2o" else None
    rc = RunConfig(model=cfg, percent=Percent.parse(PLACEMENTS["gpu"]), gpu_batch_size=2, num_gpu_batches=2,
                   prompt_len=max(PROMPT_LENS), gen_len=GEN_LEN, dtype=torch.float32, path=reference["ckpt"],
                   kv=KVSpec(policy, budget), offload_dir=str(tmp_path))
    with Engine(rc) as eng:
        want = eng.generate(prompts, GEN_LEN, sampler=TeacherForcer(targets), record_logits=True)
    logp = torch.stack(want.step_logits, 1).double().log_softmax(-1).gather(-1, targets[..., None])[..., 0]
    model = EvalModel(reference["ckpt"], cfg, tokenizer=None, dtype=torch.float32)
    got = forced_run(model, policy, 5 if policy == "h2o" else None, prompts, targets, num_batches=2)
    assert isinstance(got, TeacherForcer) and got.calls == 2 * GEN_LEN
    torch.testing.assert_close(got.logprob, logp, atol=1e-5, rtol=1e-6)
    assert torch.equal(got.correct, torch.stack(want.step_logits, 1).argmax(-1) == targets)
