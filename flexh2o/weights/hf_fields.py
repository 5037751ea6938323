"""What flexh2o does with each field of a Hugging Face config.json, per model type: every field is read (USED), has
to hold a value that changes nothing (REQUIRE: refused otherwise, in one line naming field and value), or does not
affect the computation (INERT, with the reason). A field in none of them is refused: nothing is dropped silently.
tests/weights/test_hf_fields.py walks every field of each supported transformers config class through these tables."""
from __future__ import annotations

from flexh2o.models import by_hf_model_type, families

INERT = {  # field: why it changes no logit of a decoder run
    "transformers_version": "metadata", "architectures": "metadata", "_name_or_path": "metadata",
    "model_type": "picks the family", "auto_map": "metadata (remote code is never run)",
    "output_hidden_states": "what a forward returns, not its values",
    "output_attentions": "what a forward returns, not its values", "return_dict": "what a forward returns",
    "dtype": "the storage dtype is --dtype", "torch_dtype": "the storage dtype is --dtype",
    "chunk_size_feed_forward": "chunking the MLP's rows changes no value (flexh2o chunks rows too)",
    "problem_type": "sequence-classification heads only", "id2label": "classification heads only",
    "label2id": "classification heads only", "initializer_range": "initialisation only",
    "use_cache": "flexh2o always caches keys and values", "attention_dropout": "dropout is off at inference",
    "resid_pdrop": "dropout is off at inference", "embd_pdrop": "dropout is off at inference",
    "pretraining_tp": "transformers 5 does not read it (a split matmul of the same values)",
    "tokenizer_class": "the tokenizer is --tokenizer", "max_position_embeddings": "read as max_positions (a limit)",
    "original_max_position_embeddings": "read only by longrope scaling, which is refused",
    "max_window_layers": "folded into layer_types (qwen2/qwen3)",
    "use_sliding_window": "folded into sliding_window (qwen2/qwen3)",
    "_sliding_window_pattern": "folded into layer_types (gemma3)", "sliding_window_pattern": "folded into layer_types",
    "pad_token_id": "read (padding is never attended)", "bos_token_id": "read", "eos_token_id": "read",
}

REQUIRE = {  # field: values that change nothing (any other is refused)
    "is_encoder_decoder": (False,), "mlp_bias": (False,), "hidden_act": ("silu",),
    "use_bidirectional_attention": (None, False), "quantization_config": (None,),
    "partial_rotary_factor": (1.0, 1), "cross_attention_hidden_size": (None,), "add_cross_attention": (False,),
    "tie_encoder_decoder": (False,), "attn_logit_softcapping": (None,), "final_logit_softcapping": (None,),
    "attention_bias": (False,),
}

# model_type: the fields its conversion reads (flexh2o/weights/hf_config.py), as each family declares them
# (hf_fields of its Family, flexh2o/models/: check_fields asks it); OPT, read by its own hf_convert, is not listed
USED = {mt: f.hf_fields for f in families() if f.hf_fields is not None for mt in f.hf_model_types}

ROPE_KEYS = {  # rope_type: the keys of rope_parameters it reads
    "default": ("rope_type", "rope_theta"),
    "linear": ("rope_type", "rope_theta", "factor"),
    "llama3": ("rope_type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
}


def check_fields(d: dict) -> None:
    """ValueError naming the first field of config.json `d` that flexh2o would otherwise drop."""
    used = by_hf_model_type(d["model_type"]).hf_fields
    for key, value in d.items():
        if key in used or key in INERT:
            continue
        if key in REQUIRE:
            if value not in REQUIRE[key]:
                raise ValueError(f"{key} = {value!r} is not supported (flexh2o implements "
                                 f"{' / '.join(map(repr, REQUIRE[key]))})")
            continue
        raise ValueError(f"{key} = {_short(value)} is a field flexh2o does not know for model_type "
                         f"{d['model_type']!r}: it may change the computation, so it is refused")


def check_rope(params: dict, where: str = "rope_parameters") -> None:
    """ValueError for a rope type flexh2o does not implement, or a key of its parameters it would drop."""
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_KEYS:
        raise ValueError(f"{where} rope_type = {kind!r} is not supported (flexh2o implements "
                         f"{', '.join(ROPE_KEYS)})")
    for key, value in params.items():
        if key in ROPE_KEYS[kind] or key == "type":
            continue
        if key in REQUIRE and value in REQUIRE[key]:
            continue
        if key == "original_max_position_embeddings" and kind != "llama3":
            continue  # read only by llama3 / longrope
        raise ValueError(f"{where} {key} = {_short(value)} is not supported for rope_type {kind!r}")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
