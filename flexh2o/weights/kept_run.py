"""A run's weight compression: --compress-weight's spec joined with the blocks a converted checkpoint keeps."""
from __future__ import annotations

from typing import Optional

from flexh2o.compress.codec import CompressionSpec
from flexh2o.compress.kept import with_kept
from flexh2o.weights.format import CheckpointReader


def with_checkpoint(spec: Optional[CompressionSpec], path: str) -> Optional[CompressionSpec]:
    """A run's weight compression: --compress-weight's `spec` (or None) joined with the blocks the converted
    checkpoint at `path` keeps (compress/kept.py); `spec` itself for dummy weights or a checkpoint without blocks."""
    if path == "_DUMMY_":
        return spec
    return with_kept(spec, CheckpointReader(path).kept())
