"""`tova` (Token Omission Via Attention, Oren et al. 2024): keep the tokens the newest query attends to most.

Budget: a total of `budget.total` tokens per sequence, layer and KV head, nothing protected (no window, no sinks).
Priority: the attention probability the newest query gave the token (summed over the query heads sharing the KV
head, fp32), with no accumulation over earlier queries: decay 0. At prefill this is the last prompt token's
attention; at each decode step the new token's, which sees itself, so the newest token may itself be evicted.
Lowest priority is evicted, ties evict the older position.
"""
from flexh2o.kv.policies.base import KVPolicy


class TOVAPolicy(KVPolicy):
    name = "tova"
    needs_scores = True
    priority_is_score = True
    decay = 0.0

    def priority(self, pos, score, layer, cur_pos, obs):
        return score
