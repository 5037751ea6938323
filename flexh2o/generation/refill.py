"""Refill: one generate() run whose rows take the next queued request as soon as their own finishes (continuous
batching inside the zig-zag block schedule). It is a row source handed to generate() (`RefillPlan`, a BatchPlan:
generation/batch_plan.py): the run's token state, its steps and its compute ops are the plan's to say.

A row that finishes at step s is handed the next request at once; at step s + 1 its prompt is prefilled inside the
decode step's own weight pass: each layer's compute runs the batch's decode (every row, the refilled ones
included, whose outputs are dropped) and the prefill of the refilled rows with the same loaded weights, whose
fresh cache rows (slots, positions, scores, a quantized cache's metadata) then replace the rows in the block. The
two run as one pass (`_one_pass`): the decode tokens and the prompts' tokens packed into one sequence go through
the linears, norms and MLP together, only attention being split, so a refill adds rows to the step's matmuls rather
than a second round of small ops; rows finishing at the same step are refilled together. Where prefill and decode
take the weights in different forms (compute dtype, int4 kernel) the prefill runs after the decode with the layer's
weights in the prefill form (`_prefill_form`), so a refilled row equals a run alone there too. The block is stored
home whole on that step, whatever its tier. So a row reuses its own slots (no new allocation) and its positions
restart at 0 in slot 0: a cache that never evicts keeps token i in slot i per row, as the decode's
in-order path assumes. Policies keep no state outside the block, so the row's state is all reset.

A row left without a request (the queue is empty) idles: it is fed its last token again at the same position, so it
stays inside its slots and changes nothing another row reads; it asks the queue again at every step, so a request
that joins the queue while the run goes on (flexh2o-serve's) starts at the next step. The run ends after the step
where no row has a request left (schedule/until.py); the schedule is sized for the longest run the queue can take.
"""
from __future__ import annotations

from typing import Optional

import torch

from flexh2o.generation.batch_plan import BatchPlan
from flexh2o.generation.sequences import Sequences
from flexh2o.kv.cache import KVBlock
from flexh2o.kv.layout import FIELDS, CacheLayout


def generate_refill(eng, feed, on_step=None):
    """Run `feed`'s requests on `eng` (an Engine) with refill: eng.generate() with a RefillPlan, until no row has a
    request left; returns its Generation (timings). feed: batch/feed.py's RequestFeed (take, live, all_done, and the
    sampler call)."""
    return eng.generate(None, feed.longest_gen, feed, on_step=on_step, stop_when=lambda: feed.all_done,
                        batch_plan=RefillPlan(feed))


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
        logits = self.last_logits[batch].copy_(logits)  # (b, vocab) fp32 on the CPU: converted into held memory
        b = self.b
        rows = range(batch * b, (batch + 1) * b)
        fresh = self.running.pop(batch, None)
        start = torch.full((b,), -1, dtype=torch.long)  # per row: the position its prefill ended at (-1: none)
        if step == 0:
            start = self.first.lens[batch]
        elif fresh is not None:
            start[fresh[0]] = fresh[3]
        tokens = sampler(logits, step, slice(rows.start, rows.stop))
        alive = [self.feed.live(row) for row in rows]
        live = torch.tensor(alive)
        nxt = self.nxt[batch]
        self.nxt[batch] = torch.where(live, torch.where(start >= 0, start, nxt + 1), nxt)
        self.cur[batch] = torch.where(live, tokens, self.cur[batch])
        refill = []
        for i, row in enumerate(rows):
            if not alive[i]:  # finished now, or idle: the row takes the next request, if any (a live queue grows)
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


class RefillPlan(BatchPlan):
    """A row source for generate(): rows take `feed`'s requests (module docstring). Started once per run."""

    def __init__(self, feed):
        self.feed = feed

    def sequences(self, rc, cfg, prompts, gen_len, record_logits):
        return RefillRows(self.feed, rc.gpu_batch_size, rc.num_gpu_batches, cfg.pad_token_id, cfg.vocab,
                          self.feed.longest_prompt)

    def start(self, policy, rc, seqs, pipe) -> "_Refilling":
        return _Refilling(self.feed)


