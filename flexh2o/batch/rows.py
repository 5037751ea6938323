"""Per-row sampling of request jobs: each row samples with its own request's settings and stops by its own rule; a
finished row's result is handed on the step it finishes. RowSampler serves one round of requests (the rows after
the requests only pad the batch); batch/feed.py's RequestFeed serves a refill run's queue."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from flexh2o.batch.stop_scan import StopScan
from flexh2o.batch.stopping import StopRule
from flexh2o.sampling import Sampler, greedy


class PerRowSampler:
    """sampler(logits (b, vocab), step, rows) -> ids (b,) for the engine (see sampling.py). Subclasses say which
    request a row holds (`request`, None when the row only pads the batch or has finished) and what finishing a row
    does (`finish`); samplers, tokens and scans are indexed by row."""

    def __init__(self, rule: StopRule, on_finish: Callable):
        self.rule, self.on_finish = rule, on_finish
        self.samplers: list = []
        self.tokens: list = []
        self.scans: list = []  # row -> its StopScan (stop strings searched incrementally)
        self.generated = 0  # tokens kept by the requests so far

    def request(self, row: int):
        raise NotImplementedError

    def finish(self, row: int, reason: str) -> None:
        raise NotImplementedError

    def __call__(self, logits: torch.Tensor, step: int = 0, rows: Optional[slice] = None) -> torch.Tensor:
        rows = rows if rows is not None else slice(0, logits.shape[0])
        out = greedy(logits)  # (b,): every row's greedy token, as Sampler's (rows without a live request only pad)
        chosen, finite = out.tolist(), torch.isfinite(logits).all(-1).tolist()  # one host read each per batch
        for i, row in enumerate(range(rows.start, rows.stop)):
            if self.request(row) is None:
                continue
            sampler = self.samplers[row]
            if sampler.temperature == 0 and finite[i]:  # what sampler(logits[i:i + 1]) returns, without the call
                self._took(row, chosen[i])
            else:
                out[i] = self._next(row, logits[i:i + 1])
        return out

    def _next(self, row: int, logits: torch.Tensor) -> int:
        """Sample row `row`'s next token from its logits (1, vocab); finish the row when its rule says so."""
        token = int(self.samplers[row](logits)[0])
        self._took(row, token)
        return token

    def _took(self, row: int, token: int) -> None:
        """Row `row` emitted `token`: finish it when its rule says so."""
        self.tokens[row].append(token)
        self.generated += 1
        req = self.request(row)
        reason = self.rule.reason(req, self.tokens[row], self.scans[row])
        if reason is not None:
            self.finish(row, reason)
            self.on_finish(self.rule.result(req, self.tokens[row], reason))


class RowSampler(PerRowSampler):
    """One round: row i holds requests[i] until it finishes."""

    def __init__(self, requests: list, rule: StopRule, on_finish: Callable):
        super().__init__(rule, on_finish)
        self.requests = requests
        self.samplers = [Sampler(r.temperature, r.top_p, r.seed, r.top_k) for r in requests]
        self.tokens = [[] for _ in requests]
        self.scans = [StopScan() for _ in requests]
        self.reasons: list = [None] * len(requests)

    @property
    def all_done(self) -> bool:
        return all(r is not None for r in self.reasons)

    def request(self, row: int):
        return self.requests[row] if row < len(self.requests) and self.reasons[row] is None else None

    def finish(self, row: int, reason: str) -> None:
        self.reasons[row] = reason
