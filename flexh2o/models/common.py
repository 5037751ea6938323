"""Pieces shared by model families: weight specs and small tensor helpers."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flexh2o.compress.kernels import PackedWeight
from flexh2o.tensors import native_products


@dataclass(frozen=True)
class WeightSpec:
    """One weight tensor: its Hugging Face state-dict name, shape, and how dummy weights initialise it."""

    name: str
    shape: tuple
    init: str = "normal"  # "normal" (std 0.02), "ones" (norm scales, with small noise), "zeros" (biases, small noise)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(b, t, n*d) -> (b, n, t, d)"""
    b, t, _ = x.shape
    return x.view(b, t, num_heads, -1).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(b, n, t, d) -> (b, t, n*d)"""
    b, n, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, n * d)


MLP_ELEMENTS = 1 << 24  # rows per MLP chunk are chosen so the intermediate stays under this many elements


def rowwise(fn, x: torch.Tensor, width: int, *extra: torch.Tensor) -> torch.Tensor:
    """fn(x, *extra) on x (b, t, h) in chunks of rows so a (rows, width) intermediate never grows with the batch;
    extra: tensors (b, t, ...) chunked alike (a residual the last product adds)."""
    b, t, h = x.shape
    rows = max(1, MLP_ELEMENTS // width)
    if b * t <= rows:
        return fn(x, *extra)
    flat = [a.reshape(b * t, a.shape[-1]) for a in (x, *extra)]  # each (b * t, its width)
    return torch.cat([fn(*parts) for parts in zip(*(a.split(rows) for a in flat))]).view(b, t, -1)


def linear(x: torch.Tensor, w, bias=None) -> torch.Tensor:
    """F.linear for a weight that is a plain tensor, a PackedWeight run by the int4 kernel, or a StoredWeight
    converted in chunks; an fp32 or native 16-bit product on an AVX-512 CPU by oneDNN (`onednn_runs`), else a few
    rows times a large fp32 weight on a CPU as the transposed product (`skinny_linear`)."""
    if isinstance(w, (PackedWeight, StoredWeight)):
        return w.linear(x, bias)
    if onednn_runs(x, w):
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")  # (..., n), contiguous
    return skinny_linear(x, w, bias) if is_skinny(x, w) else F.linear(x, w, bias)


def linear_relu(x: torch.Tensor, w, bias=None) -> torch.Tensor:
    """F.relu(linear(x, w, bias)), the relu inside oneDNN's product where it runs (`onednn_runs`)."""
    if isinstance(w, torch.Tensor) and onednn_runs(x, w):
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "relu", [], "")
    return F.relu(linear(x, w, bias))


def linear_add(x: torch.Tensor, w, bias, residual: torch.Tensor) -> torch.Tensor:
    """residual + linear(x, w, bias): x (..., k), residual (..., n); the sum inside oneDNN's product where it runs
    (`onednn_runs`, a contiguous residual of the output's dtype and shape), one pass over the output fewer."""
    if isinstance(w, torch.Tensor) and onednn_runs(x, w) and residual.dtype == x.dtype \
            and residual.is_contiguous() and residual.shape == (*x.shape[:-1], w.shape[0]):
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, w, bias, "add")
    return residual + linear(x, w, bias)


def onednn_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether x @ w.T + bias runs as oneDNN's fp32 linear: both fp32 on a CPU whose ATen kernels are AVX-512 and
    where the op agrees with F.linear (`onednn_linear`). GFLOP/s on an AVX-512 Zen 4, 2 threads, 64 rows, medians
    of alternated calls, F.linear / the transposed product / oneDNN: 768 x 768 60-78 / 91-109 / 96-107, 3072 x 768
    67-88 / 107-113 / 131-144, 768 x 3072 90-104 / 120-122 / 143-150, the 50272 x 768 head 62-63 / 80-86 /
    141-148; its output is (rows, n) contiguous, where the transposed product's logits cost their readers 2-3x a
    copy. At 8, 256 and 2048 rows it beat F.linear on every shape (the transposed product: 768 x 768 at 8 rows,
    the head at 2048). With MKL's and oneDNN's AVX2 kernels the transposed product ran 0.97-1.3x oneDNN's on the
    decoder's shapes (0.6-0.7x on the head), so an AVX2 CPU keeps it (benchmarks/RESULTS.md, 2026-12-06)."""
    return (x.dtype == torch.float32 and w.dtype == torch.float32 and w.device.type == "cpu"
            and x.device.type == "cpu" and onednn_linear())


