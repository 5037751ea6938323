"""`a2sf` (Accumulative Attention Score with Forgetting factor, Jo and Shin 2024): H2O whose scores forget.

Budget and protection as h2o: `heavy` + `recent` tokens, the `recent` newest positions protected. Priority: the
attention a token received, each query's probability weighted by decay ** (its age in queries): after query c the
score is sum over the queries q that attended to the token of hh_decay ** (c - q) * p_q (summed over the query
heads sharing the KV head, fp32). Decode updates it as score <- hh_decay * score + p_c. --hh-decay in (0, 1];
1 is h2o. Lowest priority is evicted, ties evict the older position.
"""
from flexh2o.kv.policies.h2o import H2OPolicy
from flexh2o.kv.policies.params import Param

DEFAULT_DECAY = 0.98
HH_DECAY = Param("hh_decay", float, DEFAULT_DECAY, "forgetting factor of the a2sf policy's scores, in (0, 1]; "
                 f"1 = h2o (default {DEFAULT_DECAY})", lo=0.0, hi=1.0)


class A2SFPolicy(H2OPolicy):
    name = "a2sf"
    params = (HH_DECAY,)

    @property
    def decay(self) -> float:
        return self.hh_decay
