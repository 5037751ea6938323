"""The sampler of one round of requests: each row samples with its own request's settings and stops by its own
rule; a finished row's result is handed on the step it finishes (the rows after the requests only pad the batch)."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from flexh2o.batch.stop_scan import StopScan
from flexh2o.batch.stopping import StopRule
from flexh2o.sampling import Sampler


class RowSampler:
    """sampler(logits (b, vocab), step, rows) -> ids (b,) for the engine (see sampling.py)."""

    def __init__(self, requests: list, rule: StopRule, on_finish: Callable):
        self.requests, self.rule, self.on_finish = requests, rule, on_finish
        self.samplers = [Sampler(r.temperature, r.top_p, r.seed) for r in requests]
        self.tokens: list = [[] for _ in requests]
        self.scans = [StopScan() for _ in requests]  # stop strings searched incrementally
        self.reasons: list = [None] * len(requests)
        self.generated = 0  # tokens kept by the requests so far

    @property
    def all_done(self) -> bool:
        return all(r is not None for r in self.reasons)

    def __call__(self, logits: torch.Tensor, step: int = 0, rows: Optional[slice] = None) -> torch.Tensor:
        rows = rows if rows is not None else slice(0, logits.shape[0])
        out = logits.argmax(-1)  # (b,): rows past the requests and finished rows only pad the batch
        for i, row in enumerate(range(rows.start, rows.stop)):
            if row < len(self.requests) and self.reasons[row] is None:
                out[i] = self._next(row, logits[i:i + 1])
        return out

    def _next(self, row: int, logits: torch.Tensor) -> int:
        """Sample row `row`'s next token from its logits (1, vocab); finish the row when its rule says so."""
        token = int(self.samplers[row](logits)[0])
        self.tokens[row].append(token)
        self.generated += 1
        req = self.requests[row]
        reason = self.rule.reason(req, self.tokens[row], self.scans[row])
        if reason is not None:
            self.reasons[row] = reason
            self.on_finish(self.rule.result(req, self.tokens[row], reason))
        return token
