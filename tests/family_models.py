"""Tiny seeded checkpoints of each model family, written by transformers itself (hidden 64, 3 layers, 4 heads,
2 KV heads, vocab 1000), with random weights scaled so attention is peaked and logits far from uniform; and the
logits transformers gives at each step of a generation (the reference the engine is compared with)."""
from __future__ import annotations

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

COMMON = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False)
WINDOW = 16  # shorter than the 40-token prompts


def hf_configs() -> dict:
    """name -> (transformers config class name, its keyword arguments)."""
    return {
        "llama3": ("LlamaConfig", dict(rope_parameters={
            "rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
        "llama-linear": ("LlamaConfig", dict(rope_parameters={"rope_type": "linear", "rope_theta": 5000.0,
                                                              "factor": 4.0})),
        "mistral": ("MistralConfig", dict(sliding_window=WINDOW, head_dim=16)),
        "qwen2": ("Qwen2Config", dict(rope_parameters={"rope_type": "default", "rope_theta": 3000.0})),
        "qwen2-window": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
        "qwen3": ("Qwen3Config", dict(head_dim=32)),
        "phi3": ("Phi3Config", dict(pad_token_id=0, eos_token_id=2)),
        "gemma2": ("Gemma2Config", dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW,
                                        attn_logit_softcapping=4.0, final_logit_softcapping=8.0,
                                        tie_word_embeddings=True)),
        "gemma3": ("Gemma3TextConfig", dict(
            head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW, tie_word_embeddings=True,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 3000.0},
                             "full_attention": {"rope_type": "linear", "rope_theta": 50000.0, "factor": 2.0}})),
    }


def hf_model(name: str, **overrides):
    """The seeded transformers model (fp32, eager attention) of family case `name` (config fields `overrides`
    replaced)."""
    import transformers
    cls_name, kw = hf_configs()[name]
    cfg = getattr(transformers, cls_name)(**{**COMMON, **kw, **overrides})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    gemma = cls_name.startswith("Gemma")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):  # Gemma scales by (1 + w)
                p.copy_((0.0 if gemma else 1.0) + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
    return model


def save(model, folder: str) -> str:
    model.save_pretrained(folder, safe_serialization=True)
    return folder
