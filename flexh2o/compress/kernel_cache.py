"""Where numba keeps the fused cache kernels (compress/fused_*kernels.py) on disk: a folder keyed by a hash of every
kernel file's source. numba checks a cached kernel against the stamp (modification time and size) of the one file
that defines it, so a kernel that inlines another file's functions (fused_decode_kernels.py inlines fused_kernels.py's
dot and axpy and fused_quant_kernels.py's put_pair) kept its old machine code when only that other file changed;
keyed by the bytes of all of them, any change finds a fresh folder and compiles anew."""
from __future__ import annotations

import contextlib
import hashlib
import os

from flexh2o.paths import cache_dir

KERNEL_FILES = ("fused_kernels.py", "fused_quant_kernels.py", "fused_decode_kernels.py")  # inlined into each other
HERE = os.path.dirname(os.path.abspath(__file__))


def sources_key(folder: str = HERE, files: tuple = KERNEL_FILES) -> str:
    """A hash (16 hex digits) of the kernel files' names and bytes in `folder`."""
    h = hashlib.blake2b(digest_size=8)
    for name in files:
        with open(os.path.join(folder, name), "rb") as fh:
            h.update(name.encode() + b"\0" + fh.read() + b"\0")
    return h.hexdigest()


def cache_folder(key: str) -> str:
    """Where kernels of sources `key` are cached: under $NUMBA_CACHE_DIR where the user set it, else in the
    package's __pycache__ as numba's own default (kept across processes and test sessions, whose cache_dir() is
    temporary: a compile of the kernels takes minutes on two busy cores), else (a read-only install) under
    flexh2o's cache_dir()/numba."""
    base = os.environ.get("NUMBA_CACHE_DIR")
    if not base:
        tree = os.path.join(HERE, "__pycache__")
        base = tree if os.access(tree if os.path.isdir(tree) else HERE, os.W_OK) else os.path.join(cache_dir(), "numba")
    return os.path.join(base, f"numba-kernels-{key}")


@contextlib.contextmanager
def kernel_cache(folder: str = HERE):
    """Inside the block numba caches the kernels it defines in cache_folder(sources_key(folder)) (numba picks a
    kernel's cache folder when the kernel is defined: import the kernel modules inside it); numba's setting is
    restored after."""
    import numba

    before = numba.config.CACHE_DIR
    numba.config.CACHE_DIR = cache_folder(sources_key(folder))
    try:
        yield numba.config.CACHE_DIR
    finally:
        numba.config.CACHE_DIR = before
