"""Which plain weights reach the compute side in their stored dtype (a models.common.StoredWeight) instead of
converted whole into the compute dtype, and the compute-side bytes they take: the one rule that the engine's weight
loads (weights/store.py), the memory plan (through weights/forms.py) and the cost model (tuning/step_cost.py) read.

A step only gathers a few rows of an embedding table, and the vocabulary head (tied or not) can be multiplied a
chunk of its rows at a time, so converting such a table whole sized the compute-side buffers by the largest layer
in the compute dtype (opt-1.3b's 50272 x 2048 table: 393 MiB in fp32, twice in flight), and a tight memory cap then
forced a 2-byte compute dtype that an AVX2 CPU multiplies ~100x slower than fp32. So a 2-D weight of the embedding
layer (0) or the head layer (num_layers + 1), stored uncompressed in another dtype than the phase computes in and
larger than one conversion chunk (models.common.STORED_CHUNK_BYTES in the compute dtype), stays stored: a lookup
converts the rows it gathers, a matmul one chunk of rows at a time into a reused buffer. Smaller ones (one chunk or
less) are converted whole, as before: that is at most one chunk's bytes anyway.
"""
from __future__ import annotations

import torch

from flexh2o.models import common


def stays_stored(layer: int, num_layers: int, spec, storage: torch.dtype, compute: torch.dtype,
                 compressed: bool) -> bool:
    """Whether weight `spec` (a WeightSpec) of layer index `layer` comes to the compute side in its stored dtype
    (see the module docstring). compressed: it is held under --compress-weight (those have their own forms)."""
    return (not compressed and storage != compute and (layer == 0 or layer > num_layers) and len(spec.shape) == 2
            and spec.numel * compute.itemsize > common.STORED_CHUNK_BYTES)


def is_multiplied(layer: int) -> bool:
    """Whether the stored weights of `layer` are multiplied (the head) rather than looked up (the embedding)."""
    return layer > 0


def stored_weight_bytes(layer: int, spec, storage: torch.dtype, compute: torch.dtype, in_place: bool) -> int:
    """Compute-side bytes of a weight that stays stored: its stored bytes where it is not used where it lives (a
    disk read or a copy to the device), plus the chunk buffer a matmul converts into."""
    copy = 0 if in_place else spec.numel * storage.itemsize
    width = spec.shape[1]
    chunk = min(spec.shape[0], common.stored_chunk_rows(width, compute)) * width * compute.itemsize
    return copy + (chunk if is_multiplied(layer) else 0)


def stored_layer_bytes(layer_specs: list, storage: torch.dtype, compute: torch.dtype, compressed) -> tuple:
    """Per layer index: (bytes at the storage dtype of its weights that stay stored and are looked up, of those
    multiplied). compressed: name -> whether --compress-weight holds it."""
    last = len(layer_specs) - 2
    out = []
    for i, layer in enumerate(layer_specs):
        kept = sum(s.numel * storage.itemsize for s in layer
                   if stays_stored(i, last, s, storage, compute, compressed(s.name)))
        out.append((0, kept) if is_multiplied(i) else (kept, 0))
    return tuple(out)


def stored_of_run(rc, memo=None) -> tuple:
    """stored_layer_bytes of a RunConfig's weights at its compute dtype (kept in `memo` when given: a search costs
    many RunConfigs)."""
    from flexh2o.compress.codec import weight_spec
    key = ("stored_form", rc.model, rc.dtype, rc.compute, rc.compress_weight)
    if memo is not None and key in memo:
        return memo[key]
    specs = rc.placement.weights.layer_specs
    shapes = {s.name: s.shape for layer in specs for s in layer}
    got = stored_layer_bytes(specs, rc.dtype, rc.compute,
                             lambda name: weight_spec(shapes[name], rc.compress_weight, name) is not None)
    if memo is not None:
        memo[key] = got
    return got
