"""Prefill attention over a prompt, in two stages: attend (chunked, scoring the keys under the policy's query
weights) and keep (the policy's keep-mask, the kept tokens packed into a fresh block): kv/attention.py's prefill.

Probabilities are materialised (chunk by chunk) only when query weights are given (the policy scores tokens and an
eviction can happen) or logits are soft-capped; otherwise the fused attention kernel runs. A sliding-window layer's
query p sees the keys of positions p - window < k <= p, and the block keeps only what the next query sees
(positions > newest + 1 - window), the policy choosing among those alone. softcap: attention logits become
softcap * tanh(logits / softcap) before the mask (Gemma 2). Grouped heads: query head n reads KV head n // group;
scores are summed over the query heads of a KV head's group, in fp32.
"""
from __future__ import annotations

from typing import Optional

import torch

from flexh2o.compress.form import as_form
from flexh2o.kv.cache import KVBlock, merged_values
from flexh2o.kv.policies.base import KVPolicy, Observed
from flexh2o.kv.sdpa import capped, prefill_chunk, sdpa


def prefill(q, k, v, pos, policy: KVPolicy, layer: int, blk: KVBlock, chunk: int, scores: bool = True,
            window: Optional[int] = None, softcap: Optional[float] = None) -> torch.Tensor:
    """q (b, n, t, d), k/v (b, kv, t, d), pos (b, t) int64 (-1 = padding) -> out (b, n, t, d); the kept tokens
    are packed into `blk` (an empty block, or rows of one). scores: whether an eviction can happen (the policy's
    scores are then computed, when it reads them)."""
    b, t = pos.shape
    weights = policy.query_weights(pos).view(1, b, t) if scores and policy.needs_scores else None
    out, score = attend(q, k, v, pos, weights, chunk, window, softcap)
    keep(k, v, pos, score[0], policy, layer, blk, window, scores)
    return out


def attend(q, k, v, pos, weights: Optional[torch.Tensor], chunk: int, window: Optional[int] = None,
           softcap: Optional[float] = None) -> tuple:
    """q (b, n, t, d), k/v (b, kv, t, d), pos (b, t), weights (m, b, t) fp32 or None -> (out (b, n, t, d), score
    (m, b, kv, t) fp32): for each of the m query weightings, the probability each key received from the queries so
    weighted, summed over a KV head's query heads (m = 1 and zeros when weights is None: the fused kernel runs)."""
    b, n, t, d = q.shape
    kv = k.shape[1]
    g = n // kv
    valid = pos >= 0  # (b, t)
    out = torch.empty_like(q)
    qg = q.view(b, kv, g, t, d)
    idx = torch.arange(t, device=q.device)
    score = torch.zeros(1 if weights is None else len(weights), b, kv, t, dtype=torch.float32, device=q.device)
    chunk = prefill_chunk(b, n, t, chunk, q.device.type)
    causal_only = window is None and q.device.type == "cpu" and bool(valid.all())  # (no host sync off the CPU)
    fused = weights is None and softcap is None  # no probabilities needed: the fused kernel
    qs = qg if fused else qg * d ** -0.5
    for s in range(0, t, chunk):
        e = min(t, s + chunk)  # the chunk's queries see keys before e only: the fused kernel reads no later one
        f = e if fused else t  # (a matmul over a slice of the keys copies them, costing more than it saves)
        allowed = _allowed(idx, valid, s, e, f, window, causal_only)
        if fused:
            out[:, :, s:e] = sdpa(q[:, :, s:e], k[:, :, :f], v[:, :, :f], attn_mask=allowed[:, None],
                                  enable_gqa=g > 1)
        else:
            _scored_chunk(qs[:, :, :, s:e], k[:, :, :f], v[:, :, :f], allowed, weights, softcap, out[:, :, s:e],
                          score, s)
    return out, score


