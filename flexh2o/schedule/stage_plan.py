"""The stage-aware block schedule of one pipeline stage: a pure generator of ops, testable without tensors.

A stage computes a contiguous range of layers. The GPU batches are cut into groups (as many as stages when there
are enough batches); a *unit* is one group at one step, and every stage runs the units in the same order (step,
then group). Inside a unit the block schedule is the single-process one over the stage's layers (weights of a
layer loaded once per unit and reused by its batches, the next layer and the next batch's cache prefetched).
So stage s computes group k while stage s + 1 computes group k - 1, and with as many groups as stages the first
stage starts step t + 1 of group 0 just as the last stage has sent its tokens of step t.

Messages: SEND / RECV ops carry the (step, layer, batch) of the compute whose output they move: hidden states of
a stage's last layer to the next stage, or the head's tokens from the last stage back to the first (consumed at
layer 0 of step + 1). The receives of a unit are posted one unit ahead; a stage waits for a message only when
its compute needs it, and sends right after the compute that produced it.
"""
from __future__ import annotations

from typing import Iterator

from flexh2o.schedule.plan import COMPUTE, FREE_WEIGHT, LOAD_ACT, LOAD_CACHE, LOAD_WEIGHT, STORE_ACT, STORE_CACHE, Op

SEND, RECV = "send", "recv"


def batch_groups(num_batches: int, num_stages: int) -> list:
    """GPU batches cut into min(batches, stages) contiguous groups whose sizes differ by at most one."""
    n = min(num_batches, num_stages)
    cuts = [num_batches * g // n for g in range(n + 1)]
    return [list(range(cuts[g], cuts[g + 1])) for g in range(n)]


def consumer(step: int, layer: int, total_layers: int) -> tuple:
    """(step, layer) of the compute that reads the output of compute (step, layer): the next layer, or the
    embedding of the next step for the head's tokens."""
    return (step, layer + 1) if layer + 1 < total_layers else (step + 1, 0)


def source(step: int, layer: int, total_layers: int) -> tuple:
    """(step, layer) of the compute whose output compute (step, layer) reads (the inverse of `consumer`)."""
    return (step, layer - 1) if layer > 0 else (step - 1, total_layers - 1)


def stage_schedule(num_steps: int, layers: range, total_layers: int, groups: list, has_cache,
                   num_stages: int = 1) -> Iterator[Op]:
    """Ops of the stage computing `layers` (engine indices, out of `total_layers` including embedding and head).

    With one stage this is exactly `block_schedule` (one group of every batch). Only messages that cross a stage
    boundary appear: nothing is sent when there is one stage, and the tokens of the last step go nowhere.
    """
    first, last = layers[0], layers[-1]
    cached = [layer for layer in range(total_layers) if has_cache(layer)]
    cache_of = {layer: cached.index(layer) if layer in cached else -1 for layer in range(total_layers)}
    units = [(step, group) for step in range(num_steps) for group in groups]
    computes = [(step, layer, batch) for step, group in units for layer in layers for batch in group]
    starts = {(step, layer, group[0]) for step, group in units for layer in layers}  # first compute of a block
    ends = {(step, layer, group[-1]) for step, group in units for layer in layers}
    blocks = [(step, layer) for step, group in units for layer in layers]
    unit_of = {(step, batch): u for u, (step, group) in enumerate(units) for batch in group}

    def recvs(u: int):
        if num_stages == 1 or u >= len(units):
            return
        step, group = units[u]
        src = source(step, first, total_layers)
        if src[0] >= 0:
            for batch in group:
                yield Op(RECV, src[0], src[1], batch)

    yield from recvs(0)
    yield Op(LOAD_WEIGHT, *blocks[0])
    if has_cache(first):
        yield Op(LOAD_CACHE, *computes[0], cache_of[first])
    block = 0
    for i, (step, layer, batch) in enumerate(computes):
        if (step, layer, batch) in starts:
            if layer == first and batch == units[unit_of[step, batch]][1][0]:
                yield from recvs(unit_of[step, batch] + 1)
            if block + 1 < len(blocks) and blocks[block + 1][1] != layer:  # a one-layer stage keeps its weights
                yield Op(LOAD_WEIGHT, *blocks[block + 1])
        nxt = computes[i + 1] if i + 1 < len(computes) and has_cache(computes[i + 1][1]) else None
        again = nxt is not None and nxt[1:] == (layer, batch)  # a one-layer stage with one batch: the same block
        if nxt is not None and not again:
            yield Op(LOAD_CACHE, *nxt, cache_of[nxt[1]])
        yield Op(LOAD_ACT, step, layer, batch)
        yield Op(COMPUTE, step, layer, batch, cache_of[layer])
        if has_cache(layer):
            yield Op(STORE_CACHE, step, layer, batch, cache_of[layer])
        if again:
            yield Op(LOAD_CACHE, *nxt, cache_of[nxt[1]])  # only once this step's block is home
        to = consumer(step, layer, total_layers)
        if layer == last and num_stages > 1 and to[0] < num_steps:
            yield Op(SEND, step, layer, batch)
        else:
            yield Op(STORE_ACT, step, layer, batch)
        if (step, layer, batch) in ends:
            if block + 1 == len(blocks) or blocks[block + 1][1] != layer:
                yield Op(FREE_WEIGHT, step, layer)
            block += 1
