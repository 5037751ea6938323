"""The stage split and the stage-aware schedule as data: matching messages, no deadlock, pipelining."""
from __future__ import annotations

import pytest

from flexh2o.config import ModelConfig, from_name
from flexh2o.pipeline.split import balanced_counts, layer_bytes, parse_stage_layers, split_stages
from flexh2o.schedule.plan import COMPUTE, block_schedule
from flexh2o.schedule.stage_plan import RECV, SEND, batch_groups, consumer, stage_schedule

TINY = ModelConfig("tiny", "opt", hidden=64, num_layers=6, num_heads=4, ffn=256, vocab=1000, max_positions=128)


def _plans(num_layers, counts, num_batches, num_steps):
    cfg = ModelConfig("t", "opt", hidden=64, num_layers=num_layers, num_heads=4, ffn=256, vocab=1000)
    stages = split_stages(cfg, len(counts), counts)
    total = num_layers + 2
    groups = batch_groups(num_batches, len(stages))
    return stages, [list(stage_schedule(num_steps, s.layers, total, groups, lambda layer: 0 < layer < total - 1,
                                        len(stages))) for s in stages]


def _simulate(stages, plans, cost=lambda op: 1):
    """Run every rank's plan: sends are non-blocking, a compute waits until the message it reads has been sent
    (and its receive posted), each compute takes `cost(op)` ticks. Returns {(rank, step, layer, batch): (start,
    end)}; fails on a deadlock, a compute that reads a message never sent or received, or an unmatched message."""
    total = stages[-1].stop
    pos, clock = [0] * len(plans), [0] * len(plans)
    sent, posted, spans = {}, [set() for _ in plans], {}
    while any(p < len(plan) for p, plan in zip(pos, plans)):
        progressed = False
        for r, plan in enumerate(plans):
            while pos[r] < len(plan):
                op = plan[pos[r]]
                if op.kind == SEND:
                    sent[stages[r].next, op.step, op.layer, op.batch] = clock[r]
                elif op.kind == RECV:
                    posted[r].add((op.step, op.layer, op.batch))
                elif op.kind == COMPUTE:
                    start = clock[r]
                    if op.layer == stages[r].first and (op.step, op.layer) != (0, 0):
                        src = (op.step, op.layer - 1) if op.layer > 0 else (op.step - 1, total - 1)
                        msg = (r, *src, op.batch)
                        assert src + (op.batch,) in posted[r], f"rank {r} reads {msg} without posting its receive"
                        if msg not in sent:
                            break  # blocked on the previous stage
                        start = max(start, sent[msg])
                    clock[r] = start + cost(op)
                    spans[r, op.step, op.layer, op.batch] = (start, clock[r])
                pos[r] += 1
                progressed = True
        assert progressed, f"deadlock at {[plan[p] if p < len(plan) else None for p, plan in zip(pos, plans)]}"
    received = {(r, *m) for r in range(len(plans)) for m in posted[r]}
    assert received == set(sent), "every send has exactly one receive"
    return spans


SHAPES = [(4, [2, 2], 1, 3), (4, [2, 2], 2, 3), (4, [1, 3], 4, 2), (6, [2, 2, 2], 3, 3), (6, [1, 2, 3], 2, 4),
          (6, [2, 2, 2], 5, 2), (7, [2, 3, 2], 6, 3), (5, [1, 1, 1, 2], 4, 2), (4, [2, 1, 1], 2, 3),
          (3, [1, 1, 1], 1, 3), (3, [1, 1, 1], 3, 2)]


@pytest.mark.parametrize("num_layers,counts,nb,steps", SHAPES)
def test_every_compute_once_and_no_deadlock(num_layers, counts, nb, steps):
    stages, plans = _plans(num_layers, counts, nb, steps)
    spans = _simulate(stages, plans)
    done = sorted((step, layer, batch) for _, step, layer, batch in spans)
    assert done == sorted((s, j, b) for s in range(steps) for j in range(num_layers + 2) for b in range(nb))
    for (r, step, layer, batch) in spans:
        assert layer in stages[r].layers


