"""Gemma 2 and Gemma 3 (text): Llama's attention and weight names plus the embedding scaled by sqrt(hidden),
(1 + w) RMSNorms computed in fp32, a norm after the attention and one before and after the MLP, a gelu_tanh MLP,
query_pre_attn_scalar (ModelConfig.query_scalar), alternating windowed and full layers (window, layer_kinds),
attention and final logit soft-capping (Gemma 2: attn_softcap, final_softcap); Gemma 3 adds (1 + w) q/k norms
per head (qk_norm) and its windowed layers' own RoPE base (local_rope_theta)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from flexh2o.config import ModelConfig
from flexh2o.models.common import WeightSpec, embedding, head_linear, linear, rowwise
from flexh2o.models.llama import P, attention_specs, self_attention
from flexh2o.models.llama import layer_specs as llama_specs

NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


def layer_specs(cfg: ModelConfig) -> list:
    h, f = cfg.hidden, cfg.ffn
    specs = llama_specs(cfg)
    blocks = []
    for i in range(cfg.num_layers):
        p = f"{P}layers.{i}."
        blocks.append([WeightSpec(p + n + ".weight", (h,), "zeros") for n in NORMS] +
                      attention_specs(cfg, p + "self_attn.") +
                      [WeightSpec(p + "mlp.gate_proj.weight", (f, h)), WeightSpec(p + "mlp.up_proj.weight", (f, h)),
                       WeightSpec(p + "mlp.down_proj.weight", (h, f))])
    head = [WeightSpec(P + "norm.weight", (h,), "zeros")] + specs[-1][1:]
    return [specs[0]] + blocks + [head]


def embed(cfg: ModelConfig, w: dict, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    x = embedding(ids, w[P + "embed_tokens.weight"])
    return x * torch.tensor(cfg.hidden ** 0.5, dtype=x.dtype)


def block(cfg: ModelConfig, w: dict, i: int, x: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
    p = f"{P}layers.{i}."
    a = p + "self_attn."
    norm = {n: w[p + n + ".weight"] for n in NORMS}
    y = rms1(x, norm["input_layernorm"], cfg.norm_eps)
    q, k, v = (linear(y, w[a + f"{n}_proj.weight"]) for n in "qkv")
    y = self_attention(cfg, w, i, q, k, v, positions, attend, norm=rms1)
    x = x + rms1(y, norm["post_attention_layernorm"], cfg.norm_eps)
    y = rms1(x, norm["pre_feedforward_layernorm"], cfg.norm_eps)
    gate, up, down = (w[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up", "down"))
    y = rowwise(lambda r: linear(F.gelu(linear(r, gate), approximate="tanh") * linear(r, up), down), y, cfg.ffn)
    return x + rms1(y, norm["post_feedforward_layernorm"], cfg.norm_eps)


def head(cfg: ModelConfig, w: dict, x: torch.Tensor) -> torch.Tensor:
    x = rms1(x, w[P + "norm.weight"], cfg.norm_eps)
    out = w[P + "embed_tokens.weight"] if cfg.tie_embeddings else w["lm_head.weight"]
    logits = head_linear(x, out).float()
    if cfg.final_softcap is not None:
        logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
    return logits


def rms1(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: x / rms(x) * (1 + w), all in fp32, then x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)
