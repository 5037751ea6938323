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

The policies live in tests/reference_policy.py, the attention and the models in tests/reference_forward.py;
this module runs the generation (tests read `ref.generate` and `ref.RefPolicy`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from reference_forward import FORWARD
from reference_policy import History, RefPolicy, merge_events  # noqa: F401 (RefPolicy: read as ref.RefPolicy)


# ---- generation -------------------------------------------------------------------------------------------------
@dataclass
class RefGeneration:
    tokens: list  # gen_len token ids
    step_logits: list  # gen_len tensors (vocab,)
    kept: list = field(default_factory=list)  # per layer: per KV head, the sorted kept positions after the last step
    # the first step whose logits the data may decide rather than the definitions (a level the quantizer rounds within
    # float noise of a half, an eviction within float noise of a tie): None = every step is determined
    unsure_from: Optional[int] = None


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
                        range(T) if step == 0 else [cur], keys[head])
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


def _record(hist: History, probs: torch.Tensor, visible: torch.Tensor, vnorm: torch.Tensor, queries,
            keys: Optional[torch.Tensor] = None) -> None:
    """Add what `queries` gave every token they saw (probs, visible: (T, T)); the value norms (and keys (T, d), as
    the cache holds them) are the latest."""
    hist.vnorm.update(enumerate(vnorm.tolist()))
    if keys is not None:
        hist.keys.update(enumerate(keys.double()))
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
