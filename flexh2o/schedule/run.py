"""Executes a block schedule: the only code that knows threads, streams and waits.

overlap=False runs every op in plan order on the caller's thread. overlap=True runs loads and stores on an I/O
thread pool (disk reads release the GIL) while compute stays on the caller's thread; ops on the same buffer are
chained, a weight load also waits for the weight free issued before it (so, as in plan order, at most two layers
of weights are in flight), and a compute waits only for the loads of its own buffers. On CUDA each I/O op runs on a
side stream and records an event that the compute stream waits on (no device-wide sync). Off CUDA, an I/O kind whose
handler has proved quicker than a thread hand-off (memory-resident loads are views) runs on the caller's thread in
plan order, after the ops already queued on its buffer (a weight load also after the last weight free): handing it
to the pool would only add the wait.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable, Optional

import torch

from flexh2o.schedule.plan import COMPUTE, FREE_WEIGHT, LOAD_WEIGHT, Op

QUICK_IO_S = 2e-4  # an I/O kind averaging less than this a call (after QUICK_AFTER calls) runs inline, off CUDA
QUICK_AFTER = 8


class Executor:
    def __init__(self, handlers: dict, overlap: bool, io_threads: int = 2, device: str = "cpu",
                 inputs: Optional[Callable] = None, inline: tuple = ()):
        """handlers: op kind -> callable(op). inputs(op) -> the buffers a compute op reads. inline: kinds run on
        the caller's thread in plan order (the non-blocking posts of a pipeline stage's messages).
        busy_s: seconds spent in each kind's handler ('stall': computes waiting for their loads); decode_busy_s:
        the same for the decode steps' ops only (step > 0)."""
        self.handlers, self.overlap, self.io_threads = handlers, overlap, io_threads
        self.cuda = torch.device(device).type == "cuda"
        self.inputs = inputs or (lambda op: [])
        self.inline = set(inline) | {COMPUTE}
        self.busy_s: dict = {}
        self.decode_busy_s: dict = {}
        self.calls: dict = {}  # op kind -> handler calls
        self._lock = threading.Lock()

    def run(self, ops: Iterable[Op]) -> None:
        if not self.overlap:
            for op in ops:
                self._handle(op)
            return
        # one side stream: every I/O op on it first waits for the compute issued before it, so memory freed
        # by the caching allocator on this stream is never reused while a kernel may still read it
        self.stream = torch.cuda.Stream() if self.cuda else None
        pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="flexh2o-io")
        pending: dict = {}
        freed: Optional[Future] = None  # the last weight free submitted
        try:
            for op in ops:
                if op.kind in self.inline or self._quick(op.kind):
                    start = time.perf_counter()
                    waits = self.inputs(op) if op.kind == COMPUTE else () if op.kind in self.inline else (op.buffer,)
                    for buf in waits:
                        _wait(pending.get(buf), self.cuda)
                    if op.kind == LOAD_WEIGHT:  # inline too: at most two layers of weights in flight
                        _wait(freed, self.cuda)
                    self._count("stall", start, op.step)
                    self._handle(op)
                    continue
                after = [pending.get(op.buffer)]
                if op.kind == LOAD_WEIGHT:  # after the free of the layer before the one computing: at most two
                    after.append(freed)    # layers of weights in flight, as the memory plan reserves
                ready = torch.cuda.Event() if self.cuda else None
                if ready is not None:
                    ready.record()  # stores must see the compute issued so far
                pending[op.buffer] = pool.submit(self._io, op, after, ready)
                if op.kind == FREE_WEIGHT:
                    freed = pending[op.buffer]
            for fut in list(pending.values()):
                _wait(fut, self.cuda)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _handle(self, op: Op) -> None:
        start = time.perf_counter()
        self.handlers[op.kind](op)
        self._count(op.kind, start, op.step)

    def _quick(self, kind: str) -> bool:
        """Whether an I/O op of `kind` runs inline: off CUDA, once its handler averaged under QUICK_IO_S."""
        n = self.calls.get(kind, 0)
        return not self.cuda and n >= QUICK_AFTER and self.busy_s[kind] < QUICK_IO_S * n

    def _count(self, kind: str, start: float, step: int) -> None:
        took = time.perf_counter() - start
        with self._lock:  # I/O threads add too
            self.busy_s[kind] = self.busy_s.get(kind, 0.0) + took
            self.calls[kind] = self.calls.get(kind, 0) + 1
            if step > 0:
                self.decode_busy_s[kind] = self.decode_busy_s.get(kind, 0.0) + took

    def _io(self, op: Op, after: list, ready):
        for fut in after:
            if fut is not None:
                fut.result()
        if not self.cuda:
            self._handle(op)
            return None
        stream = self.stream
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            self._handle(op)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()  # host-side readers (cpu-cache-compute, disk) see finished copies once the future resolves
        return done


def _wait(fut: Optional[Future], cuda: bool) -> None:
    if fut is None:
        return
    done = fut.result()  # re-raises an I/O error on the compute thread
    if cuda and done is not None:
        torch.cuda.current_stream().wait_event(done)
