"""The attention kernels' common pieces: torch's fused attention (without cuDNN on CUDA), the prefill chunk's size and
soft-capped logits."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flexh2o.kv import one_query_native
from flexh2o.storage.freed_memory import MAPPED_FROM
from flexh2o.tensors import native_products

# torch (2.11, an H200) picks cuDNN's fused attention first, and cuDNN builds a graph for each new masked shape,
# hundreds of ms each (a new prompt length, a cache of a new width: inside the timed run); the others build nothing
CUDA_SDPA = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
WORKSPACE = 16 << 20  # bytes of fp32 attention probabilities per prefill chunk on CUDA (the batch shares it)
CPU_WORKSPACE = 3 * MAPPED_FROM // 4  # the chunk's copies under glibc's mmap threshold: reused, not faulted in anew


def sdpa(q, k, v, attn_mask=None, enable_gqa: bool = False) -> torch.Tensor:
    """F.scaled_dot_product_attention, on CUDA without the cuDNN backend (CUDA_SDPA); one unmasked query a row and
    head on a CPU (a decode step) by `one_query` where the CPU multiplies its dtype natively (tensors.native_products:
    fp32, or bf16 on an AVX-512 CPU with oneDNN's bf16 kernels)."""
    if q.is_cuda:
        with sdpa_kernel(list(CUDA_SDPA)):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=enable_gqa)
    if attn_mask is None and not enable_gqa and q.shape[-2] == 1 and native_products(q.dtype):
        return one_query(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=enable_gqa)


def one_query(q, k, v) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v for one query a row and head: q (..., 1, d), k/v (..., T, d) -> (..., 1, d); in a
    16-bit dtype the logits are the product's (summed in fp32, rounded once to the dtype, as transformers' eager
    attention has them), scaled and normalised in fp32, the probabilities rounded to the dtype for the value mix.
    By kv/one_query_native.py's C code where it runs (AVX-512: a block's slices read where they lie, one pass a
    (row, head) pair), else `by_matmuls`. 128 rows x 12 heads x 40 cached tokens, 2 threads, AVX-512 Zen 4,
    by_matmuls / the C code: bf16 0.99 / 0.38 ms, fp32 0.97 / 0.56 ms (2026-12-07, shared machine)."""
    if one_query_native.takes(q, k, v):
        return one_query_native.attend(q, k, v)
    return by_matmuls(q, k, v)


def by_matmuls(q, k, v) -> torch.Tensor:
    """one_query as two batched matmuls and a softmax. A 16-bit product (ATen hands it to oneDNN, which takes dense
    batches only) copies strided operands whole, keys transposed, into a fresh mapping past glibc's threshold
    (storage/freed_memory.py): slices of a cache block are copied here instead, as they are, a heap block of rows
    (CPU_WORKSPACE) at a time. torch's fused CPU kernel against it, 12 heads, AVX-512 Zen 4: fp32, 64 rows, 1.8 /
    0.87 ms at 40 cached tokens, 6.6 / 5.1 ms at 288 (2026-12-06); bf16, 128 rows of a block's slices, 8.9 / 3.6 ms
    at 40 (the whole slices to the product: 14.1 ms), 45.9 / 21.6 ms at 288 (2026-12-07, shared machine)."""
    if k.element_size() == 4 or (k.is_contiguous() and v.is_contiguous()):
        return _one_query(q, k, v)
    rows = max(1, CPU_WORKSPACE // (k[0].numel() * k.element_size()))  # rows of keys copied into a heap block
    parts = zip(*(t.split(rows) for t in (q, k, v)))  # (rows, ...) each
    return torch.cat([_one_query(a, b.contiguous(), c.contiguous()) for a, b, c in parts])


def _one_query(q, k, v) -> torch.Tensor:
    """one_query's arithmetic: q (..., 1, d), k/v (..., T, d) -> (..., 1, d)."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(q.shape[-1] ** -0.5)  # (..., 1, T) fp32
    return torch.matmul(scores.softmax(-1).to(v.dtype), v)  # (..., 1, d)


def prefill_chunk(b: int, heads: int, t: int, max_chunk: int, device: str) -> int:
    """Queries per prefill chunk: its (b, heads, chunk, t) fp32 scores within `device`'s workspace (above)."""
    return max(1, min(max_chunk, t, (CPU_WORKSPACE if device == "cpu" else WORKSPACE) // (4 * b * heads * t)))


def capped(logits: torch.Tensor, softcap: Optional[float]) -> torch.Tensor:
    """Soft-capped attention logits (Gemma 2): softcap * tanh(logits / softcap); unchanged without a cap."""
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap
