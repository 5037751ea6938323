"""The reference's models (tests/reference_kv.py): attention under a keep-mask, with a compressed cache's
quantize-dequantize and merged values replayed from merge events, and OPT and Llama forward passes written out
plainly, each step recomputing the whole sequence."""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F


def attention(q, k, v, visible, num_heads: int, kv_heads: int, kv_quant: Optional[Callable] = None,
              prompt_len: int = 0, merges: Optional[list] = None) -> tuple:
    """q (T, n*d), k/v (T, kv*d), visible (kv, T, T) bool -> (out (T, n*d), (probs (kv, T, T) summed over each group,
    L1 norms of the values (kv, T), keys (kv, T, d): the values and keys as the newest query reads them)).
    `merges`: per KV head, the merge events (see `merged_values`) that change the values later queries read.

    With `kv_quant` (a quantize-dequantize of (T, kv, d) K or V; or a pair of them, keys' and values', each taking
    (x, prompt_len): tests/reference_quant.py), the queries after the prompt (generated tokens) read the quantized
    K/V, as from a compressed cache; the prompt's queries read them exact (prefill attends before the cache is
    written). A third member W > 0 of the pair (reference_quant.recent): query i reads token j exact when j > i - W
    (the cache's newest W tokens); a fourth S > 0: also when j < S (the sequence's first S tokens); a fifth, a
    quantize-dequantize those tokens are read through instead of exact."""
    if kv_quant is None:
        return _attention(q, k, v, visible, num_heads, kv_heads, merges)
    assert not merges or not any(merges), "the reference merges only exact K/V"
    T = q.shape[0]
    pair = kv_quant if isinstance(kv_quant, tuple) else (lambda x, n: kv_quant(x),) * 2
    qk, qv = (f(x.view(T, kv_heads, -1), prompt_len).reshape(T, -1) for f, x in zip(pair, (k, v)))
    exact = _attention(q, k, v, visible, num_heads, kv_heads)
    if len(pair) > 2 and any(pair[2:4]):
        near = pair[4] if len(pair) > 4 and pair[4] is not None else (lambda x, n: x)
        nk, nv = (near(x.view(T, kv_heads, -1), prompt_len).reshape(T, -1) for x in (k, v))
        packed = _mixed(q, (nk, qk), (nv, qv), visible, num_heads, kv_heads, *pair[2:4])
    else:
        packed = _attention(q, qk, qv, visible, num_heads, kv_heads)
    later = torch.arange(T) >= prompt_len  # (T,) query rows that read the cache
    vnorm, keys = (packed[1][i] if T > prompt_len else exact[1][i] for i in (1, 2))  # decode steps read the K/V
    return (torch.where(later[:, None], packed[0], exact[0]),  # the cache holds
            (torch.where(later[None, :, None], packed[1][0], exact[1][0]), vnorm, keys))


def _attention(q, k, v, visible, num_heads: int, kv_heads: int, merges: Optional[list] = None) -> tuple:
    """q (T, n*d), k/v (T, kv*d), visible (kv, T, T) bool -> (out (T, n*d), (probs (kv, T, T) summed over each group,
    L1 norms of the values (kv, T), keys (kv, T, d)))."""
    T = q.shape[0]
    d = q.shape[1] // num_heads
    group = num_heads // kv_heads
    vnorm = v.view(T, kv_heads, d).abs().sum(-1).T  # (kv, T)
    keys = k.view(T, kv_heads, d).transpose(0, 1)  # (kv, T, d)
    per_query = None
    if merges and any(merges):  # (kv, query, token, d): the value each query reads for each token
        heads = v.view(T, kv_heads, d).transpose(0, 1)
        per_query = torch.stack([merged_values(heads[h], merges[h]) for h in range(kv_heads)])
    q = q.view(T, num_heads, d).transpose(0, 1)  # (n, T, d)
    k = k.view(T, kv_heads, d).transpose(0, 1).repeat_interleave(group, 0)  # (n, T, d): query head h reads h // group
    v = v.view(T, kv_heads, d).transpose(0, 1).repeat_interleave(group, 0)
    mask = visible.repeat_interleave(group, 0)  # (n, T, T)
    probs = ((q @ k.transpose(1, 2)) * d ** -0.5).masked_fill(~mask, float("-inf")).softmax(-1)  # (n, T, T)
    if per_query is None:
        out = (probs @ v).transpose(0, 1).reshape(T, num_heads * d)
    else:
        out = torch.einsum("nqt,nqtd->nqd", probs, per_query.repeat_interleave(group, 0))
        out = out.transpose(0, 1).reshape(T, num_heads * d)
    return out, (probs.view(kv_heads, group, T, T).sum(1), vnorm, keys)


