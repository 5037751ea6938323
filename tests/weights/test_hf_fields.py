"""No field of a supported transformers config is dropped silently: every field of each config class is read by
the conversion, checked to hold a value that changes nothing, or listed as inert with a reason; a field that would
change the computation and is not implemented is refused in one line naming the field and its value."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

transformers = pytest.importorskip("transformers")

from flexh2o.weights.hf_config import from_hf_config  # noqa: E402
from flexh2o.weights.hf_fields import INERT, REQUIRE, ROPE_KEYS, USED  # noqa: E402

CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
           "phi3": "Phi3Config", "gemma2": "Gemma2Config", "gemma3_text": "Gemma3TextConfig"}
SMALL = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, pad_token_id=0)


def _dict(model_type: str, **kw) -> dict:
    return getattr(transformers, CLASSES[model_type])(**{**SMALL, **kw}).to_dict()


def test_tables_cover_the_supported_model_types():
    assert set(USED) == set(CLASSES)


@pytest.mark.parametrize("model_type", list(CLASSES))
def test_every_field_is_accounted_for(model_type):
    """Each field the class writes (and each key of its rope parameters) is read, required or inert; and its
    default config converts."""
    d = _dict(model_type)
    for key, value in d.items():
        assert key in USED[model_type] or key in INERT or key in REQUIRE, f"{model_type}: {key} is unaccounted"
        if key in REQUIRE and key not in USED[model_type]:
            assert value in REQUIRE[key], f"{model_type}: default {key} = {value!r} would be refused"
    for reason in INERT.values():
        assert reason
    cfg = from_hf_config(d)
    assert cfg.num_layers == 3 and cfg.family == model_type.replace("_text", "")


def test_rope_keys_of_each_type_are_read():
    for kind, keys in ROPE_KEYS.items():
        assert "rope_theta" in keys and "rope_type" in keys, kind


REFUSALS = [  # (model_type, field overrides, text the one-line error must hold)
    ("llama", {"mlp_bias": True}, "mlp_bias = True"),
    ("llama", {"attention_bias": True}, "attention_bias = True"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "'dynamic'"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "'yarn'"),
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor = 0.5"),
    ("llama", {"some_new_switch": 3}, "some_new_switch = 3"),
    ("llama", {"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ("qwen3", {"attention_bias": True}, "attention_bias = True"),
    ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "'longrope'"),
    ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation = 'gelu'"),
    ("gemma2", {"hidden_act": "silu"}, "hidden_act = 'silu'"),
    ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention = True"),
]


@pytest.mark.parametrize("model_type, change, text", REFUSALS, ids=[f"{m}-{t[:20]}" for m, _, t in REFUSALS])
def test_unimplemented_field_is_refused(model_type, change, text):
    d = {**_dict(model_type), **change}
    with pytest.raises(ValueError) as e:
        from_hf_config(d)
    msg = str(e.value)
    assert text in msg and "\n" not in msg, msg


def test_multimodal_gemma3_is_refused():
    with pytest.raises(ValueError, match="gemma3_text"):
        from_hf_config({"model_type": "gemma3"})


def test_legacy_rope_scaling_is_read():
    """Files written before transformers 5: rope_scaling + rope_theta at the top level."""
    d = _dict("llama")
    d.pop("rope_parameters")
    d.update(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    cfg = from_hf_config(d)
    assert (cfg.rope_type, cfg.rope_theta, cfg.rope_factor, cfg.rope_original_max) == ("llama3", 5e5, 8.0, 8192)


def test_convert_cli_refuses_in_one_line(tmp_path):
    """flexh2o-convert on a folder whose config asks for something unimplemented: one line, exit 2, no DST."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({**_dict("llama"), "mlp_bias": True}))
    dst = tmp_path / "dst"
    p = subprocess.run([sys.executable, "-m", "flexh2o.cli.convert", str(src), str(dst)], capture_output=True,
                       text=True, env={**os.environ})
    assert p.returncode == 2, p.stderr
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "mlp_bias = True" in lines[0], p.stderr
    assert not dst.exists()
