"""A model family is its module and one entry in models.FAMILY_MODULES: a toy family declared the way a new one
would be (Llama's compute, Qwen2's q/k/v biases as a declared fact, its own model_type and GGUF architecture) is
read from a config.json and a GGUF's metadata, names its GGUF tensors, passes RunConfig and runs; out of the table,
each of those refuses it, and a converted checkpoint naming it reads as corrupt."""
from __future__ import annotations

import dataclasses
import json
from types import ModuleType

import pytest
import torch

from flexh2o import models
from flexh2o.config import ModelConfig
from flexh2o.engine import Engine
from flexh2o.models import Family, llama
from flexh2o.placement import Percent
from flexh2o.run_config import RunConfig
from flexh2o.weights.format import CheckpointReader, CheckpointWriter
from flexh2o.weights.gguf_arch import gguf_config, hf_name
from flexh2o.weights.hf_config import from_hf_config

LLAMA_JSON = {"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": True, "rope_theta": 5000.0, "max_position_embeddings": 128}
GGUF_KEYS = {"context_length": 128, "embedding_length": 64, "block_count": 2, "feed_forward_length": 128,
             "vocab_size": 300, "attention.head_count": 4, "attention.head_count_kv": 2,
             "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 5000.0}


def _toy() -> ModuleType:
    """A family module as a new family would write it: its compute (Llama's) and its FAMILIES declaration."""
    toy = ModuleType("toy")
    toy.layer_specs, toy.embed, toy.block, toy.head = llama.layer_specs, llama.embed, llama.block, llama.head
    toy.FAMILIES = (Family("toyqwen", hf_model_types=("toyqwen",), hf_fields=llama.HF_FIELDS,
                           facts={"attn_bias": True}, gguf_arch="toyarch", gguf_tensors={"attn_fused": "self_attn.x"}),)
    return toy


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setattr(models, "FAMILY_MODULES", models.FAMILY_MODULES + (_toy(),))


def _gguf(arch: str) -> dict:
    return {"general.architecture": arch, **{f"{arch}.{k}": v for k, v in GGUF_KEYS.items()}}


def test_the_table_names_every_family_once():
    names = models.family_names()
    assert names == ("opt", "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
    types = [t for f in models.families() for t in f.hf_model_types]
    archs = [f.gguf_arch for f in models.families() if f.gguf_arch]
    assert len(set(types)) == len(types) and len(set(archs)) == len(archs)


def test_a_registered_family_is_read_from_its_checkpoints(registered):
    got = from_hf_config({**LLAMA_JSON, "model_type": "toyqwen"}, "t")
    assert got == dataclasses.replace(from_hf_config(LLAMA_JSON, "t"), family="toyqwen", attn_bias=True)
    tensors = {"token_embd.weight": (300, 64)}
    assert gguf_config("t.gguf", _gguf("toyarch"), tensors) == dataclasses.replace(
        gguf_config("t.gguf", _gguf("qwen2"), tensors), family="toyqwen")
    assert hf_name("toyarch", "blk.1.attn_fused.weight") == "model.layers.1.self_attn.x.weight"
    assert hf_name("toyarch", "blk.1.attn_q.weight") == "model.layers.1.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match="toyarch.attention.sliding_window"):  # a key it does not declare
        gguf_config("t.gguf", {**_gguf("toyarch"), "toyarch.attention.sliding_window": 8}, tensors)


def _tokens(cfg: ModelConfig, tmp_path) -> torch.Tensor:
    rc = RunConfig(model=cfg, percent=Percent.parse([100, 0, 100, 0, 100, 0]), gpu_batch_size=2, num_gpu_batches=1,
                   prompt_len=5, gen_len=4, dtype=torch.float32, offload_dir=str(tmp_path),
                   gpu_mem=64 << 20, cpu_mem=64 << 20, disk_mem=64 << 20)
    with Engine(rc) as eng:
        return eng.generate([[5, 6, 7, 8, 9], [10, 11, 12]], 4).tokens


def test_a_registered_family_runs_as_its_declaration_says(registered, tmp_path):
    """The toy family computes with Llama's module and Qwen2's biases: the same seeded weights (named alike), the
    same tokens as qwen2."""
    toy = from_hf_config({**LLAMA_JSON, "model_type": "toyqwen"}, "t")
    assert torch.equal(_tokens(toy, tmp_path), _tokens(dataclasses.replace(toy, family="qwen2"), tmp_path))


def test_a_family_out_of_the_table_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unsupported model_type 'toyqwen'"):
        from_hf_config({**LLAMA_JSON, "model_type": "toyqwen"})
    with pytest.raises(ValueError, match="GGUF architecture 'toyarch' is not supported"):
        gguf_config("t.gguf", _gguf("toyarch"), {"token_embd.weight": (300, 64)})
    cfg = dataclasses.replace(from_hf_config(LLAMA_JSON), family="toyqwen")
    with pytest.raises(ValueError, match="unknown model family 'toyqwen': use one of opt, llama, mistral"):
        RunConfig(model=cfg, prompt_len=4, gen_len=2, offload_dir=str(tmp_path))


def test_a_checkpoint_naming_no_declared_family_is_corrupt(tmp_path):
    cfg = ModelConfig("t", "opt", hidden=16, num_layers=1, num_heads=2, ffn=32, vocab=64, max_positions=32)
    with CheckpointWriter(str(tmp_path / "ck"), cfg, "float32") as w:
        for name, spec in w.specs.items():
            w.add(name, torch.zeros(spec.shape))
        w.finish()
    path = tmp_path / "ck" / "flexh2o_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "family": "nope"}))
    with pytest.raises(ValueError, match=r"flexh2o_config.json is corrupt \(unknown model family 'nope': use one of "
                                         r"opt, .*\): run flexh2o-convert again"):
        CheckpointReader(str(tmp_path / "ck"))
