"""The engine thread: one thread owns the engine for the server's lifetime and runs refill runs over the live
queue, one after another, blocking (not polling) while the queue is empty."""
from __future__ import annotations

import sys
import threading
import traceback

from flexh2o.batch.stopping import StopRule
from flexh2o.generation.refill import generate_refill
from flexh2o.serve.feed import LiveFeed
from flexh2o.serve.live import LiveQueue
from flexh2o.serve.stats import ServeStats


class EngineWorker:
    """Runs `engine` over `queue` on its own thread; stop() lets the queued and running requests finish first."""

    def __init__(self, engine, queue: LiveQueue, rule: StopRule, stats: ServeStats):
        self.engine, self.queue, self.rule, self.stats = engine, queue, rule, stats
        self.feed = None  # the run in progress (its rows), None between runs
        self.thread = threading.Thread(target=self._loop, name="flexh2o-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = None) -> None:
        """Refuse new requests, answer the queued and running ones, then return (the engine stays open)."""
        self.queue.close()
        self.thread.join(timeout)

    def _loop(self) -> None:
        rc = self.engine.rc
        while self.queue.wait():
            feed = LiveFeed(self.queue, self.rule, rc.num_seqs, rc.prompt_len, rc.gen_len, self.stats)
            self.feed = feed
            self.stats.runs += 1
            try:
                generate_refill(self.engine, feed, on_step=self._stepped)
            except Exception:  # the run is lost: its clients get an error, the server goes on
                traceback.print_exc(file=sys.stderr)
                self._fail(feed)
            finally:
                self.feed = None

    def _stepped(self, step: int) -> None:
        self.stats.steps += 1

    def _fail(self, feed: LiveFeed) -> None:
        for row, live in enumerate(feed.held):
            if live is not None:
                feed.finish(row, "error")
                live.on_done(RuntimeError("the engine failed during this request (see the server's log)"))