@pytest.mark.parametrize("num_layers,counts,nb,steps", SHAPES)
def test_each_link_sends_and_receives_in_one_order(num_layers, counts, nb, steps):
    """For every directed link, the messages the sender posts come in the order the receiver posts their
    receives (what NCCL needs; gloo matches by tag as well), and each moves the output its reader consumes."""
    stages, plans = _plans(num_layers, counts, nb, steps)
    total = num_layers + 2
    for r, s in enumerate(stages):
        sends = [(o.step, o.layer, o.batch) for o in plans[r] if o.kind == SEND]
        recvs = [(o.step, o.layer, o.batch) for o in plans[s.next] if o.kind == RECV]
        assert sends == recvs
        for step, layer, batch in recvs:
            assert consumer(step, layer, total)[1] == stages[s.next].first
        assert all(layer == s.layers[-1] for _, layer, _ in sends)
    tokens = [o for o in plans[-1] if o.kind == SEND]  # the next token goes from the last stage to the first
    assert {o.layer for o in tokens} == {total - 1} and {o.step for o in tokens} == set(range(steps - 1))


@pytest.mark.parametrize("num_layers,counts,nb,steps", SHAPES)
def test_receive_posted_before_its_sender_needs_it_and_sent_after_compute(num_layers, counts, nb, steps):
    stages, plans = _plans(num_layers, counts, nb, steps)
    for plan in plans:
        at = {(o.kind, o.step, o.layer, o.batch): i for i, o in enumerate(plan)}
        for o in plan:
            if o.kind == SEND:
                assert at[COMPUTE, o.step, o.layer, o.batch] < at[SEND, o.step, o.layer, o.batch]


@pytest.mark.parametrize("num_layers,counts,nb,steps", SHAPES)
def test_weights_resident_when_computed_and_loaded_once_each_time(num_layers, counts, nb, steps):
    """Replaying each rank's plan: a compute finds its layer's weights loaded, a layer is never loaded while
    resident, at most two layers are resident, and none is left at the end (a one-layer stage keeps its own)."""
    from flexh2o.schedule.plan import FREE_WEIGHT, LOAD_WEIGHT
    _, plans = _plans(num_layers, counts, nb, steps)
    for plan in plans:
        resident, peak = set(), 0
        for o in plan:
            if o.kind == LOAD_WEIGHT:
                assert o.layer not in resident
                resident.add(o.layer)
                peak = max(peak, len(resident))
            elif o.kind == FREE_WEIGHT:
                resident.remove(o.layer)
            elif o.kind == COMPUTE:
                assert o.layer in resident
        assert peak <= 2 and not resident


@pytest.mark.parametrize("num_layers,counts,nb,steps", SHAPES)
def test_cache_blocks_loaded_after_their_last_store(num_layers, counts, nb, steps):
    """A compute finds its (layer, batch) cache block loaded, and a block is loaded again only once the previous
    step's version is stored home."""
    from flexh2o.schedule.plan import LOAD_CACHE, STORE_CACHE
    _, plans = _plans(num_layers, counts, nb, steps)
    for plan in plans:
        resident = set()
        for o in plan:
            if o.kind == LOAD_CACHE:
                assert (o.layer, o.batch) not in resident
                resident.add((o.layer, o.batch))
            elif o.kind == STORE_CACHE:
                resident.remove((o.layer, o.batch))
            elif o.kind == COMPUTE and 0 < o.layer < num_layers + 1:
                assert (o.layer, o.batch) in resident
        assert not resident


def test_one_stage_is_the_block_schedule():
    for steps, layers, nb in [(1, 3, 1), (3, 6, 2), (2, 5, 3)]:
        def cache(layer):
            return 0 < layer < layers - 1
        got = list(stage_schedule(steps, range(layers), layers, [list(range(nb))], cache))
        assert got == list(block_schedule(steps, layers, nb, cache))