def _allowed(idx, valid, s: int, e: int, f: int, window: Optional[int], causal_only: bool) -> torch.Tensor:
    """The keys (of the first f) that queries s:e see: (1, c, f) when no row has padding or window, else (b, c, f)."""
    ki = idx[None, :f]
    if causal_only:  # no padding, no window: one (1, c, f) mask for every row
        return (ki <= idx[s:e, None])[None]
    allowed = (ki <= idx[s:e, None])[None] & valid[:, None, :f]  # (b, c, f)
    if window is not None:  # left padding shifts index and position alike: the window holds in either
        allowed = allowed & (ki > idx[s:e, None] - window)[None]
    return allowed | (ki == idx[s:e, None])[None]  # a padding query sees itself: no NaN


def _scored_chunk(qs, kc, vc, allowed, weights, softcap, out, score, s: int) -> None:
    """One chunk's attention with its probabilities: qs (b, kv, g, c, d) scaled, kc/vc (b, kv, f, d) -> out
    (b, n, c, d) written in place, and each query weighting's (weights[j] over queries s:s+c) scores added to
    score[j] (padding queries add 0)."""
    b, n, c, d = out.shape
    att = capped(torch.einsum("bhgqd,bhkd->bhgqk", qs, kc).float(), softcap)
    att = att.masked_fill_(~allowed[:, None, None], float("-inf")).softmax(-1)
    out.copy_(torch.einsum("bhgqk,bhkd->bhgqd", att.to(vc.dtype), vc).reshape(b, n, c, d))
    for j, w in enumerate(weights if weights is not None else ()):
        score[j] += torch.matmul(w[:, None, None, None, s:s + c], att).sum(2)[:, :, 0]


def keep(k, v, pos, score, policy: KVPolicy, layer: int, blk: KVBlock, window: Optional[int] = None,
         scores: bool = True) -> None:
    """The prompt's eviction: k/v (rows, kv, t, d), pos (rows, t), score (rows, kv, t) -> the policy's kept tokens
    (a windowed layer's: only among what the next query sees; a merging policy's dropped values merged into kept
    ones, when `scores`) packed into the first slots of `blk`."""
    rows, kv, t = score.shape
    keys32 = k.float() if policy.needs_keys or (policy.merges and scores) else None
    kpos = pos[:, None, :].expand(rows, kv, t)
    cur = pos.max(-1).values  # (rows,)
    if window is not None:  # what the next query cannot see is gone before the policy chooses
        kpos = torch.where(kpos > (cur + 1 - window)[:, None, None], kpos, -1)
    kept = policy.prefill_keep(kpos, score, layer, cur, obs=Observed(keys32, v).only(policy))
    if policy.merges and scores:  # the dropped prompt tokens' values go into kept ones (the policy says where)
        target, mass = policy.merge_plan(kpos, score, keys32, (kpos >= 0) & ~kept)
        v = merged_values(v.float(), target, mass)[0].to(v.dtype)
    pack(k, v, kpos, score, kept, blk)


def pack(k, v, pos, score, keep, blk: KVBlock) -> None:
    """Move kept tokens into the first slots of an empty block; the rest stay empty."""
    b, kv, t, d = k.shape
    order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)[..., :blk.pos.shape[-1]]  # kept first
    m = order.shape[-1]
    take = keep.gather(-1, order)
    first = (slice(None), slice(None), slice(0, m))
    blk.calibrate(k, pos >= 0)  # keys per channel: scales from every prompt token, kept or not
    kept = [x.gather(2, order[..., None].expand(b, kv, m, d)) for x in (k, v)]
    forms = as_form(blk.k), as_form(blk.v)
    for form, val in zip(forms, kept):
        form.assign(first, val)  # quantized here when compressed
    blk.pos[:, :, :m] = torch.where(take, pos.gather(-1, order), -1)
    for form, val in zip(forms, kept):
        form.remember_prompt(blk.pos[:, :, :m], val)  # a form keeping the newest tokens exact (compress/recent.py)
    blk.score[:, :, :m] = torch.where(take, score.gather(-1, order), 0.0)
