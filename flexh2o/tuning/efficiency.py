"""A step's work against the machine's limits, beside the cost model (as nanoGPT's estimate_mfu sits beside its
model): per phase, the FLOPs of one generation step over all sequences and the bytes it moves over each link, and
the profile's peak rates for them. metrics.RunReport divides them by the measured step times (`efficiency`).

FLOPs: 2 per matmul weight element and row (the embedding's lookups are none; the head multiplies each sequence's
last token only), and the attention's q.k and p.v, 4 x head_dim per query and key it attends (prefill: causal,
t (t + 1) / 2 pairs a head; decode: the slots a layer's cache block holds, an upper bound while a full cache
fills). Bytes per step: weights homed on disk are read once a step ("disk"), as are the cache blocks homed there
(decode: read and written back); on CUDA the weights and cache blocks homed on the cpu tier cross to the device
("h2d"); and the matmuls read every weight once per GPU batch in the compute dtype, and decode reads every cache
block, from the compute side's memory ("mem"). Peaks: the largest matmul rate the profile measured for the phase's
compute dtype (any row count), and its disk read, host-to-device and memory bandwidths.
"""
from __future__ import annotations

from collections import Counter
from typing import Optional

import torch

from flexh2o.kv.layout import CacheLayout
from flexh2o.planning.weight_layout import layout_of
from flexh2o.run_config import RunConfig
from flexh2o.tuning.hardware import Rates
from flexh2o.weights.forms import is_lookup

LINKS = ("disk", "h2d", "mem")


def step_flops(rc: RunConfig, prefill: bool) -> float:
    """FLOPs of one prefill or decode step over all rc.num_seqs sequences (module docstring)."""
    _, params2d, _, _ = layout_of(rc, None)
    cfg, n = rc.model, rc.num_seqs
    t = rc.prompt_len if prefill else 1
    body = sum(params2d[:-1])  # embedding layer (project_in, if any) and decoder blocks: every token
    flops = 2.0 * n * (t * body + params2d[-1])  # the head: each sequence's last token
    d, heads = cfg.head_dim, cfg.num_heads
    if prefill:
        return flops + cfg.num_layers * n * heads * 2.0 * d * t * (t + 1)
    return flops + sum(4.0 * n * heads * d * lay.slots for lay in CacheLayout.layers_of_run(rc))


def decode_matmuls(rc: RunConfig) -> Counter:
    """(out, in) -> how many weights of that shape one decode step multiplies, each by rc.gpu_batch_size rows:
    the matmuls step_flops counts (every 2-D weight but the embedding's tables, once per GPU batch)."""
    counts: Counter = Counter()
    for i, layer in enumerate(rc.placement.weights.layer_specs):
        for s in layer:
            if len(s.shape) == 2 and not is_lookup(i, s):
                counts[tuple(s.shape)] += rc.num_gpu_batches
    return counts


def step_bytes(rc: RunConfig, prefill: bool) -> dict:
    """link -> bytes one step moves over it (module docstring)."""
    weights, params2d, _, _ = layout_of(rc, None)
    cuda = torch.device(rc.device).type == "cuda"
    out = dict.fromkeys(LINKS, 0.0)
    for layer in weights:
        for tier, nbytes, _, _ in layer:
            if tier == "disk":
                out["disk"] += nbytes
            if cuda and tier != "gpu":
                out["h2d"] += nbytes
    compute = rc.compute_at(0 if prefill else 1)
    out["mem"] = float(sum(params2d)) * compute.itemsize * rc.num_gpu_batches
    blocks = CacheLayout.layers_of_run(rc)
    for layer, row in enumerate(rc.placement.cache_counts()):
        for tier, count in row:
            nbytes = count * blocks[layer].nbytes
            if tier == "disk":
                out["disk"] += nbytes if prefill else 2 * nbytes  # prefill writes; decode reads and writes back
            if cuda and tier == "cpu" and not prefill and not rc.cpu_cache_compute:
                out["h2d"] += nbytes
            if not prefill:
                out["mem"] += nbytes
    return out


def peaks(rc: RunConfig, hw: dict) -> dict:
    """The profile's peak rates: phase -> matmul FLOP/s of its compute dtype, and link -> bytes/s (None: none)."""
    out = {}
    for phase, step in (("prefill", 0), ("decode", 1)):
        r = Rates.from_profile(hw, rc.compute_at(step))
        out[phase] = max([r.matmul, r.decode_matmul] + [f for _, f in r.matmul_by_rows])
    r = Rates.from_profile(hw, rc.compute)
    out.update(disk=r.disk_read, h2d=r.h2d, mem=r.gpu_mem if torch.device(rc.device).type == "cuda" else r.cpu_mem)
    return out


def step_work(rc: RunConfig, hw: Optional[dict]) -> dict:
    """{'prefill': {'flops', 'bytes': {link: bytes}, 'dtype'}, 'decode': {...}, 'peaks': peaks(rc, hw)} of one
    step of each phase (no 'peaks' without a profile): what metrics.efficiency compares with the measured steps."""
    out = {phase: {"flops": step_flops(rc, phase == "prefill"), "bytes": step_bytes(rc, phase == "prefill"),
                   "dtype": str(rc.compute_at(step)).replace("torch.", "")}
           for phase, step in (("prefill", 0), ("decode", 1))}
    if hw is not None:
        out["peaks"] = peaks(rc, hw)
    return out
