"""The request queue of a refill run (generation/refill.py): rows take requests in file order as they free up; each
row samples with its request's settings and stops by its own rule, its result handed on the step it finishes."""
from __future__ import annotations

from collections import deque
from typing import Callable, Optional

import torch

from flexh2o.batch.stop_scan import StopScan
from flexh2o.batch.stopping import StopRule
from flexh2o.sampling import Sampler


class RequestFeed:
    """sampler(logits (b, vocab), step, rows) -> ids (b,) for the engine (see sampling.py), plus the queue."""

    def __init__(self, requests: list, rule: StopRule, on_finish: Callable, num_rows: int):
        self.queue = deque(requests)
        self.rule, self.on_finish = rule, on_finish
        self.req: list = [None] * num_rows  # row -> its request (None: finished, or idle)
        self.samplers: list = [None] * num_rows
        self.tokens: list = [[] for _ in range(num_rows)]
        self.scans: list = [None] * num_rows  # row -> its StopScan (stop strings searched incrementally)
        self.generated = 0  # tokens kept by the requests so far
        self.longest_prompt = max((len(r.prompt_ids) for r in requests), default=1)
        self.longest_gen = max((r.max_new_tokens for r in requests), default=1)
        self.total_gen = sum(r.max_new_tokens for r in requests)

    def take(self, row: int) -> Optional[list]:
        """Give `row` the next queued request; its prompt ids, or None when the queue is empty (the row idles)."""
        if not self.queue:
            self.req[row] = None
            return None
        r = self.queue.popleft()
        self.req[row], self.samplers[row], self.tokens[row] = r, Sampler(r.temperature, r.top_p, r.seed), []
        self.scans[row] = StopScan()
        return list(r.prompt_ids)

    def live(self, row: int) -> bool:
        return self.req[row] is not None

    @property
    def all_done(self) -> bool:
        return not self.queue and all(r is None for r in self.req)

    def __call__(self, logits: torch.Tensor, step: int = 0, rows: Optional[slice] = None) -> torch.Tensor:
        rows = rows if rows is not None else slice(0, logits.shape[0])
        out = logits.argmax(-1)  # idle rows' tokens are never used
        for i, row in enumerate(range(rows.start, rows.stop)):
            if self.req[row] is not None:
                out[i] = self._next(row, logits[i:i + 1])
        return out

    def _next(self, row: int, logits: torch.Tensor) -> int:
        token = int(self.samplers[row](logits)[0])
        self.tokens[row].append(token)
        self.generated += 1
        req = self.req[row]
        reason = self.rule.reason(req, self.tokens[row], self.scans[row])
        if reason is not None:
            self.req[row] = None
            self.on_finish(self.rule.result(req, self.tokens[row], reason))
        return token
