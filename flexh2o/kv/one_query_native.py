"""A decode step's one-query attention in C (kv/one_query_c.py) over a cache block's slices where they lie: no copy
of the strided slices (bf16's batched product by oneDNN takes dense operands only), the logits, softmax and value
mix of a (row, head) pair in one pass while its keys and values are in cache.

Built once per machine and source into the cache directory with the system's C compiler (as
compress/expand_native.py's); it runs where ATen's kernels are AVX-512 (not under ATEN_CPU_CAPABILITY=avx2 or
default) on a CPU with AVX-512F, for fp32 or bf16 operands whose head dimension is a multiple of 16 (at most 256).
Elsewhere `takes` is False and kv/sdpa.one_query's matmuls run.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Optional

import torch

from flexh2o.compress import expand_native
from flexh2o.kv.one_query_c import SOURCE

FLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared", "-ffp-contract=off")  # fused multiply-adds only where written
DTYPES = (torch.float32, torch.bfloat16)  # the C code's dtypes 0 and 1
MAX_D = 256  # the C code's largest head dimension


@functools.lru_cache(maxsize=1)
def _library() -> Optional[ctypes.CDLL]:
    """The built library (built once into the cache directory), None where it cannot be built or loaded."""
    lib = expand_native.built("onequery", SOURCE, list(FLAGS))
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.one_query_runs.restype = ctypes.c_int
    lib.one_query.restype = ctypes.c_int
    lib.one_query.argtypes = [ctypes.c_int, i64, i64, i64, i64, i64, ptr, i64, i64, i64, ptr, i64, i64, i64,
                              ptr, i64, i64, i64, ptr, ctypes.c_float, ctypes.c_int]
    return lib


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Whether the C code runs in this process: built, AVX-512F here and ATen's kernels AVX-512."""
    lib = _library()
    return (lib is not None and torch.backends.cpu.get_cpu_capability().startswith("AVX512")
            and bool(lib.one_query_runs()))


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `attend` runs q (..., G, D), k/v (..., T, D) of 4 dimensions: one dtype of DTYPES on the CPU, the
    head dimension a multiple of 16 up to MAX_D and contiguous in each, and the C code available."""
    d = q.shape[-1]
    return (q.dim() == 4 and k.dim() == 4 and v.dim() == 4 and q.dtype in DTYPES and k.dtype == q.dtype
            and v.dtype == q.dtype and q.device.type == "cpu" and k.device.type == "cpu" and d % 16 == 0
            and d <= MAX_D and all(t.stride(-1) == 1 for t in (q, k, v)) and k.shape[-2] > 0 and available())


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v: q (b, h, g, d), k/v (b, h, T, d) read at their strides -> (b, h, g, d)
    contiguous, in kv/sdpa._one_query's arithmetic (kv/one_query_c.py)."""
    b, h, g, d = q.shape
    t = k.shape[-2]
    k, v = (x.expand(b, h, t, d) for x in (k, v))  # a broadcast row or head reads stride 0
    out = torch.empty(b, h, g, d, dtype=q.dtype)
    got = _library().one_query(DTYPES.index(q.dtype), b, h, g, t, d, q.data_ptr(), *q.stride()[:3],
                               k.data_ptr(), *k.stride()[:3], v.data_ptr(), *v.stride()[:3], out.data_ptr(),
                               d ** -0.5, torch.get_num_threads())
    if got:
        raise ValueError(f"one-query attention: head dimension {d} of {q.dtype} is not one the C code takes")
    return out
