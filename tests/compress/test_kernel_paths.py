"""Every path a weight in the int4 kernel's order can take, forced (no probe of this machine decides): the kernel in
both phases, in one phase, in neither; compute in fp32, in bf16, or bf16 decode steps straight from bf16 storage;
the AVX-512 row order (blocks of 64) on the generic path. Each model's special layers go through it: OPT-350m's
project_in / project_out and post-LayerNorm (the last position `x[:, -1:]` reaches project_out as a strided
view), OPT's pre-LN blocks with a tied table of kernel shape, and Llama (GQA, RMSNorm, SwiGLU).

References: transformers built from the engine's own expanded weights (fp32), teacher-forced on the engine's
tokens; and, for the same stored weights and the same forced tokens, the kernel's logits against the generic
path's, which must agree within the kernel's bf16 rounding."""
from __future__ import annotations

import pytest
import torch

from conftest import hf_opt, ragged_prompts
from flexh2o.compress import CompressionSpec
from flexh2o.compress import int4_order, kernels
from flexh2o.config import ModelConfig
from flexh2o.engine import Engine
from flexh2o.placement import Percent
from flexh2o.run_config import RunConfig
from flexh2o.sampling import TeacherForcer

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

SPEC = CompressionSpec(4, 64, 1)
GEN, PROMPT = 4, 10
MODELS = {  # vocab 1024: the tied table is of kernel shape too (the head runs the kernel)
    "opt-pre-ln": ModelConfig("k-opt", "opt", hidden=64, num_layers=2, num_heads=4, ffn=128, vocab=1024,
                              max_positions=64),
    "opt-350m": ModelConfig("k-opt350", "opt", hidden=128, num_layers=2, num_heads=4, ffn=256, vocab=1024,
                            max_positions=64, word_embed_dim=64, norm_before=False),
    "llama": ModelConfig("k-llama", "llama", hidden=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn=128,
                         vocab=1024, max_positions=64, tie_embeddings=False, pad_token_id=0, bos_token_id=1),
}
DTYPES = {  # (storage, compute, decode compute)
    "fp32": (torch.float32, torch.float32, None),
    "bf16": (torch.bfloat16, torch.bfloat16, None),
    "bf16-decode-direct": (torch.bfloat16, torch.float32, torch.bfloat16),
}
KERNEL = {"int4": (True, True), "generic": (False, False), "prefill-only": (True, False),
          "decode-only": (False, True)}


def _rc(cfg, storage, compute, decode, offload_dir, mode="auto") -> RunConfig:
    return RunConfig(model=cfg, percent=Percent.parse([50, 50, 100, 0]), gpu_batch_size=2, num_gpu_batches=2,
                     prompt_len=PROMPT, gen_len=GEN, dtype=storage, compute_dtype=compute, decode_dtype=decode,
                     offload_dir=offload_dir, compress_weight=SPEC, weight_kernel=mode, seed=3)


def _engine(monkeypatch, cfg, dtypes, kernel: tuple, offload_dir) -> Engine:
    """An engine whose phases run the kernel as `kernel` (prefill, decode) says, forced."""
    forced = {"prefill": kernel[0], "decode": kernel[1]}
    monkeypatch.setattr("flexh2o.planning.weight_forms.kernel_phases", lambda *a, **k: dict(forced))
    eng = Engine(_rc(cfg, *dtypes, offload_dir))
    assert eng.kernel == forced
    specs = {s.name for layer in eng.rc.placement.weights.layer_specs for s in layer}
    assert {n for n in specs if "project_" in n} <= eng.weights.kernel_order  # opt-350m's projections included
    return eng


def _reference(cfg, weights: dict):
    if cfg.family == "opt":
        return hf_opt(cfg, weights)
    import transformers
    hc = transformers.LlamaConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.ffn, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.max_positions,
        rms_norm_eps=cfg.norm_eps, tie_word_embeddings=False, attn_implementation="eager",
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        pad_token_id=cfg.pad_token_id, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id)
    model = transformers.LlamaForCausalLM(hc).eval()
    sd = dict(model.state_dict())
    sd.update(weights)
    model.load_state_dict(sd, strict=True)
    return model.float()


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """(model name, storage dtype) -> transformers with that run's expanded stored weights, built once."""
    built = {}

    def get(name, storage):
        if (name, storage) not in built:
            rc = _rc(MODELS[name], storage, torch.float32, None, str(tmp_path_factory.mktemp("ref")), "generic")
            with Engine(rc) as eng:
                w = {n: eng.weights.tensor(n, dtype=torch.float32).clone() for n in eng.weights.handles}
            built[(name, storage)] = _reference(MODELS[name], w)
        return built[(name, storage)]
    return get


