"""cli/console.stop_signals_as_interrupts: the stop signals raise inside it and their handlers come back after; a
signal the process was started with ignored (nohup's SIGHUP, SIGINT of a shell's background job) stays ignored."""
from __future__ import annotations

import os
import signal
import threading

import pytest

from flexh2o.cli.console import Terminated, stop_signals_as_interrupts

pytestmark = pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                                reason="signal handlers are set in the main thread only")


@pytest.fixture
def saved_handlers():
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM)}
    yield
    for s, h in old.items():
        signal.signal(s, h)


def test_an_ignored_signal_stays_ignored_inside_and_after(saved_handlers):
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with stop_signals_as_interrupts():
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGHUP)  # ignored: nothing raised
        assert callable(signal.getsignal(signal.SIGTERM))  # SIGTERM was not ignored: handled inside
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_a_handled_signal_raises_inside_and_its_handler_comes_back(saved_handlers):
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    with pytest.raises(Terminated):
        with stop_signals_as_interrupts():
            os.kill(os.getpid(), signal.SIGHUP)  # the handler runs before os.kill returns to Python code
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL
