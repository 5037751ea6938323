"""`mean_vnorm` (the recommended combination): the mean attention a token received times the L1 norm of its value
vector, with the attention sinks and the recent window protected. It joins mean_attn's removal of the sum's bias
toward old tokens with vatp's weighting by what a token contributes to the attention output.

Budget: `heavy` + `recent` tokens per sequence, layer and KV head. Protected (never evicted): the `recent` newest
positions and the first `num_sinks` positions (--num-sinks; num_sinks <= heavy). Priority of the other tokens:
(score / seen) * sum_i |v_i|, where score is H2O's plain sum of the attention probability every query gave the token
(summed over the query heads sharing the KV head), seen = c - p + 1 is the number of queries that attended to a
token at position p when the newest position is c, and v is the token's cached value vector for that KV head; all
in fp32, the division first. Lowest priority is evicted, ties evict the older position.
"""
from flexh2o.kv.policies.mean_attn import MeanAttentionPolicy
from flexh2o.kv.policies.vatp import value_norm


class MeanVNormPolicy(MeanAttentionPolicy):
    name = "mean_vnorm"
    uses_sinks = True
    needs_values = True

    def priority(self, pos, score, layer, cur_pos, obs):
        if obs.values is None:
            raise ValueError("the mean_vnorm policy needs the cached values")
        return super().priority(pos, score, layer, cur_pos, obs) * value_norm(obs.values)
