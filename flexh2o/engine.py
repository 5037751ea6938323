"""Engine: wires tiers, weights, the KV cache, the policy and the block schedule; `generate` runs one batch job."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from flexh2o import models
from flexh2o.kv import attention
from flexh2o.kv.cache import KVBlock, KVCache
from flexh2o.planning.memory_plan import plan_memory
from flexh2o.placement import block_homes
from flexh2o.run_config import RunConfig
from flexh2o.sampling import Sampler
from flexh2o.schedule.plan import (COMPUTE, FREE_WEIGHT, LOAD_ACT, LOAD_CACHE, LOAD_WEIGHT, STORE_ACT,
                                   STORE_CACHE, block_schedule)
from flexh2o.schedule.run import Executor
from flexh2o.storage.factory import make_tiers
from flexh2o.weights.store import WeightStore


@dataclass
class Generation:
    """What `generate` returns: tokens (num_seqs, gen_len), last-step logits (num_seqs, vocab), timings."""

    tokens: torch.Tensor
    last_logits: torch.Tensor
    prefill_s: float
    decode_s: float
    step_logits: Optional[list] = None  # per step, (num_seqs, vocab), when asked for
    kept: dict = field(default_factory=dict)  # layer -> max tokens kept per row after the last step


class Engine:
    """Holds the weights in their tiers for the engine's lifetime; use as a context manager (cleans up files)."""

    def __init__(self, rc: RunConfig, on_progress: Optional[Callable] = None):
        plan = plan_memory(rc)
        plan.check()
        self.rc, self.cfg, self.plan = rc, rc.model, plan
        self.family = models.family(rc.model)
        self.device = torch.device(rc.device)
        self.tiers = make_tiers(rc, need_disk=plan.total("disk") > 0)
        self.weights = None
        try:
            self.weights = WeightStore(rc.model, self.tiers, rc.percent.shares("weights"), rc.dtype,
                                       rc.compress_weight)
            if rc.path == "_DUMMY_":
                self.weights.fill_dummy(rc.seed, on_progress)
            else:
                from flexh2o.weights.format import CheckpointReader
                self.weights.fill_from(CheckpointReader(rc.path), on_progress)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.weights is not None:
            self.weights.close()
            self.weights = None
        for tier in self.tiers.values():
            tier.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def generate(self, prompts: list, gen_len: int, sampler: Optional[Sampler] = None,
                 forced: Optional[torch.Tensor] = None, record_logits: bool = False,
                 on_step: Optional[Callable] = None) -> Generation:
        """prompts: num_seqs lists of token ids (left-padded here). forced (num_seqs, gen_len): feed these tokens
        instead of the sampled ones (teacher forcing, for perplexity)."""
        run = _Run(self, prompts, gen_len, sampler or Sampler(), forced, record_logits, on_step)
        return run.execute()


