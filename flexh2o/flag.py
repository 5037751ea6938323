"""A command-line option declared once, as data (`Flag`): argparse's option (`Flag.add_to`), a field of EngineArgs
(cli/engine_args.py) and the value a Python API keyword stands for (`Flag.value`: what `--flag VALUE` parses to,
refused in argparse's words) all come from it, as a KV policy's `Param` gives its flag. Below the CLI, so that the
layers under it declare their flags too (kv/cache_quant.CacheFlag is a Flag). Imports no torch."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Callable, Optional

from flexh2o.errors import UsageError

MANY = ("+", "*")  # nargs that take a list
_SEE = " (see flexh2o-run --help)"  # console.Parser's ending of a usage error


@dataclass(frozen=True)
class Flag:
    """One option: `flag` ("--gen-len"), its --help text and default, and argparse's type, choices, nargs, const,
    action ("store_true", "append", argparse.BooleanOptionalAction) and metavar where it has them."""

    flag: str
    help: str
    default: object = None
    type: Optional[Callable] = None
    choices: object = None
    nargs: object = None
    const: object = None
    action: object = None
    metavar: Optional[str] = None

    def __post_init__(self):
        if self.action == "store_true" and self.default is None:  # argparse's default of a switch
            object.__setattr__(self, "default", False)

    @property
    def dest(self) -> str:
        """The attribute (and the API's keyword): --gen-len -> gen_len."""
        return self.flag[2:].replace("-", "_")

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        given = {"type": self.type, "choices": self.choices, "nargs": self.nargs, "const": self.const,
                 "action": self.action, "metavar": self.metavar}
        parser.add_argument(self.flag, default=self.default, help=self.help,
                            **{k: v for k, v in given.items() if v is not None})

    def field(self):
        """EngineArgs' field of this option: its default (a list default copied per instance) and this Flag."""
        if isinstance(self.default, list):
            return field(default_factory=list(self.default).copy, metadata={"flag": self})
        return field(default=self.default, metadata={"flag": self})

    def value(self, given):
        """What `--flag given` parses to (None: not given, the default); a switch takes the truth of `given`, a
        two-way switch (--x / --no-x) the form it names. UsageError in argparse's words for a bad value."""
        if given is None:
            return self.default
        if self.action == "store_true":
            return True if given else self.default
        if self.action is argparse.BooleanOptionalAction:
            return bool(given)
        if self.action == "append":  # a repeated flag: each value given once
            return [self._one(v) for v in (given if isinstance(given, (list, tuple)) else [given])]
        if not isinstance(given, (list, tuple)):
            return [self._one(given)] if self.nargs in MANY else self._one(given)
        if self.nargs in MANY and given:
            return [self._one(v) for v in given]
        if not given:
            raise UsageError(f"argument {self.flag}: expected {'at least ' if self.nargs in MANY else ''}one "
                             f"argument{_SEE}")
        raise UsageError(f"unrecognized arguments: {' '.join(map(str, given[1:]))}{_SEE}")

    def _one(self, given):
        text = str(given).lower() if isinstance(given, bool) else str(given)
        try:
            value = self.type(text) if self.type is not None else text
        except argparse.ArgumentTypeError as e:
            raise UsageError(f"argument {self.flag}: {e}{_SEE}") from None
        except (TypeError, ValueError):
            name = getattr(self.type, "__name__", repr(self.type))
            raise UsageError(f"argument {self.flag}: invalid {name} value: {text!r}{_SEE}") from None
        if self.choices is not None and value not in self.choices:
            raise UsageError(f"argument {self.flag}: invalid choice: {value!r} (choose from "
                             f"{', '.join(map(repr, self.choices))}){_SEE}")
        return value
