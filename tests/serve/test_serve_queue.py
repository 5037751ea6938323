"""The server's live queue and counters without a server: the queue is bounded (a client's choices are queued all
or none), a cancelled request is never handed to a row, the engine thread's wait blocks until a request comes and
ends once the queue is closed and empty; /metrics' text and the summary line."""
from __future__ import annotations

import threading

import pytest

from flexh2o.serve.live import LiveQueue, LiveRequest
from flexh2o.serve.stats import ServeStats


def live(name: str) -> LiveRequest:
    return LiveRequest(name, lambda token: None, lambda end: None)


def test_the_queue_is_bounded_and_takes_a_requests_choices_whole():
    q = LiveQueue(3)
    assert q.put([live("a"), live("b")])
    assert not q.put([live("c"), live("d")])  # 4 > 3: neither is queued
    assert len(q) == 2 and q.put([live("c")]) and len(q) == 3
    with pytest.raises(ValueError, match="--max-queue 0"):
        LiveQueue(0)


def test_a_cancelled_request_is_dropped_not_taken():
    q = LiveQueue(4)
    a, b, c = live("a"), live("b"), live("c")
    q.put([a, b, c])
    b.cancel()
    assert q.pop() is a and q.pop() is c and q.pop() is None
    assert q.dropped == 1


def test_wait_blocks_until_a_request_comes_and_ends_after_close():
    q = LiveQueue(2)
    woke = []
    waiter = threading.Thread(target=lambda: woke.append(q.wait()), daemon=True)
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not woke  # nothing queued: still waiting (a wait on a condition, not a loop)
    q.put([live("a")])
    waiter.join(10)
    assert woke == [True]
    q.pop()
    q.close()
    assert q.wait() is False and not q.put([live("b")])


def test_metrics_text_and_the_summary_line():
    s = ServeStats(rows=8, finished=3, generated_tokens=40, steps=12, busy=2)
    s.refuse(429)
    text = s.prometheus(queue_length=5)
    for line in ("flexh2o_requests_finished_total 3", "flexh2o_generation_tokens_total 40", "flexh2o_steps_total 12",
                 'flexh2o_requests_refused_total{status="429"} 1', "flexh2o_queue_length 5", "flexh2o_rows_busy 2",
                 "flexh2o_rows 8", "# TYPE flexh2o_queue_length gauge"):
        assert line in text.splitlines(), line
    line = s.summary(queue_length=5)
    assert line.startswith("flexh2o-serve: 3 requests in the last") and "queue 5, rows busy 2/8" in line
    assert s.summary(queue_length=0).startswith("flexh2o-serve: 0 requests")  # counted since the last line
