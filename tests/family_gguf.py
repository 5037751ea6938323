"""Tiny GGUF files written from the seeded transformers checkpoints of tests/family_models.py the way llama.cpp's
convert_hf_to_gguf.py writes them: the architecture's metadata keys, tensor names from the gguf package's own
TensorNameMap (llama.cpp's table, not flexh2o's), llama's q/k rows permuted for interleaved RoPE, gemma's norms
stored as 1 + w, tied heads left out; float32 tensors, or 2-D weights quantized by gguf.quants."""
from __future__ import annotations

import numpy as np
import torch

import family_models as fm

# case -> (family_models case, config overrides GGUF can express, GGUF architecture)
CASES = {
    "llama-linear": ("llama-linear", {}, "llama"),
    "mistral": ("mistral", {}, "llama"),
    "qwen2": ("qwen2", {}, "qwen2"),
    "qwen3": ("qwen3", {}, "qwen3"),
    "phi3": ("phi3", {}, "phi3"),
    # GGUF carries no query_pre_attn_scalar (llama.cpp uses head_dim below 27B) ...
    "gemma2": ("gemma2", {"query_pre_attn_scalar": 32}, "gemma2"),
    # ... nor gemma3's layer pattern (5 windowed of 6) or its local RoPE base (10000)
    "gemma3": ("gemma3", {"query_pre_attn_scalar": 32, "num_hidden_layers": 6,
                          "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
                          "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                              "full_attention": {"rope_type": "linear", "rope_theta": 50000.0,
                                                                 "factor": 2.0}}}, "gemma3"),
}


def case_model(case: str):
    name, overrides, _ = CASES[case]
    return fm.hf_model(name, **overrides)


def write_gguf(model, case: str, path: str, quant=None, extra=None) -> str:
    """`model` (the case's transformers model) as a GGUF file at `path`; quant(hf_name, shape) -> a gguf type name
    ("Q8_0", "Q4_0") or None (float32) for each 2-D weight; extra(writer), if given, adds (or replaces: a key is
    dropped first when extra adds it again) metadata or tensors before the file is written."""
    import gguf
    arch = CASES[case][2]
    cfg = model.config
    w = gguf.GGUFWriter(path, arch)
    _metadata(w, cfg, arch)
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), cfg.num_hidden_layers)
    for key, t in model.state_dict().items():
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        gname = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert gname is not None, key
        a = _as_llama_cpp(t.detach().float(), key, arch, cfg).numpy()
        kind = quant(key, a.shape) if quant is not None and a.ndim == 2 else None
        if kind is None:
            w.add_tensor(gname, np.ascontiguousarray(a, dtype=np.float32))
        else:
            qtype = getattr(gguf.GGMLQuantizationType, kind)
            w.add_tensor(gname, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    if extra is not None:
        _replacing(w, extra)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _replacing(w, extra) -> None:
    written = dict(w.kv_data[0])
    w.kv_data[0].clear()
    extra(w)
    w.kv_data[0].update({k: v for k, v in written.items() if k not in w.kv_data[0]})


def _as_llama_cpp(t: torch.Tensor, key: str, arch: str, cfg) -> torch.Tensor:
    """The tensor as llama.cpp's converter stores it."""
    if arch == "llama" and key.endswith(("q_proj.weight", "k_proj.weight")):
        heads = cfg.num_attention_heads if "q_proj" in key else cfg.num_key_value_heads
        return (t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape))
    if arch.startswith("gemma") and key.endswith("norm.weight"):
        return t + 1
    return t


def _metadata(w, cfg, arch: str) -> None:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type", "default") == "linear":
        w.add_rope_scaling_type(__import__("gguf").RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if getattr(cfg, "sliding_window", None) and arch != "qwen2":
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    if arch.startswith("gemma") and cfg.final_logit_softcapping:
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    w.add_pad_token_id(cfg.pad_token_id)
