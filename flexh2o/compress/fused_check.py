"""Loading the fused cache kernels (compress/fused_kernels.py) and checking them once on this machine before a run
reads its cache with them (compress/fused_attend.py's `chosen`): any failure here sends the run to attend.py."""
from __future__ import annotations

import os

import torch

SAFE_LAYER = "threadsafe"  # numba's OpenMP or TBB pool: safe when two threads call kernels at once (workqueue is not)


def load() -> tuple:
    """(the kernels module, a line saying what runs) once the kernels ran on small blocks of each scheme and
    agreed with attend.py's levels read; raises otherwise (ImportError without numba, RuntimeError naming the
    scheme that disagreed, numba's own error where no thread-safe threading layer loads)."""
    import numba

    if "NUMBA_THREADING_LAYER" not in os.environ:  # the user's choice stands
        numba.config.THREADING_LAYER = SAFE_LAYER
    from flexh2o.compress import fused_kernels

    _start_threads(numba)
    _self_check(fused_kernels)
    return fused_kernels, f"numba {numba.__version__} ({numba.threading_layer()} threads)"


def _start_threads(numba) -> None:
    """Start numba's thread pool with passive waiting unless OMP_WAIT_POLICY says otherwise: its OpenMP runtime is
    not torch's (another copy of libgomp), and threads of one that spin after their region hold a core the other's
    next region needs (measured: a decode step several times slower with both spinning on 2 cores). The variable is
    read once, when numba loads its runtime here, and removed again: torch's runtime, already loaded, keeps its own."""
    if "OMP_WAIT_POLICY" in os.environ:
        numba.get_num_threads()
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        numba.get_num_threads()  # loads the threading layer and starts its threads
    finally:
        del os.environ["OMP_WAIT_POLICY"]


def _self_check(kn) -> None:
    """The fused read of a small block of every key and value scheme equals attend.py's within fp32 noise (the
    tests check the arithmetic; this catches a kernel miscompiled or unsupported on this CPU)."""
    from flexh2o.compress import attend, fused_attend

    gen = torch.Generator().manual_seed(0)
    b, h, s, d = 2, 2, 5, 32
    for bits, keys in ((4, "channel"), (3, "token"), (2, "channel"), (8, "token")):
        x = torch.randn(b, h, s, d, generator=gen)
        k, v = small_form(keys, bits, x), small_form("token", bits, x)
        q = torch.randn(b, h, 3, d, generator=gen)
        p = torch.softmax(torch.randn(b, h, 3, s, generator=gen), -1)
        pairs = ((fused_attend._logits(kn, q, k), attend.logits(q, k)),
                 (fused_attend._mix32(kn, p, v), attend.mix(p, v, torch.float32)))
        for got, want in pairs:
            if not torch.allclose(got, want, rtol=0, atol=1e-4 * (1 + float(want.abs().max()))):
                raise RuntimeError(f"the fused kernels disagree with the levels read ({bits}-bit {keys})")


def small_form(keys: str, bits: int, x: torch.Tensor):
    """x (b, h, s, d) stored per channel with 4 outliers ("channel") or per token in groups of d / 2."""
    from flexh2o.compress.channel import ChannelKeys, ChannelSpec
    from flexh2o.compress.codec import CacheGroupSpec, assign, empty_like_layout

    every = (slice(None), slice(None), slice(0, x.shape[2]))
    if keys == "token":
        form = empty_like_layout(x.shape, x.dtype, CacheGroupSpec(bits, x.shape[-1] // 2, -1), "cpu")
    else:
        spec = ChannelSpec(bits, 4)
        form = ChannelKeys(*(torch.zeros(sh, dtype=dt) for sh, dt in spec.parts(x.shape, x.dtype).values()), spec)
        form.calibrate(x, torch.ones(x.shape[:3], dtype=torch.bool))
    assign(form, every, x)
    return form
