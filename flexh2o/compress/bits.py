"""Packing quantized levels (uint8, each below 2**bits) into bytes along the last dimension, and back.

Value i of a row occupies bits [i * bits, (i + 1) * bits) of the row's little-endian bit stream (byte j holds bits
[8j, 8j + 8), lowest first): at 4 bits, two values a byte, low nibble first; at 8 bits the levels themselves.
A row of n values takes n * bits / 8 bytes (n * bits must be a multiple of 8).
"""
from __future__ import annotations

import torch

PACKABLE = (2, 3, 4, 8)


def packed_width(n: int, bits: int) -> int:
    """Bytes of a row of n values at `bits`; ValueError when they do not fill whole bytes."""
    if bits not in PACKABLE or (n * bits) % 8:
        raise ValueError(f"{n} values of {bits} bits do not fill whole bytes (bits: one of 2, 3, 4, 8)")
    return n * bits // 8


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """q uint8 (..., n) -> (..., n * bits / 8) uint8."""
    n = q.shape[-1]
    width = packed_width(n, bits)
    if bits == 8:
        return q.contiguous()
    if 8 % bits == 0:  # whole values a byte: value k of a byte shifted by k * bits
        per = 8 // bits
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=q.device)
        return (q.reshape(*q.shape[:-1], width, per) << shifts).sum(-1, dtype=torch.uint8)
    stream = (q[..., None] >> torch.arange(bits, dtype=torch.uint8, device=q.device)) & 1  # (..., n, bits)
    weights = torch.arange(8, dtype=torch.uint8, device=q.device)
    return (stream.reshape(*q.shape[:-1], width, 8) << weights).sum(-1, dtype=torch.uint8)


def unpack(data: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """data uint8 (..., n * bits / 8) -> levels uint8 (..., n). Bits that do not divide 8 (3) take 31 bits of an
    int32 word at most: PACKABLE's 3 uses 24."""
    if bits == 8:
        return data
    mask = (1 << bits) - 1
    if 8 % bits == 0:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=data.device)
        return ((data[..., None] >> shifts) & mask).reshape(*data.shape[:-1], n)
    # `bits` bytes hold 8 whole values: each such run read as one little-endian word, the values shifted out of it
    # (a bit-by-bit stream would expand the data 8 times: 9x slower at 3 bits)
    dev = data.device
    word = (data.view(*data.shape[:-1], n // 8, bits).to(torch.int32)
            << torch.arange(0, 8 * bits, 8, dtype=torch.int32, device=dev)).sum(-1, dtype=torch.int32)  # (..., n/8)
    values = (word[..., None] >> torch.arange(0, 8 * bits, bits, dtype=torch.int32, device=dev)).to(torch.uint8)
    return values.bitwise_and_(mask).reshape(*data.shape[:-1], n)  # the cast keeps the low 8 bits: masked there
