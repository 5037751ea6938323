"""One Engine.generate() call: the schedule's ops (schedule/plan.py) executed by the Executor (schedule/run.py),
each op handled by one of three parts: Sequences (token state), Buffers (compute-side tensors keyed by Op.buffer) and
LayerCompute (the model family's functions and the KV policy). Which rows of a GPU batch a compute op runs is the
run's BatchPlan's to say (generation/batch_plan.py: every row, unless the caller hands another), and so are the
run's token state and its steps: a row source such as refill (generation/refill.py) is a BatchPlan whose rows take
queued requests. The Engine holds what outlives a call (tiers, weights, the policy) and hands itself in; this module
never imports it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from flexh2o import models
from flexh2o.generation.batch_plan import BatchPlan
from flexh2o.generation.buffers import Buffers
from flexh2o.generation.compute import LayerCompute
from flexh2o.generation.ready import announcing_decode
from flexh2o.kv.cache import KVCache
from flexh2o.schedule.plan import (COMPUTE, FREE_WEIGHT, LOAD_ACT, LOAD_CACHE, LOAD_WEIGHT, STORE_ACT,
                                   STORE_CACHE, Op, block_schedule)
from flexh2o.schedule.run import Executor
from flexh2o.schedule.stage_plan import RECV, SEND
from flexh2o.schedule.until import until
from flexh2o.storage.freed_memory import FreedMemory, checked_after


@dataclass
class Generation:
    """What `generate` returns: tokens (num_seqs, gen_len), last-step logits (num_seqs, vocab), timings."""

    tokens: torch.Tensor
    last_logits: torch.Tensor
    prefill_s: float
    decode_s: float
    step_logits: Optional[list] = None  # per step, (num_seqs, vocab), when asked for
    kept: dict = field(default_factory=dict)  # cache layer -> max tokens kept per row after the last step (if asked)
    busy_s: dict = field(default_factory=dict)  # op kind -> seconds in its handlers ('stall': waiting for loads)
    decode_busy_s: dict = field(default_factory=dict)  # the same, decode steps only



class Run:
    """One generate() call of `eng` (an Engine): the schedule's op handlers over the run's sequences, buffers and
    layer compute."""

    def __init__(self, eng, prompts, gen_len, sampler, record_logits, on_step, pipe, stop_when=None,
                 batch_plan: Optional[BatchPlan] = None):
        rc, cfg = eng.rc, eng.cfg
        self.eng, self.rc, self.cfg, self.gen_len = eng, rc, cfg, gen_len
        self.sampler, self.on_step, self.pipe, self.stop_when = sampler, on_step, pipe, stop_when
        plan = batch_plan or BatchPlan()
        self.seqs = plan.sequences(rc, cfg, prompts, gen_len, record_logits)
        t = self.seqs.t
        if t > rc.prompt_len or gen_len > rc.gen_len:
            raise ValueError(f"prompts of up to {t} tokens + {gen_len} generated exceed the planned "
                             f"{rc.prompt_len} + {rc.gen_len}: plan with the real lengths")
        slots = cfg.layer_slots(rc.kv.slots(t, gen_len, cfg.num_layers))  # per layer: windowed ones hold fewer
        cache = KVCache(eng.tiers, rc.placement.cache, rc.gpu_batch_size, cfg.kv_heads, slots, cfg.head_dim,
                        rc.dtype, rc.compress_cache)
        self.bufs = Buffers(eng.weights, cache, eng.tiers, rc.placement.activations, eng.device)
        evicts = rc.kv.evicts(t, gen_len, cfg.num_layers)
        self.plan = plan.start(eng.policy, rc, self.seqs, pipe)
        self.steps = self.plan.steps(rc, gen_len)  # the schedule's (a row source taking requests may run more)
        self.layers = LayerCompute(models.family(cfg), cfg, rc, eng.policy, slots, evicts)
        self.times: list = []
        self.freed = FreedMemory()

    # ---- the schedule's ops -------------------------------------------------------------------------------
    def load_weight(self, op: Op) -> None:
        self.bufs.load_weights(op.layer, op.step, self.rc.compute_at(op.step))

    def free_weight(self, op: Op) -> None:
        self.bufs.free_weights(op.layer)
        last = self.cfg.num_layers + 1 if self.pipe is None else self.pipe.stage.stop - 1  # a stage's own last
        if checked_after(op.step, op.layer, last):
            self.freed.check()  # free memory gathered in the heaps leaves the process (storage/freed_memory.py)

    def load_cache(self, op: Op) -> None:
        if op.step == 0:
            return  # prefill builds the block
        on_cpu = self.rc.cpu_cache_compute and self.rc.placement.cache[op.cache_layer][op.batch] == "cpu"
        self.bufs.load_block(op.layer, op.batch, op.cache_layer, torch.device("cpu") if on_cpu else self.eng.device)

    def store_cache(self, op: Op) -> None:
        self.bufs.store_block(op.layer, op.batch, op.cache_layer)

    def load_act(self, op: Op) -> None:
        self.bufs.load_act(op.batch)

    def store_act(self, op: Op) -> None:
        self.bufs.store_act(op.batch)

    def compute(self, op: Op) -> None:
        """A compute op, as the run's plan runs it (BatchPlan.compute: compute_batch, unless a row source adds)."""
        self.plan.compute(self, op)

    def compute_batch(self, op: Op) -> None:
        """A compute op over the rows the plan computes: embedding, prefill, a decode step or the head."""
        step, layer, batch, bufs, plan = op.step, op.layer, op.batch, self.bufs, self.plan
        if self.pipe is not None and self.pipe.feeds(op):
            self._receive(op)
        ids, pos = plan.rows(step, *self.seqs.inputs(step, batch, self.eng.device))  # the rows computed
        w = bufs.weights_of(layer)
        if layer == 0:
            bufs.a[batch] = self.layers.embed(w, ids, pos)
        elif op.cache_layer < 0:
            self._emit(step, batch, plan.logits(step, self.layers.head(w, bufs.a.pop(batch))))
        elif step == 0:
            bufs.a[batch], blk = plan.prefill(self.layers, w, op.cache_layer, bufs.a[batch], pos)
            bufs.put_block(layer, batch, blk)
        else:
            bufs.a[batch] = plan.decode(self.layers, w, op.cache_layer, bufs.a[batch], pos, bufs.block(layer, batch))

    # ---- a pipeline stage's messages: the hidden states of its last layer, or the head's tokens --------------
    def recv(self, op: Op) -> None:
        """Post the receive of compute `op`'s output (of the previous stage) into a buffer of its shape."""
        b = self.rc.gpu_batch_size
        if op.layer == self.cfg.num_layers + 1:
            self.pipe.post(op, (b,), torch.long)
        else:
            self.pipe.post(op, (b, self.seqs.t if op.step == 0 else 1, self.cfg.hidden), self.rc.compute_at(op.step))

    def send(self, op: Op) -> None:
        head = op.layer == self.cfg.num_layers + 1
        self.pipe.send(op, self.seqs.tokens[op.batch, :, op.step] if head else self.bufs.a.pop(op.batch))

    def _receive(self, op: Op) -> None:
        x = self.pipe.take(op)
        if op.layer == 0:
            self.seqs.tokens[op.batch, :, op.step - 1] = x.cpu()  # the tokens the last stage emitted
        else:
            self.bufs.a[op.batch] = x

    def _emit(self, step: int, batch: int, logits: torch.Tensor) -> None:
        self.seqs.emit(step, batch, logits, self.sampler)
        if batch == self.rc.num_gpu_batches - 1:
            if self.eng.device.type == "cuda":
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())
            if self.on_step:
                self.on_step(step)

    @staticmethod
    def _compute_inputs(op: Op) -> list:
        bufs = [("w", op.layer), ("a", op.batch)]
        if op.cache_layer >= 0:
            bufs.append(("c", op.layer, op.batch))
        return bufs

    def execute(self, kept_stats: bool) -> Generation:
        handlers = {LOAD_WEIGHT: self.load_weight, FREE_WEIGHT: self.free_weight, LOAD_CACHE: self.load_cache,
                    STORE_CACHE: self.store_cache, LOAD_ACT: self.load_act, STORE_ACT: self.store_act,
                    COMPUTE: announcing_decode(self.compute), SEND: self.send, RECV: self.recv}
        L, nb = self.cfg.num_layers, self.rc.num_gpu_batches
        ops = (self.pipe.schedule(self.steps, nb, lambda layer: 1 <= layer <= L) if self.pipe is not None
               else block_schedule(self.steps, L + 2, nb, lambda layer: 1 <= layer <= L))
        ops = until(ops, self.stop_when) if self.stop_when is not None and self.pipe is None else ops
        ex = Executor(handlers, self.rc.overlap, self.rc.io_threads, self.rc.device, self._compute_inputs,
                      inline=(SEND, RECV))
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                ex.run(ops)
            if self.pipe is not None:
                self.pipe.close()
            kept = self._kept() if kept_stats else {}
        finally:
            self.bufs.cache.close()
            self.bufs.close()
        s, times = self.seqs, self.times or [time.perf_counter()]  # a stage without the head emits no steps
        return Generation(s.flat(s.tokens), s.flat(s.last_logits), times[0] - start, times[-1] - times[0],
                          [s.flat(x) for x in s.step_logits] if s.step_logits else None, kept, ex.busy_s,
                          ex.decode_busy_s)

    def _kept(self) -> dict:
        """Cache layer -> the most tokens any row keeps (reads every block back: for tests and reports only)."""
        out: dict = {}
        for layer, row in enumerate(self.rc.placement.cache):  # a pipeline stage holds only its own layers
            for batch in range(len(row)):
                blk = self.bufs.cache.load(layer, batch, torch.device("cpu"))
                out[layer] = max(out.get(layer, 0), int(blk.kept().max()))
        return out
