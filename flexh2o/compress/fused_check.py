"""Loading the fused cache kernels (compress/fused_kernels.py) and checking them once on this machine before a run
reads its cache with them (compress/fused_attend.py's `chosen`): any failure here sends the run to attend.py."""
from __future__ import annotations

import os

import torch

ENV = "FLEXH2O_CACHE_KERNEL"  # auto, fused or torch: how the quantized cache is read and written (fused_attend)
SAFE_LAYER = "threadsafe"  # numba's OpenMP or TBB pool: safe when two threads call kernels at once (workqueue is not)


def load(check) -> tuple:
    """(the kernels module, a line saying what runs) once `check(kernels)` ran them on small blocks of each scheme
    (compress/fused_attend.py's: against attend.py's levels read); raises otherwise (ImportError without numba,
    check's RuntimeError naming the scheme that disagreed, numba's own error where no thread-safe threading layer
    loads)."""
    import numba

    if "NUMBA_THREADING_LAYER" not in os.environ:  # the user's choice stands
        numba.config.THREADING_LAYER = SAFE_LAYER
    from flexh2o.compress.kernel_cache import kernel_cache
    with kernel_cache():  # numba's cache keyed by every kernel file's source (compress/kernel_cache.py)
        from flexh2o.compress import fused_kernels

    _start_threads(numba)
    check(fused_kernels)
    return fused_kernels, f"numba {numba.__version__} ({numba.threading_layer()} threads)"


def _start_threads(numba) -> None:
    """Start numba's thread pool with passive waiting unless OMP_WAIT_POLICY says otherwise: numba's OpenMP layer
    binds to the libgomp already loaded, torch's own (one runtime, one pool: checked with LD_DEBUG=bindings, 7 Dec
    2026), which read its OMP_WAIT_POLICY when torch loaded it; the variable set here reaches only what loads a
    runtime of its own now (a numba built against another OpenMP), and is removed again. Threads spinning after a
    region hold a core the next region needs (measured when two runtimes ran: a decode step several times slower on
    2 cores): set OMP_WAIT_POLICY=PASSIVE before starting Python to make torch's own threads wait passively."""
    if "OMP_WAIT_POLICY" in os.environ:
        numba.get_num_threads()
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        numba.get_num_threads()  # loads the threading layer and starts its threads
    finally:
        del os.environ["OMP_WAIT_POLICY"]


def small_form(keys: str, bits: int, x: torch.Tensor, groups: int = 2):
    """x (b, h, s, d) stored per channel with 4 outliers ("channel") or per token in `groups` groups."""
    from flexh2o.compress.channel import ChannelKeys, ChannelSpec
    from flexh2o.compress.codec import CacheGroupSpec, assign, empty_like_layout

    every = (slice(None), slice(None), slice(0, x.shape[2]))
    if keys == "token":
        form = empty_like_layout(x.shape, x.dtype, CacheGroupSpec(bits, x.shape[-1] // groups, -1), "cpu")
    else:
        spec = ChannelSpec(bits, 4)
        form = ChannelKeys(*(torch.zeros(sh, dtype=dt) for sh, dt in spec.parts(x.shape, x.dtype).values()), spec)
        form.calibrate(x, torch.ones(x.shape[:3], dtype=torch.bool))
    assign(form, every, x)
    return form
