"""The progress bar of a batch job on stderr: requests done / total, generated tokens per second, ETA."""
from __future__ import annotations

import sys
import time

from tqdm import tqdm


class Progress:
    def __init__(self, total: int, done: int = 0, enabled: bool = True):
        self.bar = tqdm(total=total, initial=done, desc="requests", unit="req", disable=not enabled,
                        file=sys.stderr, dynamic_ncols=True)
        self.start = time.perf_counter()
        self.base = 0  # tokens of the rounds already finished
        self.now = 0  # tokens so far in all

    def finished(self, result) -> None:
        self.bar.update(1)

    def tokens(self, in_round: int) -> None:
        self.now = self.base + in_round
        took = time.perf_counter() - self.start
        if took > 0:
            self.bar.set_postfix_str(f"{self.now / took:.1f} tok/s", refresh=False)

    def round_done(self, in_round: int) -> None:
        self.base += in_round
        self.now = self.base

    def close(self) -> None:
        self.bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
