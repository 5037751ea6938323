"""The order of torch's packed int4 weight on this CPU (aten._convert_weight_to_int4pack_for_cpu), written and read
back by permutation alone.

A (N, K) weight's N * K / 2 bytes come in blocks of `row_block()` output rows, each (K, block / 2) bytes, byte i of
input k holding two rows (low, high nibble): rows i and i + block / 2 in blocks of 32 where torch's kernel is built
for AVX2 and of 64 for AVX-512; rows 2i and 2i + 1 in blocks of 32 in its generic build (ATEN_CPU_CAPABILITY=default),
and in a last block of fewer rows (32 rows at the end of an AVX-512 weight). `torch_order` finds the order torch's
own converter writes, once per process.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch


class RowOrder(NamedTuple):
    """An order of torch's packed int4 weight: whole blocks of `block` output rows, each (K, block / 2) bytes whose
    byte i of input k holds rows 2i and 2i + 1 (`paired`) or rows i and i + block / 2 (low, high nibble). A last
    block of fewer rows is always paired."""

    block: int
    paired: bool = False


ROW_ORDERS = (RowOrder(32), RowOrder(64), RowOrder(32, paired=True))  # torch's AVX2, AVX-512, generic builds


@functools.lru_cache(maxsize=None)
def torch_order() -> Optional[RowOrder]:
    """The order of ROW_ORDERS torch's converter writes on this CPU (None: no kernel, or another order). A 96-row
    probe of random levels (every row and input its own, so no two orders write the same bytes): three whole blocks
    of 32, or one of 64 and a last block of 32."""
    if not hasattr(torch, "_convert_weight_to_int4pack_for_cpu"):
        return None
    q = torch.randint(0, 16, (96, 128), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    try:
        written = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    except RuntimeError:
        return None
    return next((o for o in ROW_ORDERS if torch.equal(written, pack_levels(q.to(torch.uint8), o))), None)


def row_order() -> RowOrder:
    """The kernel's order on this CPU (blocks of 32 rows, i and i + 16 a byte, where torch's kernel is missing)."""
    return torch_order() or ROW_ORDERS[0]


def row_block() -> int:
    """Output rows per block of the kernel's order on this CPU."""
    return row_order().block


def split_rows(n: int, block: int) -> tuple:
    """Rows in whole blocks, rows in the last, shorter block."""
    return n - n % block, n % block


def nibbles(t: torch.Tensor, block: int, paired: bool) -> torch.Tensor:
    """A view of (rows, K) values, rows a multiple of `block`, as (rows / block, K, block / 2, 2): [b, k, i, h] is
    the row that byte i of input k in block b holds in its low (h = 0) or high (h = 1) nibble."""
    n, k = t.shape
    if paired:
        return t.view(n // block, block // 2, 2, k).permute(0, 3, 1, 2)  # rows 2i, 2i + 1
    return t.view(n // block, 2, block // 2, k).permute(0, 3, 2, 1)  # rows i, i + block / 2


def pack_levels(q: torch.Tensor, order: Optional[RowOrder] = None) -> torch.Tensor:
    """(N, K) levels 0..15 uint8 -> (N, K / 2) bytes in the kernel's order (default row_order())."""
    order = order or row_order()
    n, k = q.shape
    whole, last = split_rows(n, order.block)
    parts = [(order.block, order.paired, q[:whole])] + ([(last, True, q[whole:])] if last else [])
    return torch.cat([_pack_bytes(nibbles(x, b, p)).reshape(x.shape[0], k // 2) for b, p, x in parts])


def _pack_bytes(x: torch.Tensor) -> torch.Tensor:
    """(..., 2) levels (low, high) -> (...) bytes."""
    return x[..., 0] | (x[..., 1] << 4)


def unpack_levels(packed: torch.Tensor, order: Optional[RowOrder] = None) -> torch.Tensor:
    """(N, K / 2) bytes in the kernel's order -> (N, K) levels 0..15 uint8."""
    n, k = packed.shape[0], packed.shape[1] * 2
    out = torch.empty(n, k, dtype=torch.uint8, device=packed.device)
    write_levels(packed, out, order or row_order())
    return out


def write_levels(packed: torch.Tensor, out: torch.Tensor, order: RowOrder) -> None:
    """The levels of kernel-order bytes (N, K / 2) written into `out` (N, K) (any dtype) through permuted views."""
    n, k = out.shape
    whole, last = split_rows(n, order.block)
    for rows, block, paired in [(slice(0, whole), order.block, order.paired), (slice(whole, n), last, True)]:
        if block and rows.stop > rows.start:
            x = packed[rows].reshape(-1, k, block // 2)  # (blocks, k, bytes i)
            dst = nibbles(out[rows], block, paired)  # (blocks, k, i, low / high)
            dst.select(3, 0).copy_(x & 0xF)
            dst.select(3, 1).copy_(x >> 4)
