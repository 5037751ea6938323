"""Llama family (RoPE, RMSNorm, SwiGLU, grouped-query attention, optional tied embeddings), and its small variants
that share the weight names: Mistral (a sliding window: ModelConfig.window, applied by kv/attention.py), Qwen2
(q/k/v biases: attn_bias), Qwen3 (per-head q/k RMSNorm: qk_norm, and an explicit head_dim: head_size); Llama 3's
rope scaling is models/rope.py."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from typing import Callable

from flexh2o.config import ModelConfig
from flexh2o.models.family import Family
from flexh2o.models.rope import cos_sin, rotate
from flexh2o.models.common import WeightSpec, embedding, head_linear, linear, merge_heads, rowwise, split_heads

P = "model."
HF_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings", "rope_parameters", "rope_theta",
             "rope_scaling", "head_dim")  # the config.json fields a Llama-like conversion reads
HF_WINDOWED = ("sliding_window", "layer_types")


def gguf_window(a: Callable) -> dict:
    """llama (Mistral) and phi3: `attention.sliding_window` windows every layer, as Hugging Face's config does
    (llama.cpp itself turns phi3's window off)."""
    window = a("attention.sliding_window", 0)
    return {"sliding_window": int(window)} if window else {}


def _qwen_layer_types(d: dict, n: int) -> list:
    first = d.get("max_window_layers", n)
    return ["sliding_attention" if i >= first else "full_attention" for i in range(n)]


# transformers' Qwen configs drop the window unless use_sliding_window; its layers from max_window_layers on
QWEN_HF = dict(hf_fields=HF_FIELDS + HF_WINDOWED, hf_window_switch="use_sliding_window",
               hf_layer_types=_qwen_layer_types)
FAMILIES = (  # llama.cpp permutes only the llama architecture's q/k rows (interleaved RoPE); the others keep HF's
    Family("llama", hf_model_types=("llama",), hf_fields=HF_FIELDS, gguf_arch="llama",
           gguf_keys=("attention.sliding_window",),
           gguf_facts=lambda a, *_: {**gguf_window(a), **({"family": "mistral"} if gguf_window(a) else {})},
           gguf_undo={"attn_q.weight": "rope_q", "attn_k.weight": "rope_k"}),
    Family("mistral", hf_model_types=("mistral",), hf_fields=HF_FIELDS + HF_WINDOWED),  # GGUF: llama + a window
    Family("qwen2", hf_model_types=("qwen2",), **QWEN_HF, facts={"attn_bias": True}, gguf_arch="qwen2"),
    Family("qwen3", hf_model_types=("qwen3",), **QWEN_HF, facts={"qk_norm": True}, gguf_arch="qwen3"),
)


def layer_specs(cfg: ModelConfig) -> list:
    h = cfg.hidden
    embed = [WeightSpec(P + "embed_tokens.weight", (cfg.vocab, h))]
    out = P + "embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"
    head = [WeightSpec(P + "norm.weight", (h,), "ones"), WeightSpec(out, (cfg.vocab, h))]
    return [embed] + [_block_specs(cfg, i) for i in range(cfg.num_layers)] + [head]


def _block_specs(cfg: ModelConfig, i: int) -> list:
    h, f = cfg.hidden, cfg.ffn
    p = f"{P}layers.{i}."
    return ([WeightSpec(p + "input_layernorm.weight", (h,), "ones")] + attention_specs(cfg, p + "self_attn.") +
            [WeightSpec(p + "post_attention_layernorm.weight", (h,), "ones"),
             WeightSpec(p + "mlp.gate_proj.weight", (f, h)),
             WeightSpec(p + "mlp.up_proj.weight", (f, h)),
             WeightSpec(p + "mlp.down_proj.weight", (h, f))])


def attention_specs(cfg: ModelConfig, a: str, fused: bool = False) -> list:
    """q/k/v/o projections (fused: one qkv_proj, Phi-3), their biases (attn_bias) and q/k norms (qk_norm)."""
    h, q, kv = cfg.hidden, cfg.num_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    if fused:
        specs = [WeightSpec(a + "qkv_proj.weight", (q + 2 * kv, h))]
    else:
        specs = [WeightSpec(a + "q_proj.weight", (q, h)), WeightSpec(a + "k_proj.weight", (kv, h)),
                 WeightSpec(a + "v_proj.weight", (kv, h))]
    if cfg.attn_bias:
        specs += [WeightSpec(a + f"{n}_proj.bias", (size,), "zeros") for n, size in (("q", q), ("k", kv), ("v", kv))]
    if cfg.qk_norm:
        specs += [WeightSpec(a + "q_norm.weight", (cfg.head_dim,), "ones"),
                  WeightSpec(a + "k_norm.weight", (cfg.head_dim,), "ones")]
    return specs + [WeightSpec(a + "o_proj.weight", (h, q))]


def embed(cfg: ModelConfig, w: dict, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return embedding(ids, w[P + "embed_tokens.weight"])  # (b, t, h)


def block(cfg: ModelConfig, w: dict, i: int, x: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
    """One decoder layer; keys are rotated at their own positions before they reach the cache."""
    p = f"{P}layers.{i}."
    a = p + "self_attn."
    y = rms(x, w[p + "input_layernorm.weight"], cfg.norm_eps)
    q, k, v = (linear(y, w[a + f"{n}_proj.weight"], w.get(a + f"{n}_proj.bias")) for n in "qkv")
    x = x + self_attention(cfg, w, i, q, k, v, positions, attend)
    y = rms(x, w[p + "post_attention_layernorm.weight"], cfg.norm_eps)
    gate, up, down = (w[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up", "down"))
    return x + rowwise(lambda r: linear(F.silu(linear(r, gate)) * linear(r, up), down), y, cfg.ffn)


def self_attention(cfg: ModelConfig, w: dict, i: int, q, k, v, positions: torch.Tensor, attend,
                   norm=None) -> torch.Tensor:
    """Projected q (b, t, n*d), k, v (b, t, kv*d) -> the attention block's output (b, t, h) after o_proj: heads
    split, q/k normed per head (qk_norm; `norm` replaces rms, Gemma 3), rotated, attended (the callback owns the
    cache), merged. A query_scalar scales q so that attention's head_dim ** -0.5 gives query_scalar ** -0.5."""
    a = f"{P}layers.{i}.self_attn."
    q, k, v = split_heads(q, cfg.num_heads), split_heads(k, cfg.kv_heads), split_heads(v, cfg.kv_heads)
    if cfg.qk_norm:
        norm = norm or rms
        q, k = norm(q, w[a + "q_norm.weight"], cfg.norm_eps), norm(k, w[a + "k_norm.weight"], cfg.norm_eps)
    cos, sin = cos_sin(cfg, i, positions, q.dtype)  # (b, 1, t, d)
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    if cfg.query_scalar is not None:
        q = q * (cfg.head_dim / cfg.query_scalar) ** 0.5
    return linear(merge_heads(attend(q, k, v)), w[a + "o_proj.weight"])


def head(cfg: ModelConfig, w: dict, x: torch.Tensor) -> torch.Tensor:
    x = rms(x, w[P + "norm.weight"], cfg.norm_eps)
    out = w[P + "embed_tokens.weight"] if cfg.tie_embeddings else w["lm_head.weight"]
    return head_linear(x, out)  # (b, t, vocab) in the compute dtype, as OPT's head


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)
