"""The server's counters: what /metrics shows (Prometheus text format) and the summary line printed on stderr every
--stats-interval seconds. The engine thread writes the engine's counters, the HTTP side only `refused`; each
counter has one writer."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

COUNTERS = (("requests_finished_total", "requests answered to their end (eos, stop or length)", "finished"),
            ("requests_cancelled_total", "requests whose client went away (their row freed at once)", "cancelled"),
            ("prompt_tokens_total", "prompt tokens of the requests rows took", "prompt_tokens"),
            ("generation_tokens_total", "tokens generated", "generated_tokens"),
            ("steps_total", "engine generation steps run", "steps"),
            ("runs_total", "refill runs started (a run lasts while rows have requests)", "runs"))


@dataclass
class ServeStats:
    rows: int  # the engine's rows (--gpu-batch-size x --num-gpu-batches)
    finished: int = 0
    cancelled: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    runs: int = 0
    busy: int = 0  # rows holding a request now
    refused: dict = field(default_factory=dict)  # HTTP status -> requests refused at the door
    _last: tuple = field(default_factory=lambda: (time.monotonic(), 0, 0, 0))

    def refuse(self, status: int) -> None:
        self.refused[status] = self.refused.get(status, 0) + 1

    def prometheus(self, queue_length: int) -> str:
        """The counters and gauges in Prometheus' text exposition format."""
        lines = []
        for name, help_, attr in COUNTERS:
            lines += [f"# HELP flexh2o_{name} {help_}", f"# TYPE flexh2o_{name} counter",
                      f"flexh2o_{name} {getattr(self, attr)}"]
        lines += ["# HELP flexh2o_requests_refused_total requests refused before they were queued, by HTTP status",
                  "# TYPE flexh2o_requests_refused_total counter"]
        lines += [f'flexh2o_requests_refused_total{{status="{s}"}} {n}' for s, n in sorted(self.refused.items())]
        for name, help_, value in (("queue_length", "requests waiting for a row", queue_length),
                                   ("rows_busy", "rows holding a request", self.busy),
                                   ("rows", "rows of the engine (--gpu-batch-size x --num-gpu-batches)", self.rows)):
            lines += [f"# HELP flexh2o_{name} {help_}", f"# TYPE flexh2o_{name} gauge", f"flexh2o_{name} {value}"]
        return "\n".join(lines) + "\n"

    def summary(self, queue_length: int) -> str:
        """One line over the time since the last summary: requests answered, tokens/s, queue length, rows busy."""
        now, done = time.monotonic(), self.finished + self.cancelled
        then, done_before, tokens_before, _ = self._last
        self._last = (now, done, self.generated_tokens, 0)
        rate = (self.generated_tokens - tokens_before) / max(now - then, 1e-9)
        return (f"flexh2o-serve: {done - done_before} requests in the last {now - then:.0f} s, {rate:.1f} tok/s; "
                f"queue {queue_length}, rows busy {self.busy}/{self.rows}")
