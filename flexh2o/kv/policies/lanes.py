"""`LanePolicy`: several (policy, budget) lanes side by side in one batch, each lane owning a contiguous range of rows.

A row behaves exactly as in a run of its lane's policy alone: the same kept tokens, in the same slots (the block has
the largest lane's slot count; the extra slots stay empty and attention masks them). Used by `flexh2o-eval ppl` so
that many lanes share each weight read. It needs to see the whole batch at once: one GPU batch, prefilled in one
piece (RunConfig.prefill_batch = rows).

Decode work is batched over the lanes, whatever their number: the score update runs once over the whole batch; the
protection (each row's own recent window and sinks as (rows, 1, 1) tensors) and the eviction choice once over the
rows that may evict: the lanes up to the last one whose sequence holds more tokens than its budget (a lane within
its budget evicts nothing: in a table of budgets up to 50%, the larger budgets' lanes skip the policy work of their
first steps), up to the last slot the generic rule's rows use (a class with its own rule, adakv, decides its rows
over its own slots). The priority runs once per policy class (and parameters) over that class's rows, up to the last
slot they use, read as a strided view when the rows are evenly spaced (else copied). Prefill (once per layer) asks
each lane.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional
import torch

from flexh2o.kv.policies.base import KVPolicy, Observed, lowest_unprotected, protected_rows
from flexh2o.tensors import row_extents

UNBOUNDED = torch.iinfo(torch.int64).max  # the total of a lane without a budget: it never evicts


@dataclass(frozen=True)
class RowBudget:
    """Budget.heavy / .recent per row, as (rows, 1, 1) int64 tensors (what a policy's rules read from a Budget)."""

    heavy: torch.Tensor
    recent: torch.Tensor

    @property
    def total(self) -> torch.Tensor:
        return self.heavy + self.recent


@dataclass(frozen=True)
class _Group:
    """Every lane of one policy class and parameters: their rows (index (rows,), and as a list) and that policy over
    those rows, each with its own budget (a RowBudget)."""

    index: torch.Tensor
    policy: KVPolicy
    rows: tuple
    view: Optional[slice]  # the rows as one strided slice, when they are evenly spaced

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """The group's rows of x: a strided view when they are evenly spaced, else a copy."""
        return x[self.view] if self.view is not None else x.index_select(0, self.index)

    def put(self, dst: torch.Tensor, src: torch.Tensor, n: Optional[int] = None) -> None:
        """dst[the group's rows, :, :n] = src, in place (n None: every slot)."""
        rows = self.view if self.view is not None else self.index
        if n is None:
            dst[rows] = src
        else:
            dst[rows, :, :n] = src


@dataclass(frozen=True)
class _Rows:
    """Per-row facts of the lanes on one device: total budget, recent window and sinks protected, decay (None when
    every row has decay 1), and the groups."""

    total: torch.Tensor
    recent: torch.Tensor
    sinks: torch.Tensor
    decay: Optional[torch.Tensor]
    groups: list


class LanePolicy(KVPolicy):
    name = "lanes"

    def __init__(self, lanes: list):
        """lanes: (rows, policy) in row order."""
        super().__init__(None)
        self.lanes, self.slices, start = [p for _, p in lanes], [], 0
        for rows, _ in lanes:
            self.slices.append(slice(start, start + rows))
            start += rows
        self.rows = start
        self.needs_scores = any(p.needs_scores for p in self.lanes)
        self.needs_values = any(p.needs_values for p in self.lanes)
        self.needs_keys = any(p.needs_keys for p in self.lanes)
        self.merges = any(p.merges for p in self.lanes)
        self._device_state = {}  # device name -> _Rows, built on first use
        self._layer_totals = {}  # (device name, layer) -> per-row totals, when some lane's budget is per layer
        self._lane_total = {}  # layer -> per lane, its total budget there (None: unbounded): _lane_totals
        self._heads = {}  # (k, scoring) -> the first k lanes as a LanePolicy (_head)

    def slots(self, prompt_len: int, gen_len: int) -> int:
        return max(p.slots(prompt_len, gen_len) for p in self.lanes)

    def evicts(self, prompt_len: int, gen_len: int) -> bool:
        return any(p.evicts(prompt_len, gen_len) for p in self.lanes)

    def _parts(self, x: torch.Tensor) -> list:
        self._check(x)
        return [x[sl] for sl in self.slices]

    def _check(self, x: torch.Tensor) -> None:
        if x.shape[0] != self.rows:
            raise ValueError(f"the lanes cover {self.rows} rows but a block of {x.shape[0]} came: run them as one "
                             "GPU batch prefilled in one piece")

    def query_weights(self, qpos):
        return torch.cat([p.query_weights(q) for p, q in zip(self.lanes, self._parts(qpos))])

    def prefill_keep(self, pos, score, layer, cur_pos, obs=Observed()):
        obss = [obs.only(p).map(lambda x, sl=sl: x[sl]) for p, sl in zip(self.lanes, self.slices)]
        parts = zip(self.lanes, self._parts(pos), self._parts(score), self._parts(cur_pos), obss)
        return torch.cat([p.prefill_keep(ps, s, layer, c, obs=o) for p, ps, s, c, o in parts])

    def accumulate(self, score, att) -> None:
        """score <- decay * score + att, each row with its lane's decay (rows of decay 1 are multiplied by 1)."""
        self._check(score)
        decay = self._state(score.device).decay
        if decay is not None:
            score.mul_(decay)
        score.add_(att)

    def protected(self, pos, cur_pos):
        rows = self._state(pos.device)
        prot = protected_rows(pos, cur_pos, rows.recent, rows.sinks)  # every class of the generic rule
        for g in rows.groups:
            if type(g.policy).protected is not KVPolicy.protected:
                g.put(prot, g.policy.protected(g.take(pos), g.take(cur_pos)))
        return prot

    def priority(self, pos, score, layer, cur_pos, obs: Observed = Observed(), extents: Optional[list] = None,
                 groups: Optional[list] = None):
        """Each row's lane's priority (rows of lanes without a budget get their score: they never evict). A class
        computes it over its rows' slots up to their last used one; the slots past it are empty (never read).
        extents: per row, its slots up to its last used one (row_extents), when the caller has them; groups: the
        classes to compute (default: all; the other rows get their score); obs: what the step observed (Observed), for
        the classes that read it."""
        prio = score
        extents = row_extents(pos) if extents is None else extents
        for g in self._state(pos.device).groups if groups is None else groups:
            if g.policy.priority_is_score:  # its rows' priority is their score, as prio already holds
                continue
            n = max(extents[r] for r in g.rows)
            sc = g.take(score[:, :, :n])
            oi = obs.only(g.policy).map(lambda x: g.take(x[:, :, :n]))
            own = g.policy.scored(g.take(pos[:, :, :n]), sc, layer, g.take(cur_pos), oi)
            prio = prio.clone() if prio is score else prio  # never write into the scores
            g.put(prio, own, n)
        return prio

    def decode_evict(self, pos, score, layer, cur_pos, extents: Optional[list] = None, obs=Observed()):
        """As KVPolicy.decode_evict, over the rows that may evict only: the lanes up to the last one holding more
        tokens than its budget (`_evicting`), up to the last slot they use; the other rows evict nothing."""
        self._check(pos)
        rows = self._state(pos.device)
        if not rows.groups:
            return None
        extents = row_extents(pos) if extents is None else extents
        lanes = self._evicting(cur_pos, layer)
        if lanes == 0:
            return None
        if lanes < len(self.lanes):
            r = self.slices[lanes - 1].stop
            cut = (slice(0, r), slice(None), slice(0, max(extents[:r])))
            head = self._head(lanes).decode_evict(pos[cut], score[cut], layer, cur_pos[:r], extents[:r],
                                                  obs=obs.map(lambda x: x[cut]))
            evict = torch.zeros_like(pos, dtype=torch.bool)
            if head is not None:
                evict[cut] = head
            return evict
        # the classes of the generic rule (lowest unprotected priority) run together up to the last slot their rows
        # use; a class with its own eviction rule (adakv's heads share a budget) decides its rows over its own
        evict = torch.zeros_like(pos, dtype=torch.bool)
        own_rule = [g for g in rows.groups if type(g.policy).decode_evict is not KVPolicy.decode_evict]
        generic = [g for g in rows.groups if type(g.policy).decode_evict is KVPolicy.decode_evict]
        n = max((extents[r] for g in generic for r in g.rows), default=0)
        if n:
            cut = (slice(None), slice(None), slice(0, n))
            prio = self.priority(pos[cut], score[cut], layer, cur_pos, obs.map(lambda x: x[cut]), extents,
                                 generic).float()
            evict[cut] = lowest_unprotected(pos[cut], prio, self.protected(pos[cut], cur_pos),
                                            self._total(pos.device, layer))
        for g in own_rule:
            n = max(extents[r] for r in g.rows)
            oi = obs.only(g.policy).map(lambda x: g.take(x[:, :, :n]))
            own = g.policy.decode_evict(g.take(pos[:, :, :n]), g.take(score[:, :, :n]), layer, g.take(cur_pos),
                                        obs=oi)
            g.put(evict, False)
            g.put(evict, own, n)
        return evict

    def merge_plan(self, pos, score, keys, evict, extents: Optional[list] = None) -> tuple:
        """The merging lanes' plans on their rows; the other rows (and lanes that evict nothing) merge nothing."""
        self._check(pos)
        extents = row_extents(pos) if extents is None else extents
        target = torch.full_like(pos, -1)
        on_cpu = pos.device.type == "cpu"  # off the CPU, asking whether a lane evicted would make the host wait
        for p, sl in zip(self.lanes, self.slices):
            if p.merges and (not on_cpu or bool(evict[sl].any())):
                n = max(extents[sl])  # the lane's slots up to its last used one: no kept token past it
                target[sl, :, :n] = p.merge_plan(pos[sl, :, :n], score[sl, :, :n], keys[sl, :, :n],
                                                 evict[sl, :, :n])[0]
        return target, score

    def _evicting(self, cur_pos: torch.Tensor, layer: int) -> int:
        """The lanes up to the last one that may evict this step, as a count: a row evicts only when its sequence
        holds more tokens (cur_pos + 1) than its budget in `layer`. Off the CPU: every lane (reading cur_pos would
        make the host wait for the device)."""
        if cur_pos.device.type != "cpu":
            return len(self.lanes)
        seen = cur_pos.tolist()
        k = 0
        for i, (sl, total) in enumerate(zip(self.slices, self._lane_totals(layer))):
            if total is not None and max(seen[sl]) + 1 > total:
                k = i + 1
        return k

    def first_rows(self, rows: int, scoring: bool = False) -> "LanePolicy":
        """The lanes covering the first `rows` rows (a lane boundary) as a LanePolicy of their own. scoring: it
        accumulates attention scores even where none of its lanes reads them (a leader whose dormant followers do:
        they take its scores when they wake, generation/followers.py)."""
        k = next((i + 1 for i, sl in enumerate(self.slices) if sl.stop == rows), None)
        if k is None:
            raise ValueError(f"{rows} rows end no lane of {[sl.stop for sl in self.slices]}")
        return self if k == len(self.lanes) else self._head(k, scoring)  # (all lanes: it scores if any lane does)

    def _head(self, k: int, scoring: bool = False) -> "LanePolicy":
        """The lanes' first k lanes as a LanePolicy of their own (built once per k and `scoring`); scoring: it
        accumulates scores whatever its lanes read."""
        if (k, scoring) not in self._heads:
            head = LanePolicy([(sl.stop - sl.start, p) for p, sl in zip(self.lanes[:k], self.slices)])
            head.needs_scores = head.needs_scores or scoring
            self._heads[k, scoring] = head
        return self._heads[k, scoring]

    def _total(self, device, layer: int) -> torch.Tensor:
        """(rows, 1, 1) int64: each row's budget in `layer` (its lane's layer_budget)."""
        if not any(p.layered for p in self.lanes):
            return self._state(device).total
        key = (str(device), layer)
        if key not in self._layer_totals:
            totals = []
            for total, sl in zip(self._lane_totals(layer), self.slices):
                totals += [UNBOUNDED if total is None else total] * (sl.stop - sl.start)
            self._layer_totals[key] = torch.tensor(totals, dtype=torch.int64, device=device).view(-1, 1, 1)
        return self._layer_totals[key]

    def _lane_totals(self, layer: int) -> list:
        """Per lane, its total budget in `layer` (its layer_budget; None: unbounded), built once per layer."""
        if layer not in self._lane_total:
            self._lane_total[layer] = [p.layer_total(layer) for p in self.lanes]
        return self._lane_total[layer]

    def _state(self, device) -> _Rows:
        key = str(device)
        if key not in self._device_state:
            self._device_state[key] = self._build(torch.device(device))
        return self._device_state[key]

    def _build(self, device) -> _Rows:
        cols = {k: [] for k in ("total", "recent", "sinks", "heavy", "decay")}
        by_key = {}
        for p, sl in zip(self.lanes, self.slices):
            b = p.budget
            row = {"total": UNBOUNDED if b is None else b.total, "heavy": 0 if b is None else b.heavy,
                   "recent": b.recent if b is not None and p.windowed else 0,
                   "sinks": p.num_sinks if p.uses_sinks else 0, "decay": float(p.decay)}
            for k, x in row.items():
                cols[k] += [x] * (sl.stop - sl.start)
            if b is not None:
                by_key.setdefault((type(p), tuple(sorted(p.options().items())), p.decay), []).append(sl)
        t = {k: torch.tensor(x, dtype=torch.float32 if k == "decay" else torch.int64, device=device).view(-1, 1, 1)
             for k, x in cols.items()}
        budget = RowBudget(t["heavy"], t["total"] - t["heavy"])
        groups = [self._group(key, slices, budget, device) for key, slices in by_key.items()]
        decay = None if all(d == 1.0 for d in cols["decay"]) else t["decay"]
        return _Rows(t["total"], t["recent"], t["sinks"], decay, groups)

    def _group(self, key, slices: list, budget: RowBudget, device) -> _Group:
        cls, options, _ = key
        rows = tuple(r for sl in slices for r in range(sl.start, sl.stop))
        index = torch.tensor(rows, dtype=torch.int64, device=device)
        own = RowBudget(budget.heavy.index_select(0, index), budget.recent.index_select(0, index))
        steps = {b - a for a, b in zip(rows, rows[1:])}
        view = slice(rows[0], rows[-1] + 1, steps.pop() if steps else 1) if len(steps) <= 1 else None
        return _Group(index, cls(own, **dict(options)), rows, view)
