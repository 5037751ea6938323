"""Group-wise quantization of weights and KV cache (FlexGen's scheme) and the bytes a tensor takes under it.

The names below come from compress/codec.py (torch), imported on first use: importing the package alone (for
compress/defaults.py, which the command line's --help reads) imports no torch."""
from __future__ import annotations

__all__ = ["CompressedTensor", "CompressionSpec", "dequantize", "quantize", "stored_bytes", "stored_parts",
           "weight_spec"]


def __getattr__(name: str):
    if name in __all__:
        from flexh2o.compress import codec
        return getattr(codec, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