def _mixed(q, k: tuple, v: tuple, visible, num_heads: int, kv_heads: int, window: int, sinks: int = 0) -> tuple:
    """_attention where k and v are (exact, quantized) pairs: query i reads token j's exact K and V when
    j > i - window or j < sinks, the quantized ones otherwise; the value norms and keys are those the newest query
    reads."""
    T = q.shape[0]
    d = q.shape[1] // num_heads
    group = num_heads // kv_heads
    token = torch.arange(T)[None, :]
    near = (token > torch.arange(T)[:, None] - window) | (token < sinks)  # (query, token)

    def heads(x):  # (T, kv*d) -> (n, T, d): query head h reads h // group
        return x.view(T, kv_heads, d).transpose(0, 1).repeat_interleave(group, 0)
    qh = q.view(T, num_heads, d).transpose(0, 1)
    logits = torch.where(near, qh @ heads(k[0]).transpose(1, 2), qh @ heads(k[1]).transpose(1, 2)) * d ** -0.5
    probs = logits.masked_fill(~visible.repeat_interleave(group, 0), float("-inf")).softmax(-1)  # (n, T, T)
    out = (probs * near) @ heads(v[0]) + (probs * ~near) @ heads(v[1])
    norms = [x.view(T, kv_heads, d).abs().sum(-1).T for x in v]  # (kv, T) exact, quantized
    vnorm = torch.where(near[-1], norms[0], norms[1])
    keys = torch.where(near[-1][:, None, None], k[0].view(T, kv_heads, d), k[1].view(T, kv_heads, d))
    return (out.transpose(0, 1).reshape(T, num_heads * d),
            (probs.view(kv_heads, group, T, T).sum(1), vnorm, keys.transpose(0, 1)))


def merged_values(v: torch.Tensor, events: list) -> torch.Tensor:
    """v (T, d) one KV head's values, events [(c, target, [(source, m_source)], m_target)] -> (query, token, d): the
    value each query reads, every event at query c changing what queries after c read for its target: the
    m-weighted mean of the target's and its sources' values as they were then."""
    T = v.shape[0]
    state, out, todo = v.clone(), v.new_empty(T, T, v.shape[1]), sorted(events, key=lambda e: e[0])
    for query in range(T):
        while todo and todo[0][0] < query:
            _, t, sources, m_t = todo.pop(0)
            mass = m_t + sum(m for _, m in sources)
            if mass > 0:
                state[t] = (m_t * state[t] + sum(m * state[e] for e, m in sources)) / mass
        out[query] = state
    return out



