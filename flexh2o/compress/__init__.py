"""Group-wise quantization of weights and KV cache (FlexGen's scheme) and the bytes a tensor takes under it."""
from flexh2o.compress.codec import (CompressedTensor, CompressionSpec, dequantize, quantize, stored_bytes,
                                    stored_parts, weight_spec)

__all__ = ["CompressedTensor", "CompressionSpec", "dequantize", "quantize", "stored_bytes", "stored_parts",
           "weight_spec"]
