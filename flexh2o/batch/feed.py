"""The request queue of a refill run (generation/refill.py): rows take requests in file order as they free up; each
row samples with its request's settings and stops by its own rule, its result handed on the step it finishes."""
from __future__ import annotations

from collections import deque
from typing import Callable, Optional

from flexh2o.batch.rows import PerRowSampler
from flexh2o.batch.stop_scan import StopScan
from flexh2o.batch.stopping import StopRule
from flexh2o.sampling import Sampler


class RequestFeed(PerRowSampler):
    """The per-row sampler of a refill run (batch/rows.py), plus the queue its rows take requests from."""

    def __init__(self, requests: list, rule: StopRule, on_finish: Callable, num_rows: int):
        super().__init__(rule, on_finish)
        self.queue = deque(requests)
        self.req: list = [None] * num_rows  # row -> its request (None: finished, or idle)
        self.samplers = [None] * num_rows
        self.tokens = [[] for _ in range(num_rows)]
        self.scans = [None] * num_rows
        self.longest_prompt = max((len(r.prompt_ids) for r in requests), default=1)
        self.longest_gen = max((r.max_new_tokens for r in requests), default=1)
        self.total_gen = sum(r.max_new_tokens for r in requests)

    def take(self, row: int) -> Optional[list]:
        """Give `row` the next queued request; its prompt ids, or None when the queue is empty (the row idles)."""
        if not self.queue:
            self.req[row] = None
            return None
        r = self.queue.popleft()
        self.req[row], self.samplers[row], self.tokens[row] = r, Sampler(r.temperature, r.top_p, r.seed, r.top_k), []
        self.scans[row] = StopScan()
        return list(r.prompt_ids)

    def live(self, row: int) -> bool:
        return self.req[row] is not None

    @property
    def all_done(self) -> bool:
        return not self.queue and all(r is None for r in self.req)

    def request(self, row: int):
        return self.req[row]

    def finish(self, row: int, reason: str) -> None:
        self.req[row] = None