def opt_forward(cfg, w: dict, ids: list, visible: list, quant: tuple = (None, 0),
                merges: Optional[list] = None) -> tuple:
    """Pre-LayerNorm OPT. -> (logits of the last position (vocab,), [(probs (kv, T, T), vnorm (kv, T)) per layer])."""
    assert cfg.norm_before and cfg.embed_dim == cfg.hidden, "the reference covers pre-LN OPT without projections"
    P = "model.decoder."
    T = len(ids)
    x = w[P + "embed_tokens.weight"][ids] + w[P + "embed_positions.weight"][torch.arange(T) + 2]  # (T, h)
    all_probs = []
    for i in range(cfg.num_layers):
        p = f"{P}layers.{i}."
        y = _layer_norm(x, w, p + "self_attn_layer_norm")
        q, k, v = (_linear(y, w, f"{p}self_attn.{name}_proj") for name in "qkv")
        o, probs = attention(q, k, v, visible[i], cfg.num_heads, cfg.num_heads, *quant, merges and merges[i])
        x = x + _linear(o, w, p + "self_attn.out_proj")
        y = _layer_norm(x, w, p + "final_layer_norm")
        x = x + _linear(F.relu(_linear(y, w, p + "fc1")), w, p + "fc2")
        all_probs.append(probs)
    x = _layer_norm(x, w, P + "final_layer_norm")
    return x[-1] @ w[P + "embed_tokens.weight"].T, all_probs


def llama_forward(cfg, w: dict, ids: list, visible: list, quant: tuple = (None, 0),
                  merges: Optional[list] = None) -> tuple:
    """Llama with grouped KV heads; Qwen2's q/k/v biases and Qwen3's per-head q/k RMSNorm when the weights have
    them; a sliding window is in `visible`. -> (logits of the last position (vocab,), [(probs, vnorm) per layer])."""
    T, d = len(ids), cfg.head_dim
    x = w["model.embed_tokens.weight"][ids]  # (T, h)
    cos, sin = _rope(T, d, cfg.rope_theta)  # (T, d)
    all_probs = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        y = _rms_norm(x, w[p + "input_layernorm.weight"], cfg.norm_eps)
        q, k, v = (y @ w[f"{p}self_attn.{name}_proj.weight"].T + w.get(f"{p}self_attn.{name}_proj.bias", 0)
                   for name in "qkv")
        if p + "self_attn.q_norm.weight" in w:  # each head's vector normed on its own
            q, k = (_rms_norm(x.view(T, -1, d), w[f"{p}self_attn.{n}_norm.weight"], cfg.norm_eps).view(T, -1)
                    for x, n in ((q, "q"), (k, "k")))
        q, k = _rotate(q, cos, sin, d), _rotate(k, cos, sin, d)
        o, probs = attention(q, k, v, visible[i], cfg.num_heads, cfg.kv_heads, *quant, merges and merges[i])
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        y = _rms_norm(x, w[p + "post_attention_layernorm.weight"], cfg.norm_eps)
        gate, up = y @ w[p + "mlp.gate_proj.weight"].T, y @ w[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        all_probs.append(probs)
    x = _rms_norm(x, w["model.norm.weight"], cfg.norm_eps)
    out = w["model.embed_tokens.weight"] if cfg.tie_embeddings else w["lm_head.weight"]
    return x[-1] @ out.T, all_probs


def _linear(x, w, name):
    return x @ w[name + ".weight"].T + w[name + ".bias"]


def _layer_norm(x, w, name):
    return F.layer_norm(x, (x.shape[-1],), w[name + ".weight"], w[name + ".bias"], 1e-5)


def _rms_norm(x, weight, eps):
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(T: int, d: int, theta: float) -> tuple:
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)  # (d/2,)
    angle = torch.arange(T, dtype=torch.float32)[:, None] * inv_freq  # (T, d/2)
    angle = torch.cat([angle, angle], -1)  # (T, d)
    return angle.cos(), angle.sin()


def _rotate(x, cos, sin, d: int):
    """RoPE on every head of x (T, heads*d), rotate-half convention."""
    T = x.shape[0]
    x = x.view(T, -1, d)  # (T, heads, d)
    half = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return (x * cos[:, None] + half * sin[:, None]).reshape(T, -1)


FORWARD = {"opt": opt_forward, "llama": llama_forward, "mistral": llama_forward, "qwen2": llama_forward,
           "qwen3": llama_forward}
