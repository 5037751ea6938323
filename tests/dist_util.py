"""Helpers for tests that run several ranks: local processes on 127.0.0.1 joined by a gloo process group."""
from __future__ import annotations

import os
import queue
import socket
import time
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int) -> dict:
    """What torchrun gives each worker, on the loopback interface only."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}


def _child(fn, rank, world, port, args, results):
    os.environ.update(rank_env(rank, world, port))
    import torch
    torch.set_num_threads(1)
    try:
        results.put((rank, "ok", fn(rank, world, *args)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_ranks(fn, world: int, *args, timeout: float = 120.0, start: str = "fork") -> list:
    """fn(rank, world, *args) in `world` processes (forked: no second import of torch, each child on one thread;
    fn returns no tensors, only lists or numpy arrays);
    returns [(status, result)] by rank, ("exited", exit code) for a rank that ended without a word. Every process
    is ended before returning."""
    ctx = mp.get_context(start)
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, args, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got, deadline = {}, time.monotonic() + timeout
        while len(got) < world and time.monotonic() < deadline:
            try:
                rank, status, value = results.get(timeout=0.2)
                got[rank] = (status, value)
            except queue.Empty:
                if all(not p.is_alive() for r, p in enumerate(procs) if r not in got):
                    break  # the rest exited without a word
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        return [got.get(r, ("exited", procs[r].exitcode)) for r in range(world)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
