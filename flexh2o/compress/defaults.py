"""The compression schemes' defaults and choices, without torch (the command line's --help reads them before any
tensor is made): FlexGen's bits and group (CompressionSpec, compress/codec.py) and how a quantized KV cache holds
its keys and what it keeps exact (CacheQuant, kv/layout.py)."""
from __future__ import annotations

DEFAULT_BITS = 4  # FlexGen's 4-bit groups
DEFAULT_GROUP = 64  # values per group (FlexGen's)
KEY_SCHEMES = ("channel", "fitted", "token")
DEFAULT_KEYS = "channel"  # beat FlexGen's per-token keys at equal bytes on SmolLM2 (ACCURACY.md, 2026-12-02, 564b508)
DEFAULT_OUTLIERS = 8  # key values per token kept exact (1/8 of SmolLM2's head_dim of 64; ACCURACY.md, 2026-12-03)
DEFAULT_RECENT = 16  # newest tokens of a row kept exact: of 8, 16, 32, the best 4-bit full cache on SmolLM2
# (ACCURACY.md)
DEFAULT_SINKS = 4  # first tokens of a row kept exact (attention sinks): macbeth 4-bit full cache +1.2% -> +0.4%
DEFAULT_ROTATE = True  # K and V quantized in a Hadamard-rotated basis (--cache-rotate): the 3-bit full cache on
# SmolLM2 +3.9% -> +0.7% / -0.1% (hamlet / macbeth), held-out texts better at 3 and 4 bits (ACCURACY.md)
