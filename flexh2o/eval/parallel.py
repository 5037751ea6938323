"""`flexh2o-eval ppl --procs N`: the lanes split between N processes, each with its share of the torch threads.

One process with 2 threads keeps both cores busy only inside torch's parallel regions: between ops (the Python of a
decode step: ~30 layers of attention and policy work per token) the second core idles, and every region wakes the
passive OpenMP thread. N single-threaded processes on N cores have no such gaps. Each process runs every text's
windows for a contiguous range of the lanes in cache-size order (`lane_split`): a process of small budgets then
attends and runs its policies over few slots, and the ranges are cut so that the processes' estimated work is
even. A lane's rows do not depend on which other lanes share its batch; the parent merges the rows back into the
order of one process's result.

Children are started with `spawn` (never fork a process whose OpenMP runtime is live); each sends its progress (at
most once a second) and then its rows (or its error) through one queue.
"""
from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from dataclasses import replace

import torch

from flexh2o.eval.common import EvalModel, EvalResult, machine, progress_bar, spec_of
from flexh2o.eval.ppl_rows import distinct_lanes, ppl_rows, table_jobs, total_tokens
from flexh2o.generation.followers import can_follow, first_eviction
from flexh2o.models import layer_specs


def run_split(model: EvalModel, s, procs: int, progress: bool = True) -> EvalResult:
    """run_ppl of settings `s` with its lanes split between min(procs, lanes) processes (lane_split)."""
    groups = lane_split(model, s, procs)
    threads = max(1, torch.get_num_threads() // len(groups))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    children = [ctx.Process(target=_child, args=(i, model, replace(s, only_lanes=tuple(g)), threads, queue),
                            daemon=True) for i, g in enumerate(groups)]
    bar = progress_bar(total_tokens(model, s), f"ppl ({len(groups)} processes)", progress)
    parts = {}
    try:
        for c in children:
            c.start()
        while len(parts) < len(children):
            kind, index, payload = queue.get()
            if kind == "tick":
                bar.update(payload)
            elif kind == "error":
                raise RuntimeError(f"ppl process {index} ({len(groups[index])} lanes) failed: {payload}")
            else:
                parts[index] = payload
    finally:
        bar.close()
        for c in children:
            if c.is_alive():
                c.terminate()
            c.join()
    return _merged(s, [parts[i] for i in range(len(groups))], groups)


# lane_split's cost model, in units of one cached slot of one row read by decode attention (per layer, KV head and head
# dim), fitted to a py-spy profile of the SmolLM2-135M policy table (2026-12-01, 2b48b61: matmuls and the rest of the
# model 49% of the samples, attention 24%, the policies 22% before the work on them that followed, counted at 70%):
SLOT_WEIGHT = 110.0  # weight FLOPs per token that cost as much as one slot of attention
POLICY_WEIGHT = 0.75  # a slot in the policy's work at a step where its lane evicts, in attention slots


def lane_cost(slots: int, budget, prefix: int, steps: int, weight: float, dormant: int = 0) -> float:
    """One lane's decode work in slot units: `weight` per step (the matmuls), attention over the tokens it holds
    (growing to `slots`), and the policy over its slots at every step where it holds more than `budget` tokens
    (LanePolicy skips the lanes within their budget; budget None never evicts); none of it in its first `dormant`
    steps (a follower that has not evicted yet, generation/followers.py)."""
    attention = sum(min(prefix + t + 1, slots) for t in range(dormant, steps))
    evicting = 0 if budget is None else min(steps, max(0, steps - (budget - prefix)))
    return (steps - dormant) * weight + attention + POLICY_WEIGHT * evicting * slots


def lane_split(model: EvalModel, s, procs: int) -> list:
    """The table's distinct lanes in cache-size order, cut into min(procs, lanes) contiguous groups whose largest
    estimated work (the sum of its lanes' lane_cost) is least."""
    cfg = model.cfg
    steps = s.context - s.prefix
    policies = {lane: spec_of(model, *lane).make(cfg.num_layers) for lane in distinct_lanes(table_jobs(s))}
    slots = {lane: p.slots(s.prefix, steps) for lane, p in policies.items()}
    order = sorted(slots, key=lambda lane: slots[lane])
    params = sum(w.numel for specs in layer_specs(cfg)[1:] for w in specs)  # every matmul's (not the lookup's)
    weight = 2 * params / (SLOT_WEIGHT * cfg.num_layers * cfg.kv_heads * cfg.head_dim)
    costs = []
    for lane in order:  # a pass's leader is counted as a follower too (one lane of many: an approximation)
        policy = policies[lane]
        first = first_eviction(policy, cfg.num_layers)
        dormant = min(steps, max(0, int(first) - s.prefix)) if can_follow(policy) and lane[1] is not None else 0
        costs.append(lane_cost(slots[lane], lane[1], s.prefix, steps, weight, dormant))
    ends = [0]
    for c in costs:
        ends.append(ends[-1] + c)
    n = min(procs, len(order))
    best = {(0, 0): (0.0, [])}  # (groups, lanes used) -> (largest group cost, cut points)
    for g in range(1, n + 1):
        for j in range(g, len(order) - (n - g) + 1):
            best[g, j] = min(((max(best[g - 1, i][0], ends[j] - ends[i]), best[g - 1, i][1] + [j])
                              for i in range(g - 1, j) if (g - 1, i) in best), key=lambda x: x[0])
    cuts = [0] + best[n, len(order)][1]
    return [order[a:b] for a, b in zip(cuts, cuts[1:])]


TICK_S = 1.0  # a child reports its progress at most this often (each report wakes the parent)


def _child(index: int, model: EvalModel, s, threads: int, queue) -> None:
    pending, last = [0], [time.monotonic()]

    def tick(n: int) -> None:
        pending[0] += n
        if time.monotonic() - last[0] >= TICK_S:
            queue.put(("tick", index, pending[0]))
            pending[0], last[0] = 0, time.monotonic()
    try:
        torch.set_num_threads(threads)
        start = time.monotonic()
        rows = ppl_rows(model, s, tick).rows
        if pending[0]:
            queue.put(("tick", index, pending[0]))
        queue.put(("rows", index, (rows, time.monotonic() - start)))
    except BaseException as e:  # the parent names the failure in one line
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        queue.put(("error", index, last))


def _merged(s, parts: list, groups: list) -> EvalResult:
    """One result from the processes' (rows, seconds), ordered as one process orders them (table cells, then
    texts); the machine record says how many processes ran, each one's lanes and seconds (how even the split was)."""
    rows = [r for part, _ in parts for r in part]
    cells = [(p, spec or "all") for p, spec, _ in table_jobs(s)]
    rows.sort(key=lambda r: (cells.index((r["policy"], r["budget"])), s.texts.index(r["text"])))
    split = [{"lanes": len(g), "seconds": round(sec, 3)} for g, (_, sec) in zip(groups, parts)]
    result = EvalResult("ppl", s, machine={**machine(), "procs": len(parts), "split": split})
    result.rows = rows
    return result
