"""The zig-zag block schedule as data: a pure generator of ops, testable without tensors.

For each generated token (step), for each layer, for each GPU batch: the layer's weights are loaded once and
reused by every batch of the block. Prefetching is expressed by order: the load of layer + 1's weights and the
load of the next batch's cache and activations are issued before the current compute; stores follow it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

LOAD_WEIGHT, FREE_WEIGHT = "load_weight", "free_weight"
LOAD_CACHE, STORE_CACHE = "load_cache", "store_cache"
LOAD_ACT, STORE_ACT = "load_act", "store_act"
COMPUTE = "compute"


@dataclass(frozen=True)
class Op:
    kind: str
    step: int
    layer: int
    batch: int = -1  # -1 for weight ops
    cache_layer: int = -1  # index of the layer's KV cache among the layers that have one; -1: none

    @property
    def buffer(self) -> tuple:
        """The resource this op fills or drains: ('w', layer), ('c', layer, batch) or ('a', batch)."""
        if self.kind in (LOAD_WEIGHT, FREE_WEIGHT):
            return ("w", self.layer)
        if self.kind in (LOAD_CACHE, STORE_CACHE):
            return ("c", self.layer, self.batch)
        return ("a", self.batch)


def block_schedule(num_steps: int, num_layers: int, num_batches: int, has_cache) -> Iterator[Op]:
    """Ops for the whole generation. `num_layers` counts every layer (embedding and head included);
    `has_cache(layer)` says which layers keep a KV cache; ops of such a layer carry its `cache_layer` (0 for the
    first layer with a cache), so nothing downstream computes it from the layer index.

    Loads of a layer's weights and of a batch's cache are issued one compute ahead (the prefetch); the load of
    a batch's activations comes right before its compute, since the previous layer produces them.
    """
    cached = [layer for layer in range(num_layers) if has_cache(layer)]
    cache_of = [cached.index(layer) if layer in cached else -1 for layer in range(num_layers)]
    num_blocks = num_steps * num_layers  # block j is (step, layer) = divmod(j, num_layers)
    num_computes = num_blocks * num_batches  # compute i is block i // num_batches, batch i % num_batches

    def compute(i: int) -> tuple:  # computed, not listed: a long schedule (a server's run) costs no memory
        return (*divmod(i // num_batches, num_layers), i % num_batches)
    yield Op(LOAD_WEIGHT, 0, 0)
    if cache_of[0] >= 0:
        yield Op(LOAD_CACHE, 0, 0, 0, cache_of[0])
    for i in range(num_computes):
        step, layer, batch = compute(i)
        c = cache_of[layer]
        if batch == 0 and i // num_batches + 1 < num_blocks:
            yield Op(LOAD_WEIGHT, *divmod(i // num_batches + 1, num_layers))
        if i + 1 < num_computes and cache_of[compute(i + 1)[1]] >= 0:
            yield Op(LOAD_CACHE, *compute(i + 1), cache_of[compute(i + 1)[1]])
        yield Op(LOAD_ACT, step, layer, batch)
        yield Op(COMPUTE, step, layer, batch, c)
        if c >= 0:
            yield Op(STORE_CACHE, step, layer, batch, c)
        yield Op(STORE_ACT, step, layer, batch)
        if batch == num_batches - 1:
            yield Op(FREE_WEIGHT, step, layer)