@functools.lru_cache(maxsize=1)
def onednn_linear() -> bool:
    """Whether this process runs fp32 CPU linears by oneDNN (decided once): torch built with it, AVX-512 ATen
    kernels, and its product of a small case within the fp32 rounding of F.linear's."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise") \
            or not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return False
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=gen) for s in ((8, 96), (40, 96), (40,)))
    try:
        got = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    except RuntimeError:
        return False
    bound = 96 * torch.finfo(torch.float32).eps * (x.abs() @ w.abs().t() + b.abs())  # k terms summed in any order
    return bool(((got - F.linear(x, w, b)).abs() <= bound).all())


def onednn_runs(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether x @ w.T + bias runs as oneDNN's linear: in fp32 (`onednn_fits`) or in a 16-bit dtype
    (`onednn16_fits`)."""
    return onednn_fits(x, w) or onednn16_fits(x, w)


def onednn16_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether x @ w.T + bias runs as oneDNN's linear in a 16-bit dtype: x and w of one dtype the CPU multiplies by
    its own AVX-512 kernels (tensors.native_products: bf16 on a Zen 4), where the op agrees with the exact product
    within that dtype's rounding (`onednn_linear16`). GFLOP/s, bf16, AVX-512 Zen 4, 2 threads, 64 / 128 / 256
    rows, F.linear / oneDNN: 768 x 768 129 / 184 / 221 against 198 / 260 / 286, 3072 x 768 237 / 297 / 312 against
    267 / 325 / 338, 768 x 3072 257 / 173 / 341 against 302 / 344 / 366, the 50272 x 768 head 240 / 188 / 287
    against 234 / 215 / 286 (benchmarks/linear_paths.py --dtype bfloat16, 2026-12-07); the bias, relu and residual
    sum inside the product besides."""
    return (x.dtype == w.dtype and x.dtype.itemsize == 2 and w.device.type == "cpu" and x.device.type == "cpu"
            and onednn_linear16(w.dtype))


@functools.lru_cache(maxsize=None)
def onednn_linear16(dtype: torch.dtype) -> bool:
    """Whether this process runs CPU linears in the 16-bit `dtype` by oneDNN (decided once a dtype): the CPU
    multiplies it natively (tensors.native_products) and oneDNN's product of a small case, with the bias and with a
    residual summed inside, is within the dtype's rounding of the exact one."""
    if not native_products(dtype) or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    gen = torch.Generator().manual_seed(0)
    x, w, b, r = (torch.randn(*s, generator=gen).to(dtype) for s in ((8, 96), (40, 96), (40,), (8, 40)))
    try:
        got = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "").double()
        added = torch.ops.mkldnn._linear_pointwise.binary(x, r, w, b, "add").double()
    except RuntimeError:
        return False
    exact = x.double() @ w.double().t() + b.double()  # (8, 40)
    mag = x.double().abs() @ w.double().abs().t() + b.double().abs()
    # 96 products summed in fp32 in any order, the sum rounded to the dtype (half its eps) and, were the bias or the
    # residual added after a rounding, once more: within 96 fp32 eps and one 16-bit eps of the magnitudes
    bound = (96 * torch.finfo(torch.float32).eps + torch.finfo(dtype).eps) * (mag + r.double().abs())
    return bool(((got - exact).abs() <= bound).all() and ((added - exact - r.double()).abs() <= bound).all())


SKINNY_ROWS = 64  # rows of x at most, for the transposed product
SKINNY_ELEMENTS = 1 << 21  # weight elements at least (opt-125m's fc1/fc2 and every vocabulary head)


