"""`full`: never evict (FlexGen's cache)."""
from flexh2o.kv.policies.base import KVPolicy


class FullPolicy(KVPolicy):
    name = "full"

    def __init__(self, budget=None, num_sinks: int = 4, seed: int = 0, **options):
        super().__init__(None, num_sinks, seed, **options)

    def priority(self, pos, score, layer, cur_pos, obs):
        return pos
