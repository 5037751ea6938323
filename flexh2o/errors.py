"""How an error reads to a person: one line, whatever the exception's text held (the console scripts and the
pipeline stages' agreed refusals print it), and the error of a bad command line."""
from __future__ import annotations


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


class UsageError(ValueError):
    """A bad command line (unknown flag, wrong type, missing argument)."""
