"""GGUF's quantized blocks kept as they are: repacked into the codec's layout (compress/codec.py) with their own
values, groups and scales, and how a checkpoint's index records them.

ggml's blocks run along the input dimension (the last of a GGUF tensor's numpy array, dimension 1 of a (N, K)
weight), 32 values each (llama.cpp's ggml-common.h):
  Q4_0  fp16 d, 16 bytes: x = d * (q - 8)          -> 4-bit levels q, scale d, minimum -8 d
  Q4_1  fp16 d, fp16 m, 16 bytes: x = d * q + m    -> 4-bit levels q, scale d, minimum m
  Q8_0  fp16 d, 32 int8: x = d * q                 -> 8-bit levels q + 128, scale d, minimum -128 d
  Q4_K  256 values: fp16 d, dmin, 12 bytes of 6-bit sub-scales sc and sub-minimums mn, 128 bytes; each 32 values:
        x = d sc q - dmin mn                       -> 4-bit levels q, scale d sc, minimum -dmin mn (fp32: 17 bits)
A 4-bit byte of a Q4_0/Q4_1 block holds value j (low nibble) and j + 16 (high nibble); the codec's holds 2i and
2i + 1: the levels are reordered, never requantized. Each dequantizes to exactly gguf.quants.dequantize's fp32
(a product of a level and a scale is exact in fp32, and the one addition rounds as ggml's does).
"""
from __future__ import annotations

import numpy as np
import torch

from flexh2o.compress.codec import CompressedTensor, CompressionSpec, stored_bytes
from flexh2o.dtypes import DTYPES, dtype_name

GROUP = 32  # values per ggml block (and per Q4_K sub-block)
KEPT = ("Q4_0", "Q4_1", "Q8_0", "Q4_K")  # GGUF types converted into the codec's form as they are


def kept_spec(kind: str) -> CompressionSpec:
    """The codec spec a GGUF block type is kept under."""
    bits = 8 if kind == "Q8_0" else 4
    return CompressionSpec(bits, GROUP, 1, torch.float32 if kind == "Q4_K" else torch.float16)


def from_gguf(raw: np.ndarray, kind: str, shape: tuple) -> CompressedTensor:
    """A GGUF tensor's raw bytes (rows, bytes per row) of block type `kind` -> its CompressedTensor of `shape`
    (rows, K), grouped along K in groups of 32."""
    rows, k = shape
    b = torch.from_numpy(np.array(raw, dtype=np.uint8).reshape(rows, -1))
    if kind == "Q4_K":
        return _from_q4_k(b, rows, k)
    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
    b = b.view(rows, k // GROUP, size)  # (rows, blocks, bytes of a block)
    d = b[..., 0:2].contiguous().view(torch.float16).squeeze(-1)  # (rows, blocks)
    if kind == "Q8_0":
        data = b[..., 2:] ^ 0x80  # int8 q -> q + 128
        lo = -128 * d.float()
    else:
        qs = b[..., 4:] if kind == "Q4_1" else b[..., 2:]  # (rows, blocks, 16)
        levels = torch.cat([qs & 0xF, qs >> 4], -1)  # values 0..31 of each block
        data = levels[..., 0::2] | (levels[..., 1::2] << 4)
        lo = b[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float() if kind == "Q4_1" else -8 * d.float()
    meta = torch.stack([d, _exact_half(lo, kind)], -1)
    return CompressedTensor(data.contiguous(), meta, k, kept_spec(kind))


def _from_q4_k(b: torch.Tensor, rows: int, k: int) -> CompressedTensor:
    from gguf.quants import Q4_K
    blocks = b.view(rows, k // 256, 144)  # (rows, super-blocks, 144)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # (rows, sb, 1)
    dmin = blocks[..., 2:4].contiguous().view(torch.float16).float()
    sc, mn = (torch.from_numpy(np.asarray(a, dtype=np.float32)).view(rows, k // 256, 8)
              for a in Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12).numpy()))
    qs = blocks[..., 16:].reshape(rows, k // 256, 4, 1, 32)  # 4 chunks of 32 bytes: sub-blocks 2c and 2c + 1
    levels = torch.cat([qs & 0xF, qs >> 4], 3).reshape(rows, k // GROUP, GROUP)
    data = levels[..., 0::2] | (levels[..., 1::2] << 4)
    meta = torch.stack([d * sc, -(dmin * mn)], -1).view(rows, k // GROUP, 2)
    return CompressedTensor(data.contiguous(), meta, k, kept_spec("Q4_K"))


def _exact_half(lo: torch.Tensor, kind: str) -> torch.Tensor:
    """A minimum derived from an fp16 scale (-8 d, -128 d: exact unless it overflows fp16) as fp16."""
    half = lo.to(torch.float16)
    if not bool(torch.isfinite(half).all()):
        raise ValueError(f"a {kind} block's scale is too large to keep its minimum in fp16")
    return half


def blocks_entry(ct: CompressedTensor) -> dict:
    """The index fields of a kept tensor (its file: data bytes, then meta bytes)."""
    return {"dtype": dtype_name(ct.meta.dtype), "blocks": {"bits": ct.spec.bits, "group_size": ct.spec.group_size}}


def entry_spec(entry: dict) -> CompressionSpec:
    """The codec spec of a kept tensor's index entry."""
    b = entry["blocks"]
    return CompressionSpec(b["bits"], b["group_size"], 1, DTYPES[entry["dtype"]])


def entry_ok(entry: dict) -> bool:
    """Whether an index entry's "blocks" (if any) is well formed."""
    b = entry.get("blocks")
    if b is None:
        return True
    return (isinstance(b, dict) and b.get("bits") in (4, 8) and isinstance(b.get("group_size"), int)
            and b["group_size"] >= 2 and b["group_size"] % 2 == 0 and len(entry["shape"]) == 2
            and entry["shape"][1] % b["group_size"] == 0)


def entry_nbytes(entry: dict) -> int:
    """Bytes of a kept tensor's file (data, then meta)."""
    return stored_bytes(tuple(entry["shape"]), DTYPES[entry["dtype"]], entry_spec(entry))


def split(buf: torch.Tensor, entry: dict) -> CompressedTensor:
    """A kept tensor's file bytes (uint8) -> its CompressedTensor (views of `buf`)."""
    spec, shape = entry_spec(entry), tuple(entry["shape"])
    (ds, _), (ms, mdt) = spec.layout(shape, spec.scale_dtype)
    n = int(np.prod(ds))
    return CompressedTensor(buf[:n].view(ds), buf[n:].view(mdt).view(ms), shape[1], spec)


def keeps(kind: str, shape: tuple) -> bool:
    """Whether a GGUF tensor of block type `kind` and (rows, K) `shape` is kept in its blocks."""
    return kind in KEPT and len(shape) == 2 and shape[1] % (256 if kind == "Q4_K" else GROUP) == 0

