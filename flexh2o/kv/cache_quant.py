"""How a quantized KV cache is held (CacheQuant), and the flags of its scheme declared on its fields.

Each field that a user chooses on the command line carries its flag as metadata (`CacheFlag`, `flag` in the
field's metadata): flexh2o-run's, -serve's, -plan's and -eval's option (cli/compress_flags.py), the API's keyword
(cli/engine_args.py) and the printed command line (tuning/search.py) are made from it, so a new scheme's field here,
with its flag, is the one place they are written. `bits` is the weights' --compress-bits; `group_size` is
compress/defaults.cache_group's choice (--cache-group-size, an explicit --compress-group-size, or the default:
cli/compress_flags.py). Imports no torch (--help reads
the flags); the specs the fields make come from compress/ when asked for. kv/layout.py re-exports CacheQuant.
"""
from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass, field, fields
from typing import Callable, Optional

from flexh2o.compress.defaults import (DEFAULT_GROUP, DEFAULT_KEYS, DEFAULT_OUTLIERS, DEFAULT_RECENT, DEFAULT_ROTATE,
                                       DEFAULT_SINKS, KEY_SCHEMES)
from flexh2o.flag import Flag


@dataclass(frozen=True)
class CacheFlag(Flag):
    """A CacheQuant field's flag: a Flag (flexh2o/flag.py; a flag given None leaves the field its default) with
    `shown` (quant -> bool): when a printed command line names it (None: when the field holds another value than the
    flag's default gives)."""

    shown: Optional[Callable] = None

    def text(self, value) -> str:
        """`value` as flexh2o-run parses it back."""
        if self.action is argparse.BooleanOptionalAction:
            return self.flag if value else self.flag.replace("--", "--no-", 1)
        return self.flag if self.action == "store_true" else f"{self.flag} {value}"


def _flag(flag: str, help: str, **options) -> dict:
    """A field's metadata: its CacheFlag."""
    return {"flag": CacheFlag(flag, help, **options)}


