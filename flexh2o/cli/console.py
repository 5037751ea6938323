"""What every console script shares: argument errors and user errors as one line on stderr with exit status 2,
Ctrl-C as exit status 130, never a traceback for bad input."""
from __future__ import annotations

import argparse
import sys
from typing import Callable

from flexh2o.storage.base import TierFullError


class UsageError(ValueError):
    """A bad command line (unknown flag, wrong type, missing argument)."""


class Parser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of printing the whole usage and exiting."""

    def error(self, message):
        raise UsageError(f"{message} (see {self.prog} --help)")


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def run_main(prog: str, body: Callable[[], int], interrupted: str = "interrupted") -> int:
    """Run a script's body; ValueError/OSError/TierFullError -> 'prog: error: ...' and 2, Ctrl-C -> 130."""
    try:
        return body()
    except (ValueError, OSError, TierFullError) as e:
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: {interrupted}", file=sys.stderr)
        return 130
