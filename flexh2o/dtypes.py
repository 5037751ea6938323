"""The one dtype table: names on the command line and in files <-> torch dtypes."""
from __future__ import annotations

import torch

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
ALIASES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def parse_dtype(name: str) -> torch.dtype:
    """'float16' | 'bfloat16' | 'float32' (or fp16/bf16/fp32) -> torch dtype; ValueError naming the choices."""
    key = ALIASES.get(name, name)
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: choose float16, bfloat16 or float32")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16'."""
    return str(dtype).replace("torch.", "")