@dataclass(frozen=True)
class CacheQuant:
    """How the KV cache is quantized: values per token in groups of `group_size` along head_dim at `bits`
    (FlexGen's scheme); keys either the same way (keys "token") or per channel, calibrated on the prompt, with
    `outliers` values per token kept exact (keys "channel": evenly spaced levels; "fitted": levels fitted to the
    prompt's values of each channel); all with the newest `recent` tokens of each row also
    kept exact (0: none); `rotate`: K and V quantized times a Hadamard matrix along head_dim (compress/rotation.py);
    `exact_bits` 8: what is kept exact is stored in 8 bits instead of the storage dtype (the keys' outliers as fp8
    e4m3, the newest and first tokens each quantized alone at 8 bits; 0: the storage dtype).
    group_dim (-1) is the values' grouped dimension."""

    bits: int = 4
    group_size: int = DEFAULT_GROUP  # FlexGen's; a run's default is compress/defaults.cache_group's
    keys: str = field(default=DEFAULT_KEYS, metadata=_flag(
        "--cache-keys", choices=list(KEY_SCHEMES), default=DEFAULT_KEYS,
        help=f"--compress-cache's keys: token (FlexGen's groups along head_dim), channel (per-channel scales "
             f"calibrated on the prompt, each token quantized alone, --key-outliers values a token kept exact) or "
             f"fitted (as channel, with each channel's levels fitted to the prompt's values by k-means: KVQuant's "
             f"non-uniform levels); default {DEFAULT_KEYS}"))
    outliers: int = field(default=DEFAULT_OUTLIERS, metadata=_flag(
        "--key-outliers", type=int, default=DEFAULT_OUTLIERS,
        shown=lambda q: q.keys != "token" and q.outliers != DEFAULT_OUTLIERS,  # keys per token keep none
        help=f"key values per token kept exact under --cache-keys channel or fitted (default {DEFAULT_OUTLIERS})"))
    recent: int = field(default=0, metadata=_flag(
        "--cache-recent", type=int, default=DEFAULT_RECENT, metavar="N",
        help=f"--compress-cache: the newest N tokens of each sequence also kept exact in the storage dtype (both "
             f"key schemes; a token is read quantized once it leaves them; eviction still sees every token; the "
             f"plan counts their bytes); 0: none (FlexGen's scheme); default {DEFAULT_RECENT}"))
    sinks: int = field(default=0, metadata=_flag(
        "--cache-sinks", type=int, default=DEFAULT_SINKS, metavar="N",
        help=f"--compress-cache: the first N tokens of each sequence (attention sinks) also kept exact in the storage "
             f"dtype while they are kept; the plan counts their bytes; 0: none; default {DEFAULT_SINKS}"))
    rotate: bool = field(default=False, metadata=_flag(  # the flag's default is DEFAULT_ROTATE (off unless asked here)
        "--cache-rotate", action=argparse.BooleanOptionalAction, default=DEFAULT_ROTATE,
        help="--compress-cache: quantize K and V times a Hadamard matrix along head_dim (rotated back when read; "
             "QuaRot's rotation, which spreads a token's outlier channels over all of them; no extra bytes); "
             f"default {str(DEFAULT_ROTATE).lower()} ({'on' if DEFAULT_ROTATE else 'off'})"))
    exact_bits: int = field(default=0, metadata=_flag(
        "--cache-exact-bits", type=int, choices=[8], metavar="8",
        help="--compress-cache: store what the cache keeps exact in 8 bits instead of the storage dtype (the key "
             "outliers as fp8 e4m3, each --cache-recent and --cache-sinks token quantized alone at 8 bits): about half "
             "their bytes, so more tokens fit the same bytes (benchmarks/ACCURACY.md); default: the storage dtype"))

    def __post_init__(self):
        from flexh2o.compress.channel import ChannelSpec
        from flexh2o.compress.codec import CacheGroupSpec
        from flexh2o.compress.recent import check_ring_bits
        if self.keys not in KEY_SCHEMES:
            raise ValueError(f"--cache-keys {self.keys}: choose one of {', '.join(KEY_SCHEMES)}")
        if self.recent < 0:
            raise ValueError(f"--cache-recent must be 0 or more (got {self.recent})")
        if self.sinks < 0:
            raise ValueError(f"--cache-sinks must be 0 or more (got {self.sinks})")
        ChannelSpec(self.bits, self.outliers)  # validates the bits and the outliers
        check_ring_bits(self.exact_bits)
        if self.exact_bits and not (self.recent or self.sinks or (self.keys != "token" and self.outliers)):
            raise ValueError(f"--cache-exact-bits {self.exact_bits}: this cache keeps nothing exact (no "
                             f"--cache-recent, --cache-sinks or key outliers); drop --cache-exact-bits")
        CacheGroupSpec(self.bits, self.group_size, -1)  # validates the bits and the group size

    group_dim = -1  # the values' grouped dimension (head_dim), as a CompressionSpec's

    @property
    def value_spec(self):
        """The values' CacheGroupSpec (compress/codec.py)."""
        from flexh2o.compress.codec import CacheGroupSpec
        return CacheGroupSpec(self.bits, self.group_size, -1)

    @property
    def key_spec(self):
        """ChannelSpec (keys per channel) or CacheGroupSpec (per token, as the values)."""
        from flexh2o.compress.channel import ChannelSpec
        if self.keys == "token":
            return self.value_spec
        return ChannelSpec(self.bits, self.outliers, self.keys == "fitted", self.exact_bits == 8)

    @functools.lru_cache(maxsize=64)  # made once a scheme and block shape: a block is assembled at every load
    def form_spec(self, field: str, slots: int, head_dim: int):
        """The scheme spec (compress/form.py) of K ("k") or V ("v") in a block of `slots` slots: keys per channel or
        per token, values per token; rotated with `rotate`; with its ring of the newest `recent` and first `sinks`
        tokens (each cut to the slots) kept exact, or in 8 bits with `exact_bits`."""
        from flexh2o.compress.recent import RingSpec, ring_spec
        from flexh2o.compress.rotation import RotatedSpec
        spec = self.key_spec if field == "k" else self.value_spec
        if self.rotate:
            spec = RotatedSpec(spec)
        window, sinks = min(self.recent, slots), min(self.sinks, slots)
        if window + sinks:
            spec = RingSpec(spec, window, sinks, ring_spec(self.exact_bits, head_dim))
        return spec

    @classmethod
    def of(cls, spec) -> Optional["CacheQuant"]:
        """None, a CacheQuant, or a CompressionSpec (FlexGen's: keys and values per token) as a CacheQuant."""
        from flexh2o.compress.codec import CompressionSpec
        if spec is None or isinstance(spec, cls):
            return spec
        if isinstance(spec, CompressionSpec):
            return cls(spec.bits, spec.group_size, "token")
        raise TypeError(f"not a cache quantization: {spec!r}")

    def describe(self) -> str:
        keys = "keys per token" if self.keys == "token" else \
            f"keys per channel{', fitted levels' if self.keys == 'fitted' else ''}, {self.outliers} exact"
        recent = f", newest {self.recent} tokens exact" if self.recent else ""
        recent += f", first {self.sinks} tokens exact" if self.sinks else ""
        recent += ", rotated" if self.rotate else ""
        recent += f", exact parts at {self.exact_bits} bits" if self.exact_bits else ""
        return f"{self.bits}-bit/{self.group_size} ({keys}{recent})"


def flagged() -> tuple:
    """(field name, CacheFlag) of each CacheQuant field declared with a flag, in the fields' order (this module's
    CacheQuant when called)."""
    return tuple((f.name, f.metadata["flag"]) for f in fields(CacheQuant) if "flag" in f.metadata)


def from_flags(bits: int, group_size: int, given: Callable) -> CacheQuant:
    """The CacheQuant of `bits` and `group_size` whose flagged fields hold their flags' values (given(dest, default):
    the parsed value; None leaves the field its default). ValueError from its checks."""
    values = {name: given(flag.dest, flag.default) for name, flag in flagged()}
    return CacheQuant(bits, group_size, **{name: v for name, v in values.items() if v is not None})


def printed_flags(quant: CacheQuant) -> list:
    """The flags of `quant`'s flagged fields that a printed flexh2o-run command line gives (from_flags reads them
    back): each field whose value is not what its flag's default gives, or as its flag's `shown` says."""
    out = []
    for f in fields(quant):
        flag = f.metadata.get("flag")
        if flag is None:
            continue
        value = getattr(quant, f.name)
        default = f.default if flag.default is None else flag.default
        if (flag.shown(quant) if flag.shown is not None else value != default):
            out.append(flag.text(value))
    return out
