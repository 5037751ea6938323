"""The live queue between the HTTP side and the engine thread: requests wait here until a row takes them.

A LiveRequest carries the engine's Request and two callbacks the engine thread calls (a token, then the end); the
HTTP side sets `cancelled` when its client goes away, and the engine frees the row at its next step boundary (or
drops the request from the queue unstarted). The queue is bounded: a put beyond `max_queue` waiting requests is
refused whole, so the server answers 429 instead of growing without limit.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(eq=False)
class LiveRequest:
    """One request of a client: on_token(id) per generated token, on_done(Result or None: cancelled) at its end."""

    request: object  # requests.Request
    on_token: Callable[[int], None]
    on_done: Callable[[Optional[object]], None]
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True


class LiveQueue:
    """A bounded FIFO of LiveRequests, safe between threads; the engine thread blocks in `wait` while it is empty."""

    def __init__(self, max_queue: int):
        if max_queue < 1:
            raise ValueError(f"--max-queue {max_queue}: give at least 1")
        self.max_queue = max_queue
        self._items: deque = deque()
        self._cond = threading.Condition()
        self._closed = False
        self.dropped = 0  # requests cancelled before a row took them

    def __len__(self) -> int:
        return len(self._items)

    def put(self, live: list) -> bool:
        """Queue all of `live` (one client request's choices), or none when they would pass max_queue."""
        with self._cond:
            if self._closed or len(self._items) + len(live) > self.max_queue:
                return False
            self._items.extend(live)
            self._cond.notify_all()
            return True

    def pop(self) -> Optional[LiveRequest]:
        """The oldest request not cancelled, or None (never blocks)."""
        with self._cond:
            while self._items:
                live = self._items.popleft()
                if not live.cancelled:
                    return live
                self.dropped += 1
            return None

    def wait(self) -> bool:
        """Block until a request waits (True) or the queue is closed and empty (False)."""
        with self._cond:
            while True:
                while self._items and self._items[0].cancelled:  # gone before a row took it
                    self._items.popleft()
                    self.dropped += 1
                if self._items or self._closed:
                    return bool(self._items)
                self._cond.wait()

    def close(self) -> None:
        """No more puts; `wait` returns False once the queued requests are taken."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