def _logits(eng, prompts, targets) -> torch.Tensor:
    gen = eng.generate(prompts, GEN, sampler=TeacherForcer(targets), record_logits=True)
    assert torch.equal(gen.tokens, targets)
    return torch.stack(gen.step_logits, 1)  # (n, gen, vocab)


def _bound(want: torch.Tensor, dtypes, kernel) -> float:
    """Allowed max difference from fp32 transformers: fp32's rounding on the all-fp32 generic path; else a few
    bf16 steps (2^-8 relative) of the logits' scale, accumulated over the layers."""
    if dtypes[1] == torch.float32 and dtypes[2] is None and not any(kernel):
        return 1e-4
    return float(want.abs().max()) * 2 ** -4


def _needs_kernel(kernel):
    if any(kernel) and not kernels.kernel_available("cpu"):
        pytest.skip("this torch has no CPU int4 kernel in an order flexh2o writes")


@pytest.mark.parametrize("kernel", sorted(KERNEL))
@pytest.mark.parametrize("dtypes", sorted(DTYPES))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_kernel_path_equals_transformers(monkeypatch, references, offload_dir, name, dtypes, kernel):
    from test_llama import hf_step_logits
    kernel, dt = KERNEL[kernel], DTYPES[dtypes]
    _needs_kernel(kernel)
    cfg = MODELS[name]
    prompts = ragged_prompts(4, PROMPT, cfg.vocab, seed=5)
    targets = torch.randint(4, cfg.vocab, (4, GEN), generator=torch.Generator().manual_seed(6))
    with _engine(monkeypatch, cfg, dt, kernel, offload_dir) as eng:
        got = _logits(eng, prompts, targets)
    want = hf_step_logits(references(name, dt[0]), prompts, targets)
    torch.testing.assert_close(got, want, atol=_bound(want, dt, kernel), rtol=0)


@pytest.mark.parametrize("dtypes", sorted(DTYPES))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_kernel_on_and_off_agree_within_bf16_rounding(monkeypatch, tmp_path, name, dtypes):
    """The same stored weights and forced tokens, the kernel in both phases against neither: the kernel's bf16
    activations, scales and zeros are its only difference (a few bf16 steps of the logits' scale), and it ran."""
    _needs_kernel((True,))
    cfg, dt = MODELS[name], DTYPES[dtypes]
    prompts = ragged_prompts(4, PROMPT, cfg.vocab, seed=7)
    targets = torch.randint(4, cfg.vocab, (4, GEN), generator=torch.Generator().manual_seed(8))
    got = {}
    for mode in ("int4", "generic"):
        with _engine(monkeypatch, cfg, dt, KERNEL[mode], str(tmp_path / mode)) as eng:
            got[mode] = _logits(eng, prompts, targets)
    scale = float(got["generic"].abs().max())
    torch.testing.assert_close(got["int4"], got["generic"], atol=scale * 2 ** -5, rtol=0)
    assert (got["int4"] - got["generic"]).abs().max() > 0


@pytest.mark.parametrize("name", sorted(MODELS))
def test_avx512_row_order_on_the_generic_path(monkeypatch, references, offload_dir, name):
    """Blocks of 64 rows (torch's order on AVX-512) forced on any CPU: stored, expanded and looked up in that order,
    the generic path equals transformers (fp32). The kernel itself reads only its CPU's order (CI also runs these
    tests under ATEN_CPU_CAPABILITY=avx2)."""
    from test_llama import hf_step_logits
    monkeypatch.setattr(int4_order, "torch_order", lambda: int4_order.RowOrder(64))
    assert kernels.row_block() == 64
    cfg = MODELS[name]
    prompts = ragged_prompts(4, PROMPT, cfg.vocab, seed=9)
    targets = torch.randint(4, cfg.vocab, (4, GEN), generator=torch.Generator().manual_seed(10))
    with _engine(monkeypatch, cfg, DTYPES["fp32"], KERNEL["generic"], offload_dir) as eng:
        got = _logits(eng, prompts, targets)
    want = hf_step_logits(references(name, torch.float32), prompts, targets)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
