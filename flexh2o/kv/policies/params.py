"""A policy parameter, declared once on its policy class (`params`): its name, type, default, help text and valid
range. The command-line flags (cli/kv_flags.py), their checks (cli/checks.py), the KVSpec (kv/spec.py), the eval
options (eval/common.py) and the printed command line (tuning/search.py) are all derived from these declarations.

The flag of a parameter is its name with dashes (`hh_decay` -> `--hh-decay`). Two messages describe a bad value:
the KVSpec's ("--hh-decay must be between 0 and 1 (got 2.0)") and, when `fix` is given, the command line's own
("--head-cap 0.5: must be a finite number >= 1; the most one KV head holds, in budgets"), as cli/checks.py words it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Param:
    """name: the keyword (KVSpec, the policy's constructor, the attribute); type: int or float; help: --help's text;
    valid values: lo <= value <= hi (finite for a float); fix: the command line's hint after a bad value (None: the
    command line reports the KVSpec's message); shown: when the printed command line names the flag ((policy class,
    value) -> bool; None: whenever the run's policy declares it); label: how KVSpec.describe names the value (None:
    it does not)."""

    name: str
    type: type
    default: object
    help: str
    lo: float = -math.inf
    hi: float = math.inf
    fix: Optional[str] = None
    shown: Optional[object] = None
    label: Optional[str] = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def ok(self, value) -> bool:
        if self.type is int:
            return self.lo <= value <= self.hi
        return math.isfinite(value) and self.lo <= value <= self.hi

    def check(self, value) -> None:
        """The KVSpec's check: ValueError naming the flag when `value` is out of range."""
        if self.ok(value):
            return
        if self.type is int:
            raise ValueError(f"{self.flag} must be {self.lo:g} or more (got {value})")
        if math.isfinite(self.hi):
            raise ValueError(f"{self.flag} must be between {self.lo:g} and {self.hi:g} (got {value})")
        raise ValueError(f"{self.flag} must be a finite number >= {self.lo:g} (got {value})")

    def printed(self, cls, value) -> bool:
        """The printed command line names this flag for a run of policy class `cls` holding `value`."""
        if self.shown is not None:
            return bool(self.shown(cls, value))
        return any(p.name == self.name for p in declared(cls))

    def flag_text(self, value) -> str:
        """`--flag value` as flexh2o-run parses it back."""
        return f"{self.flag} {value}"


def declared(cls) -> tuple:
    """Every Param a policy class declares, its bases' first (the MRO, base classes first), each name once."""
    out, seen = [], set()
    for klass in reversed(cls.__mro__):
        for p in vars(klass).get("params", ()):
            if p.name not in seen:
                out.append(p)
                seen.add(p.name)
    return tuple(out)


def all_params(classes) -> tuple:
    """Every Param declared by any of `classes` (registry order, each name once)."""
    out, seen = [], set()
    for cls in classes:
        for p in declared(cls):
            if p.name not in seen:
                out.append(p)
                seen.add(p.name)
    return tuple(out)
