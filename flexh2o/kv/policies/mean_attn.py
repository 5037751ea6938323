"""`mean_attn`: H2O with the mean instead of the sum of received attention (kvpress's ObservedAttention
normalisation), which removes the sum's bias toward old tokens that simply were seen by more queries.

Budget and protection as h2o: `heavy` + `recent` tokens, the `recent` newest positions protected. Priority: the sum
of the attention probability every query gave the token (summed over the query heads sharing the KV head, fp32)
divided by the number of queries that attended to it. A token at position p, still cached when the newest position
is c, was seen by every query p..c: the divisor is c - p + 1 (fp32 division). Lowest priority is evicted, ties
evict the older position.
"""
from flexh2o.kv.policies.h2o import H2OPolicy


class MeanAttentionPolicy(H2OPolicy):
    name = "mean_attn"

    def priority(self, pos, score, layer, cur_pos, obs):
        seen = (cur_pos.view(-1, 1, 1) - pos + 1).clamp(min=1).float()  # (b, h, s) queries that saw the token
        return score / seen
