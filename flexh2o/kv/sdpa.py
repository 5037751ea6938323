"""The attention kernels' common pieces: torch's fused attention (without cuDNN on CUDA), the prefill chunk's size and
soft-capped logits."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flexh2o.storage.freed_memory import MAPPED_FROM

# torch (2.11, an H200) picks cuDNN's fused attention first, and cuDNN builds a graph for each new masked shape,
# hundreds of ms each (a new prompt length, a cache of a new width: inside the timed run); the others build nothing
CUDA_SDPA = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
WORKSPACE = 16 << 20  # bytes of fp32 attention probabilities per prefill chunk on CUDA (the batch shares it)
CPU_WORKSPACE = 3 * MAPPED_FROM // 4  # the chunk's copies under glibc's mmap threshold: reused, not faulted in anew


def sdpa(q, k, v, attn_mask=None, enable_gqa: bool = False) -> torch.Tensor:
    """F.scaled_dot_product_attention, on CUDA without the cuDNN backend (CUDA_SDPA); one unmasked fp32 query a
    row and head on a CPU (a decode step) by `one_query`."""
    if q.is_cuda:
        with sdpa_kernel(list(CUDA_SDPA)):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=enable_gqa)
    if attn_mask is None and not enable_gqa and q.shape[-2] == 1 and q.dtype == torch.float32:
        return one_query(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=enable_gqa)


def one_query(q, k, v) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v as two batched matmuls and a softmax: q (..., 1, d), k/v (..., T, d) ->
    (..., 1, d). torch's fused CPU kernel against it, fp32, 64 rows x 12 heads, AVX-512 Zen 4 (2026-12-06):
    1.8 / 0.87 ms at 40 cached tokens, 6.6 / 5.1 ms at 288."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(q.shape[-1] ** -0.5)  # (..., 1, T)
    return torch.matmul(scores.softmax(-1), v)  # (..., 1, d)


def prefill_chunk(b: int, heads: int, t: int, max_chunk: int, device: str) -> int:
    """Queries per prefill chunk: its (b, heads, chunk, t) fp32 scores within `device`'s workspace (above)."""
    return max(1, min(max_chunk, t, (CPU_WORKSPACE if device == "cpu" else WORKSPACE) // (4 * b * heads * t)))


def capped(logits: torch.Tensor, softcap: Optional[float]) -> torch.Tensor:
    """Soft-capped attention logits (Gemma 2): softcap * tanh(logits / softcap); unchanged without a cap."""
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap
