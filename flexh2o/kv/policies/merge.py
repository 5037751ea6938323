"""Merging (after CaM, Zhang et al. 2024, and D2O, Wan et al. 2024): the wrapper `Merging` makes any scoring policy
merge an evicted token's value into the most similar kept token of its sequence and KV head instead of dropping
it, with the first `num_sinks` positions protected too. `merge` is it over mean_attn (`merge:POLICY` over another
scoring policy, e.g. `merge:h2o`).

Which tokens stay: the wrapped policy's choice with the sinks protected. `merge`'s, as pyramid with --pyramid-ratio 1
(the same budget in every layer): `heavy` + `recent` tokens per sequence, layer and KV head; the `recent` newest and
the first `num_sinks` positions protected (--num-sinks; num_sinks <= heavy); the others ranked by their summed
attention (over the query heads of the KV head, fp32) divided by c - p + 1; the lowest goes, ties evict the older
position.

Merging, whenever tokens are evicted (prefill: every prompt token not kept; decode: the one evicted token):
  * target: the kept token t (after the eviction; the newest token included) of the same sequence and KV head
    whose key is most similar to the evicted token e's, by cosine k_e . k_t / (max(|k_e|, 1e-8) max(|k_t|, 1e-8))
    in fp32, on the keys as the cache holds them (dequantized when compressed; at prefill, the prompt's keys as
    computed, before the cache stores them); ties go to the older position;
  * weights: m, each token's accumulated attention, the score the cache keeps for the wrapped policy (`merge`'s: the
    plain sum of the probabilities every query gave it; a policy with a decay d weighs query q's by d ** (c - q))
    at the moment of the eviction;
  * t's value becomes (m_t v_t + sum over the e merged into t of m_e v_e) / (m_t + sum m_e), in fp32 (the e of
    one prefill merge at once, each with its own value); keys and scores do not change.
The policy only answers (merge_plan: which slot absorbs which, with what weight); kv/cache.py writes the values
(a compressed cache re-quantizes the merged slot).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from flexh2o.kv.policies.base import KVPolicy
from flexh2o.kv.policies.mean_attn import MeanAttentionPolicy

if TYPE_CHECKING:  # torch is imported where a tensor is made: the flags' parser reads the policies without it
    import torch

EPS = 1e-8  # the smallest key norm the cosine divides by


class Merging(KVPolicy):
    """The wrapper: put it before a scoring policy's class (kv/policies/wrappers.py composes them)."""

    wrapper = "merge"
    uses_sinks = True
    merges = True

    def merge_plan(self, pos, score, keys, evict, extents=None) -> tuple:
        """pos/score (b, h, s), keys (b, h, s, d) fp32, evict bool (b, h, s) -> (target (b, h, s) int64: the slot
        absorbing each evicted slot's value, -1 elsewhere; mass (b, h, s) fp32: each slot's weight)."""
        return most_similar_kept(pos, keys, evict), score


class MergePolicy(Merging, MeanAttentionPolicy):
    name = "merge"


def most_similar_kept(pos, keys, evict) -> torch.Tensor:
    """(b, h, s) int64: per slot marked in `evict`, the slot among the kept ones (valid, not evicted) of the same row
    with the highest key cosine (ties: the older position); -1 for the others (and where nothing is kept)."""
    import torch
    kept = (pos >= 0) & ~evict  # (b, h, s)
    norm = keys.norm(dim=-1).clamp(min=EPS)  # (b, h, s)
    if int(evict.sum(-1).max()) <= 1:  # decode: at most one evicted slot per row: its key against every key
        e = evict.to(torch.int8).argmax(-1, keepdim=True)  # (b, h, 1); rows evicting nothing get no target below
        src = keys.gather(2, e[..., None].expand(*e.shape, keys.shape[-1])) / norm.gather(-1, e)[..., None]
        cos = torch.einsum("bhnd,bhsd->bhns", src, keys) / norm[:, :, None]  # (b, h, 1, s)
    else:
        unit = keys / norm[..., None]  # (b, h, s, d)
        cos = torch.einsum("bhnd,bhsd->bhns", unit, unit)  # (b, h, s, s)
    cos = cos.masked_fill(~kept[:, :, None], -torch.inf)
    best = cos.amax(-1, keepdim=True)
    tie = kept[:, :, None] & (cos == best)
    oldest = torch.where(tie, pos[:, :, None], torch.iinfo(pos.dtype).max).amin(-1, keepdim=True)
    target = (tie & (pos[:, :, None] == oldest)).to(torch.int8).argmax(-1)  # (b, h, n)
    target = torch.where(tie.any(-1), target, -1)
    return torch.where(evict, target, -1)  # (b, h, s); decode: the row's one evicted slot gets the row's target
