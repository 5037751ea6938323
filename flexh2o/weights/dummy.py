"""Seeded dummy weights: the values a run without a checkpoint stores (weights/store.py, WeightStore.fill_dummy)."""
from __future__ import annotations

import zlib

import torch

from flexh2o.models.common import WeightSpec

CHUNK = 1 << 20  # dummy values are drawn per chunk of elements, so they do not depend on the tier


def dummy_chunks(spec: WeightSpec, seed: int, dtype: torch.dtype):
    """Seeded random values for one weight, as consecutive flat chunks (normal std 0.02; norm scales near 1,
    biases near 0). Each chunk has its own seed, so the values do not depend on where they are written."""
    base = zlib.crc32(spec.name.encode()) ^ (seed * 0x9E3779B1)
    for i, start in enumerate(range(0, spec.numel, CHUNK)):
        g = torch.Generator().manual_seed((base + i * 7919) & 0x7FFFFFFFFFFFFFFF)
        part = torch.empty(min(CHUNK, spec.numel - start)).normal_(0.0, 0.02, generator=g)
        if spec.init == "ones":
            part += 1.0
        yield part.to(dtype)
