"""Reference KV-eviction generation, written apart from the engine so the engine can be checked against it.

Plain and slow on purpose:
  * one unpadded sequence at a time (so padding cannot leak in: the reference never sees any);
  * every step recomputes the whole sequence from scratch (OPT or Llama, written out below) under a keep-mask
    `visible[layer][kv_head, query, key]`: query q sees exactly the tokens its (layer, KV head) kept when q was
    generated, plus itself. The prompt's queries see the whole causal prefix (prefill is full attention);
  * kept sets are Python sets per (layer, KV head); scores live in fp32 and are the sum, over every query that has
    attended to a token, of the probability it gave the token, summed over the query heads sharing the KV head;
  * each policy is a handful of lines over those sets (class `RefPolicy`).

Only `random_key` (the seeded hash that defines the `random` policy's choice) comes from the engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from flexh2o.kv.policies.random import random_key

ScoreFn = Callable[[int], float]  # position -> accumulated score (an fp32 value)


# ---- policies ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RefPolicy:
    """name in full / h2o / local / streaming / random. h2o and random: `heavy` + `recent`; local and streaming: a
    budget of `heavy + recent` tokens (streaming: the first `num_sinks` of them are the attention sinks)."""

    name: str
    heavy: int = 0
    recent: int = 0
    num_sinks: int = 4
    seed: int = 0

    @property
    def budget(self) -> Optional[int]:
        return None if self.name == "full" else self.heavy + self.recent

    def prefill(self, n: int, score: ScoreFn, layer: int, head: int) -> set:
        """Positions kept out of an n-token prompt."""
        everything = set(range(n))
        if self.budget is None or n <= self.budget:
            return everything
        if self.name == "local":
            return set(range(n - self.budget, n))
        if self.name == "streaming":
            return set(range(self.num_sinks)) | set(range(n - (self.budget - self.num_sinks), n))
        recent = set(range(n - self.recent, n))
        older = everything - recent
        value = self._value(score, layer, head)
        heavy = sorted(older, key=lambda t: (value(t), t), reverse=True)[:self.heavy]  # ties keep the newer
        return recent | set(heavy)

    def evict(self, kept: set, cur: int, score: ScoreFn, layer: int, head: int) -> int:
        """The position to drop from `kept` (which holds one token too many; `cur` is the newest position)."""
        if self.name == "local":
            return min(kept)
        if self.name == "streaming":
            return min(t for t in kept if t >= self.num_sinks)
        outside = [t for t in kept if t <= cur - self.recent]  # the recent window is the R newest positions
        value = self._value(score, layer, head)
        return min(outside, key=lambda t: (value(t), t))  # lowest value; ties evict the older

    def _value(self, score: ScoreFn, layer: int, head: int) -> ScoreFn:
        if self.name == "h2o":
            return score
        return lambda t: ref_random_key(self.seed, layer, head, t)


@lru_cache(maxsize=None)
def ref_random_key(seed: int, layer: int, head: int, pos: int) -> float:
    """The `random` policy's key of one token: random_key reads the KV head from dimension 1 of its input."""
    grid = torch.full((1, head + 1, 1), pos, dtype=torch.int64)
    return float(random_key(seed, layer, grid)[0, head, 0])


# ---- models -----------------------------------------------------------------------------------------------------
def attention(q, k, v, visible, num_heads: int, kv_heads: int, kv_quant: Optional[Callable] = None,
              prompt_len: int = 0) -> tuple:
    """q (T, n*d), k/v (T, kv*d), visible (kv, T, T) bool -> (out (T, n*d), probs (kv, T, T) summed over each group).

    With `kv_quant` (a quantize-dequantize of (T, kv, d) K or V), the queries after the prompt (generated tokens)
    read the quantized K/V, as from a compressed cache; the prompt's queries read them exact (prefill attends
    before the cache is written)."""
    if kv_quant is None:
        return _attention(q, k, v, visible, num_heads, kv_heads)
    T = q.shape[0]
    qk, qv = (kv_quant(x.view(T, kv_heads, -1)).reshape(T, -1) for x in (k, v))
    exact = _attention(q, k, v, visible, num_heads, kv_heads)
    packed = _attention(q, qk, qv, visible, num_heads, kv_heads)
    later = torch.arange(T) >= prompt_len  # (T,) query rows that read the cache
    return (torch.where(later[:, None], packed[0], exact[0]),
            torch.where(later[None, :, None], packed[1], exact[1]))


def _attention(q, k, v, visible, num_heads: int, kv_heads: int) -> tuple:
    """q (T, n*d), k/v (T, kv*d), visible (kv, T, T) bool -> (out (T, n*d), probs (kv, T, T) summed over each group)."""
    T = q.shape[0]
    d = q.shape[1] // num_heads
    group = num_heads // kv_heads
    q = q.view(T, num_heads, d).transpose(0, 1)  # (n, T, d)
    k = k.view(T, kv_heads, d).transpose(0, 1).repeat_interleave(group, 0)  # (n, T, d): query head h reads h // group
    v = v.view(T, kv_heads, d).transpose(0, 1).repeat_interleave(group, 0)
    mask = visible.repeat_interleave(group, 0)  # (n, T, T)
    probs = ((q @ k.transpose(1, 2)) * d ** -0.5).masked_fill(~mask, float("-inf")).softmax(-1)  # (n, T, T)
    out = (probs @ v).transpose(0, 1).reshape(T, num_heads * d)
    return out, probs.view(kv_heads, group, T, T).sum(1)


