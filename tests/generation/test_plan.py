"""The block schedule as data: ordering properties, checked without tensors."""
from __future__ import annotations

import pytest

from flexh2o.schedule.plan import (COMPUTE, FREE_WEIGHT, LOAD_ACT, LOAD_CACHE, LOAD_WEIGHT, STORE_ACT, STORE_CACHE,
                                   block_schedule)

SHAPES = [(1, 3, 1), (3, 4, 1), (2, 5, 3), (4, 6, 4)]


def _ops(steps, layers, batches):
    return list(block_schedule(steps, layers, batches, lambda layer: 0 < layer < layers - 1))


@pytest.mark.parametrize("steps,layers,batches", SHAPES)
def test_every_compute_once_in_zigzag_order(steps, layers, batches):
    computes = [(o.step, o.layer, o.batch) for o in _ops(steps, layers, batches) if o.kind == COMPUTE]
    assert computes == [(s, j, b) for s in range(steps) for j in range(layers) for b in range(batches)]


@pytest.mark.parametrize("steps,layers,batches", SHAPES)
def test_loads_precede_use_and_stores_follow_compute(steps, layers, batches):
    ops = _ops(steps, layers, batches)
    at = {(o.kind, o.step, o.layer, o.batch): i for i, o in enumerate(ops)}
    for o in ops:
        if o.kind != COMPUTE:
            continue
        i = at[COMPUTE, o.step, o.layer, o.batch]
        assert at[LOAD_WEIGHT, o.step, o.layer, -1] < i
        assert at[LOAD_ACT, o.step, o.layer, o.batch] < i
        assert at[STORE_ACT, o.step, o.layer, o.batch] > i
        if 0 < o.layer < layers - 1:
            assert at[LOAD_CACHE, o.step, o.layer, o.batch] < i < at[STORE_CACHE, o.step, o.layer, o.batch]
        else:
            assert (LOAD_CACHE, o.step, o.layer, o.batch) not in at


@pytest.mark.parametrize("steps,layers,batches", SHAPES)
def test_weights_loaded_once_per_block_and_freed_after_it(steps, layers, batches):
    ops = _ops(steps, layers, batches)
    loads = [(o.step, o.layer) for o in ops if o.kind == LOAD_WEIGHT]
    assert loads == [(s, j) for s in range(steps) for j in range(layers)]  # once per token per layer
    for s in range(steps):
        for j in range(layers):
            last = max(i for i, o in enumerate(ops) if o.kind == COMPUTE and (o.step, o.layer) == (s, j))
            free = next(i for i, o in enumerate(ops) if o.kind == FREE_WEIGHT and (o.step, o.layer) == (s, j))
            assert free > last


@pytest.mark.parametrize("steps,layers,batches", SHAPES)
def test_no_buffer_read_before_its_load_and_prefetch_is_one_ahead(steps, layers, batches):
    """Replaying the plan: a compute only reads buffers that are loaded and not yet stored/freed; at most two
    layers of weights are resident (the one computing and the prefetched next)."""
    resident_w, resident_c, peak_w = set(), set(), 0
    for o in _ops(steps, layers, batches):
        if o.kind == LOAD_WEIGHT:
            resident_w.add(o.layer)
            peak_w = max(peak_w, len(resident_w))
        elif o.kind == FREE_WEIGHT:
            resident_w.remove(o.layer)
        elif o.kind == LOAD_CACHE:
            resident_c.add((o.layer, o.batch))
        elif o.kind == STORE_CACHE:
            resident_c.remove((o.layer, o.batch))
        elif o.kind == COMPUTE:
            assert o.layer in resident_w
            if 0 < o.layer < layers - 1:
                assert (o.layer, o.batch) in resident_c
    assert peak_w <= 2 and not resident_w and not resident_c


def test_next_layer_weights_prefetched_before_current_compute():
    ops = _ops(2, 4, 2)
    idx = {(o.kind, o.step, o.layer, o.batch): i for i, o in enumerate(ops)}
    assert idx[LOAD_WEIGHT, 0, 2, -1] < idx[COMPUTE, 0, 1, 0]
    assert idx[LOAD_CACHE, 0, 1, 1] < idx[COMPUTE, 0, 1, 0]  # next batch's cache loads while this one computes
