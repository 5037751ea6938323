"""torch's weight-only int4 kernel for CPU (aten._weight_int4pack_mm_for_cpu) fed from the codec's layout.

The kernel's groups run along the input dimension (K) of a (N, K) weight and its dequantization is
(q - 8) * scale + zero, so a 4-bit CompressedTensor grouped along dimension 1 converts exactly:
zero = minimum + 8 * scale. Its packed weight is the same N * K / 2 bytes as the codec's data in another order
(`to_kernel_order` / `from_kernel_order` convert by permutation alone), so a weight is stored in the kernel's order
at load time (the same bytes in its tier) and either fed to the kernel or expanded back for the generic path.

The order depends on the CPU torch runs on (blocks of 32 or 64 output rows, compress/int4_order.py);
`kernel_available` is false when torch writes none of the orders known there. A weight needs a multiple of
KERNEL_ROWS rows on every CPU, so the same weights take the kernel's form wherever the plan is made.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from flexh2o.compress import expand_native, int4_rows
from flexh2o.compress.codec import CompressedTensor, CompressionSpec, dequantize, stored_bytes
from flexh2o.compress.int4_order import (pack_levels, row_block, row_order, split_rows, torch_order, unpack_levels,
                                         write_levels)

KERNEL_GROUPS = (32, 64, 128, 256)
KERNEL_ROWS = 32  # a weight in the kernel's form has a multiple of this many output rows
ROWS_ELEMENTS = 1 << 20  # a lookup expands its row blocks this many fp32 elements at a time (4 MiB)


def kernel_spec_ok(spec: Optional[CompressionSpec]) -> bool:
    """The one rule of which quantization the int4 kernel takes: 4 bits in groups of KERNEL_GROUPS along the input
    dimension of a (N, K) weight (the run's check, the flags, the weights' layout and each weight's shape use it)."""
    return spec is not None and spec.bits == 4 and spec.group_size in KERNEL_GROUPS and spec.group_dim in (1, -1)


def kernel_shape_ok(shape: tuple, spec: Optional[CompressionSpec]) -> bool:
    """Whether a weight of `shape` stored under `spec` can be held in the int4 kernel's order."""
    return (len(shape) == 2 and kernel_spec_ok(spec) and shape[0] % KERNEL_ROWS == 0
            and shape[1] % spec.group_size == 0)


def packed_bytes(shape: tuple, dtype: torch.dtype, spec: CompressionSpec) -> int:
    """Bytes of the PackedWeight of a (N, K) weight stored as `dtype` under `spec`: its stored data and meta, and
    the kernel's bf16 scales and zeros (K / group, N, 2)."""
    return stored_bytes(tuple(shape), dtype, spec) + scales_bytes(shape, spec)


def scales_bytes(shape: tuple, spec: CompressionSpec) -> int:
    """Bytes of the kernel's bf16 scales and zeros (K / group, N, 2) of a (N, K) weight (`kernel_scales`)."""
    n, k = shape
    return n * (k // spec.group_size) * 2 * 2


def rows_buffer_bytes(shape: tuple) -> int:
    """Bytes of the fp32 buffer a lookup in a (N, K) PackedWeight expands its row blocks into (PackedWeight.rows)."""
    n, k = shape
    return min(n, _rows_chunk(k) * row_block()) * k * 4


def _rows_chunk(k: int) -> int:
    """Row blocks of a K-wide table expanded at once by a lookup."""
    return max(1, ROWS_ELEMENTS // (row_block() * k))


def kernel_available(device) -> bool:
    """The CPU int4 kernel exists in this torch and its packed order is one `to_kernel_order` writes."""
    return torch.device(device).type == "cpu" and torch_order() is not None


def codec_levels(ct: CompressedTensor) -> torch.Tensor:
    """A 4-bit CompressedTensor's levels 0..15 (..., groups * group_size) along its grouped (last packed) axis."""
    return torch.stack([ct.data & 0xF, ct.data >> 4], -1).flatten(-3)


def to_kernel_order(ct: CompressedTensor) -> CompressedTensor:
    """A (N, K) weight grouped along K (codec order) -> the same tensor with `data` in the kernel's order (N, K/2)."""
    n, k = ct.shape
    if not kernel_shape_ok((n, k), ct.spec):
        raise ValueError(f"the int4 kernel needs 4 bits grouped along the input dimension in groups of "
                         f"{'/'.join(map(str, KERNEL_GROUPS))} dividing it and {KERNEL_ROWS} | rows "
                         f"(got {ct.spec}, shape {ct.shape})")
    return CompressedTensor(pack_levels(codec_levels(ct)), ct.meta, k, ct.spec)


def from_kernel_order(ct: CompressedTensor) -> CompressedTensor:
    """Inverse of to_kernel_order: `data` back in the codec's order (N, groups, group_size / 2)."""
    n, k = ct.data.shape[0], ct.data.shape[1] * 2
    q = unpack_levels(ct.data).view(n, k // ct.spec.group_size, ct.spec.group_size // 2, 2)
    return CompressedTensor(q[..., 0] | (q[..., 1] << 4), ct.meta, k, ct.spec)


def kernel_scales(meta: torch.Tensor) -> torch.Tensor:
    """meta (N, groups, 2) (scale, minimum) -> the kernel's bf16 (groups, N, 2) (scale, minimum + 8 scale). Each
    (scale, zero) bf16 pair is moved as one 32-bit word in the transposition: a weight's every load (each decode
    step's, for weights in memory) runs this, and transposing pairs of 16-bit values took over twice as long."""
    n, groups = meta.shape[:2]
    out = torch.empty(groups, n, 2, dtype=torch.bfloat16)
    if expand_native.scales_into(meta, out):  # one pass of C where it is built, the same bits
        return out
    m = meta.to(torch.float32, memory_format=torch.contiguous_format, copy=True)  # never meta itself (Q4_K: fp32)
    m[..., 1].add_(m[..., 0], alpha=8)  # 8 scale is exact: one rounding, as lo + 8 * scale
    pairs = m.to(torch.bfloat16).view(torch.int32).view(n, groups)
    return pairs.t().contiguous().view(torch.bfloat16).view(groups, n, 2)


@dataclass
class PackedWeight:
    """A (N, K) weight on the compute side in the kernel's form: packed bytes (N, K / 2), its scales and zeros
    (K / group, N, 2) bf16 (None with `kernel` False: only the kernel reads them), and the stored meta (N, groups,
    2) (exact rows for embedding lookups). `linear` and `rows` are the operations the models use on it; results
    come in `dtype` (the compute dtype). With `kernel` False, `linear` is the generic path instead, a few row blocks
    at a time (no expanded copy of the whole weight)."""

    packed: torch.Tensor
    scales_zeros: Optional[torch.Tensor]
    meta: torch.Tensor
    spec: CompressionSpec
    dtype: torch.dtype = torch.float32
    kernel: bool = True

    @staticmethod
    def from_stored(ct: CompressedTensor, dtype: torch.dtype = torch.float32, kernel: bool = True,
                    scales: Optional[torch.Tensor] = None, lazy: bool = False) -> "PackedWeight":
        """From a kernel-order CompressedTensor (meta (N, groups, 2): scale, minimum). scales: the kernel's scales
        and zeros of this weight already built (`kernel_scales`: a weight store keeps them for weights it holds on
        the compute side, weights/forms.py), else built here where the kernel runs, or (lazy) at the first product
        torch's kernel runs (`linear`: none where compress/int4_rows.py's product is the one chosen)."""
        if scales is None and kernel and not lazy:
            scales = kernel_scales(ct.meta)
        return PackedWeight(ct.data, scales if kernel else None, ct.meta, ct.spec, dtype, kernel)

    @property
    def group_size(self) -> int:
        return self.spec.group_size

    def nbytes(self) -> int:
        """Bytes it holds, with the kernel's scales and zeros where the kernel may still build them (`linear`)."""
        held = sum(x.numel() * x.element_size() for x in (self.packed, self.scales_zeros, self.meta) if x is not None)
        later = self.kernel and self.scales_zeros is None
        return held + (scales_bytes((self.meta.shape[0], self.packed.shape[1] * 2), self.spec) if later else 0)

    def linear(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x (..., K) -> x @ W.T + bias (..., N) in x's dtype, through the kernel (bf16 activations; at the rows where
        compress/int4_rows.py's product from the packed bytes measures faster, that product), or with
        `kernel` False expanded block by block (rows_buffer_bytes at a time) and multiplied in x's dtype."""
        if not self.kernel:
            return self._expanded_linear(x, bias)
        if int4_rows.chosen(x, self.packed, self.group_size):  # measured faster here (compress/int4_rows.py)
            y = int4_rows.product(x, self.packed, self.meta, self.group_size).to(x.dtype)
        else:
            if self.scales_zeros is None:  # from_stored's lazy: built for the kernel's first product
                self.scales_zeros = kernel_scales(self.meta)
            y = int4_linear(x, self.packed, self.group_size, self.scales_zeros).to(x.dtype)
        return y if bias is None else y.add_(bias)

    def _expanded_linear(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        n, k = self.meta.shape[0], self.packed.shape[1] * 2
        flat = x.reshape(-1, k)  # (rows, K)
        out = torch.empty(flat.shape[0], n, dtype=x.dtype, device=x.device)  # (rows, N)
        step = _rows_chunk(k) * row_block()  # whole blocks: each slice's order is its own
        wdt = x.dtype if native_expands(self.group_size, x.dtype) else torch.float32  # straight into x's dtype
        buf = torch.empty(min(n, step), k, dtype=wdt, device=x.device)  # (rows of a chunk, K)
        for start in range(0, n, step):
            stop = min(n, start + step)
            sub = CompressedTensor(self.packed[start:stop], self.meta[start:stop], k, self.spec)
            w = expand_kernel_order(sub, buf[:stop - start])
            out[:, start:stop] = flat @ (w if x.dtype == w.dtype else w.to(x.dtype)).t()  # (rows, chunk)
        out = out.view(*x.shape[:-1], n)
        return out if bias is None else out.add_(bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (any shape) of the expanded weight, (*ids.shape, K) in `dtype`, exactly as the generic path
        expands them: only the row blocks holding them are expanded, a few at a time (rows_buffer_bytes); the last,
        shorter block (its order differs) on its own."""
        n, k = self.meta.shape[0], self.packed.shape[1] * 2
        block = row_block()
        whole, last = split_rows(n, block)
        flat = ids.reshape(-1)
        blocks, inverse = torch.unique(flat // block, return_inverse=True)
        data = self.packed[:whole].view(whole // block, block * k // 2)
        meta = self.meta[:whole].view(whole // block, block * self.meta[0].numel())
        out = torch.empty(flat.numel(), k, dtype=self.dtype, device=ids.device)  # (ids, K)
        step = _rows_chunk(k)
        buf = torch.empty(min(len(blocks), step) * block, k, device=ids.device)  # (rows of the chunk, K) fp32
        for start in range(0, len(blocks), step):
            part = blocks[start:start + step]
            tail = bool(last) and int(part[-1]) == whole // block  # the chunk ends with the last, shorter block
            full = part[:-1] if tail else part
            sub = CompressedTensor(data[full].view(-1, k // 2), meta[full].view(-1, *self.meta.shape[1:]), k,
                                   self.spec)  # (len(full) * block, K / 2)
            rows = len(full) * block
            expand_kernel_order(sub, buf[:rows])
            if tail:  # after the whole blocks, in the buffer's room for one more block
                expand_kernel_order(CompressedTensor(self.packed[whole:], self.meta[whole:], k, self.spec),
                                    buf[rows:rows + last])
            table = buf[:rows + (last if tail else 0)]
            pick = ((inverse >= start) & (inverse < start + len(part))).nonzero().squeeze(1)
            local = (inverse[pick] - start) * block + flat[pick] % block
            out[pick] = table[local].to(self.dtype)
        return out.view(*ids.shape, k)


def int4pack_from(ct: CompressedTensor) -> tuple:
    """(packed weight, scales and zeros) for the kernel from a codec-order CompressedTensor grouped along K."""
    pw = PackedWeight.from_stored(to_kernel_order(ct))
    return pw.packed, pw.scales_zeros


def int4_linear(x: torch.Tensor, packed: torch.Tensor, group_size: int, sz: torch.Tensor) -> torch.Tensor:
    """x (..., K) -> x @ W.T (..., N) through the int4 kernel (bf16 activations, bf16 result). The kernel needs
    every operand contiguous: a view such as the last position `x[:, -1:]` of a bf16 run (its rows a sequence
    apart) is copied here, and nothing is copied for a tensor that already is."""
    flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
    return torch._weight_int4pack_mm_for_cpu(flat, packed.contiguous(), group_size,
                                             sz.contiguous()).view(*x.shape[:-1], -1)


def native_expands(group_size: int, dtype: torch.dtype) -> bool:
    """Whether `expand_kernel_order` writes a weight of this grouping straight into `dtype` in one pass (the C
    expansion of compress/expand_native.py is built here and takes them); else fp32 first, then converted."""
    return _native(group_size, torch.empty(0, dtype=dtype))


def _native(group_size: int, out: torch.Tensor) -> bool:
    """The C expansion takes this CPU's order (blocks of rows i and i + block / 2: not torch's generic build's
    pairs), this grouping and `out`."""
    order = row_order()
    return not order.paired and expand_native.supports(order.block, group_size, out)


def expand_kernel_order(ct: CompressedTensor, out: torch.Tensor) -> torch.Tensor:
    """A kernel-order weight expanded into `out` (N, K) (the generic path, with a reused buffer), as dequantize
    then a conversion to out's dtype, bit for bit: in one pass by the C expansion where it takes `out`
    (compress/expand_native.py), else the levels written through a permuted view of an fp32 `out`, then scaled
    and shifted in place."""
    n, k = ct.data.shape[0], ct.data.shape[1] * 2
    if _native(ct.spec.group_size, out):
        expand_native.expand_into(ct.data, ct.meta, ct.spec.group_size, row_block(), out)
        return out
    if out.dtype != torch.float32 or not out.is_contiguous():
        return out.copy_(dequantize(from_kernel_order(ct), out.dtype))
    write_levels(ct.data, out, row_order())
    g = out.view(n, k // ct.spec.group_size, ct.spec.group_size)  # (N, groups, size)
    g.mul_(ct.meta[..., 0].unsqueeze(-1)).add_(ct.meta[..., 1].unsqueeze(-1))
    return out
