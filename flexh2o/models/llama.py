"""Llama family (RoPE, RMSNorm, SwiGLU, grouped-query attention, optional tied embeddings)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from flexh2o.config import ModelConfig
from flexh2o.models.common import WeightSpec, embedding, head_linear, linear, merge_heads, rowwise, split_heads

P = "model."


def layer_specs(cfg: ModelConfig) -> list:
    h = cfg.hidden
    embed = [WeightSpec(P + "embed_tokens.weight", (cfg.vocab, h))]
    out = P + "embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"
    head = [WeightSpec(P + "norm.weight", (h,), "ones"), WeightSpec(out, (cfg.vocab, h))]
    return [embed] + [_block_specs(cfg, i) for i in range(cfg.num_layers)] + [head]


def _block_specs(cfg: ModelConfig, i: int) -> list:
    h, f, kv = cfg.hidden, cfg.ffn, cfg.kv_heads * cfg.head_dim
    p = f"{P}layers.{i}."
    return [WeightSpec(p + "input_layernorm.weight", (h,), "ones"),
            WeightSpec(p + "self_attn.q_proj.weight", (h, h)),
            WeightSpec(p + "self_attn.k_proj.weight", (kv, h)),
            WeightSpec(p + "self_attn.v_proj.weight", (kv, h)),
            WeightSpec(p + "self_attn.o_proj.weight", (h, h)),
            WeightSpec(p + "post_attention_layernorm.weight", (h,), "ones"),
            WeightSpec(p + "mlp.gate_proj.weight", (f, h)),
            WeightSpec(p + "mlp.up_proj.weight", (f, h)),
            WeightSpec(p + "mlp.down_proj.weight", (h, f))]


def embed(cfg: ModelConfig, w: dict, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return embedding(ids, w[P + "embed_tokens.weight"])  # (b, t, h)


def block(cfg: ModelConfig, w: dict, i: int, x: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
    """One decoder layer; keys are rotated at their own positions before they reach the cache."""
    p = f"{P}layers.{i}."
    a = p + "self_attn."
    y = _rms(x, w[p + "input_layernorm.weight"], cfg.norm_eps)
    q = split_heads(linear(y, w[a + "q_proj.weight"]), cfg.num_heads)  # (b, n, t, d)
    k = split_heads(linear(y, w[a + "k_proj.weight"]), cfg.kv_heads)  # (b, kv, t, d)
    v = split_heads(linear(y, w[a + "v_proj.weight"]), cfg.kv_heads)
    cos, sin = _rope(positions, cfg.head_dim, cfg.rope_theta, x.dtype)  # (b, 1, t, d)
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    x = x + linear(merge_heads(attend(q, k, v)), w[a + "o_proj.weight"])
    y = _rms(x, w[p + "post_attention_layernorm.weight"], cfg.norm_eps)
    gate, up, down = (w[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up", "down"))
    return x + rowwise(lambda r: linear(F.silu(linear(r, gate)) * linear(r, up), down), y, cfg.ffn)


def head(cfg: ModelConfig, w: dict, x: torch.Tensor) -> torch.Tensor:
    x = _rms(x, w[P + "norm.weight"], cfg.norm_eps)
    out = w[P + "embed_tokens.weight"] if cfg.tie_embeddings else w["lm_head.weight"]
    return head_linear(x, out).float()  # (b, t, vocab)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rope(positions: torch.Tensor, dim: int, theta: float, dtype) -> tuple:
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim)
    ang = positions.float()[..., None] * inv  # (b, t, d/2)
    emb = torch.cat([ang, ang], dim=-1)[:, None]  # (b, 1, t, d)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)
