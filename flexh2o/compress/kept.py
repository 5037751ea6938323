"""A checkpoint's own quantized blocks (GGUF Q4_0/Q4_1/Q8_0, weights/gguf_blocks.py) kept as they are: the weight
compression of a run is --compress-weight's spec for the weights converted plain and each kept weight's own spec
(bits, groups of 32 along the input dimension, fp16 scales and minimums) for the others."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from typing import Optional

from flexh2o.compress.codec import CompressionSpec

KEPT_DEFAULT = CompressionSpec(4, 32, 1)  # the fields of a KeptBlocks without --compress-weight (kernel grouping)


@dataclass(frozen=True)
class KeptBlocks(CompressionSpec):
    """CompressionSpec fields: --compress-weight's spec for the weights stored plain (used only where `others`);
    `kept`: ((name, CompressionSpec), ...) the checkpoint's compressed weights, sorted by name (spec None: a weight
    the checkpoint keeps in blocks that the run stores plain, expanded once)."""

    kept: tuple = field(default=(), repr=False)
    others: bool = True

    @cached_property
    def _table(self) -> dict:
        return dict(self.kept)

    def for_weight(self, name: Optional[str]) -> Optional[CompressionSpec]:
        if name in self._table:
            return self._table[name]
        return CompressionSpec(self.bits, self.group_size, self.group_dim, self.scale_dtype) if self.others else None

    def __hash__(self) -> int:  # the dataclass hash rehashes every kept spec; memo keys ask often
        return self._hash

    @cached_property
    def _hash(self) -> int:
        return hash((self.bits, self.group_size, self.group_dim, self.scale_dtype, self.kept, self.others))


def with_kept(spec: Optional[CompressionSpec], kept: dict) -> Optional[CompressionSpec]:
    """--compress-weight's `spec` (None: not given) joined with a checkpoint's kept blocks (name -> spec); without
    kept blocks, `spec` itself."""
    if not kept:
        return spec
    base = spec or KEPT_DEFAULT
    return KeptBlocks(base.bits, base.group_size, base.group_dim, base.scale_dtype,
                      kept=tuple(sorted(kept.items())), others=spec is not None)


def describe_kept(spec: Optional[CompressionSpec]) -> str:
    """'' or what a run keeps of a checkpoint's blocks, e.g. 'kept blocks 210 x 4-bit/32, 1 x 8-bit/32'."""
    if not isinstance(spec, KeptBlocks):
        return ""
    counts = Counter((s.bits, s.group_size) for _, s in spec.kept if s is not None)
    return "kept blocks " + ", ".join(f"{n} x {b}-bit/{g}" for (b, g), n in sorted(counts.items()))


def compresses_others(spec: Optional[CompressionSpec]) -> bool:
    """Whether --compress-weight was given (a checkpoint's kept blocks alone do not give it)."""
    return spec is not None and (not isinstance(spec, KeptBlocks) or spec.others)
