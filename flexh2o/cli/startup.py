"""Ctrl-C while a console script starts: torch takes seconds to import, before run_main (console.py) can turn
Ctrl-C into exit status 130; until then nothing needs cleaning up, so the script exits 130 with one line instead of
Python's KeyboardInterrupt traceback. Imports nothing heavy: it runs before torch loads."""
from __future__ import annotations

import os
import signal
import threading


def quiet_startup_interrupt(argv0: str) -> None:
    """In a console script (argv[0] a flexh2o-* program) whose Ctrl-C is Python's default, Ctrl-C exits 130 at once
    with 'prog: interrupted' until run_main installs its own handler. A no-op elsewhere (tests, programs that import
    flexh2o.cli or handle Ctrl-C themselves)."""
    prog = os.path.basename(argv0 or "")
    if not prog.startswith("flexh2o-") or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return

    def on_interrupt(signum, frame):
        os.write(2, f"{prog}: interrupted\n".encode())
        os._exit(130)
    signal.signal(signal.SIGINT, on_interrupt)
