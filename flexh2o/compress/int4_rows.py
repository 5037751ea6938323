"""4-bit weights in the int4 kernel's order multiplied from their packed bytes at a decode step's few rows, in C
(compress/int4_rows_c.py), where a measurement on this machine finds that faster than torch's int4 kernel.

torch's kernel (aten._weight_int4pack_mm_for_cpu) expands the weight again for every few activation rows (tiles of
4 on AVX-512), so at 16 rows it ran 0.43-0.48 ms for a 1024 x 1024 weight against bf16's 0.25 ms (Zen 4, one
thread). Here each group of a row block is unpacked once and every activation row multiplies it from registers:
on an AVX512-BF16 CPU by bf16 dot products of the exact levels (kind 2: bf16 activations, as torch's kernel takes
them, fp32 sums, then scale and minimum per group: q.(s w + m) = s (q.w) + m sum(q)), else by fp32 FMAs of the
levels (kind 1: AVX2, fp32 activations), scale and minimum applied alike. The result comes in fp32.

The library is built once per machine and source into the cache directory with the system's C compiler (as
compress/expand_native.py's); where none builds, where torch runs its generic kernels (ATEN_CPU_CAPABILITY=default)
or on another order, `chosen` is False and torch's kernel runs. On the AVX2 path of an AVX-512 CPU
(ATEN_CPU_CAPABILITY=avx2) the bf16 instructions are left out, as an AVX2-only CPU has none. Which of the two runs
is measured once a process for each (rows, input width, group, dtype) (`_faster`): nothing is assumed of a CPU.
"""
from __future__ import annotations

import ctypes
import functools
import statistics
import time
from typing import Optional

import torch

from flexh2o.compress import expand_native
from flexh2o.compress.int4_order import row_order
from flexh2o.compress.int4_rows_c import SOURCE

FLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared", "-ffp-contract=off")  # no fused multiply-add but where written
MAX_GROUP = 256  # the C code's largest group
ROWS_MULTIPLE = 32  # the C code takes weights of a multiple of this many output rows (compress/kernels.KERNEL_ROWS)
META_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the meta the C code reads (its `meta_kind`s)
PROBE_N = 1024  # output rows of the probe's weight
PROBE_ROWS = 256  # activation rows above which the answer at this many is taken (the products are compute bound)
ROUNDS = 9  # alternated rounds of the probe, after one call of each that warms up
ROUND_S = 0.002  # a probe's round repeats a call to about this many seconds (at most MAX_CALLS): one call of a
MAX_CALLS = 20  # few hundred microseconds on two busy cores is mostly its threads' wake-ups


@functools.lru_cache(maxsize=1)
def _library() -> Optional[ctypes.CDLL]:
    """The built library (built once into the cache directory), None where it cannot be built or loaded."""
    lib = expand_native.built("int4rows", SOURCE, list(FLAGS))
    if lib is None:
        return None
    lib.mm4_kind.restype = ctypes.c_int
    lib.mm4_kind.argtypes = [ctypes.c_int]
    lib.mm4.restype = ctypes.c_int
    lib.mm4.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                        ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                        ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    return lib


@functools.lru_cache(maxsize=1)
def kind() -> int:
    """2: the bf16 dot product runs here, 1: the fp32 one, 0: none (not built, torch's generic kernels or another
    order of the packed weight)."""
    cap, lib = torch.backends.cpu.get_cpu_capability(), _library()
    if lib is None or cap not in ("AVX2", "AVX512") or row_order().paired:
        return 0
    return lib.mm4_kind(int(cap == "AVX512"))


def fits(packed: torch.Tensor, group_size: int) -> bool:
    """Whether the C code takes a (N, K / 2) packed weight of this grouping."""
    n, k = packed.shape[0], packed.shape[1] * 2
    return (packed.device.type == "cpu" and n % ROWS_MULTIPLE == 0 and group_size <= MAX_GROUP
            and group_size % 2 == 0 and k % group_size == 0)


def chosen(x: torch.Tensor, packed: torch.Tensor, group_size: int) -> bool:
    """Whether `product` multiplies x by this weight: it runs here and measured faster than torch's int4 kernel at
    x's rows (rounded up to a power of two, at most PROBE_ROWS)."""
    if x.device.type != "cpu" or not kind() or not fits(packed, group_size):
        return False
    rows = max(1, x.numel() // x.shape[-1])
    return _faster(min(PROBE_ROWS, 1 << (rows - 1).bit_length()), x.shape[-1], group_size, x.dtype)


def product(x: torch.Tensor, packed: torch.Tensor, meta: torch.Tensor, group_size: int,
            use: Optional[int] = None) -> torch.Tensor:
    """x (..., K) @ W.T -> (..., N) fp32, W the (N, K) weight of kernel-order bytes `packed` (N, K / 2) and meta
    (N, K / group, 2) (scale, minimum). use: the kind to run (default `kind()`; 1 runs on any AVX2 CPU)."""
    use = use or kind()
    n, k = packed.shape[0], packed.shape[1] * 2
    flat = x.reshape(-1, k)  # (M, K)
    m = flat.shape[0]
    xs = flat.to(torch.bfloat16 if use == 2 else torch.float32).contiguous()  # (M, K) as the product multiplies it
    sums = xs.float().view(m, k // group_size, group_size).sum(-1)  # (M, groups) fp32
    mt = (meta if meta.dtype in META_DTYPES else meta.float()).contiguous()  # (N, groups, 2)
    out = torch.empty(m, n)  # (M, N) fp32
    got = _library().mm4(packed.contiguous().data_ptr(), mt.data_ptr(), META_DTYPES.index(mt.dtype), n, k,
                         group_size, row_order().block, use, xs.data_ptr(), sums.data_ptr(), m, out.data_ptr(),
                         torch.get_num_threads())
    if got:
        raise ValueError(f"int4 rows: a ({n}, {k}) weight in groups of {group_size} is not one this product takes")
    return out.view(*x.shape[:-1], n)


@functools.lru_cache(maxsize=None)
def _faster(rows: int, k: int, group_size: int, dtype: torch.dtype) -> bool:
    """Whether `product` (then converted to dtype) beats torch's int4 kernel for `rows` activation rows of `dtype`
    times a random (PROBE_N, k) weight: ROUNDS alternated rounds of a few calls each, medians compared."""
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (PROBE_N, k // 2), dtype=torch.uint8, generator=g)  # any byte is two levels
    meta = (torch.rand(PROBE_N, k // group_size, 2, generator=g) * 0.01).to(torch.bfloat16)
    zeros = (torch.rand(k // group_size, PROBE_N, 2, generator=g) * 0.01).to(torch.bfloat16)  # the kernel's
    x = torch.randn(rows, k, generator=g).to(dtype)
    paths = {"own": lambda: product(x, packed, meta, group_size).to(dtype),
             "torch": lambda: torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), packed,
                                                                group_size, zeros).to(dtype)}
    times = {name: [] for name in paths}
    with torch.inference_mode():
        calls = {name: _calls(fn) for name, fn in paths.items()}
        for _ in range(ROUNDS):
            for name, fn in paths.items():
                start = time.perf_counter()
                for _ in range(calls[name]):
                    fn()
                times[name].append((time.perf_counter() - start) / calls[name])
    return statistics.median(times["own"]) < statistics.median(times["torch"])


def _calls(fn) -> int:
    """Calls of fn a probe's round makes (ROUND_S over the time of this first, warming call)."""
    start = time.perf_counter()
    fn()
    return max(1, min(MAX_CALLS, int(ROUND_S / max(time.perf_counter() - start, 1e-6))))
