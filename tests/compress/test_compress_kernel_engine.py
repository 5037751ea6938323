"""--compress-weight with weights grouped along the input dimension: decoder-block weights are stored in the int4
kernel's order (the same bytes), run by the kernel or expanded (the generic path). Generic: equal to transformers
built from the expanded weights (fp32, 1e-4); int4: equal to it within the kernel's bf16 rounding."""
from __future__ import annotations

import pytest
import torch

from conftest import hf_opt, ragged_prompts
from flexh2o.compress import CompressionSpec, stored_bytes, weight_spec
from flexh2o.compress.kernels import PackedWeight
from flexh2o.config import ModelConfig
from flexh2o.engine import Engine
from flexh2o.models import layer_specs
from flexh2o.placement import Percent
from flexh2o.run_config import RunConfig

pytest.importorskip("transformers")
TINY = ModelConfig("tiny", "opt", hidden=64, num_layers=3, num_heads=4, ffn=256, vocab=1000, max_positions=128)
SPEC = CompressionSpec(4, 64, 1)
GEN = 5
PLACEMENTS = {"gpu": [100, 0, 100, 0], "disk": [0, 0, 0, 0, 0, 0], "mixed": [30, 30, 30, 30, 30, 30]}

pytestmark = pytest.mark.usefixtures("one_thread")


def _rc(cfg, percent, offload_dir, mode, **kw) -> RunConfig:
    return RunConfig(model=cfg, percent=Percent.parse(percent), gpu_batch_size=2, num_gpu_batches=2, prompt_len=12,
                     gen_len=GEN, dtype=torch.float32, offload_dir=offload_dir, compress_weight=SPEC,
                     weight_kernel=mode, **kw)


@pytest.fixture(scope="module")
def opt_model(tmp_path_factory):
    with Engine(_rc(TINY, PLACEMENTS["gpu"], str(tmp_path_factory.mktemp("o")), "generic")) as eng:
        weights = {n: eng.weights.tensor(n, dtype=torch.float32).clone() for n in eng.weights.handles}
    return hf_opt(TINY, weights)


def _check(model, eng, prompts, mode):
    from test_llama import hf_step_logits
    gen = eng.generate(prompts, GEN, record_logits=True)
    got, want = torch.stack(gen.step_logits, 1), hf_step_logits(model, prompts, gen.tokens)
    if mode == "generic":
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    else:  # bf16 activations, scales and zeros: a few bf16 steps of the logits' scale
        scale = float(want.abs().max())
        torch.testing.assert_close(got, want, atol=scale * 2 ** -6, rtol=2 ** -6)
        assert (got - want).abs().max() > 1e-5  # the kernel really ran


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize("mode", ["generic", "int4"])
def test_opt_kernel_order_equals_transformers(opt_model, offload_dir, placement, mode):
    with Engine(_rc(TINY, PLACEMENTS[placement], offload_dir, mode, overlap=placement != "mixed")) as eng:
        assert eng.kernel == {"prefill": mode == "int4", "decode": mode == "int4"}
        blocks = {s.name for layer in layer_specs(TINY)[1:-1] for s in layer if len(s.shape) == 2}
        assert eng.weights.kernel_order == blocks  # every block matmul; tables of 1000 rows: the codec's order
        _check(opt_model, eng, ragged_prompts(4, 12, TINY.vocab, seed=1), mode)


def test_opt_tied_table_in_kernel_order(tmp_path, offload_dir):
    """A vocab of 1024 rows: the tied embedding is kept in the kernel's order too, looked up by rows and run by the
    kernel in the head."""
    cfg = ModelConfig("tiny1k", "opt", hidden=64, num_layers=2, num_heads=4, ffn=128, vocab=1024, max_positions=128)
    with Engine(_rc(cfg, PLACEMENTS["gpu"], str(tmp_path / "w"), "generic")) as eng:
        model = hf_opt(cfg, {n: eng.weights.tensor(n, dtype=torch.float32).clone() for n in eng.weights.handles})
    with Engine(_rc(cfg, PLACEMENTS["disk"], offload_dir, "int4")) as eng:
        assert "model.decoder.embed_tokens.weight" in eng.weights.kernel_order
        _check(model, eng, ragged_prompts(4, 12, cfg.vocab, seed=3), "int4")


