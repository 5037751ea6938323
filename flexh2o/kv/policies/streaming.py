"""`streaming` (StreamingLLM): the first `num_sinks` tokens (attention sinks) plus the most recent ones."""
from flexh2o.kv.policies.base import KVPolicy


class StreamingPolicy(KVPolicy):
    name = "streaming"

    def priority(self, pos, score, layer):
        return pos

    def protected(self, pos, cur_pos):
        return (pos >= 0) & (pos < self.num_sinks)
