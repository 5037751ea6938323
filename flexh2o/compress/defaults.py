"""The compression schemes' defaults and choices, without torch (the command line's --help reads them before any
tensor is made): FlexGen's bits and group (CompressionSpec, compress/codec.py) and how a quantized KV cache holds
its keys and what it keeps exact (CacheQuant, kv/layout.py)."""
from __future__ import annotations

DEFAULT_BITS = 4  # FlexGen's 4-bit groups
DEFAULT_GROUP = 64  # values per group (FlexGen's)
KEY_SCHEMES = ("channel", "fitted", "token")
DEFAULT_KEYS = "channel"  # beat FlexGen's per-token keys at equal bytes on SmolLM2 (ACCURACY.md, 2026-12-02, 564b508)
DEFAULT_OUTLIERS = 8  # key values per token kept exact (1/8 of SmolLM2's head_dim of 64; ACCURACY.md, 2026-12-03)
DEFAULT_CACHE_GROUP = 32  # the quantized cache's values (and per-token keys') per group along head_dim, apart from
# the weights' DEFAULT_GROUP: with DEFAULT_RECENT 32, the 4-bit full cache within +0.5% of the plain cache on four
# whole plays (ACCURACY.md rows 25-28, 2026-12-07, 8ff9aec: +0.25/+0.00/+0.49/+0.31%; groups of 64 with 16 exact
# +0.53% on hamlet) for 8% more bytes at 1024 tokens
DEFAULT_RECENT = 32  # newest tokens of a row kept exact (with DEFAULT_CACHE_GROUP: ACCURACY.md rows 25-28)
DEFAULT_SINKS = 4  # first tokens of a row kept exact (attention sinks): macbeth 4-bit full cache +1.2% -> +0.4%
DEFAULT_ROTATE = True  # K and V quantized in a Hadamard-rotated basis (--cache-rotate): the 3-bit full cache on
# SmolLM2 +3.9% -> +0.7% / -0.1% (hamlet / macbeth), held-out texts better at 3 and 4 bits (ACCURACY.md)


def cache_group(keys: str, compress_group: int | None = None, given: int | None = None) -> int:
    """The quantized cache's group along head_dim: `given` (--cache-group-size), else an explicit --compress-group-size
    `compress_group` (one group for weights and cache, FlexGen's meaning), else FlexGen's DEFAULT_GROUP for keys per
    token (FlexGen's scheme) and DEFAULT_CACHE_GROUP for keys per channel or fitted."""
    if given is not None:
        return given
    if compress_group is not None:
        return compress_group
    return DEFAULT_GROUP if keys == "token" else DEFAULT_CACHE_GROUP
