"""Run a list of requests on one engine: rounds of up to num_seqs requests (file order), each row sampled and
stopped by its own request, results handed to `on_result` as rows finish, the results file synced every step.

A round ends at the step after which every one of its requests has finished (generate's stop_when), so rows that
stop early cost nothing once their whole round has stopped; a finished row inside a running round still takes its
batch slot until the round ends (no refill yet).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from flexh2o.batch.progress import Progress
from flexh2o.batch.rows import RowSampler
from flexh2o.batch.stopping import StopRule
from flexh2o.engine import Engine
from flexh2o.prompts import fill_batch
from flexh2o.run_config import RunConfig


@dataclass
class BatchStats:
    """What a batch job did: requests answered, tokens generated (useful ones: up to each row's end), seconds."""

    requests: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    rounds: int = 0
    steps: int = 0  # generation steps run, summed over rounds
    results: list = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        return (f"requests {self.requests} in {self.rounds} rounds ({self.steps} steps): {self.generated_tokens} "
                f"generated tokens in {self.seconds:.2f} s = {self.tokens_per_s:.1f} useful tok/s")


def rounds_of(requests: list, num_seqs: int) -> list:
    return [requests[i:i + num_seqs] for i in range(0, len(requests), num_seqs)]


def run_requests(rc: RunConfig, requests: list, rule: StopRule, on_result: Optional[Callable] = None,
                 on_step: Optional[Callable] = None, progress: Optional[Progress] = None,
                 warmup: bool = True) -> BatchStats:
    """Answer `requests` (each within rc's planned prompt_len and gen_len). on_result(Result) per finished
    request, as it finishes; on_step() after every generation step (the results file's sync)."""
    stats = BatchStats()
    with Engine(rc) as eng:
        if warmup and requests:
            eng.generate(fill_batch([list(r.prompt_ids[:8]) for r in requests[:rc.num_seqs]], rc.num_seqs), 2)
        start = time.perf_counter()
        for group in rounds_of(requests, rc.num_seqs):
            stats.steps += _round(eng, rc, group, rule, stats, on_result, on_step, progress)
            stats.rounds += 1
        stats.seconds = time.perf_counter() - start
    return stats


def _round(eng, rc, group: list, rule: StopRule, stats: BatchStats, on_result, on_step, progress) -> int:
    """One round of requests; the steps it ran."""
    steps = [0]

    def finished(result) -> None:
        stats.requests += 1
        stats.generated_tokens += result.generated_tokens
        stats.results.append(result)
        if on_result is not None:
            on_result(result)
        if progress is not None:
            progress.finished(result)

    def stepped(step) -> None:
        steps[0] = step + 1
        if on_step is not None:
            on_step()
        if progress is not None:
            progress.tokens(sampler.generated)
    sampler = RowSampler(group, rule, finished)
    prompts = fill_batch([list(r.prompt_ids) for r in group], rc.num_seqs)
    gen_len = max(r.max_new_tokens for r in group)
    eng.generate(prompts, gen_len, sampler, on_step=stepped, stop_when=lambda: sampler.all_done)
    if progress is not None:
        progress.round_done(sampler.generated)
    return steps[0]
