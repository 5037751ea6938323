"""`streaming` (StreamingLLM): the first `num_sinks` tokens (attention sinks) plus the most recent ones."""
from flexh2o.kv.policies.base import KVPolicy


class StreamingPolicy(KVPolicy):
    name = "streaming"
    uses_sinks = True

    def priority(self, pos, score, layer, cur_pos, obs):
        return pos