class _Refilling(BatchPlan):
    """One run of a RefillPlan: its compute ops also prefill the rows being refilled (module docstring)."""

    def __init__(self, feed):
        self.feed = feed
        self.pre: dict = {}  # batch -> hidden states (r, t', h) of the rows prefilled in this step (separate passes)
        self.mixed: dict = {}  # batch -> True while this step's refill runs in one pass with the decode
        self.split_forms = None  # prefill and decode take the weights in different forms (set by the first op)

    def steps(self, rc, gen_len: int) -> int:
        """While the queue lasts every row emits a token each step (a refilled row's first comes from its
        prefill): the most steps the queue can take."""
        return -(-self.feed.total_gen // rc.num_seqs) + self.feed.longest_gen + 2

    def compute(self, run, op) -> None:
        step, layer, batch = op.step, op.layer, op.batch
        if self.split_forms is None:
            kernel = run.eng.kernel or {}
            self.split_forms = (run.rc.compute_at(0) != run.rc.compute_at(1)
                                or bool(kernel.get("prefill")) != bool(kernel.get("decode")))
        if step > 0 and layer == 0:
            run.seqs.inputs(step, batch, run.eng.device)  # moves the batch's pending refill to `running`
        got = run.seqs.prefills(batch) if step > 0 else None
        if step > 0 and layer == 0:
            self.mixed[batch] = got is not None and not self.split_forms and _fits_one_pass(run.rc, got[1])
        if got is None:
            return run.compute_batch(op)
        rows, ids, pos = got[0], got[1].to(run.eng.device), got[2].to(run.eng.device)
        if self.mixed[batch]:
            return _one_pass(run, op, rows, ids, pos)
        return self._two_passes(run, op, rows, ids, pos)

    def _two_passes(self, run, op, rows, ids, pos) -> None:
        """Each layer runs the decode of every row (the refilled rows' outputs are dropped), then the refilled
        rows' prefill with the layer's weights as a prefill step takes them (`_prefill_form`)."""
        step, layer, batch, lc, bufs = op.step, op.layer, op.batch, run.layers, run.bufs
        if layer > 0 and op.cache_layer < 0:  # the head
            dec = lc.head(bufs.weights_of(layer), bufs.a.pop(batch))
            pre = self._prefill_form(run, layer, lambda w: lc.head(w, self.pre.pop(batch)))
            dec[rows.to(dec.device)] = pre.to(dec.device, dec.dtype)
            run._emit(step, batch, dec)
            return None
        run.compute_batch(op)  # the decode step of every row (layer 0: their embedding)
        if layer == 0:
            self.pre[batch] = self._prefill_form(run, layer, lambda w: lc.embed(w, ids, pos))
            return None
        self.pre[batch], fresh = self._prefill_form(
            run, layer, lambda w: lc.prefill(w, op.cache_layer, self.pre[batch], pos))
        put_rows(bufs.block(layer, batch), rows, fresh)
        return None

    def _prefill_form(self, run, layer: int, fn):
        """fn(the layer's weights as step 0 takes them): where prefill and decode differ in compute dtype or int4
        form (RunConfig.compute_at, Engine.kernel), a refilled row is prefilled as it would be alone, the layer's
        weights loaded again in the prefill form in place of the decode form and the decode form loaded back after,
        so at most one form of the layer is held beside the prefetched next layer, as the memory plan counts (the
        cost: two more loads of the layer per refill of a GPU batch). Otherwise the loaded weights as they are."""
        bufs = run.bufs
        if not self.split_forms:
            return fn(bufs.weights_of(layer))
        bufs.free_weights(layer)
        bufs.load_weights(layer, 0, run.rc.compute_at(0))
        try:
            return fn(bufs.weights_of(layer))
        finally:
            bufs.free_weights(layer)
            bufs.load_weights(layer, 1, run.rc.compute_at(1))


def _fits_one_pass(rc, ids: torch.Tensor) -> bool:
    """The decode and the refill prefill run as one pass when its tokens are no more than a planned prefill
    sub-batch's (so the memory plan's transients hold)."""
    return rc.gpu_batch_size + ids.numel() <= rc.prefill_rows() * rc.prompt_len


def _one_pass(run, op, rows, ids, pos) -> None:
    """The decode tokens of the batch's b rows and the refilled rows' prompt tokens packed as one sequence
    (1, b + r t', h) through each layer's linears, norms and MLP; only attention is split: the b decode
    tokens attend their block (LayerCompute.decode_attend), the prompts their own tokens (prefill_attend, into a
    fresh block whose rows then replace the refilled ones)."""
    step, layer, batch, bufs, lc = op.step, op.layer, op.batch, run.bufs, run.layers
    ids_d, pos_d = run.seqs.inputs(step, batch, run.eng.device)  # (b, 1)
    b, (r, t) = ids_d.shape[0], ids.shape
    w = bufs.weights_of(layer)
    if layer == 0:
        bufs.a[batch] = lc.embed(w, _pack(ids_d, ids), _pack(pos_d, pos))  # (1, b + r t, h)
    elif op.cache_layer < 0:
        x = bufs.a.pop(batch)[0]  # (b + r t, h)
        last = torch.cat([x[:b], x[b:].view(r, t, -1)[:, -1]])  # (b + r, h): each row's newest token
        logits = lc.head(w, last[:, None])  # (b + r, vocab)
        dec = logits[:b].clone()
        dec[rows.to(dec.device)] = logits[b:]
        run._emit(step, batch, dec)
    else:
        c, blk = op.cache_layer, bufs.block(layer, batch)
        fresh = lc.empty_block(r, c, ids.device)
        attend = _split_attend(lc, c, b, r, t, pos_d, pos, blk, fresh)
        bufs.a[batch] = lc.family.block(run.cfg, w, c, bufs.a[batch], _pack(pos_d, pos).clamp(min=0), attend)
        put_rows(blk, rows, fresh)


def _pack(dec: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """dec (b, 1), pre (r, t) -> (1, b + r t): the decode tokens, then each prompt's in order."""
    return torch.cat([dec.reshape(1, -1), pre.reshape(1, -1)], 1)


def _split_attend(lc, c: int, b: int, r: int, t: int, pos_d, pos_p, blk: KVBlock, fresh: KVBlock):
    """attend(q, k, v) over a packed sequence (1, heads, b + r t, d): the first b tokens are one decode step of
    the block's rows, the rest r prompts of t tokens prefilled into `fresh`; the same calls, policy and model facts
    as LayerCompute.decode / prefill (generation/compute.py)."""

    def parts(x):  # (1, n, b + r t, d) -> (b, n, 1, d), (r, n, t, d): the layouts split_heads gives each part
        x = x[0]
        return x[:, :b].transpose(0, 1)[:, :, None], x[:, b:].view(x.shape[0], r, t, -1).transpose(0, 1)

    def attend(q, k, v):
        (qd, qp), (kd, kp), (vd, vp) = parts(q), parts(k), parts(v)
        _, cur, at = lc.step_positions(pos_d)  # made once a step (LayerCompute.step_positions)
        od = lc.decode_attend(c, qd, kd, vd, cur, blk, lc.policy, at)
        op = lc.prefill_attend(c, qp, kp, vp, pos_p, fresh)
        n, d = q.shape[1], q.shape[3]
        out = torch.empty(b + r * t, n, d, dtype=op.dtype, device=op.device)  # (tokens, n, d)
        out[:b] = od[:, :, 0].to(out.device)
        out[b:] = op.transpose(1, 2).reshape(r * t, n, d)
        return out.transpose(0, 1)[None]  # (1, n, b + r t, d)
    return attend
