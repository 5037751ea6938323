"""torch's weight-only int4 kernel for CPU (aten._weight_int4pack_mm_for_cpu) fed from the codec's layout.

The kernel's groups run along the input dimension (K) of a (N, K) weight and its dequantization is
(q - 8) * scale + zero, so a CompressedTensor grouped along dimension 1 (4 bits, groups of 32/64/128/256) converts
exactly: zero = minimum + 8 * scale. FlexGen's weights are grouped along dimension 0, which the kernel cannot
express; the engine keeps the generic path (expand, then a dense matmul) as the reference, and this conversion is
what a kernel path needs (benchmarks/quant_kernels.py measures both).
"""
from __future__ import annotations

import torch

from flexh2o.compress.codec import CompressedTensor

KERNEL_GROUPS = (32, 64, 128, 256)


def int4pack_from(ct: CompressedTensor) -> tuple:
    """(packed weight, scales and zeros (K / group, N, 2) bf16) for aten._weight_int4pack_mm_for_cpu, from a 4-bit
    CompressedTensor of a (N, K) weight grouped along dimension 1 with K a multiple of the group."""
    n, k = ct.shape
    spec = ct.spec
    if spec.bits != 4 or spec.dim(2) != 1 or spec.group_size not in KERNEL_GROUPS or k % spec.group_size:
        raise ValueError(f"the int4 kernel needs 4 bits grouped along the input dimension in groups of "
                         f"{'/'.join(map(str, KERNEL_GROUPS))} dividing it (got {spec}, shape {ct.shape})")
    q = torch.stack([ct.data & 0xF, ct.data >> 4], -1).reshape(n, k).to(torch.int32)  # (N, K) levels 0..15
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    scale, lo = ct.meta[..., 0].float(), ct.meta[..., 1].float()  # (N, groups)
    sz = torch.stack([scale, lo + 8 * scale], -1).to(torch.bfloat16).transpose(0, 1).contiguous()  # (groups, N, 2)
    return packed, sz


def int4_linear(x: torch.Tensor, packed: torch.Tensor, group_size: int, sz: torch.Tensor) -> torch.Tensor:
    """x (..., K) -> x @ W.T (..., N) through the int4 kernel (bf16 activations)."""
    flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    return torch._weight_int4pack_mm_for_cpu(flat, packed, group_size, sz).view(*x.shape[:-1], -1)
