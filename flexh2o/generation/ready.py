"""A readiness line for whoever must act while a run decodes (a test that signals a process mid-decode, a
supervisor): with $FLEXH2O_READY_FILE set, each generate() call appends '<pid> decode' to that file once it has
computed its first decode op (step >= 1; a pipeline stage without the head counts its own layers' ops). One write
with O_APPEND, so the ranks of one job may share the file. Unset (the default), nothing is wrapped or written."""
from __future__ import annotations

import os
from typing import Callable

ENV = "FLEXH2O_READY_FILE"


def announcing_decode(compute: Callable) -> Callable:
    """`compute` (the compute op's handler), wrapped to append this process's line after its first decode op;
    `compute` itself when $FLEXH2O_READY_FILE is unset."""
    path = os.environ.get(ENV)
    if not path:
        return compute
    announced = []

    def handler(op) -> None:
        compute(op)
        if op.step >= 1 and not announced:
            announced.append(op.step)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, f"{os.getpid()} decode\n".encode())
            finally:
                os.close(fd)
    return handler
