"""A Hugging Face folder or a .gguf file given to --model / --path: converted once (weights/convert.py: one tensor
in memory at a time, staged beside the destination and renamed into place, so an interrupted conversion leaves no
half-written checkpoint) into a cache directory keyed by the source's files (path, size, mtime) and the options, and
reused by every later run.

Where: <root>/<source name>-<key>, with <...>.lock beside it (held while converting, so runs started together
convert once); flexh2o-run's root is <planning.machine.cache_dir()>/models ($FLEXH2O_CACHE_DIR, else
$XDG_CACHE_HOME/flexh2o, else ~/.cache/flexh2o). A .gguf keeps its Q4_0/Q4_1/Q8_0/Q4_K blocks (weights/blocks.py)
and stores everything else without loss (float32, or the one 16-bit type all the rest is in); a Hugging Face folder
is stored in the dtype its config.json names (float32 when none): weights/convert.py's source_dtype."""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
from typing import Callable, Optional

from flexh2o.config import CONFIG_FILE
from flexh2o.weights.index import FORMAT_VERSION

RUN_FILES = 1  # what a conversion keeps beside the weights (weights/run_files.py); a new version converts again


def is_source(path: str) -> bool:
    """Whether `path` is a checkpoint to convert: a .gguf file, or a folder with config.json and no flexh2o
    checkpoint in it."""
    if path.endswith(".gguf"):
        return os.path.isfile(path)
    return (os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))
            and not os.path.isfile(os.path.join(path, CONFIG_FILE)))


def converted(src: str, root: str, dtype: Optional[str] = None, keep_blocks: Optional[bool] = None,
              progress: Optional[Callable] = None) -> tuple:
    """(checkpoint directory, whether it was converted now) for the source `src`: the cached conversion under `root`
    when one exists, else a new one. dtype / keep_blocks: None for the defaults in the module docstring."""
    from flexh2o.weights.convert import convert
    gguf = src.endswith(".gguf")
    dtype = dtype or "auto"  # the source's own dtype (weights/convert.py: source_dtype)
    keep = gguf if keep_blocks is None else keep_blocks and gguf
    dst = os.path.join(root, f"{_stem(src)}-{_key(src, dtype, keep)}")
    if os.path.isfile(os.path.join(dst, CONFIG_FILE)):
        return dst, False
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    with open(f"{dst}.lock", "a") as lock:  # runs started together (torchrun ranks) convert once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isfile(os.path.join(dst, CONFIG_FILE)):
            return dst, False
        convert(src, dst, dtype=dtype, overwrite=True, progress=progress, keep_blocks=keep)
    return dst, True


def _stem(src: str) -> str:
    base = os.path.basename(os.path.normpath(os.path.abspath(src)))
    return os.path.splitext(base)[0] if src.endswith(".gguf") else base


def _key(src: str, dtype: str, keep: bool) -> str:
    """16 hex digits of a hash of the source's absolute path, its files' names, sizes and mtimes, and the options."""
    src = os.path.abspath(src)
    files = [src] if os.path.isfile(src) else sorted(os.path.join(src, f) for f in os.listdir(src)
                                                     if os.path.isfile(os.path.join(src, f)))
    stats = [(os.path.basename(f), os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]
    text = json.dumps([src, stats, dtype, keep, FORMAT_VERSION, RUN_FILES])
    return hashlib.sha256(text.encode()).hexdigest()[:16]

