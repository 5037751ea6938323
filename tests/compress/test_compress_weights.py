"""--compress-weight: weights live compressed in their home tier (gpu, cpu, disk), move compressed and are expanded
on the compute side. The engine equals transformers' OPT and Llama built from the expanded weights, on every
placement, overlap on and off; the tiers hold and move the compressed bytes."""
from __future__ import annotations

import pytest
import torch

from conftest import hf_greedy, hf_opt, ragged_prompts
from flexh2o.compress import CompressionSpec, stored_bytes
from flexh2o.config import ModelConfig
from flexh2o.engine import Engine
from flexh2o.models import layer_specs
from flexh2o.placement import Percent
from flexh2o.run_config import RunConfig

TINY = ModelConfig("tiny", "opt", hidden=64, num_layers=3, num_heads=4, ffn=256, vocab=1000, max_positions=128)
PLACEMENTS = {"gpu": [100, 0, 100, 0], "cpu": [0, 100, 0, 100], "disk": [0, 0, 0, 0, 0, 0],
              "mixed": [30, 30, 30, 30, 30, 30]}
SPEC = CompressionSpec(4, 64)
GEN = 5

pytestmark = pytest.mark.usefixtures("one_thread")


def _rc(cfg, percent, offload_dir, spec=SPEC, **kw) -> RunConfig:
    return RunConfig(model=cfg, percent=Percent.parse(percent), gpu_batch_size=kw.pop("gbs", 2),
                     num_gpu_batches=kw.pop("nb", 2),
                     prompt_len=12, gen_len=GEN, dtype=torch.float32, offload_dir=offload_dir,
                     compress_weight=spec, **kw)


def expanded_weights(eng) -> dict:
    """The weights as the compute side sees them (dequantized), HF state-dict names -> fp32 tensors."""
    return {name: eng.weights.tensor(name, dtype=torch.float32).clone() for name in eng.weights.handles}


@pytest.fixture(scope="module")
def opt_ref(tmp_path_factory):
    prompts = ragged_prompts(4, 12, TINY.vocab, seed=1)
    with Engine(_rc(TINY, PLACEMENTS["gpu"], str(tmp_path_factory.mktemp("o")))) as eng:
        weights = expanded_weights(eng)
    model = hf_opt(TINY, weights)
    return prompts, [hf_greedy(model, p, GEN) for p in prompts], weights


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_opt_equals_transformers_on_expanded_weights(opt_ref, offload_dir, placement, overlap):
    prompts, ref, _ = opt_ref
    with Engine(_rc(TINY, PLACEMENTS[placement], offload_dir, overlap=overlap)) as eng:
        gen = eng.generate(prompts, GEN)
    for i, (tokens, logits) in enumerate(ref):
        assert gen.tokens[i].tolist() == tokens, f"sequence {i}"
        torch.testing.assert_close(gen.last_logits[i], logits, atol=1e-4, rtol=1e-4)


def test_expanded_weights_are_quantized_and_seeded(opt_ref, offload_dir):
    """The reference really is the quantized model: 2-D weights differ from the plain ones by at most half a step
    and sit on at most 16 levels per group; 1-D weights are untouched."""
    _, _, packed = opt_ref
    with Engine(_rc(TINY, PLACEMENTS["disk"], offload_dir, spec=None)) as eng:
        plain = expanded_weights(eng)
    name = "model.decoder.layers.1.fc1.weight"  # (256, 64): 4 groups of 64 rows per column
    diff = (packed[name] - plain[name]).abs()
    assert 0 < diff.max() < 0.02
    for group in packed[name].split(64, 0):
        assert all(len(group[:, c].unique()) <= 16 for c in range(group.shape[1]))
    bias = "model.decoder.layers.1.fc1.bias"
    assert torch.equal(packed[bias], plain[bias])


@pytest.mark.parametrize("bits", [4, 8])
def test_tiers_hold_and_move_compressed_bytes(offload_dir, bits):
    """Every weight on disk: the disk tier holds the compressed bytes and each step reads each layer's compressed
    tensors once (the tied embedding twice: embedding and head)."""
    spec = CompressionSpec(bits, 64)

    def size(s, sp):
        return stored_bytes(s.shape, torch.float32, sp if len(s.shape) > 1 else None)
    layers = layer_specs(TINY)
    unique = {s.name: s for layer in layers for s in layer}.values()
    for sp in (spec, None):
        with Engine(_rc(TINY, [0, 0, 100, 0], offload_dir, spec=sp)) as eng:
            assert eng.tiers["disk"].used == sum(size(s, sp) for s in unique)
            eng.generate(ragged_prompts(4, 12, TINY.vocab), GEN)
            assert eng.tiers["disk"].bytes_loaded == GEN * sum(size(s, sp) for layer in layers for s in layer)
    ratio = sum(size(s, spec) for s in unique) / sum(size(s, None) for s in unique)
    assert ratio < (0.18 if bits == 4 else 0.30)  # fp32 storage: 4 (8) bits + two fp32 per 64 values; 1-D plain


