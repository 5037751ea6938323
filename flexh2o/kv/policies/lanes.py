"""`LanePolicy`: several (policy, budget) lanes side by side in one batch, each lane owning a contiguous range of rows.

Every call is answered by handing each lane its own rows, so a row behaves exactly as in a run of its lane's policy
alone: the same kept tokens, in the same slots (the block has the largest lane's slot count; the extra slots stay
empty and attention masks them). Used by `flexh2o-eval ppl` so that many lanes share each weight read. It needs to
see the whole batch at once: one GPU batch, prefilled in one piece (RunConfig.prefill_batch = rows).
"""
from __future__ import annotations

import torch

from flexh2o.kv.policies.base import KVPolicy


class LanePolicy(KVPolicy):
    name = "lanes"

    def __init__(self, lanes: list):
        """lanes: (rows, policy) in row order."""
        super().__init__(None)
        self.lanes, self.slices, start = [p for _, p in lanes], [], 0
        for rows, _ in lanes:
            self.slices.append(slice(start, start + rows))
            start += rows
        self.rows = start
        self.needs_scores = any(p.needs_scores for p in self.lanes)
        self.needs_values = any(p.needs_values for p in self.lanes)

    def slots(self, prompt_len: int, gen_len: int) -> int:
        return max(p.slots(prompt_len, gen_len) for p in self.lanes)

    def _parts(self, x: torch.Tensor) -> list:
        if x.shape[0] != self.rows:
            raise ValueError(f"the lanes cover {self.rows} rows but a block of {x.shape[0]} came: run them as one "
                             "GPU batch prefilled in one piece")
        return [x[sl] for sl in self.slices]

    def query_weights(self, qpos):
        return torch.cat([p.query_weights(q) for p, q in zip(self.lanes, self._parts(qpos))])

    def accumulate(self, score, att) -> None:
        for p, s, a in zip(self.lanes, self._parts(score), self._parts(att)):
            p.accumulate(s, a)  # in place on a view of the lane's rows

    def prefill_keep(self, pos, score, layer, cur_pos, v=None):
        vs = self._parts(v) if v is not None else [None] * len(self.lanes)
        parts = zip(self.lanes, self._parts(pos), self._parts(score), self._parts(cur_pos), vs)
        return torch.cat([p.prefill_keep(ps, s, layer, c, vv) for p, ps, s, c, vv in parts])

    def decode_evict(self, pos, score, layer, cur_pos, v=None):
        vs = self._parts(v) if v is not None else [None] * len(self.lanes)
        parts = list(zip(self.lanes, self._parts(pos), self._parts(score), self._parts(cur_pos), vs))
        out = [p.decode_evict(ps, s, layer, c, vv) for p, ps, s, c, vv in parts]
        if all(e is None for e in out):
            return None
        return torch.cat([torch.zeros_like(ps, dtype=torch.bool) if e is None else e
                          for e, (_, ps, *_) in zip(out, parts)])