def opt_forward(cfg, w: dict, ids: list, visible: list, quant: tuple = (None, 0)) -> tuple:
    """Pre-LayerNorm OPT. -> (logits of the last position (vocab,), [probs (kv, T, T) per layer])."""
    assert cfg.norm_before and cfg.embed_dim == cfg.hidden, "the reference covers pre-LN OPT without projections"
    P = "model.decoder."
    T = len(ids)
    x = w[P + "embed_tokens.weight"][ids] + w[P + "embed_positions.weight"][torch.arange(T) + 2]  # (T, h)
    all_probs = []
    for i in range(cfg.num_layers):
        p = f"{P}layers.{i}."
        y = _layer_norm(x, w, p + "self_attn_layer_norm")
        q, k, v = (_linear(y, w, f"{p}self_attn.{name}_proj") for name in "qkv")
        o, probs = attention(q, k, v, visible[i], cfg.num_heads, cfg.num_heads, *quant)
        x = x + _linear(o, w, p + "self_attn.out_proj")
        y = _layer_norm(x, w, p + "final_layer_norm")
        x = x + _linear(F.relu(_linear(y, w, p + "fc1")), w, p + "fc2")
        all_probs.append(probs)
    x = _layer_norm(x, w, P + "final_layer_norm")
    return x[-1] @ w[P + "embed_tokens.weight"].T, all_probs


def llama_forward(cfg, w: dict, ids: list, visible: list, quant: tuple = (None, 0)) -> tuple:
    """Llama with grouped KV heads. -> (logits of the last position (vocab,), [probs (kv, T, T) per layer])."""
    T, d = len(ids), cfg.head_dim
    x = w["model.embed_tokens.weight"][ids]  # (T, h)
    cos, sin = _rope(T, d, cfg.rope_theta)  # (T, d)
    all_probs = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        y = _rms_norm(x, w[p + "input_layernorm.weight"], cfg.norm_eps)
        q, k, v = (y @ w[f"{p}self_attn.{name}_proj.weight"].T for name in "qkv")
        q, k = _rotate(q, cos, sin, d), _rotate(k, cos, sin, d)
        o, probs = attention(q, k, v, visible[i], cfg.num_heads, cfg.kv_heads, *quant)
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


FORWARD = {"opt": opt_forward, "llama": llama_forward}


# ---- generation -------------------------------------------------------------------------------------------------
@dataclass
class RefGeneration:
    tokens: list  # gen_len token ids
    step_logits: list  # gen_len tensors (vocab,)
    kept: list = field(default_factory=list)  # per layer: per KV head, the sorted kept positions after the last step


def generate(cfg, weights: dict, prompt: list, gen_len: int, policy: RefPolicy,
             forced: Optional[list] = None, kv_quant: Optional[Callable] = None) -> RefGeneration:
    """Greedy (or teacher-forced with `forced`) generation of one unpadded prompt under `policy`, fp32.
    `kv_quant`: the quantize-dequantize of a compressed cache, applied to the K/V generated tokens read."""
    w = {name: t.float() for name, t in weights.items()}
    forward = FORWARD[cfg.family]
    n, L, H = len(prompt), cfg.num_layers, cfg.kv_heads
    size = n + gen_len
    visible = [torch.zeros(H, size, size, dtype=torch.bool) for _ in range(L)]  # per layer (kv, query, key)
    score = [torch.zeros(H, size, dtype=torch.float32) for _ in range(L)]  # per layer (kv, position)
    kept = [[set() for _ in range(H)] for _ in range(L)]
    ids = list(prompt)
    out = RefGeneration([], [])
    for step in range(gen_len):
        T = len(ids)
        cur = T - 1
        if step == 0:
            for layer in range(L):
                visible[layer][:, :T, :T] = torch.ones(T, T, dtype=torch.bool).tril()
        else:
            for layer in range(L):
                for head in range(H):
                    visible[layer][head, cur, sorted(kept[layer][head] | {cur})] = True
        logits, probs = forward(cfg, w, ids, [m[:, :T, :T] for m in visible], (kv_quant, n))
        for layer in range(L):
            if step == 0:
                score[layer][:, :T] = probs[layer].sum(1)  # every prompt query, fp32
            else:
                score[layer][:, :T] += probs[layer][:, cur]  # the new query, its own token included
            for head in range(H):
                _apply_policy(policy, kept[layer][head], step, cur, score[layer][head], layer, head)
        nxt = int(logits.argmax()) if forced is None else int(forced[step])
        out.tokens.append(nxt)
        out.step_logits.append(logits)
        ids.append(nxt)
    out.kept = [[sorted(s) for s in row] for row in kept]
    return out


def _apply_policy(policy: RefPolicy, kept: set, step: int, cur: int, score: torch.Tensor, layer: int, head: int):
    """Update one (layer, KV head)'s kept set in place after the attention of `step`."""
    value = lambda t: float(score[t])  # noqa: E731
    if step == 0:
        kept |= policy.prefill(cur + 1, value, layer, head)
        return
    kept.add(cur)
    while policy.budget is not None and len(kept) > policy.budget:
        kept.remove(policy.evict(kept, cur, value, layer, head))