class _Run:
    """State of one generate() call: buffers of the block schedule and per-batch token state."""

    def __init__(self, eng: Engine, prompts, gen_len, sampler, forced, record_logits, on_step):
        rc = eng.rc
        b, nb = rc.gpu_batch_size, rc.num_gpu_batches
        if len(prompts) != b * nb:
            raise ValueError(f"{len(prompts)} prompts given for {b} x {nb} sequences")
        self.eng, self.rc, self.cfg, self.gen_len = eng, rc, eng.cfg, gen_len
        self.sampler, self.forced, self.on_step = sampler, forced, on_step
        self.policy = rc.policy()
        self.t = max(len(p) for p in prompts)
        if self.t > rc.prompt_len or gen_len > rc.gen_len or min(map(len, prompts)) < 1:
            raise ValueError(f"prompts of up to {self.t} tokens + {gen_len} generated exceed the planned "
                             f"{rc.prompt_len} + {rc.gen_len} (or a prompt is empty): plan with the real lengths")
        ids = torch.full((b * nb, self.t), self.cfg.pad_token_id, dtype=torch.long)
        pos = torch.full((b * nb, self.t), -1, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, self.t - len(p):] = torch.tensor(p, dtype=torch.long)
            pos[i, self.t - len(p):] = torch.arange(len(p))
        self.ids, self.pos = ids.view(nb, b, self.t), pos.view(nb, b, self.t)
        self.lens = (self.pos[:, :, -1] + 1)  # (nb, b) real prompt lengths
        self.tokens = torch.zeros(nb, b, gen_len, dtype=torch.long)
        self.last_logits = torch.zeros(nb, b, self.cfg.vocab)
        self.step_logits = [torch.zeros(nb, b, self.cfg.vocab) for _ in range(gen_len)] if record_logits else None
        self.wbuf, self.cbuf, self.dirty, self.abuf, self.ahandles = {}, {}, {}, {}, {}
        self.act_homes = block_homes(1, nb, rc.percent.shares("activations"))[0]
        slots = self.policy.slots(self.t, gen_len)
        self.cache = KVCache(eng.tiers, block_homes(self.cfg.num_layers, nb, rc.percent.shares("cache")),
                             b, self.cfg.kv_heads, slots, self.cfg.head_dim, rc.dtype, rc.compress_cache)
        self.slots = slots
        self.times = []

    # ---- the schedule's ops -------------------------------------------------------------------------------
    def load_weight(self, op):
        self.wbuf[op.layer], copied = self.eng.weights.load_layer(op.layer, self.eng.device, self.rc.compute)
        self.eng.tiers["gpu"].charge(copied)
        self.wbuf[op.layer, "copied"] = copied

    def free_weight(self, op):
        self.eng.tiers["gpu"].refund(self.wbuf.pop((op.layer, "copied")))
        self.eng.weights.release(self.wbuf.pop(op.layer))

    def load_cache(self, op):
        if op.step == 0:
            return  # prefill builds the block
        device = torch.device("cpu") if self._attend_on_cpu(op.layer - 1, op.batch) else self.eng.device
        self.cbuf[op.layer, op.batch] = self.cache.load(op.layer - 1, op.batch, device)

    def store_cache(self, op):
        blk = self.cbuf.pop((op.layer, op.batch))
        self.cache.store(op.layer - 1, op.batch, blk, self.dirty.pop((op.layer, op.batch)))

    def load_act(self, op):
        tier = self.eng.tiers[self.act_homes[op.batch]]
        h = self.ahandles.pop(op.batch, None)
        if h is not None:
            self.abuf[op.batch] = tier.load(h, self.eng.device, self.rc.compute)
            tier.free(h)

    def store_act(self, op):
        tier = self.eng.tiers[self.act_homes[op.batch]]
        if tier.name == "gpu" or op.layer == self.cfg.num_layers + 1:
            return  # stays on the compute device (or is consumed by the head)
        x = self.abuf.pop(op.batch)
        h = tier.alloc(tuple(x.shape), x.dtype)
        tier.store(h, x)
        self.ahandles[op.batch] = h

    def compute(self, op):
        step, layer, batch = op.step, op.layer, op.batch
        ids, pos = self._inputs(step, batch)
        w = self.wbuf[layer]
        if layer == 0:
            self.abuf[batch] = self.eng.family.embed(self.cfg, w, ids, pos.clamp(min=0))
        elif layer <= self.cfg.num_layers:
            self.abuf[batch] = self._block(step, layer, batch, w, pos)
        else:
            logits = self.eng.family.head(self.cfg, w, self.abuf.pop(batch)[:, -1:])[:, 0]  # (b, vocab)
            self._emit(step, batch, logits)

    # ---- helpers -------------------------------------------------------------------------------------------
    def _inputs(self, step: int, batch: int) -> tuple:
        dev = self.eng.device
        if step == 0:
            return self.ids[batch].to(dev), self.pos[batch].to(dev)
        prev = self.tokens[batch, :, step - 1:step]
        return prev.to(dev), (self.lens[batch] + step - 1).view(-1, 1).to(dev)

    def _block(self, step, layer, batch, w, pos):
        """A decoder layer for one GPU batch; prefill runs it over sub-batches of rows so its transient
        buffers stay bounded, packing each sub-batch's kept tokens into its rows of one fresh cache block."""
        x, fam = self.abuf[batch], self.eng.family
        if step > 0:
            def attend(q, k, v):
                out, slot = attention.decode(q, k, v, pos[:, 0], self.cbuf[layer, batch], self.policy, layer - 1)
                self.dirty[layer, batch] = slot
                return out
            return fam.block(self.cfg, w, layer - 1, x, pos.clamp(min=0), attend)
        b = x.shape[0]
        blk = KVBlock.empty(b, self.cfg.kv_heads, self.slots, self.cfg.head_dim, self.rc.dtype, x.device,
                            self.rc.compress_cache)
        scores = self.slots < self.t + self.gen_len  # an eviction can happen
        outs, rows = [], self.rc.prefill_rows()
        for r in range(0, b, rows):
            sl = slice(r, r + rows)

            def attend(q, k, v, sl=sl):
                return attention.prefill(q, k, v, pos[sl], self.policy, layer - 1, blk.rows(sl), self.rc.attn_chunk,
                                         scores)
            outs.append(fam.block(self.cfg, w, layer - 1, x[sl], pos[sl].clamp(min=0), attend))
        self.cbuf[layer, batch], self.dirty[layer, batch] = blk, None
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _attend_on_cpu(self, cache_layer: int, batch: int) -> bool:
        return self.rc.cpu_cache_compute and self.cache.homes[cache_layer][batch] == "cpu"

    def _emit(self, step, batch, logits):
        logits = logits.float().cpu()
        self.last_logits[batch] = logits
        if self.step_logits is not None:
            self.step_logits[step][batch] = logits
        if self.forced is not None:
            nxt = self.forced.view(*self.tokens.shape)[batch, :, step]
        else:
            nxt = self.sampler(logits)
        self.tokens[batch, :, step] = nxt
        if batch == self.rc.num_gpu_batches - 1:
            if self.eng.device.type == "cuda":
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())
            if self.on_step:
                self.on_step(step)

    def _compute_inputs(self, op):
        bufs = [("w", op.layer), ("a", op.batch)]
        if 1 <= op.layer <= self.cfg.num_layers:
            bufs.append(("c", op.layer, op.batch))
        return bufs

    def execute(self) -> Generation:
        handlers = {LOAD_WEIGHT: self.load_weight, FREE_WEIGHT: self.free_weight, LOAD_CACHE: self.load_cache,
                    STORE_CACHE: self.store_cache, LOAD_ACT: self.load_act, STORE_ACT: self.store_act,
                    COMPUTE: self.compute}
        L = self.cfg.num_layers
        ops = block_schedule(self.gen_len, L + 2, self.rc.num_gpu_batches, lambda layer: 1 <= layer <= L)
        ex = Executor(handlers, self.rc.overlap, self.rc.io_threads, self.rc.device, self._compute_inputs)
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                ex.run(ops)
            kept = self._kept()
        finally:
            self.cache.close()
            for batch, h in self.ahandles.items():
                self.eng.tiers[self.act_homes[batch]].free(h)
        n = self.rc.num_seqs
        return Generation(self.tokens.view(n, -1), self.last_logits.view(n, -1), self.times[0] - start,
                          self.times[-1] - self.times[0],
                          [x.view(n, -1) for x in self.step_logits] if self.step_logits else None, kept)

    def _kept(self) -> dict:
        out = {}
        for layer in range(self.cfg.num_layers):
            for batch in range(self.rc.num_gpu_batches):
                blk = self.cache.load(layer, batch, torch.device("cpu"))
                out[layer] = max(out.get(layer, 0), int(blk.kept().max()))
        return out
