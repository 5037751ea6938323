"""`local`: a sliding window, the last `budget` tokens."""
from flexh2o.kv.policies.base import KVPolicy


class LocalPolicy(KVPolicy):
    name = "local"

    def priority(self, pos, score, layer, cur_pos, obs):
        return pos