def test_llama_int4_kernel_equals_transformers(offload_dir):
    from test_compress_weights import expanded_weights
    from test_llama import _configs, _hf_model
    hf_cfg, cfg = _configs(False)
    model = _hf_model(hf_cfg)
    with Engine(_rc(cfg, [100, 0, 100, 0], offload_dir, "generic", seed=4)) as eng:
        weights = expanded_weights(eng)
    for name, t in model.state_dict().items():  # names the engine lacks (rotary buffers) stay
        weights.setdefault(name, t)
    model.load_state_dict(weights, strict=True)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, cfg.vocab, (n,), generator=g).tolist() for n in (7, 12, 3, 10)]
    with Engine(_rc(cfg, [0, 0, 100, 0], offload_dir, "int4", seed=4)) as eng:
        _check(model, eng, prompts, "int4")


def test_kernel_order_keeps_the_bytes_and_the_kernel_gets_packed_weights(offload_dir):
    """The disk tier holds exactly tensor_bytes under the dim-1 spec; a decode load hands PackedWeights."""
    layers = layer_specs(TINY)
    unique = {s.name: s for layer in layers for s in layer}.values()
    with Engine(_rc(TINY, [0, 0, 100, 0], offload_dir, "int4")) as eng:
        assert eng.tiers["disk"].used == sum(stored_bytes(s.shape, torch.float32, weight_spec(s.shape, SPEC))
                                             for s in unique)
        tensors, _ = eng.weights.load_layer(1, torch.device("cpu"), torch.float32, "decode")
        assert isinstance(tensors["model.decoder.layers.0.fc1.weight"], PackedWeight)
        assert isinstance(tensors["model.decoder.layers.0.fc1.bias"], torch.Tensor)
        eng.weights.release(tensors)


def test_phases_choose_their_path(opt_model, offload_dir):
    """Generic prefill, int4 decode (what the probe picks on a CPU like this one): the prefill step's logits are the
    generic path's (1e-4), the decode steps' within the kernel's rounding; the run reports the split."""
    from test_llama import hf_step_logits
    prompts = ragged_prompts(4, 12, TINY.vocab, seed=1)
    with Engine(_rc(TINY, PLACEMENTS["disk"], offload_dir, "auto")) as eng:
        assert set(eng.kernel) == {"prefill", "decode"}
        eng.weights.forms = eng.forms.with_kernel({"decode"})
        gen = eng.generate(prompts, GEN, record_logits=True)
        assert set(eng.weights.seconds) == {"prefill", "decode"}
    got, want = torch.stack(gen.step_logits, 1), hf_step_logits(opt_model, prompts, gen.tokens)
    torch.testing.assert_close(got[:, 0], want[:, 0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[:, 1:], want[:, 1:], atol=float(want.abs().max()) * 2 ** -6, rtol=2 ** -6)
    assert (got[:, 1:] - want[:, 1:]).abs().max() > 1e-5


def test_eval_passes_weight_kernel():
    """flexh2o-eval reads --weight-kernel as flexh2o-run does and its engine runs follow it: int4 runs the kernel
    (within its rounding of the generic path on the same stored weights), off groups along dimension 0."""
    from dataclasses import replace

    from flexh2o.cli import eval as eval_cli
    from flexh2o.eval.common import EvalModel, forced_run
    prompts = ragged_prompts(2, 12, TINY.vocab, seed=4)
    targets = torch.randint(3, TINY.vocab, (2, GEN), generator=torch.Generator().manual_seed(5))
    models = {}
    for flag in ("int4", "off"):
        models[flag] = EvalModel("_DUMMY_", TINY, None, torch.float32)
        eval_cli.set_run_options(models[flag], eval_cli.build_parser().parse_args(
            ["ppl", "--compress-weight", "--weight-kernel", flag]))
    assert (models["int4"].weight_kernel, models["int4"].compress_weight.group_dim) == ("int4", 1)
    assert (models["off"].weight_kernel, models["off"].compress_weight.group_dim) == ("generic", 0)
    kernel = forced_run(models["int4"], "h2o", 6, prompts, targets).logprob
    generic = forced_run(replace(models["int4"], weight_kernel="generic"), "h2o", 6, prompts, targets).logprob
    assert 1e-6 < (kernel - generic).abs().max() < 0.05
