"""`mean_keydiff`: mean_attn's priority joined with how unlike the other held keys a token's key is (KeyDiff's key
diversity, Park et al. 2025), by ranks: a token both little attended and with a key like the rest is the one dropped.

Budget and protection as mean_attn: `heavy` + `recent` tokens, the `recent` newest positions protected. Among a row's
held tokens (those in its slots, the protected ones and the incoming one included), per KV head: a = each token's
rank by mean_attn's value (the sum of the attention probability every query gave it, summed over the query heads
of the KV head, divided by the c - p + 1 queries that saw it), d = its rank by minus the cosine similarity of its
cached key to the mean of the held keys (the keys as the cache holds them: dequantized, in fp32). Ranks count from 0
for the lowest value, equal values ranking the older position lower. Priority: a + keydiff_weight * d
(--keydiff-weight).
Lowest priority is evicted, ties evict the older position.

Measured on SmolLM2-135M (benchmarks/ACCURACY.md, issue 26): at 425 of 1024 tokens it loses less perplexity than
mean_attn, plain or with the 3-bit cache (simulated in benchmarks/evict_sim.py first, as prio='distinct').
"""
import torch

from flexh2o.kv.policies.mean_attn import MeanAttentionPolicy
from flexh2o.kv.policies.params import Param

DEFAULT_KEYDIFF_WEIGHT = 1.0
KEYDIFF_WEIGHT = Param("keydiff_weight", float, DEFAULT_KEYDIFF_WEIGHT, "the mean_keydiff policy's weight of a "
                       "token's key-distinctness rank against its mean-attention rank, >= 0; 0 = mean_attn "
                       f"(default {DEFAULT_KEYDIFF_WEIGHT:g})", lo=0.0)


def held_rank(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """(b, h, s) fp32: each held slot's (pos >= 0) rank by x among its row's held slots, 0 for the lowest, equal
    values ranking the older position lower; empty slots rank after every held one."""
    x = torch.where(pos >= 0, x.float(), torch.inf)
    order = torch.argsort(pos, dim=-1, stable=True)  # oldest first, then by x: the stable sort keeps age in ties
    order = torch.gather(order, -1, torch.argsort(torch.gather(x, -1, order), dim=-1, stable=True))
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(order.shape[-1], device=pos.device).expand_as(order))
    return rank.float()


def key_distinctness(k: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """(b, h, s) fp32: minus the cosine similarity of each slot's key to the mean of its row's held keys."""
    k = k.float()
    held = (pos >= 0).unsqueeze(-1)
    anchor = (k * held).sum(-2, keepdim=True) / held.sum(-2, keepdim=True).clamp(min=1)
    return -torch.nn.functional.cosine_similarity(k, anchor, dim=-1)


class MeanKeyDiffPolicy(MeanAttentionPolicy):
    name = "mean_keydiff"
    needs_keys = True
    params = (KEYDIFF_WEIGHT,)

    def priority(self, pos, score, layer, cur_pos, v, obs=None):
        if obs is None or obs.keys is None:
            raise ValueError("the mean_keydiff policy needs the cached keys")
        attended = held_rank(super().priority(pos, score, layer, cur_pos, v), pos)
        return attended + self.keydiff_weight * held_rank(key_distinctness(obs.keys, pos), pos)
