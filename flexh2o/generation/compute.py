"""A layer's compute for one GPU batch: embedding, a decoder block (prefill in bounded sub-batches, or once for
copies of the same prompts, or one decode step with the cache attended in place), or the head. Which rows are
computed is the run's batch plan's to say (generation/batch_plan.py)."""
from __future__ import annotations

from typing import Optional

import torch

from flexh2o.kv import prefill as kv_prefill
from flexh2o.kv.cache import KVBlock
from flexh2o.kv.decode import DecodePath
from flexh2o.kv.policies.base import KVPolicy
from flexh2o.kv.policies.copies import PromptCopies
from flexh2o.kv.step_rows import StepRows

STEPS_KEPT = 64  # decode steps' positions remembered (the GPU batches of the step now computed are enough)


class LayerCompute:
    """Calls the model family's pure functions; `attend` callbacks own the cache block of the (layer, batch)."""

    def __init__(self, family, cfg, rc, policy: KVPolicy, slots: tuple, evicts: bool):
        self.family, self.cfg, self.rc, self.policy = family, cfg, rc, policy
        self.slots, self.evicts = slots, evicts  # slots: per decoder layer (ModelConfig.layer_slots)
        self._steps: dict = {}  # id(pos of a decode step) -> (pos, what step_positions derives from it)
        self._paths: dict = {}  # decoder layer -> its DecodePath, made once a run (decode_path)

    def shape(self, layer: int) -> tuple:
        """The model's facts of a layer's attention: (sliding window or None, logit soft-cap or None)."""
        return self.cfg.window(layer), self.cfg.attn_softcap

    def decode_path(self, layer: int) -> DecodePath:
        """How decoder layer `layer`'s decode steps run (kv/decode.py), chosen once a run from the layer's facts,
        whether the run evicts and whether its cache is quantized."""
        path = self._paths.get(layer)
        if path is None:
            path = self._paths[layer] = DecodePath.of(*self.shape(layer), self.evicts,
                                                      self.rc.compress_cache is not None)
        return path

    def decode_attend(self, layer: int, q, k, v, cur, blk: KVBlock, policy: KVPolicy, at: StepRows):
        """One decode step's attention of decoder layer `layer` over `blk` (its path: decode_path)."""
        return self.decode_path(layer)(q, k, v, cur, blk, policy, layer, at)

    def prefill_attend(self, layer: int, q, k, v, pos, blk: KVBlock):
        """Prefill attention of decoder layer `layer`, the kept tokens packed into `blk` (kv/prefill.py)."""
        return kv_prefill.prefill(q, k, v, pos, self.policy, layer, blk, self.rc.attn_chunk, self.evicts,
                                  *self.shape(layer))

    def embed(self, w: dict, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.family.embed(self.cfg, w, ids, pos.clamp(min=0))

    def head(self, w: dict, x: torch.Tensor) -> torch.Tensor:
        """Logits (b, vocab) of each row's last position."""
        return self.family.head(self.cfg, w, x[:, -1:])[:, 0]

    def decode(self, w: dict, cache_layer: int, x: torch.Tensor, pos: torch.Tensor, blk: KVBlock,
               policy: Optional[KVPolicy] = None) -> torch.Tensor:
        """One token per row: x (b, 1, h), pos (b, 1); the block gets the new K/V and loses at most one token.
        policy: the policy of these rows when they are not the whole batch (LanePolicy.first_rows)."""
        policy = self.policy if policy is None else policy
        clamped, cur, at = self.step_positions(pos)

        def attend(q, k, v):
            return self.decode_attend(cache_layer, q, k, v, cur, blk, policy, at)
        return self.family.block(self.cfg, w, cache_layer, x, clamped, attend)

    def step_positions(self, pos: torch.Tensor) -> tuple:
        """pos (b, 1) of a decode step -> (pos clamped at 0, pos (b,), its values as a kv/step_rows.StepRows): every
        layer of a step is handed the same tensor per GPU batch (Sequences.inputs), so they are derived once a step
        and batch (the zig-zag schedule's layers take the batches in turn), and the StepRows keeps what the layers
        derive alike from the positions. On CUDA the list is one read a step and GPU batch, made after the previous
        step's logits were read (Sequences.emit), so the device has little left to finish; it spares every layer a
        search for the free slot and four indexed writes."""
        got = self._steps.get(id(pos))
        if got is None or got[0] is not pos:
            if len(self._steps) >= STEPS_KEPT:  # earlier steps': their tensors are no longer handed out
                self._steps.clear()
            cur = pos[:, 0]
            got = self._steps[id(pos)] = pos, (pos.clamp(min=0), cur, StepRows(cur.tolist()))
        return got[1]

    def prefill(self, w: dict, cache_layer: int, x: torch.Tensor, pos: torch.Tensor) -> tuple:
        """x (b, t, h), pos (b, t) -> (output (b, t, h), a fresh block holding each row's kept tokens). Rows are
        run in sub-batches of rc.prefill_rows() so transient buffers stay bounded whatever the batch; each
        sub-batch's output is copied into the layer's output as it comes (one sub-batch's beside the input and the
        output, as the memory plan counts them: not every sub-batch's and then their join)."""
        b = x.shape[0]
        blk = self.empty_block(b, cache_layer, x.device)
        out, rows = None, self.rc.prefill_rows()
        for r in range(0, b, rows):
            sl = slice(r, r + rows)

            def attend(q, k, v, sl=sl):
                return self.prefill_attend(cache_layer, q, k, v, pos[sl], blk.rows(sl))
            part = self.family.block(self.cfg, w, cache_layer, x[sl], pos[sl].clamp(min=0), attend)
            if rows >= b:
                return part, blk
            if out is None:
                out = torch.empty((b,) + tuple(part.shape[1:]), dtype=part.dtype, device=part.device)
            out[sl] = part
        return out, blk

    def prefill_copies(self, w: dict, cache_layer: int, x: torch.Tensor, pos: torch.Tensor, copies: int) -> tuple:
        """prefill of one copy of the rows for `copies` copies over the same prompts (a LanePlan): the block has
        copies x b rows (kv/policies/copies.py), the output stays b rows and the rows run in one piece."""
        blk = self.empty_block(x.shape[0] * copies, cache_layer, x.device)
        rows, (window, softcap) = PromptCopies(copies), self.shape(cache_layer)

        def attend(q, k, v):  # attention once over the b rows; each copy keeps its tokens with its own scores
            scored = self.evicts and self.policy.needs_scores
            weights, which = rows.weights(self.policy, pos) if scored else (None, rows.unscored(q.device))
            out, score = kv_prefill.attend(q, k, v, pos, weights, self.rc.attn_chunk, window, softcap)
            kv_prefill.keep(rows.rows(k), rows.rows(v), rows.rows(pos), rows.scores(score, which), self.policy,
                            cache_layer, blk, window, self.evicts)
            return out
        return self.family.block(self.cfg, w, cache_layer, x, pos.clamp(min=0), attend), blk

    def empty_block(self, rows: int, cache_layer: int, device) -> KVBlock:
        """A fresh block of `rows` rows for decoder layer `cache_layer` (its slots, the run's dtype and cache form)."""
        return KVBlock.empty(rows, self.cfg.kv_heads, self.slots[cache_layer], self.cfg.head_dim, self.rc.dtype,
                             device, self.rc.compress_cache)
