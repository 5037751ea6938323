"""Cutting a schedule short: the ops of whole steps, until a condition checked between steps holds."""
from __future__ import annotations

from typing import Callable, Iterable, Iterator

from flexh2o.schedule.plan import COMPUTE, Op


def until(ops: Iterable[Op], stop: Callable[[], bool]) -> Iterator[Op]:
    """`ops` up to the first compute of a step begun after stop() holds (checked at each new step's first compute,
    so the loads prefetched for it are still issued: the executor waits for them and the run's buffers free them)."""
    step = 0
    for op in ops:
        if op.kind == COMPUTE and op.step > step:
            if stop():
                return
            step = op.step
        yield op