@pytest.mark.parametrize("counts,nb", [([2, 2], 2), ([2, 3, 2], 3), ([2, 2], 4)])
def test_stage_s_computes_group_k_while_stage_s_plus_1_computes_group_k_minus_1(counts, nb):
    """Equal work per stage (embedding and head count as layers) and as many GPU batches as stages or more: after
    the pipeline fills, every stage is busy at once, on consecutive groups."""
    stages, plans = _plans(sum(counts), counts, nb, 4)
    spans = _simulate(stages, plans)
    groups = batch_groups(nb, len(stages))

    def unit_span(r, step, group):
        iv = [spans[r, step, layer, b] for layer in stages[r].layers for b in group]
        return min(a for a, _ in iv), max(b for _, b in iv)
    for step in range(4):
        for k in range(1, len(groups)):
            for s in range(len(stages) - 1):
                a0, a1 = unit_span(s, step, groups[k])
                b0, b1 = unit_span(s + 1, step, groups[k - 1])
                assert a0 < b1 and b0 < a1, (step, k, s)  # at the same time
                if len(groups[k]) == 1:
                    assert (a0, a1) == (b0, b1)  # one batch per group: exactly side by side
    last = max(end for _, end in spans.values())
    unit = len(stages[0].layers) * max(map(len, groups))
    for r in range(len(stages)):  # a stage idles only while the pipeline fills and drains
        work = sum(end - start for (rank, *_), (start, end) in spans.items() if rank == r)
        assert last - work <= (len(stages) - 1) * unit


def test_pipelining_removes_the_bubble():
    stages, one = _plans(4, [2, 2], 1, 6)
    t1 = max(end for _, end in _simulate(stages, one).values())
    stages, two = _plans(4, [2, 2], 2, 6)
    t2 = max(end for _, end in _simulate(stages, two).values())
    assert t1 == 2 * 6 * 3  # one batch: the stages take turns
    assert t2 < 2 * t1 * 0.6  # twice the work in little more than the time of one


def test_balanced_split_by_bytes():
    cfg = from_name("opt-1.3b")
    assert balanced_counts(layer_bytes(cfg), 1) == [24]
    assert balanced_counts(layer_bytes(cfg), 2) == [12, 12]  # embedding and (tied) head weigh about the same
    sizes = [50, 10, 10, 10, 10, 10, 10, 1]  # a heavy embedding: the first stage takes fewer decoder layers
    assert balanced_counts(sizes, 2) == [1, 5]
    for n in (2, 3):  # the largest stage is as small as any split can make it (brute force)
        got = _largest(sizes, balanced_counts(sizes, n))
        assert got == min(_largest(sizes, c) for c in _compositions(6, n))
    for n in (2, 3, 4):
        sizes = layer_bytes(cfg)
        best = balanced_counts(sizes, n)
        stages = split_stages(cfg, n, best)
        per = [sum(sizes[s.first:s.stop]) for s in stages]
        assert max(per) - min(per) <= max(sizes)  # within one layer of even
        assert stages[0].first == 0 and stages[-1].stop == cfg.num_layers + 2
        assert all(a.stop == b.first for a, b in zip(stages, stages[1:]))


def _compositions(total, parts):
    if parts == 1:
        yield [total]
        return
    for first in range(1, total - parts + 2):
        for rest in _compositions(total - first, parts - 1):
            yield [first] + rest


def _largest(sizes, counts):
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    per = [sum(sizes[1 + a:1 + b]) for a, b in zip(bounds, bounds[1:])]
    per[0] += sizes[0]
    per[-1] += sizes[-1]
    return max(per)


def test_stage_layers_given_and_refused():
    assert [s.layers for s in split_stages(TINY, 2, parse_stage_layers("2,4"))] == [range(0, 3), range(3, 8)]
    for text, ranks, needle in [("3,2", 2, "sum to the 6"), ("6", 2, "names 1 stages but 2 ranks"),
                                ("0,6", 2, "at least 1"), ("a,b", 2, "integers"), ("3,3", 9, "at most 6 ranks")]:
        with pytest.raises(ValueError, match=needle):
            split_stages(TINY, ranks, parse_stage_layers(text))
