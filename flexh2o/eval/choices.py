"""What the evaluations offer, without torch (flexh2o-eval --help reads it before any tensor is made): the policies
they compare and the bundled texts."""
from __future__ import annotations

from flexh2o.kv.policies import POLICIES

EVICTING = tuple(p for p in POLICIES if p != "full")  # every policy but full
TEXTS = ("hamlet", "macbeth", "julius_caesar")
