"""`vatp` (Value-Aware Token Pruning, Guo et al. 2024): H2O's accumulated attention times the L1 norm of the
token's value vector, with the attention sinks protected (their values have small norms, so VATP alone drops them).

Budget: `heavy` + `recent` tokens. Protected: the `recent` newest positions and the first `num_sinks` positions
(--num-sinks; num_sinks <= heavy). Priority of the others: score * sum_i |v_i|, score being H2O's plain sum of the
attention probability every query gave the token (summed over the query heads sharing the KV head), v the token's
cached value vector for that KV head, both in fp32. Lowest priority is evicted, ties evict the older position.
"""
from flexh2o.kv.policies.h2o import H2OPolicy


def value_norm(v):
    """(b, h, s, d) values -> (b, h, s) fp32 L1 norms."""
    return v.float().abs().sum(-1)


class VATPPolicy(H2OPolicy):
    name = "vatp"
    uses_sinks = True
    needs_values = True

    def priority(self, pos, score, layer, cur_pos, obs):
        if obs.values is None:
            raise ValueError("the vatp policy needs the cached values")
        return score * value_norm(obs.values)
