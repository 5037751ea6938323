"""The ring of messages between pipeline stages: torch.distributed point-to-point isend/irecv, every wait bounded.

A message is keyed by the (step, layer, batch) of the compute that produced it; its tag is step * batches + batch
(each directed link carries one layer's outputs). Receives are posted early and waited for only when the compute
needs them; sends are waited for in the background. A wait runs on a daemon thread and the caller joins it in short
slices, so Ctrl-C and SIGTERM are handled at once even while a peer is slow; a peer that dies or stays silent past
the timeout ends the wait with StageLost naming the peer, the message and the fix.
"""
from __future__ import annotations

import datetime
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

JOIN_SLICE_S = 0.05  # how often a waiting caller looks up (and lets signal handlers run)


class StageLost(ConnectionError):
    """A peer stage died, was killed, hangs, or its connection broke: one line naming it."""


@dataclass
class LinkStats:
    """What one stage's ring traffic cost: seconds waiting for messages, bytes and messages each way."""

    wait_s: float = 0.0
    sent_bytes: int = 0
    received_bytes: int = 0
    sent: int = 0
    received: int = 0
    sent_by_step: dict = field(default_factory=dict)  # step -> bytes sent


class Ring:
    """Messages from the previous stage (`src`) and to the next one (`dst`) of a ring of ranks."""

    def __init__(self, rank: int, src: int, dst: int, num_batches: int, timeout_s: float, device: torch.device):
        self.rank, self.src, self.dst = rank, src, dst
        self.num_batches, self.timeout_s, self.device = num_batches, timeout_s, device
        self.posted: dict = {}  # key -> (tensor, work)
        self.sending: list = []  # (waiter, tensor) of sends not yet known to be done
        self.stats = LinkStats()

    def tag(self, key: tuple) -> int:
        step, _, batch = key
        return step * self.num_batches + batch

    def post(self, key: tuple, shape: tuple, dtype: torch.dtype) -> None:
        """Post the receive of message `key` (step, layer, batch) into a fresh buffer."""
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        try:
            self.posted[key] = (buf, dist.irecv(buf, self.src, tag=self.tag(key)))
        except RuntimeError as e:  # the connection is already gone
            raise StageLost(self._lost(key, "from", self.src).format(_first_line(e))) from None

    def take(self, key: tuple) -> torch.Tensor:
        """The tensor of message `key`, waiting (bounded) for it to arrive."""
        buf, work = self.posted.pop(key)
        start = time.perf_counter()
        _Waiter(work, self.timeout_s).join(self._lost(key, "from", self.src))
        self.stats.wait_s += time.perf_counter() - start
        self.stats.received += 1
        self.stats.received_bytes += buf.numel() * buf.element_size()
        return buf

    def send(self, key: tuple, tensor: torch.Tensor) -> None:
        tensor = tensor.contiguous()
        try:
            work = dist.isend(tensor, self.dst, tag=self.tag(key))
        except RuntimeError as e:
            raise StageLost(self._lost(key, "to", self.dst).format(_first_line(e))) from None
        self.sending = [(w, t, k) for w, t, k in self.sending if not w.done()]
        self.sending.append((_Waiter(work, self.timeout_s), tensor, key))
        self.stats.sent += 1
        nbytes = tensor.numel() * tensor.element_size()
        self.stats.sent_bytes += nbytes
        self.stats.sent_by_step[key[0]] = self.stats.sent_by_step.get(key[0], 0) + nbytes

    def close(self) -> None:
        """Wait (bounded) until every send has left; drop receives never taken."""
        for waiter, _, key in self.sending:
            waiter.join(self._lost(key, "to", self.dst))
        self.sending, self.posted = [], {}

    def _lost(self, key: tuple, direction: str, peer: int) -> str:
        step, layer, batch = key
        return (f"rank {self.rank}: message of step {step}, layer {layer}, batch {batch} {direction} rank {peer} "
                f"did not get through within {self.timeout_s:g} s ({{}}): a rank died, was killed or hangs; see its "
                "output, or raise --stage-timeout if a stage is just slow")


class _Waiter:
    """work.wait(timeout) on a daemon thread; join() re-raises its failure as StageLost."""

    def __init__(self, work, timeout_s: float):
        self.error = None
        self.thread = threading.Thread(target=self._wait, args=(work, timeout_s), daemon=True,
                                       name="flexh2o-ring-wait")
        self.thread.start()

    def _wait(self, work, timeout_s: float) -> None:
        try:
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        except Exception as e:  # noqa: BLE001 - any failure of the transport ends the job the same way
            self.error = e

    def done(self) -> bool:
        return not self.thread.is_alive() and self.error is None

    def join(self, message: str) -> None:
        while self.thread.is_alive():
            self.thread.join(JOIN_SLICE_S)
        if self.error is not None:
            raise StageLost(message.format(_first_line(self.error)))


def _first_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    for cut in (". This is typically", " GLHF"):
        text = text.split(cut)[0]
    return text[:200] or type(e).__name__
