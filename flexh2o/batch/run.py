"""Run a list of requests on one engine, each row sampled and stopped by its own request, results handed to
`on_result` as rows finish, the results file synced every step.

refill (the default): one run whose rows take the next request (file order) as soon as theirs finishes, its prefill
sharing the decode step's weight pass (generation/refill.py). refill False: FlexGen's fixed batches, rounds of
num_seqs requests, a round ending at the step after which all its requests have finished (generate's stop_when),
a finished row keeping its batch slot until then.

Beside job.measure_job (the fixed-length job loop of flexh2o-run's benchmark runs) this is a second loop over one
engine: they share the rounds and the warm-up (job.py); the rest stays apart on purpose: measure_job returns each
round's Generation (timings, bytes moved, peaks, per-phase weight seconds) for the run report and takes a pipeline
stage's generate, while this loop streams per-request Results and stopping, reuses a caller's engine (api.LLM) and
refills rows, none of which the benchmark report needs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from flexh2o.batch.feed import RequestFeed
from flexh2o.batch.progress import Progress
from flexh2o.batch.rows import RowSampler
from flexh2o.batch.stopping import StopRule
from flexh2o.engine import Engine
from flexh2o.generation.refill import generate_refill
from flexh2o.job import rounds_of, warm_up
from flexh2o.prompts import fill_batch
from flexh2o.run_config import RunConfig


@dataclass
class BatchStats:
    """What a batch job did: requests answered, tokens generated (useful ones: up to each row's end), seconds."""

    requests: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    rounds: int = 0  # fixed rounds run (a refilled job is one run of its rows)
    steps: int = 0  # generation steps run, summed over rounds
    refilled_rows: int = 0  # with refill: the rows that took the requests in turn; 0: fixed rounds
    results: list = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        how = (f"on {self.refilled_rows} refilled rows" if self.refilled_rows else
               f"in {self.rounds} round{'s' * (self.rounds != 1)}")
        return (f"requests {self.requests} {how} ({self.steps} steps): {self.generated_tokens} "
                f"generated tokens in {self.seconds:.2f} s = {self.tokens_per_s:.1f} useful tok/s")


def run_requests(rc: RunConfig, requests: list, rule: StopRule, on_result: Optional[Callable] = None,
                 on_step: Optional[Callable] = None, progress: Optional[Progress] = None,
                 warmup: bool = True, refill: bool = True, engine: Optional[Engine] = None) -> BatchStats:
    """Answer `requests` (each within rc's planned prompt_len and gen_len). on_result(Result) per finished
    request, as it finishes; on_step() after every generation step (the results file's sync). engine: an Engine
    built for rc, kept open by the caller (api.LLM); else one is built and closed here."""
    if engine is not None:
        return _answer(engine, requests, rule, on_result, on_step, progress, warmup, refill)
    with Engine(rc) as eng:
        return _answer(eng, requests, rule, on_result, on_step, progress, warmup, refill)


def _answer(eng, requests, rule, on_result, on_step, progress, warmup, refill) -> BatchStats:
    rc = eng.rc
    stats = BatchStats(refilled_rows=rc.num_seqs if refill else 0)
    if warmup and requests:
        warm_up(eng, [r.prompt_ids for r in requests], rc.num_seqs)
    start = time.perf_counter()
    groups = [requests] if refill else rounds_of(requests, rc.num_seqs)
    for group in groups:
        stats.steps += _round(eng, rc, group, rule, stats, on_result, on_step, progress, refill)
        stats.rounds += 1
    stats.seconds = time.perf_counter() - start
    return stats


def _round(eng, rc, group: list, rule: StopRule, stats: BatchStats, on_result, on_step, progress,
           refill: bool = False) -> int:
    """One round of requests (with refill: all of them); the steps it ran."""
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
    if refill:
        sampler = RequestFeed(group, rule, finished, rc.num_seqs)
        generate_refill(eng, sampler, on_step=stepped)
        if progress is not None:
            progress.round_done(sampler.generated)
        return steps[0]
    sampler = RowSampler(group, rule, finished)
    prompts = fill_batch([list(r.prompt_ids) for r in group], rc.num_seqs)
    gen_len = max(r.max_new_tokens for r in group)
    eng.generate(prompts, gen_len, sampler, on_step=stepped, stop_when=lambda: sampler.all_done)
    if progress is not None:
        progress.round_done(sampler.generated)
    return steps[0]
