"""Reference KV-eviction generation, written apart from the engine so the engine can be checked against it.

Plain and slow on purpose:
  * one unpadded sequence at a time (so padding cannot leak in: the reference never sees any);
  * every step recomputes the whole sequence from scratch (OPT or Llama, written out below) under a keep-mask
    `visible[layer][kv_head, query, key]`: query q sees exactly the tokens its (layer, KV head) kept when q was
    generated, plus itself. The prompt's queries see the whole causal prefix (prefill is full attention);
  * kept sets are Python sets per (layer, KV head), next to a History per (layer, KV head): for every token, the
    list of (query, probability) of every query that attended to it (summed over the query heads sharing the KV
    head), and the L1 norm of its value vector;
  * each policy is a handful of lines over those sets, its value of a token computed from the History by the
    policy's definition (class `RefPolicy`), never from a running score.
  * policies whose KV heads share a budget (adakv) decide a layer's sets together (`layer_prefill`, `layer_evict`);
    a merging policy (merge) logs each merge as an event, and the attention replays the events into the values every
    later query reads (`merged_values`), so merged values are never kept as state either.

Only `random_key` (the seeded hash that defines the `random` policy's choice) comes from the engine.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from functools import lru_cache
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from flexh2o.kv.policies.random import random_key


# ---- policies ---------------------------------------------------------------------------------------------------
@dataclass
class History:
    """What a (layer, KV head) has seen: `probs[t]` lists (query position, probability the query gave token t,
    summed over the query heads of the KV head) for every query that attended to t; `vnorm[t]` is the L1 norm of
    token t's value vector."""

    probs: dict = field(default_factory=dict)
    vnorm: dict = field(default_factory=dict)

    def seen(self, query: int, token: int, p: float) -> None:
        self.probs.setdefault(token, []).append((query, p))


# heavy tokens + a protected recent window
WINDOWED = ("h2o", "random", "a2sf", "mean_attn", "vatp", "h2o_sinks", "mean_vnorm", "pyramid", "adakv", "merge")
SINKS = ("streaming", "vatp", "h2o_sinks", "mean_vnorm", "pyramid", "adakv", "merge")  # first num_sinks protected
MEAN = ("mean_attn", "pyramid", "adakv", "merge")  # value: the mean attention a token received
MERGING = ("merge",)  # an evicted token's value goes into the kept token of the most similar key (`merge_events`)
SHARED_HEADS = ("adakv",)  # the KV heads of a layer share heads x budget tokens, each at most head_cap x budget
LAYERED = ("pyramid",)  # each layer has its own budget (`layer_total`)
# A wrapped name WRAPPER:BASE (pyramid:tova, adakv:vatp, merge:h2o) is the wrapper's rule (LAYERED, SHARED_HEADS or
# MERGING) over BASE's value and protection, with the first num_sinks tokens protected too; the plain wrapper names
# are the wrappers over mean_attn.
WRAPPERS = MERGING + SHARED_HEADS + LAYERED


