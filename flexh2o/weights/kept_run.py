"""A run's weight compression: --compress-weight's spec joined with the blocks a converted checkpoint keeps.

The vocabulary head's 8-bit blocks (a GGUF's Q8_0 output, or its tied Q8_0 token_embd: SmolLM2) are the exception:
the int4 kernel cannot take them, so the expand path expanded the whole head at every decode step (and the tied
table again for layer 0's lookup), ~1.2 s a step under load. They are expanded once instead, into their home tier,
which then holds the head plain in the storage dtype: the plan counts those bytes (weight_spec says None), and the
values are exactly the blocks' (an fp32 expansion is exact; a 16-bit one rounds each product once)."""
from __future__ import annotations

from typing import Optional

from flexh2o.compress.codec import CompressionSpec
from flexh2o.compress.kept import with_kept
from flexh2o.models import layer_specs
from flexh2o.weights.format import CheckpointReader


def with_kept_blocks(spec: Optional[CompressionSpec], reader: CheckpointReader) -> Optional[CompressionSpec]:
    """`spec` joined with the blocks the opened checkpoint `reader` keeps (compress/kept.py), an 8-bit head stored
    plain; `spec` itself for a checkpoint without blocks."""
    kept = dict(reader.kept())
    for name in head_weights(reader.config):
        if name in kept and kept[name].bits == 8:
            kept[name] = None  # plain: expanded once by WeightStore.fill_from
    return with_kept(spec, kept)


def head_weights(cfg) -> list:
    """Names of the vocabulary head's matrices (the tied embedding table where the head is tied)."""
    return [s.name for s in layer_specs(cfg)[-1] if len(s.shape) == 2]
