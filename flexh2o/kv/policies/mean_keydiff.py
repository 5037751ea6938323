"""`mean_keydiff`: mean_attn's priority joined with how unlike the other held keys a token's key is (KeyDiff's key
diversity, Park et al. 2025), by ranks: a token both little attended and with a key like the rest is the one dropped.

Budget and protection as mean_attn: `heavy` + `recent` tokens, the `recent` newest positions protected. Among a row's
held tokens (those in its slots, the protected ones and the incoming one included), per KV head: a = each token's
rank by mean_attn's value (the sum of the attention probability every query gave it, summed over the query heads
of the KV head, divided by the c - p + 1 queries that saw it), d = its rank by minus the cosine similarity of its
cached key to the mean of the held keys (in fp32; at a decode step the keys as the cache holds them, dequantized;
at prefill the prompt's exact keys, as vatp reads the values). Ranks count from 0
for the lowest value, equal values ranking the older position lower. Priority: a + keydiff_weight * d
(--keydiff-weight).
Lowest priority is evicted, ties evict the older position.

Measured on SmolLM2-135M (benchmarks/ACCURACY.md, 2026-12-05, f779f4a): at 425 of 1024 tokens it loses less perplexity
than mean_attn, plain or with the 3-bit cache (simulated in benchmarks/evict_sim.py first, as prio='distinct').
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from flexh2o.kv.policies.mean_attn import MeanAttentionPolicy
from flexh2o.kv.policies.params import Param

if TYPE_CHECKING:  # torch is imported where a tensor is made: the flags' parser reads the policies without it
    import torch

DEFAULT_KEYDIFF_WEIGHT = 1.0
KEYDIFF_WEIGHT = Param("keydiff_weight", float, DEFAULT_KEYDIFF_WEIGHT, "the mean_keydiff policy's weight of a "
                       "token's key-distinctness rank against its mean-attention rank, >= 0; 0 = mean_attn "
                       f"(default {DEFAULT_KEYDIFF_WEIGHT:g})", lo=0.0)


def held_ranks(pos: torch.Tensor, *values: torch.Tensor) -> list:
    """For each x of `values` (b, h, s): fp32 (b, h, s), each held slot's (pos >= 0) rank by x among its row's held
    slots, 0 for the lowest, equal values ranking the older position lower; empty slots rank after every held one."""
    import torch
    by_age = torch.argsort(pos, dim=-1, stable=True)  # oldest first: a stable sort by x then keeps age in ties
    steps = torch.arange(pos.shape[-1], device=pos.device).expand_as(pos)
    out = []
    for x in values:
        x = torch.where(pos >= 0, x.float(), torch.inf)
        order = torch.gather(by_age, -1, torch.argsort(torch.gather(x, -1, by_age), dim=-1, stable=True))
        out.append(torch.empty_like(order).scatter_(-1, order, steps).float())
    return out


def key_distinctness(k: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """(b, h, s) fp32: minus the cosine similarity of each slot's key to the mean of its row's held keys (0 where
    either is a zero vector)."""
    import torch
    k, held = k.float(), (pos >= 0).float()
    mean = torch.einsum("bhsd,bhs->bhd", k, held) / held.sum(-1, keepdim=True).clamp(min=1)
    norms = torch.linalg.vector_norm(k, dim=-1) * torch.linalg.vector_norm(mean, dim=-1, keepdim=True)
    return -torch.einsum("bhsd,bhd->bhs", k, mean) / norms.clamp(min=torch.finfo(torch.float32).tiny)


class MeanKeyDiffPolicy(MeanAttentionPolicy):
    name = "mean_keydiff"
    needs_keys = True
    params = (KEYDIFF_WEIGHT,)

    def priority(self, pos, score, layer, cur_pos, obs):
        if obs.keys is None:
            raise ValueError("the mean_keydiff policy needs the cached keys")
        attended, unlike = held_ranks(pos, super().priority(pos, score, layer, cur_pos, obs),
                                      key_distinctness(obs.keys, pos))
        return attended + self.keydiff_weight * unlike