@dataclass(frozen=True)
class RefPolicy:
    """name in full / local / streaming / tova: a budget of `heavy + recent` tokens (streaming: the first
    `num_sinks` of them are the attention sinks). The WINDOWED policies keep the `recent` newest tokens plus `heavy`
    others by their value (`_value`); those in SINKS also keep the first `num_sinks` tokens. pyramid: layer `layer`
    of `num_layers` has its own budget (`layer_total`). WRAPPER:BASE: see WRAPPERS."""

    name: str
    heavy: int = 0
    recent: int = 0
    num_sinks: int = 4
    seed: int = 0
    hh_decay: float = 0.98
    num_layers: int = 1
    pyramid_ratio: float = 0.5
    head_cap: float = 2.0

    @property
    def wrapper(self) -> Optional[str]:
        head = self.name.split(":")[0]
        return head if head in WRAPPERS else None

    @property
    def base(self) -> str:
        """The policy whose value and protection a wrapper keeps (the name itself when not wrapped)."""
        if ":" in self.name:
            return self.name.split(":", 1)[1]
        return "mean_attn" if self.name in WRAPPERS else self.name

    @property
    def shares_heads(self) -> bool:
        return self.wrapper in SHARED_HEADS

    @property
    def merging(self) -> bool:
        return self.wrapper in MERGING

    @property
    def budget(self) -> Optional[int]:
        return None if self.name == "full" else self.heavy + self.recent

    def budget_at(self, layer: int) -> Optional[int]:
        if self.wrapper in LAYERED:
            return self.layer_total(layer)
        return self.budget

    def most_per_head(self, layer: int) -> Optional[int]:
        """The most tokens one KV head of `layer` may hold."""
        if self.shares_heads:
            return math.floor(self.head_cap * self.budget)
        return self.budget_at(layer)

    def layer_heavy(self, layer: int) -> int:
        """pyramid over a windowed policy: layer's budget less the recent window."""
        return self.layer_total(layer) - self.recent

    def layer_total(self, layer: int) -> int:
        """pyramid: the P protected tokens (the window, when the base has one, and the sinks) + the layer's share of
        the L * (budget - P) free tokens, shares proportional to (L - 1) * b + (a - b) * layer for ratio a / b,
        rounded by largest remainder (ties to the lower layer)."""
        L, r = self.num_layers, Fraction(self.pyramid_ratio)
        a, b = r.numerator, r.denominator
        w = [max(1, L - 1) * b + (a - b) * i for i in range(L)]
        protected = (self.recent if self.base in WINDOWED else 0) + self.num_sinks
        free = L * (self.budget - protected)
        floor = [free * x // sum(w) for x in w]
        left = free - sum(floor)
        extra = sorted(range(L), key=lambda i: (-(free * w[i] % sum(w)), i))[:left]
        return protected + floor[layer] + (layer in extra)

    def prefill(self, n: int, hist: History, layer: int, head: int, first: int = 0) -> set:
        """Positions kept out of an n-token prompt whose positions below `first` are gone (a sliding window)."""
        everything = set(range(first, n))
        budget = self.budget_at(layer)
        if budget is None or len(everything) <= budget:
            return everything
        if self.name == "local":
            return set(range(n - self.budget, n))
        if self.name == "streaming":
            return (set(range(self.num_sinks)) & everything) | set(range(n - (self.budget - self.num_sinks), n))
        if self.name == "tova":
            return set(sorted(everything, key=lambda t: (self._value(t, n - 1, hist, layer, head), t),
                              reverse=True)[:self.budget])  # ties keep the newer
        protect = self._protected(everything, n - 1)
        value = lambda t: (self._value(t, n - 1, hist, layer, head), t)  # noqa: E731
        heavy = sorted(everything - protect, key=value, reverse=True)[:budget - len(protect)]
        return protect | set(heavy)

    def layer_prefill(self, n: int, hists: list, layer: int) -> list:
        """SHARED_HEADS: the kept positions of every head (hists: one History per head) out of an n-token prompt:
        the protected ones, then greedily by value (ties: newer, then lower head) while the layer and the head
        have room."""
        heads, cap = len(hists), self.most_per_head(layer)
        kept = [self._protected(set(range(n)), n - 1) for _ in range(heads)]
        pool = [(self._value(t, n - 1, hists[h], layer, h), t, -h) for h in range(heads)
                for t in set(range(n)) - kept[h]]
        for _, t, neg_head in sorted(pool, reverse=True):
            if sum(map(len, kept)) < heads * self.budget and len(kept[-neg_head]) < cap:
                kept[-neg_head].add(t)
        return kept

    def layer_evict(self, kept: list, cur: int, hists: list, layer: int) -> None:
        """SHARED_HEADS, in place: drop tokens while the layer holds more than heads x budget or a head more than
        its cap, each time the lowest value (ties: older, then lower head) of the over-cap heads, else of all."""
        heads, cap = len(kept), self.most_per_head(layer)
        while sum(map(len, kept)) > heads * self.budget or max(map(len, kept)) > cap:
            over = [h for h in range(heads) if len(kept[h]) > cap] or range(heads)
            pool = [(self._value(t, cur, hists[h], layer, h), t, h) for h in over
                    for t in kept[h] - self._protected(kept[h], cur)]
            _, t, h = min(pool)
            kept[h].remove(t)

    def evict(self, kept: set, cur: int, hist: History, layer: int, head: int) -> int:
        """The position to drop from `kept` (which holds one token too many; `cur` is the newest position)."""
        if self.name == "local":
            return min(kept)
        if self.name == "streaming":
            return min(t for t in kept if t >= self.num_sinks)
        outside = kept - self._protected(kept, cur)
        return min(outside, key=lambda t: (self._value(t, cur, hist, layer, head), t))  # ties evict the older

    def _protected(self, kept: set, cur: int) -> set:
        window = {t for t in kept if t > cur - self.recent} if self.base in WINDOWED else set()  # R newest
        sinks = self.base in SINKS or self.wrapper is not None
        return window | ({t for t in kept if t < self.num_sinks} if sinks else set())

    def mass(self, t: int, cur: int, hist: History) -> float:
        """The attention token t has received by query cur as the base policy accumulates it (a merge's weight):
        tova only the newest query's, a2sf each query's weighted by hh_decay ** its age, the others the plain sum."""
        seen = hist.probs.get(t, [])
        if self.base == "tova":
            return sum(p for q, p in seen if q == cur)
        if self.base == "a2sf":
            return sum(self.hh_decay ** (cur - q) * p for q, p in seen)
        return sum(p for _, p in seen)

    def _value(self, t: int, cur: int, hist: History, layer: int, head: int) -> float:
        """How much a policy wants to keep token t when the newest position is cur, from its history alone."""
        seen = hist.probs.get(t, [])
        total = sum(p for _, p in seen)
        base = self.base
        if base == "random":
            return ref_random_key(self.seed, layer, head, t)
        if base in ("tova", "a2sf"):
            return self.mass(t, cur, hist)
        if base in MEAN:
            return total / len(seen)
        if base == "vatp":
            return total * hist.vnorm[t]
        if base == "mean_vnorm":
            return total / len(seen) * hist.vnorm[t]
        return total  # h2o, h2o_sinks


@lru_cache(maxsize=None)
def ref_random_key(seed: int, layer: int, head: int, pos: int) -> float:
    """The `random` policy's key of one token: random_key reads the KV head from dimension 1 of its input."""
    grid = torch.full((1, head + 1, 1), pos, dtype=torch.int64)
    return float(random_key(seed, layer, grid)[0, head, 0])


# ---- models -----------------------------------------------------------------------------------------------------
def attention(q, k, v, visible, num_heads: int, kv_heads: int, kv_quant: Optional[Callable] = None,
              prompt_len: int = 0, merges: Optional[list] = None) -> tuple:
    """q (T, n*d), k/v (T, kv*d), visible (kv, T, T) bool -> (out (T, n*d), (probs (kv, T, T) summed over each group,
    L1 norms of the values (kv, T), keys (kv, T, d))).
    `merges`: per KV head, the merge events (see `merged_values`) that change the values later queries read.

    With `kv_quant` (a quantize-dequantize of (T, kv, d) K or V; or a pair of them, keys' and values', each taking
    (x, prompt_len): tests/reference_quant.py), the queries after the prompt (generated tokens) read the quantized
    K/V, as from a compressed cache; the prompt's queries read them exact (prefill attends before the cache is
    written). A third member W > 0 of the pair (reference_quant.recent): query i reads token j exact when j > i - W
    (the cache's newest W tokens); a fourth S > 0: also when j < S (the sequence's first S tokens)."""
    if kv_quant is None:
        return _attention(q, k, v, visible, num_heads, kv_heads, merges)
    assert not merges or not any(merges), "the reference merges only exact K/V"
    T = q.shape[0]
    pair = kv_quant if isinstance(kv_quant, tuple) else (lambda x, n: kv_quant(x),) * 2
    qk, qv = (f(x.view(T, kv_heads, -1), prompt_len).reshape(T, -1) for f, x in zip(pair, (k, v)))
    exact = _attention(q, k, v, visible, num_heads, kv_heads)
    if len(pair) > 2 and any(pair[2:]):
        packed = _mixed(q, (k, qk), (v, qv), visible, num_heads, kv_heads, *pair[2:])
    else:
        packed = _attention(q, qk, qv, visible, num_heads, kv_heads)
    later = torch.arange(T) >= prompt_len  # (T,) query rows that read the cache
    vnorm = packed[1][1] if T > prompt_len else exact[1][1]  # decode steps weigh the values the cache holds
    return (torch.where(later[:, None], packed[0], exact[0]),
            (torch.where(later[None, :, None], packed[1][0], exact[1][0]), vnorm, exact[1][2]))


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
    j > i - window or j < sinks, the quantized ones otherwise; the value norms are those the newest query reads."""
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
    return (out.transpose(0, 1).reshape(T, num_heads * d),
            (probs.view(kv_heads, group, T, T).sum(1), vnorm, k[0].view(T, kv_heads, d).transpose(0, 1)))


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


def merge_events(kept: set, evicted: set, cur: int, hist: History, keys: torch.Tensor,
                 weight: Optional[Callable] = None) -> list:
    """The merge events of tokens `evicted` after query `cur` (keys (T, d) of the head): each source goes into the
    kept token of highest key cosine (ties: the older), weighted by the attention each has received so far
    (`weight`(t): default the plain sum of its probabilities)."""
    def mass(t):
        return weight(t) if weight is not None else sum(p for _, p in hist.probs.get(t, []))

    def cos(a, b):
        return float(keys[a] @ keys[b]) / (max(float(keys[a].norm()), 1e-8) * max(float(keys[b].norm()), 1e-8))
    into = {}
    for e in sorted(evicted):
        t = max(kept, key=lambda t: (cos(e, t), -t))
        into.setdefault(t, []).append((e, mass(e)))
    return [(cur, t, sources, mass(t)) for t, sources in sorted(into.items())]


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


# ---- generation -------------------------------------------------------------------------------------------------
@dataclass
class RefGeneration:
    tokens: list  # gen_len token ids
    step_logits: list  # gen_len tensors (vocab,)
    kept: list = field(default_factory=list)  # per layer: per KV head, the sorted kept positions after the last step


def generate(cfg, weights: dict, prompt: list, gen_len: int, policy: RefPolicy,
             forced: Optional[list] = None, kv_quant: Optional[Callable] = None,
             forward: Optional[Callable] = None) -> RefGeneration:
    """Greedy (or teacher-forced with `forced`) generation of one unpadded prompt under `policy`, fp32.
    `kv_quant`: the quantize-dequantize of a compressed cache, applied to the K/V generated tokens read.
    `forward`: the model's forward pass, as FORWARD's (default: FORWARD's of cfg.family; tests/reference_gemma.py)."""
    w = {name: t.float() for name, t in weights.items()}
    forward = forward or FORWARD[cfg.family]
    n, L, H = len(prompt), cfg.num_layers, cfg.kv_heads
    size = n + gen_len
    visible = [torch.zeros(H, size, size, dtype=torch.bool) for _ in range(L)]  # per layer (kv, query, key)
    hist = [[History() for _ in range(H)] for _ in range(L)]
    kept = [[set() for _ in range(H)] for _ in range(L)]
    merges = [[[] for _ in range(H)] for _ in range(L)]  # per layer and KV head, the merge events so far
    ids = list(prompt)
    out = RefGeneration([], [])
    for step in range(gen_len):
        T = len(ids)
        cur = T - 1
        if step == 0:
            for layer in range(L):
                visible[layer][:, :T, :T] = _causal(T, cfg.window(layer) if hasattr(cfg, "window") else None)
        else:
            for layer in range(L):
                for head in range(H):
                    visible[layer][head, cur, sorted(kept[layer][head] | {cur})] = True
        logits, stats = forward(cfg, w, ids, [m[:, :T, :T] for m in visible], (kv_quant, n), merges)
        for layer in range(L):
            probs, vnorm, keys = stats[layer]
            before = [set(range(T)) if step == 0 else s | {cur} for s in kept[layer]]
            for head in range(H):
                _record(hist[layer][head], probs[head], visible[layer][head, :T, :T], vnorm[head],
                        range(T) if step == 0 else [cur])
            _apply_layer(policy, kept[layer], step, cur, hist[layer], layer,
                         cfg.window(layer) if hasattr(cfg, "window") else None)
            for head in range(H) if policy.merging else ():
                h = hist[layer][head]
                merges[layer][head] += merge_events(kept[layer][head], before[head] - kept[layer][head], cur, h,
                                                    keys[head], lambda t, h=h: policy.mass(t, cur, h))
        nxt = int(logits.argmax()) if forced is None else int(forced[step])
        out.tokens.append(nxt)
        out.step_logits.append(logits)
        ids.append(nxt)
    out.kept = [[sorted(s) for s in row] for row in kept]
    return out


def _record(hist: History, probs: torch.Tensor, visible: torch.Tensor, vnorm: torch.Tensor, queries) -> None:
    """Add what `queries` gave every token they saw (probs, visible: (T, T)); the value norms are the latest."""
    hist.vnorm.update(enumerate(vnorm.tolist()))
    for q in queries:
        for t in visible[q].nonzero()[:, 0].tolist():
            hist.seen(q, t, float(probs[q, t]))


def _causal(T: int, window: Optional[int]) -> torch.Tensor:
    """(T, T) bool: query q sees keys k <= q, and only k > q - window in a sliding-window layer."""
    q, k = torch.arange(T)[:, None], torch.arange(T)[None, :]
    return (k <= q) & (k > q - window) if window is not None else k <= q


def _apply_layer(policy: RefPolicy, kept: list, step: int, cur: int, hists: list, layer: int,
                 window: Optional[int] = None):
    """Update one layer's kept sets (one per KV head) in place after the attention of `step`. A sliding window
    first drops what the next query (cur + 1) cannot see; the policy then chooses among the rest."""
    if not policy.shares_heads:
        for head, k in enumerate(kept):
            _apply_policy(policy, k, step, cur, hists[head], layer, head, window)
        return
    assert window is None, "the reference windows only policies whose heads decide alone"
    if step == 0:
        kept[:] = policy.layer_prefill(cur + 1, hists, layer)
        return
    for k in kept:
        k.add(cur)
    policy.layer_evict(kept, cur, hists, layer)


def _apply_policy(policy: RefPolicy, kept: set, step: int, cur: int, hist: History, layer: int, head: int,
                  window: Optional[int] = None):
    """Update one (layer, KV head)'s kept set in place after the attention of `step`."""
    first = 0 if window is None else max(0, cur + 2 - window)  # the oldest position the next query sees
    if step == 0:
        kept |= policy.prefill(cur + 1, hist, layer, head, first)
        return
    kept.add(cur)
    kept -= {t for t in kept if t < first}
    while policy.budget is not None and len(kept) > policy.budget_at(layer):
        kept.remove(policy.evict(kept, cur, hist, layer, head))
