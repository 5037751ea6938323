"""The CLI's use of `Flag` (flexh2o/flag.py, re-exported here): a script's options added to its parser in order
(`add_flags`) and add_argument's calls kept as data (`declare`). Imports no torch."""
from __future__ import annotations

import argparse
from typing import Callable

from flexh2o.flag import Flag

__all__ = ["Flag", "add_flags", "declare"]


def add_flags(parser: argparse.ArgumentParser, flags) -> None:
    """Each Flag's option, in order."""
    for f in flags:
        f.add_to(parser)


def declare(flags: list) -> Callable:
    """a(flag, **options) appending Flag(flag, **options) to `flags`: add_argument's calls, kept as data."""
    return lambda flag, **options: flags.append(Flag(flag, **options))
