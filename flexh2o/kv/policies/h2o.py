"""`h2o`: Heavy-Hitter Oracle. Keep the `heavy` tokens with the largest accumulated attention plus the `recent` window.

Scores: for each cached token, the sum over every query that attended to it (prefill and decode, the query's own
step included) of its softmax probability, summed over the query heads sharing the KV head, in fp32.
"""
from flexh2o.kv.policies.base import KVPolicy


class H2OPolicy(KVPolicy):
    name = "h2o"
    needs_scores = True
    priority_is_score = True
    windowed = True

    def priority(self, pos, score, layer, cur_pos, obs):
        return score
