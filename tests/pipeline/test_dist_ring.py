"""The ring transport between stages: messages both ways on gloo, and a bounded, named failure when a peer dies."""
from __future__ import annotations

import os
import time

import pytest
import torch

from dist_util import run_ranks


def _exchange(rank, world, timeout_s, die):
    from flexh2o.pipeline.group import StageGroup
    from flexh2o.pipeline.transport import Ring, StageLost
    group = StageGroup.start("cpu", timeout_s)
    ring = Ring(rank, (rank - 1) % world, (rank + 1) % world, 2, timeout_s, torch.device("cpu"))
    got = []
    for step in range(3):
        key = (step, 7, 1)
        if die and rank == 1 and step == 1:
            os._exit(0)  # a rank that vanishes mid-job
        start = time.perf_counter()
        try:  # the loss surfaces where the closed connection is first seen: posting the receive, sending or waiting
            ring.post(key, (2, 3), torch.float32)
            ring.send(key, torch.full((2, 3), float(rank * 10 + step)))
            got.append(ring.take(key)[0, 0].item())
        except StageLost as e:
            return {"lost": str(e), "after_s": time.perf_counter() - start}
    ring.close()
    group.agree(None)
    return {"got": got, "sent": ring.stats.sent_bytes, "received": ring.stats.received_bytes}


@pytest.mark.parametrize("world", [2, 3])
def test_messages_go_round_the_ring(world):
    out = run_ranks(_exchange, world, 30.0, False)
    for rank, (status, value) in enumerate(out):
        assert status == "ok", value
        src = (rank - 1) % world
        assert value["got"] == [src * 10 + step for step in range(3)]
        assert value["sent"] == value["received"] == 3 * 6 * 4


def test_a_dead_peer_ends_the_wait_with_its_name():
    status, value = run_ranks(_exchange, 2, 5.0, True)[0]
    assert status == "ok", value
    assert "lost" in value and "from rank 1" in value["lost"] and "did not get through" in value["lost"]
    assert value["after_s"] < 10.0
