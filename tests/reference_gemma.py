"""Gemma 2's forward pass for tests/reference_kv.py's generate (its `forward` argument), written out plainly and apart
from flexh2o/models/gemma.py: the embedding times sqrt(hidden); RMSNorms that scale by (1 + w); a norm after the
attention and one before and one after the MLP; gelu (tanh approximation) gating; attention scaled by
query_pre_attn_scalar ** -0.5 with its logits soft-capped (cap * tanh(logits / cap)) before the keep-mask; the final
logits soft-capped too. Sliding windows are in `visible` (reference_kv builds it from cfg.window)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from reference_forward import _rope, _rotate


def gemma2_forward(cfg, w: dict, ids: list, visible: list, quant: tuple = (None, 0),
                   merges: Optional[list] = None) -> tuple:
    """-> (logits of the last position (vocab,), [(probs (kv, T, T), vnorm (kv, T), keys (kv, T, d)) per layer])."""
    assert quant[0] is None and not (merges and any(any(m) for m in merges)), "exact K/V, no merges"
    T, d = len(ids), cfg.head_dim
    x = w["model.embed_tokens.weight"][ids] * cfg.hidden ** 0.5  # (T, h)
    cos, sin = _rope(T, d, cfg.rope_theta)
    stats = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        y = _norm(x, w[p + "input_layernorm.weight"], cfg.norm_eps)
        q, k, v = (y @ w[f"{p}self_attn.{n}_proj.weight"].T for n in "qkv")
        q, k = _rotate(q, cos, sin, d), _rotate(k, cos, sin, d)
        o, layer_stats = _attention(q, k, v, visible[i], cfg)
        x = x + _norm(o @ w[p + "self_attn.o_proj.weight"].T, w[p + "post_attention_layernorm.weight"], cfg.norm_eps)
        y = _norm(x, w[p + "pre_feedforward_layernorm.weight"], cfg.norm_eps)
        gate, up = y @ w[p + "mlp.gate_proj.weight"].T, y @ w[p + "mlp.up_proj.weight"].T
        mlp = (F.gelu(gate, approximate="tanh") * up) @ w[p + "mlp.down_proj.weight"].T
        x = x + _norm(mlp, w[p + "post_feedforward_layernorm.weight"], cfg.norm_eps)
        stats.append(layer_stats)
    x = _norm(x, w["model.norm.weight"], cfg.norm_eps)
    logits = x[-1] @ w["model.embed_tokens.weight"].T
    return _cap(logits, cfg.final_softcap), stats


def _norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight)


def _cap(x, cap):
    return x if cap is None else cap * torch.tanh(x / cap)


def _attention(q, k, v, visible, cfg) -> tuple:
    """q (T, n*d), k/v (T, kv*d), visible (kv, T, T) -> (out (T, n*d), (probs (kv, T, T) summed over each KV head's
    query heads, L1 norms of the values (kv, T), keys (kv, T, d)))."""
    T, n, kv, d = q.shape[0], cfg.num_heads, cfg.kv_heads, cfg.head_dim
    group = n // kv
    qh = q.view(T, n, d).transpose(0, 1)  # (n, T, d)
    kh, vh = (t.view(T, kv, d).transpose(0, 1) for t in (k, v))  # (kv, T, d)
    logits = qh @ kh.repeat_interleave(group, 0).transpose(1, 2) * cfg.query_scalar ** -0.5  # (n, T, T)
    logits = _cap(logits, cfg.attn_softcap).masked_fill(~visible.repeat_interleave(group, 0), float("-inf"))
    probs = logits.softmax(-1)
    out = (probs @ vh.repeat_interleave(group, 0)).transpose(0, 1).reshape(T, n * d)
    return out, (probs.view(kv, group, T, T).sum(1), vh.abs().sum(-1), kh)
