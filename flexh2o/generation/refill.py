"""Refill: one generate() run whose rows take the next queued request as soon as their own finishes (continuous
batching inside the zig-zag block schedule).

A row that finishes at step s is handed the next request at once; at step s + 1 its prompt is prefilled inside the
decode step's own weight pass: each layer's compute runs the batch's decode (every row, the refilled ones
included, whose outputs are dropped) and then the prefill of the refilled rows with the same loaded weights, whose
fresh cache rows (slots, positions, scores, a quantized cache's metadata) then replace the rows in the block. The
block is stored home whole on that step, whatever its tier. So a row reuses its own slots (no new allocation) and
its positions restart at 0 in slot 0: a cache that never evicts keeps token i in slot i per row, as the decode's
in-order path assumes. Policies keep no state outside the block, so the row's state is all reset.

A row left without a request (the queue is empty) idles: it is fed its last token again at the same position, so
it stays inside its slots and changes nothing another row reads. The run ends after the step where no row has a
request left (schedule/until.py); the schedule is sized for the longest run the queue can take.
"""
from __future__ import annotations

from typing import Optional

import torch

from flexh2o.engine import Engine, _Run
from flexh2o.generation.sequences import Sequences
from flexh2o.kv.cache import KVBlock
from flexh2o.kv.layout import FIELDS, CacheLayout


def generate_refill(eng: Engine, feed, on_step=None) -> int:
    """Run `feed`'s requests on `eng` with refill; returns the steps run. feed: batch/feed.py's RequestFeed (take,
    live, all_done, and the sampler call)."""
    run = _RefillRun(eng, feed, on_step)
    run.execute(False)
    return len(run.times)


def put_rows(blk: KVBlock, rows: torch.Tensor, fresh: KVBlock) -> None:
    """Rows `rows` of `blk` become the rows of `fresh` (every stored part: K/V, a quantized cache's data and
    metadata, positions, scores), in place; the block is then stored home whole."""
    for f in FIELDS:
        dst, src = CacheLayout.split(getattr(blk, f)), CacheLayout.split(getattr(fresh, f))
        for name, t in dst.items():
            t[rows.to(t.device)] = src[name].to(t.device)
    blk.written = None


