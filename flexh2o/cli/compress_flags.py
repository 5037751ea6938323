"""The compression flags shared by flexh2o-run and flexh2o-eval, and the CompressionSpecs they make. The flags'
defaults come from compress/defaults.py (no torch: --help imports none); the specs are made where torch is. The
quantized cache's scheme flags are generated from kv/cache_quant.CacheQuant's fields (each declares its flag): a
scheme's field there is its flag here, with no change to this file."""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from flexh2o.cli.flags import add_flags, declare
from flexh2o.compress.defaults import (DEFAULT_BITS, DEFAULT_CACHE_GROUP, DEFAULT_GROUP, DEFAULT_KEYS,
                                       DEFAULT_OUTLIERS, cache_group)
from flexh2o.kv.cache_quant import flagged, from_flags

if TYPE_CHECKING:
    from flexh2o.compress import CompressionSpec


def compression_flags() -> tuple:
    """The compression Flags (flexh2o-run, -plan, -eval)."""
    flags: list = []
    a = declare(flags)
    a("--compress-weight", action="store_true", help="keep weights group-wise quantized in every tier (FlexGen)")
    a("--compress-cache", action="store_true", help="keep the KV cache quantized in every tier: values per token "
      "in groups along head_dim (FlexGen), keys as --cache-keys says")
    flags += cache_scheme_flags()
    a("--compress-bits", type=int, choices=[2, 3, 4, 8], default=DEFAULT_BITS,
      help=f"bits a value under --compress-* (default {DEFAULT_BITS}; 2 and 3: the cache only)")
    a("--compress-group-size", type=int, default=None, metavar="N", help=f"values per quantization group of the "
      f"weights (default {DEFAULT_GROUP}, FlexGen's); given, also the quantized cache's groups unless "
      f"--cache-group-size is given")
    a("--cache-group-size", type=int, default=None, metavar="N",
      help=f"--compress-cache: values per group along head_dim of the cached values (and of per-token keys); default "
           f"{DEFAULT_CACHE_GROUP} ({DEFAULT_GROUP}, FlexGen's, with --cache-keys token), or --compress-group-size "
           f"where that is given (benchmarks/ACCURACY.md: at 4 bits groups of 32 with --cache-recent 32 kept the cache "
           f"within +0.5%% of the plain one where 64 did not; at 2 and 3 bits 32 or 16 cost less perplexity than 64 "
           f"for 4 or 12 more bytes a token and KV head on SmolLM2)")
    a("--weight-kernel", choices=["auto", "int4", "off"], default="auto",
      help="--compress-weight on a CPU: auto (weights grouped along the input dimension, each phase runs torch's "
           "int4 kernel where a probe at start measures it faster), int4 (always), off (FlexGen's grouping along "
           "dimension 0, always expanded)")
    return tuple(flags)


def cache_scheme_flags() -> list:
    """The Flags of the quantized cache's scheme: each kv/cache_quant.CacheQuant field's CacheFlag (a Flag), in the
    fields' order (read when called: a field's flag is its declaration's)."""
    return [c for _, c in flagged()]


def add_compression_flags(p: argparse.ArgumentParser) -> None:
    """compression_flags() added to parser `p`."""
    add_flags(p, compression_flags())


def compression_specs(args: argparse.Namespace, device: str = "cpu") -> tuple:
    """(weight spec or None, CacheQuant or None): FlexGen's scheme (--compress-bits, --compress-group-size), the
    cache's values along head_dim in groups of compress/defaults.cache_group's choice and its keys as --cache-keys
    says, weights along
    dimension 0 (FlexGen's) or, where the int4 kernel can run them (--weight-kernel auto/int4), along the input
    dimension (1)."""
    from flexh2o.compress import CompressionSpec
    from flexh2o.compress.codec import BITS
    cache = None
    if not args.compress_cache and not args.compress_weight:
        _refuse_alone(args, {"compress_bits": DEFAULT_BITS, "compress_group_size": None},
                      "how --compress-weight and --compress-cache quantize, and neither is on: add one of them")
    if not args.compress_cache:
        _refuse_alone(args, {**{c.dest: c.default for _, c in flagged()}, "cache_group_size": None},
                      "the quantized KV cache, which is off: add --compress-cache")
    else:
        keys = getattr(args, "cache_keys", DEFAULT_KEYS)
        given = getattr(args, "cache_group_size", None)
        group = cache_group(keys, getattr(args, "compress_group_size", None), given)
        outliers = getattr(args, "key_outliers", DEFAULT_OUTLIERS)
        if keys == "token" and outliers not in (0, DEFAULT_OUTLIERS):  # 0: FlexGen's scheme written out in full
            raise ValueError(f"--key-outliers {outliers}: keys per token (--cache-keys token) keep no value exact; "
                             f"use --cache-keys channel or fitted, or drop --key-outliers")
        try:  # each flagged field of CacheQuant from its flag (validated there)
            cache = from_flags(args.compress_bits, group, lambda dest, default: getattr(args, dest, default))
        except ValueError as e:  # the group's check names --compress-group-size: name the flag given
            if given is None:
                raise
            raise ValueError(str(e).replace("--compress-group-size", "--cache-group-size")) from None
    if not args.compress_weight:
        return None, cache
    if args.compress_bits not in BITS:
        raise ValueError(f"--compress-bits {args.compress_bits} with --compress-weight: weights take "
                         f"{' or '.join(map(str, BITS))} bits")
    group = getattr(args, "compress_group_size", None)
    spec = CompressionSpec(args.compress_bits, DEFAULT_GROUP if group is None else group)  # validates the two flags
    return spec.along(weight_group_dim(args, spec, device)), cache


def _refuse_alone(args: argparse.Namespace, defaults: dict, sets: str) -> None:
    """ValueError naming the first flag of `defaults` (dest -> default) given another value while what it `sets`
    is off (it would change nothing): '<flag> <value> sets <sets> or drop <flag>'."""
    for name, default in defaults.items():
        value = getattr(args, name, default)
        if value != default:
            flag = "--" + name.replace("_", "-")
            if value is False:  # the --no- form of a --flag / --no-flag pair
                flag = flag.replace("--", "--no-", 1)
            given = flag if isinstance(value, bool) else f"{flag} {value}"
            raise ValueError(f"{given} sets {sets} or drop {flag}")


def weight_group_dim(args: argparse.Namespace, spec: CompressionSpec, device: str) -> int:
    from flexh2o.compress.kernels import KERNEL_GROUPS, kernel_spec_ok
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