@pytest.mark.parametrize("spec", [SPEC, CompressionSpec(4, 64, 1)], ids=["codec-order", "kernel-order"])
def test_disk_files_written_by_a_run_read_back_identically(offload_dir, spec):
    """The compressed files one run writes to its disk tier (data and meta of every weight, a cache block's K)
    read back byte for byte: the same tensors as the same run homed in memory holds."""
    from flexh2o.compress import quantize
    from flexh2o.compress.tier import CompressedTier
    stored = {}
    for where, percent in (("disk", [0, 0, 0, 0]), ("gpu", [100, 0, 100, 0])):
        with Engine(_rc(TINY, percent, offload_dir, spec=spec)) as eng:
            w = eng.weights
            stored[where] = {n: w.tiers[n].load_compressed(h, torch.device("cpu")) for n, h in w.handles.items()
                             if isinstance(w.tiers[n], CompressedTier)}
            if where == "disk":
                k = torch.randn(2, 4, 9, 16, generator=torch.Generator().manual_seed(3))
                tier = CompressedTier(eng.tiers["disk"], CompressionSpec(4, 16, -1))
                h = tier.alloc(tuple(k.shape), torch.float32)
                tier.store(h, k)
                back, want = tier.load_compressed(h, torch.device("cpu")), quantize(k, tier.spec, torch.float32)
                assert torch.equal(back.data, want.data) and torch.equal(back.meta, want.meta)
                tier.free(h)
    assert stored["disk"].keys() == stored["gpu"].keys() and len(stored["disk"]) > 0
    for n, ct in stored["disk"].items():
        assert torch.equal(ct.data, stored["gpu"][n].data) and torch.equal(ct.meta, stored["gpu"][n].meta), n


# ---- Llama ------------------------------------------------------------------------------------------------------
transformers = pytest.importorskip("transformers")
LLAMA_PLACEMENTS = dict(PLACEMENTS, **{"w-disk-c-gpu": [0, 0, 100, 0, 100, 0], "w-gpu-c-disk": [100, 0, 0, 0, 100, 0]})


@pytest.fixture(scope="module")
def llama_ref(tmp_path_factory):
    """A converted tiny grouped-KV Llama checkpoint; the HF model loaded with the engine's expanded weights."""
    from flexh2o.weights.format import CheckpointWriter
    from test_llama import _configs, _hf_model
    hf_cfg, cfg = _configs(False)
    model = _hf_model(hf_cfg)
    ckpt = str(tmp_path_factory.mktemp("ckpt") / cfg.name)
    with CheckpointWriter(ckpt, cfg, "float32") as w:
        for name, t in model.state_dict().items():
            w.add(name, t)
        w.finish()
    rc = _rc(cfg, PLACEMENTS["gpu"], str(tmp_path_factory.mktemp("l")), path=ckpt)
    with Engine(rc) as eng:
        weights = expanded_weights(eng)
    before = model.state_dict()["model.layers.0.mlp.up_proj.weight"].clone()
    model.load_state_dict(weights, strict=True)
    assert 0 < (model.state_dict()["model.layers.0.mlp.up_proj.weight"] - before).abs().max() < 0.2
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, cfg.vocab, (n,), generator=g).tolist() for n in (7, 12, 3, 10)]
    return {"model": model, "cfg": cfg, "ckpt": ckpt, "prompts": prompts}


@pytest.mark.parametrize("placement", sorted(LLAMA_PLACEMENTS))
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_llama_equals_transformers_on_expanded_weights(llama_ref, offload_dir, placement, overlap):
    from test_llama import hf_step_logits
    rc = _rc(llama_ref["cfg"], LLAMA_PLACEMENTS[placement], offload_dir, path=llama_ref["ckpt"], overlap=overlap)
    with Engine(rc) as eng:
        gen = eng.generate(llama_ref["prompts"], GEN, record_logits=True)
    want = hf_step_logits(llama_ref["model"], llama_ref["prompts"], gen.tokens)
    torch.testing.assert_close(torch.stack(gen.step_logits, 1), want, atol=1e-4, rtol=1e-4)
    assert torch.equal(gen.tokens, want.argmax(-1))


def test_eval_takes_the_compression_flags(llama_ref):
    """flexh2o-eval ppl/recall: --compress-weight/--compress-cache reach the engine runs of forced_run."""
    from flexh2o.cli import eval as eval_cli
    from flexh2o.cli.compress_flags import compression_specs
    from flexh2o.eval.common import EvalModel, forced_run
    args = eval_cli.build_parser().parse_args(["ppl", "--compress-weight", "--compress-cache", "--compress-bits", "8"])
    w, c = compression_specs(args)
    assert (w.bits, w.group_dim, c.bits, c.group_dim) == (8, 0, 8, -1)
    assert compression_specs(eval_cli.build_parser().parse_args(["recall"])) == (None, None)
    cfg, prompts = llama_ref["cfg"], llama_ref["prompts"]
    targets = torch.randint(3, cfg.vocab, (len(prompts), GEN), generator=torch.Generator().manual_seed(3))
    runs = {}
    for name, specs in (("plain", (None, None)), ("packed", (SPEC, CompressionSpec(4, 16, -1)))):
        model = EvalModel(llama_ref["ckpt"], cfg, None, torch.float32, compress_weight=specs[0],
                          compress_cache=specs[1])
        runs[name] = forced_run(model, "h2o", 6, prompts, targets).logprob
    assert (runs["plain"] - runs["packed"]).abs().max() > 1e-3  # the specs really reached the engine