class RefillRows:
    """Token state per row: the step-0 prompts (a Sequences), then per row the token fed next and its position;
    `pending[batch]`: the rows that prefill at the next step, with their left-padded prompts."""

    def __init__(self, feed, b: int, nb: int, pad_id: int, vocab: int, longest: int):
        self.feed, self.b, self.nb, self.pad = feed, b, nb, pad_id
        prompts = [feed.take(row) or [pad_id] for row in range(b * nb)]  # rows without a request idle
        self.first = Sequences(prompts, b, nb, 1, pad_id, vocab)
        self.t = max(longest, self.first.t)  # the longest prompt of any request: the cache is sized for it
        self.cur = torch.full((nb, b), pad_id, dtype=torch.long)
        self.nxt = torch.zeros(nb, b, dtype=torch.long)
        self.pending: dict = {}  # batch -> (rows (r,), ids (r, t'), pos (r, t')) prefilled at the next step
        self.running: dict = {}  # batch -> the same, for the step now computed
        self.tokens = torch.zeros(nb, b, 0, dtype=torch.long)
        self.last_logits = torch.zeros(nb, b, vocab)
        self.step_logits = None
        self._inputs: dict = {}

    def inputs(self, step: int, batch: int, device) -> tuple:
        if step == 0:
            return self.first.inputs(0, batch, device)
        key = (step, batch, str(device))
        if key not in self._inputs:
            if self._inputs and next(iter(self._inputs))[0] != step:
                self._inputs.clear()
            self._inputs[key] = (self.cur[batch].view(-1, 1).to(device, copy=True),
                                 self.nxt[batch].view(-1, 1).to(device, copy=True))
            if step > 0:
                got = self.pending.pop(batch, None)
                if got is not None:
                    self.running[batch] = got
        return self._inputs[key]

    def prefills(self, batch: int) -> Optional[tuple]:
        """(rows, ids, pos) of the rows of `batch` prefilled in the step now computed (None: none)."""
        return self.running.get(batch)

    def emit(self, step: int, batch: int, logits: torch.Tensor, sampler) -> None:
        logits = logits.float().cpu()
        self.last_logits[batch] = logits
        b = self.b
        rows = range(batch * b, (batch + 1) * b)
        before = [self.feed.live(row) for row in rows]
        fresh = self.running.pop(batch, None)
        prefilled = {int(i): int(n) for i, n in zip(fresh[0], fresh[3])} if fresh is not None else {}
        if step == 0:
            prefilled = {i: int(n) for i, n in enumerate(self.first.lens[batch])}
        tokens = sampler(logits, step, slice(rows.start, rows.stop))
        refill = []
        for i, row in enumerate(rows):
            if self.feed.live(row):
                self.cur[batch, i] = tokens[i]
                self.nxt[batch, i] = prefilled[i] if i in prefilled else self.nxt[batch, i] + 1
            elif before[i]:  # finished now: the row takes the next request, if any
                prompt = self.feed.take(row)
                if prompt is not None:
                    refill.append((i, prompt))
        if refill:
            self.pending[batch] = _padded(refill, self.pad)

    def flat(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(self.b * self.nb, *x.shape[2:])


def _padded(refill: list, pad: int) -> tuple:
    """[(row, prompt)] -> (rows (r,), ids (r, t'), pos (r, t') left-padded, -1 on padding, lengths (r,))."""
    t = max(len(p) for _, p in refill)
    ids = torch.full((len(refill), t), pad, dtype=torch.long)
    pos = torch.full((len(refill), t), -1, dtype=torch.long)
    for j, (_, p) in enumerate(refill):
        ids[j, t - len(p):] = torch.tensor(p, dtype=torch.long)
        pos[j, t - len(p):] = torch.arange(len(p))
    rows = torch.tensor([i for i, _ in refill], dtype=torch.long)
    return rows, ids, pos, torch.tensor([len(p) for _, p in refill])


class _RefillRun(_Run):
    """_Run whose compute ops also prefill the rows being refilled (module docstring)."""

    def __init__(self, eng: Engine, feed, on_step):
        self.feed = feed
        super().__init__(eng, None, feed.longest_gen, feed, False, on_step, None, None)
        self.pre: dict = {}  # batch -> hidden states (r, t', h) of the rows prefilled in this step
        # while the queue lasts every row emits a token each step (a refilled row's first comes from its prefill):
        self.gen_len = -(-feed.total_gen // eng.rc.num_seqs) + feed.longest_gen + 2  # the most steps it can take
        self.stop_when = lambda: feed.all_done

    def _sequences(self, prompts, gen_len, record_logits):
        rc, cfg = self.rc, self.cfg
        return RefillRows(self.feed, rc.gpu_batch_size, rc.num_gpu_batches, cfg.pad_token_id, cfg.vocab,
                          self.feed.longest_prompt)

    def compute(self, op) -> None:
        step, layer, batch = op.step, op.layer, op.batch
        got = self.seqs.prefills(batch) if step > 0 else None
        if step > 0 and layer == 0:
            self.seqs.inputs(step, batch, self.eng.device)  # moves the batch's pending refill to `running`
            got = self.seqs.prefills(batch)
        if got is None:
            return super().compute(op)
        rows, ids, pos = got[0], got[1].to(self.eng.device), got[2].to(self.eng.device)
        w = self.bufs.weights_of(layer)
        if layer == 0:
            self.pre[batch] = self.layers.embed(w, ids, pos)
            return super().compute(op)
        if op.cache_layer < 0:
            dec = self.layers.head(w, self.bufs.a.pop(batch))
            dec[rows.to(dec.device)] = self.layers.head(w, self.pre.pop(batch)).to(dec.dtype)
            self._emit(step, batch, dec)
            return None
        super().compute(op)  # the decode of every row (the refilled rows' outputs are dropped)
        self.pre[batch], fresh = self.layers.prefill(w, op.cache_layer, self.pre[batch], pos)
        put_rows(self.bufs.block(layer, batch), rows, fresh)
        return None
