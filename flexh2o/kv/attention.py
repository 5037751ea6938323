"""Attention over a KV block, with the block's policy applied: prefill (kv/prefill.py: attend, then keep) and one
decode step (kv/decode.py: append, attend, evict, along a DecodePath chosen once per run and layer).

A run's LayerCompute (generation/compute.py) holds its layers' paths; `decode` here takes one step alone along the
path a run of the same facts would take (a test, a tool). Grouped heads: query head n reads KV head n // group.
Probabilities are accumulated per KV head, summed over the query heads of its group, in fp32.
"""
from __future__ import annotations

from typing import Optional

import torch

from flexh2o.compress.form import as_form
from flexh2o.kv.cache import KVBlock
from flexh2o.kv.decode import DecodePath
from flexh2o.kv.policies.base import KVPolicy
from flexh2o.kv.prefill import pack as _pack, prefill  # noqa: F401  (named here for their callers)
from flexh2o.kv.sdpa import CUDA_SDPA, prefill_chunk, sdpa  # noqa: F401
from flexh2o.kv.step_rows import StepRows


def decode(q, k, v, cur_pos, blk: KVBlock, policy: KVPolicy, layer: int, window: Optional[int] = None,
           softcap: Optional[float] = None, evicts: bool = True, at: Optional[StepRows] = None) -> torch.Tensor:
    """One new token (q (b, n, 1, d), k/v (b, kv, 1, d), cur_pos (b,) -> out (b, n, 1, d)) along the DecodePath of
    a layer with this window and soft-cap in a run that evicts (`evicts`) and holds its cache as `blk` does."""
    path = DecodePath.of(window, softcap, evicts, as_form(blk.k).quantized)
    return path(q, k, v, cur_pos, blk, policy, layer, at)
