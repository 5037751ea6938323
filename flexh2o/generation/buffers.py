"""Compute-side buffers of the block schedule, keyed by Op.buffer: a layer's weights, a (layer, batch) cache
block, a batch's hidden states. Working bytes taken from the gpu tier are charged and refunded here only."""
from __future__ import annotations

import torch

from flexh2o.kv.cache import KVBlock, KVCache


class Buffers:
    def __init__(self, weights, cache: KVCache, tiers: dict, act_homes: tuple, device: torch.device):
        self.weights, self.cache, self.tiers = weights, cache, tiers  # weights: a WeightStore and its WeightForms
        self.act_homes, self.device = act_homes, device
        self.w: dict = {}  # layer -> (name -> tensor, bytes copied)
        self.c: dict = {}  # (layer, batch) -> KVBlock on the compute side
        self.a: dict = {}  # batch -> hidden states on the compute side
        self.spilled: dict = {}  # batch -> handle of hidden states stored in a non-gpu tier

    # ---- weights --------------------------------------------------------------------------------------------
    def load_weights(self, layer: int, step: int, dtype: torch.dtype) -> None:
        """A layer's weights on the compute side in `dtype` (the compute dtype of the step they serve), in the int4
        kernel's form where that step's phase runs it (the store's WeightForms)."""
        phase = "prefill" if step == 0 else "decode"
        tensors, copied = self.weights.load_layer(layer, self.device, dtype, phase)
        self.tiers["gpu"].charge(copied)
        self.w[layer] = (tensors, copied)

    def weights_of(self, layer: int) -> dict:
        return self.w[layer][0]

    def free_weights(self, layer: int) -> None:
        tensors, copied = self.w.pop(layer)
        self.tiers["gpu"].refund(copied)
        self.weights.release(tensors)

    # ---- cache blocks ---------------------------------------------------------------------------------------
    def load_block(self, layer: int, batch: int, cache_layer: int, device) -> None:
        self.c[layer, batch] = self.cache.load(cache_layer, batch, device)

    def put_block(self, layer: int, batch: int, blk: KVBlock) -> None:
        self.c[layer, batch] = blk

    def block(self, layer: int, batch: int) -> KVBlock:
        return self.c[layer, batch]

    def store_block(self, layer: int, batch: int, cache_layer: int) -> None:
        self.cache.store(cache_layer, batch, self.c.pop((layer, batch)))

    # ---- activations ----------------------------------------------------------------------------------------
    def load_act(self, batch: int) -> None:
        h = self.spilled.pop(batch, None)
        if h is not None:
            tier = self.tiers[self.act_homes[batch]]
            self.a[batch] = tier.load(h, self.device)  # in the dtype they were computed in
            tier.free(h)

    def store_act(self, batch: int) -> None:
        """Spill a batch's hidden states to their home tier (kept on the compute device when that is the gpu)."""
        tier = self.tiers[self.act_homes[batch]]
        if tier.name == "gpu" or batch not in self.a:
            return
        x = self.a.pop(batch)
        h = tier.alloc(tuple(x.shape), x.dtype)
        tier.store(h, x)
        self.spilled[batch] = h

    def close(self) -> None:
        for layer in list(self.w):  # a run stopped early (generate's stop_when) leaves its prefetched weights
            self.free_weights(layer)
        for batch, h in self.spilled.items():
            self.tiers[self.act_homes[batch]].free(h)
        self.spilled = {}
