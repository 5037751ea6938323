"""The HTTP side of one client request: its choices' LiveRequests, whose engine-thread callbacks are handed to the
event loop (loop.call_soon_threadsafe) as events on one asyncio queue, and the text of each answer in pieces."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Optional

from flexh2o.serve.live import LiveRequest

SPLIT = "\ufffd"  # what a decoder shows for an unfinished UTF-8 character


@dataclass(frozen=True)
class Event:
    """index: the choice; token: a generated id (None on the end); end: the Result, None (cancelled) or an error."""

    index: int
    token: Optional[int] = None
    end: object = None
    is_end: bool = False


class Answer:
    """The choices of one client request, as LiveRequests to queue; `events()` yields their tokens and ends."""

    def __init__(self, requests: list):
        loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        put = self.queue.put_nowait

        def live(i, req):
            return LiveRequest(req, lambda t: loop.call_soon_threadsafe(put, Event(i, token=t)),
                               lambda end: loop.call_soon_threadsafe(put, Event(i, end=end, is_end=True)))
        self.live = [live(i, r) for i, r in enumerate(requests)]
        self.open = len(requests)

    async def events(self):
        """Each choice's token events, then its end event, until every choice has ended."""
        while self.open:
            event = await self.queue.get()
            self.open -= event.is_end
            yield event

    def cancel(self) -> None:
        """The client went away: rows holding these requests are freed at the engine's next step boundary."""
        for live in self.live:
            live.cancel()


class TextDeltas:
    """An answer's text in pieces as its tokens come, each piece final: an unfinished UTF-8 character waits for its
    next token, the last len(longest stop) - 1 characters wait too, and a stop string the newest token completes
    is cut off, as the end cuts the text before it. The pieces joined are the answer's text (`end`)."""

    def __init__(self, tokenizer, stops: tuple):
        self.tokenizer = tokenizer
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list = []
        self.sent = ""

    def add(self, token: int) -> str:
        if self.tokenizer is None:
            return ""
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith(SPLIT):
            return ""
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]  # the token that ends the answer
        safe = text[:min(hits + [len(text) - self.hold])]
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        piece, self.sent = safe[len(self.sent):], safe
        return piece

    def end(self, text: Optional[str]) -> str:
        """The rest of the answer whose whole text is `text`."""
        text = text or ""
        return text[len(self.sent):] if text.startswith(self.sent) else ""
