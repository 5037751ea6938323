"""`h2o_sinks`: H2O with StreamingLLM's attention sinks protected.

Budget: `heavy` + `recent` tokens per sequence, layer and KV head. Protected (never evicted): the `recent` newest
positions and the first `num_sinks` positions (--num-sinks; they count against `heavy`, so num_sinks <= heavy).
Priority of the other tokens: H2O's score, the plain sum of the attention probability every query gave the token
(summed over the query heads sharing the KV head, fp32). Lowest priority is evicted, ties evict the older position.
"""
from flexh2o.kv.policies.h2o import H2OPolicy


class H2OSinksPolicy(H2OPolicy):
    name = "h2o_sinks"
    uses_sinks = True
