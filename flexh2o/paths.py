"""Where flexh2o keeps what it measures or builds once per machine (profiles, probes, converted models, native
builds: `cache_dir`, read by planning/machine.py and compress/expand_native.py) and where the disk tier's files go
unless a run says otherwise (`offload_dir`, read by every script's --offload-dir and RunConfig)."""
from __future__ import annotations

import os


def cache_dir() -> str:
    """$FLEXH2O_CACHE_DIR, else $XDG_CACHE_HOME/flexh2o, else ~/.cache/flexh2o (not created here)."""
    if os.environ.get("FLEXH2O_CACHE_DIR"):
        return os.environ["FLEXH2O_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "flexh2o")


def offload_dir() -> str:
    """The disk tier's default folder: $FLEXH2O_OFFLOAD_DIR, else ~/flexh2o_offload (each run works in its own
    directory inside it, removed at exit; not created here)."""
    return os.environ.get("FLEXH2O_OFFLOAD_DIR") or os.path.join(os.path.expanduser("~"), "flexh2o_offload")