def is_skinny(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether x @ w.T runs faster as (w @ x.T).T: an fp32 weight of at least SKINNY_ELEMENTS on a CPU times at
    most SKINNY_ROWS rows (a decode step). MKL's sgemm on an AVX2 Zen 3, 2 threads, 8 / 64 rows: 3072 x 768
    1.6 / 1.5x, 768 x 3072 1.6 / 1.4x, 50272 x 768 2.9 / 1.8x faster; one thread 1.65 / 1.2x, 0.91 / 0.93x,
    1.7 / 1.4x (benchmarks/RESULTS.md, 2026-12-02, 8160d9d). Smaller weights gained nothing reliable."""
    return (w.dtype == torch.float32 and w.device.type == "cpu" and x.dtype == w.dtype
            and x.numel() <= SKINNY_ROWS * x.shape[-1] and w.numel() >= SKINNY_ELEMENTS)


def skinny_linear(x: torch.Tensor, w: torch.Tensor, bias=None) -> torch.Tensor:
    """F.linear(x, w, bias) computed as (w @ x.T).T: x (..., k), w (n, k) -> (..., n), a transposed view."""
    rows = x.reshape(-1, x.shape[-1])  # (r, k)
    out = torch.mm(w, rows.t()) if bias is None else torch.addmm(bias[:, None], w, rows.t())  # (n, r)
    return out.t().view(*x.shape[:-1], w.shape[0])


HEAD_CHUNK_BYTES = 1 << 20  # on a CPU, an fp32 head's weight is multiplied this many bytes of rows at a time


def head_linear(x: torch.Tensor, w) -> torch.Tensor:
    """linear(x, w) for the vocabulary projection: for an fp32 weight on a CPU, in slices of the weight's rows of
    HEAD_CHUNK_BYTES, whose outputs are joined. SmolLM2's 49152 x 576 head, one thread, 10 / 34 / 67 / 100 rows:
    1.4-1.7x faster than one call on an AVX2 Zen 3, 1.04-1.24x on an AVX-512 Zen 4; a bf16 head there ran
    1.1-1.25x slower in slices, so other dtypes are one call. Each output is the same dot product, summed in the
    order the BLAS kernel picks for the slice's shape: equal to one call's up to that rounding (bit-equal at the row
    counts measured but 1, 2, 3 and 7). A PackedWeight, a weight off the CPU, a product oneDNN runs (`onednn_fits`)
    or a skinny product (`is_skinny`: up to SKINNY_ROWS rows, where the transposed product beat the slices at 2
    threads) is one call."""
    if isinstance(w, (PackedWeight, StoredWeight)) or w.device.type != "cpu" or onednn_fits(x, w) \
            or is_skinny(x, w):
        return linear(x, w)
    if w.dtype != torch.float32:  # F.linear, where oneDNN's 16-bit product (`onednn16_fits`) ran no faster
        return F.linear(x, w)
    rows = max(1, HEAD_CHUNK_BYTES // (w.shape[1] * w.element_size()))
    if w.shape[0] <= rows:
        return F.linear(x, w)
    return torch.cat([F.linear(x, part) for part in w.split(rows)], -1)


def embedding(ids: torch.Tensor, w) -> torch.Tensor:
    """F.embedding for a plain table, or a PackedWeight or StoredWeight (only the rows looked up are expanded or
    converted)."""
    return w.rows(ids) if isinstance(w, (PackedWeight, StoredWeight)) else F.embedding(ids, w)


STORED_CHUNK_BYTES = 1 << 23  # a StoredWeight's matmul converts this many bytes of rows (compute dtype) at a time


def stored_chunk_rows(width: int, dtype: torch.dtype) -> int:
    """Rows of a (N, width) StoredWeight converted at a time into `dtype` (at least one)."""
    return max(1, STORED_CHUNK_BYTES // (width * dtype.itemsize))


@dataclass(frozen=True)
class StoredWeight:
    """A large weight handed to the compute side in its stored dtype (weights/stored_form.py says which): a lookup
    converts only the rows it gathers, a matmul converts stored_chunk_rows rows at a time into one reused buffer,
    so the compute side never holds the whole table in the compute dtype."""

    stored: torch.Tensor  # (N, K) in the storage dtype
    dtype: torch.dtype  # the compute dtype

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """(*ids.shape, K) in the compute dtype: the rows gathered, then converted (equal to converting first)."""
        return F.embedding(ids, self.stored).to(self.dtype)

    def linear(self, x: torch.Tensor, bias=None) -> torch.Tensor:
        """x (..., K) -> x @ W.T + bias (..., N) in x's dtype, each chunk of W's rows converted into the buffer and
        multiplied as `linear` multiplies a plain weight of that chunk's shape."""
        n, k = self.stored.shape
        flat = x.reshape(-1, k)  # (r, K)
        out = torch.empty(flat.shape[0], n, dtype=x.dtype, device=x.device)  # (r, N)
        step = stored_chunk_rows(k, x.dtype)
        buf = torch.empty(min(n, step), k, dtype=x.dtype, device=x.device)  # (rows of a chunk, K)
        for start in range(0, n, step):
            stop = min(n, start + step)
            w = buf[:stop - start].copy_(self.stored[start:stop])  # (chunk, K)
            out[:, start:stop] = linear(flat, w, None if bias is None else bias[start:stop])  # (r, chunk)
        return out.view(*x.shape[:-1], n)
