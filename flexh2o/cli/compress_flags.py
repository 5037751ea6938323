"""The compression flags shared by flexh2o-run and flexh2o-eval, and the CompressionSpecs they make."""
from __future__ import annotations

import argparse
from typing import Optional

from flexh2o.compress import CompressionSpec


def add_compression_flags(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--compress-weight", action="store_true", help="keep weights group-wise quantized in every tier (FlexGen)")
    a("--compress-cache", action="store_true", help="keep the KV cache group-wise quantized in every tier (FlexGen)")
    a("--compress-bits", type=int, choices=[4, 8], default=4, help="bits a value under --compress-* (default 4)")
    a("--compress-group-size", type=int, default=64, help="values per quantization group (default 64)")


def compression_specs(args: argparse.Namespace) -> tuple:
    """(weight spec or None, cache spec or None): FlexGen's scheme (--compress-bits, --compress-group-size), weights
    grouped along dimension 0, the cache along head_dim."""
    spec = CompressionSpec(args.compress_bits, args.compress_group_size)  # validates the two flags

    def along(dim: int, wanted: bool) -> Optional[CompressionSpec]:
        return spec.along(dim) if wanted else None
    return along(0, args.compress_weight), along(-1, args.compress_cache)
