"""What every console script shares: argument errors and user errors as one line on stderr with exit status 2,
Ctrl-C as exit status 130 (SIGTERM and SIGHUP the same way: 128 + the signal), never a traceback for bad input."""
from __future__ import annotations

import argparse
import atexit
import contextlib
import signal
import sys
import threading
from typing import Callable

from flexh2o.errors import UsageError, one_line

STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n))


class Parser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of printing the whole usage and exiting, and whose --help shows every
    option's default (help_text.HelpFormatter)."""

    def __init__(self, *args, **kwargs):
        from flexh2o.cli.help_text import HelpFormatter
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise UsageError(f"{message} (see {self.prog} --help)")


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised in the main thread like Ctrl-C, so every cleanup that handles Ctrl-C runs."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def run_main(prog: str, body: Callable[[], int], interrupted: str = "interrupted") -> int:
    """Run a script's body; ValueError/OSError/TierError -> 'prog: error: ...' and 2, Ctrl-C -> 130,
    SIGTERM/SIGHUP -> 128 + signal, each after the body's own cleanup (finally blocks, context managers) ran."""
    try:
        with stop_signals_as_interrupts():
            return body()
    except _user_errors() as e:  # evaluated when something is raised
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
        return 2
    except Terminated as e:
        print(f"{prog}: {interrupted} ({signal.Signals(e.signum).name})", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print(f"{prog}: {interrupted}", file=sys.stderr)
        return 130


def _user_errors() -> tuple:
    """ValueError, OSError and storage's TierError (only once storage is imported: a --help never loads torch)."""
    base = sys.modules.get("flexh2o.storage.base")
    return (ValueError, OSError) + ((base.TierError,) if base is not None else ())


@contextlib.contextmanager
def stop_signals_as_interrupts():
    """While inside, SIGTERM/SIGHUP raise Terminated and SIGINT KeyboardInterrupt in the main thread (then all three
    are ignored, so a second signal cannot cut the cleanup short); the previous handlers come back after, and once a
    signal arrived, the interpreter's shutdown ignores all three too (Python's exit would otherwise die of an
    impatient second Ctrl-C). A signal ignored on entry (nohup, a shell's background job) is left ignored. No-op off
    the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got = []

    def on_signal(signum, frame):
        for s in STOP_SIGNALS + (signal.SIGINT,):
            signal.signal(s, signal.SIG_IGN)
        got.append(signum)
        raise Terminated(signum) if signum != signal.SIGINT else KeyboardInterrupt()
    # a signal the process was started with ignored (nohup's SIGHUP, SIGINT of a shell's background job) stays so
    old = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS + (signal.SIGINT,)
           if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if got:
            atexit.unregister(_ignore_stop_signals)  # registered once however many runs were interrupted
            atexit.register(_ignore_stop_signals)


def _ignore_stop_signals() -> None:
    for s in STOP_SIGNALS + (signal.SIGINT,):
        signal.signal(s, signal.SIG_IGN)

