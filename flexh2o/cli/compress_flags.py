"""The compression flags shared by flexh2o-run and flexh2o-eval, and the CompressionSpecs they make."""
from __future__ import annotations

import argparse
from typing import Optional

from flexh2o.compress import CompressionSpec
from flexh2o.compress.kernels import KERNEL_GROUPS, kernel_spec_ok


def add_compression_flags(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--compress-weight", action="store_true", help="keep weights group-wise quantized in every tier (FlexGen)")
    a("--compress-cache", action="store_true", help="keep the KV cache group-wise quantized in every tier (FlexGen)")
    a("--compress-bits", type=int, choices=[4, 8], default=4, help="bits a value under --compress-* (default 4)")
    a("--compress-group-size", type=int, default=64, help="values per quantization group (default 64)")
    a("--weight-kernel", choices=["auto", "int4", "off"], default="auto",
      help="--compress-weight on a CPU: auto (weights grouped along the input dimension, each phase runs torch's "
           "int4 kernel where a probe at start measures it faster), int4 (always), off (FlexGen's grouping along "
           "dimension 0, always expanded)")


def compression_specs(args: argparse.Namespace, device: str = "cpu") -> tuple:
    """(weight spec or None, cache spec or None): FlexGen's scheme (--compress-bits, --compress-group-size), the
    cache along head_dim, weights along dimension 0 (FlexGen's) or, where the int4 kernel can run them
    (--weight-kernel auto/int4), along the input dimension (1)."""
    spec = CompressionSpec(args.compress_bits, args.compress_group_size)  # validates the two flags

    def along(dim: int, wanted: bool) -> Optional[CompressionSpec]:
        return spec.along(dim) if wanted else None
    return along(weight_group_dim(args, spec, device), args.compress_weight), along(-1, args.compress_cache)


def weight_group_dim(args: argparse.Namespace, spec: CompressionSpec, device: str) -> int:
    mode = getattr(args, "weight_kernel", "off")
    fits = kernel_spec_ok(spec.along(1))
    if mode == "int4" and not fits:
        raise ValueError(f"--weight-kernel int4 needs --compress-bits 4 and --compress-group-size one of "
                         f"{'/'.join(map(str, KERNEL_GROUPS))} (or use --weight-kernel auto)")
    if mode == "int4" and device != "cpu":
        raise ValueError(f"--weight-kernel int4 runs on the CPU only (--device {device}): use --weight-kernel auto")
    return 1 if mode != "off" and fits and device == "cpu" else 0


def weight_kernel_mode(args: argparse.Namespace) -> str:
    """RunConfig.weight_kernel from --weight-kernel."""
    mode = getattr(args, "weight_kernel", "off")
    return "generic" if mode == "off" else mode
