"""Where flexh2o keeps what it measures or builds once per machine (profiles, probes, converted models, native
builds): one rule, read by planning/machine.py and compress/expand_native.py."""
from __future__ import annotations

import os


def cache_dir() -> str:
    """$FLEXH2O_CACHE_DIR, else $XDG_CACHE_HOME/flexh2o, else ~/.cache/flexh2o (not created here)."""
    if os.environ.get("FLEXH2O_CACHE_DIR"):
        return os.environ["FLEXH2O_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "flexh2o")
