"""The rows of a server's refill run (generation/refill.py): like a batch job's RequestFeed (batch/feed.py), but
the requests come from the live queue while the run goes on, and a cancelled request frees its row at once.

A run's schedule is finite (its length is fixed when it starts), so rows take new requests only during its first
`epoch` steps: any request taken by then ends inside the run (it asks at most the plan's gen_len tokens). After
that the rows drain, the run ends, and the engine thread starts the next one at once if requests wait. At each
step boundary, before a GPU batch's tokens are sampled, its rows whose client went away are freed; a freed or
finished row takes the next queued request at once, and a row left idle takes one as soon as one arrives.
"""
from __future__ import annotations

from typing import Optional

import torch

from flexh2o.batch.rows import PerRowSampler
from flexh2o.batch.stop_scan import StopScan
from flexh2o.batch.stopping import StopRule
from flexh2o.sampling import Sampler
from flexh2o.serve.live import LiveQueue
from flexh2o.serve.stats import ServeStats

CANCELLED = "cancelled"


def epoch_steps(gen_len: int) -> int:
    """Steps during which a run's rows take requests: long beside one request (a drain costs at most gen_len
    steps of some idle rows), short enough that a run's per-step records (its step times) stay small; the schedule
    itself is computed op by op (schedule/plan.py), whatever its length."""
    return max(1024, 16 * gen_len)


class LiveFeed(PerRowSampler):
    """feed for generate_refill: take / live / all_done / request / finish, and the per-row sampler call."""

    def __init__(self, queue: LiveQueue, rule: StopRule, num_rows: int, prompt_len: int, gen_len: int,
                 stats: ServeStats):
        super().__init__(rule, self._finished)
        self.queue, self.stats = queue, stats
        self.held: list = [None] * num_rows  # row -> its LiveRequest (None: idle)
        self.samplers = [None] * num_rows
        self.tokens = [[] for _ in range(num_rows)]
        self.scans = [None] * num_rows
        self.longest_prompt, self.longest_gen = prompt_len, gen_len  # the plan's: every request fits them
        self.epoch = epoch_steps(gen_len)
        self.total_gen = self.epoch * num_rows  # sizes the run's schedule: epoch + gen_len + 2 steps
        self.step = -1  # the step being sampled (-1: before step 0)
        self._ending = None  # the LiveRequest of the row being finished

    def take(self, row: int) -> Optional[list]:
        """Give `row` the next queued request while the run takes them; its prompt ids, or None (the row idles)."""
        live = self.queue.pop() if self.step < self.epoch else None
        self.held[row] = live
        if live is None:
            return None
        r = live.request
        self.samplers[row] = Sampler(r.temperature, r.top_p, r.seed, r.top_k)
        self.tokens[row], self.scans[row] = [], StopScan()
        self.stats.busy += 1
        self.stats.prompt_tokens += len(r.prompt_ids)
        return list(r.prompt_ids)

    def live(self, row: int) -> bool:
        return self.held[row] is not None

    @property
    def all_done(self) -> bool:
        return all(x is None for x in self.held) and (self.step >= self.epoch or len(self.queue) == 0)

    def request(self, row: int):
        live = self.held[row]
        return None if live is None else live.request

    def finish(self, row: int, reason: str) -> None:
        self._ending, self.held[row] = self.held[row], None
        self.stats.busy -= 1

    def __call__(self, logits: torch.Tensor, step: int = 0, rows: Optional[slice] = None) -> torch.Tensor:
        self.step = step
        rows = rows if rows is not None else slice(0, logits.shape[0])
        for row in range(rows.start, rows.stop):  # clients gone: their rows are freed before this step's tokens
            live = self.held[row]
            if live is not None and live.cancelled:
                self.finish(row, CANCELLED)
                self.stats.cancelled += 1
                live.on_done(None)
        return super().__call__(logits, step, rows)

    def _took(self, row: int, token: int) -> None:
        self.held[row].on_token(token)  # before the end, which the same token may bring
        self.stats.generated_tokens += 1
        super()._took(row, token)

    def _finished(self, result) -> None:
        self.stats.finished += 1
        self._ending.on_done(result)
