"""Cost model: predicted prefill and per-token decode time of a RunConfig on a hardware profile (pure Python).

Each generation step walks every layer once (0 = embedding, 1..L decoder blocks, L+1 = head): the layer's weights
are loaded once for all GPU batches, then per batch its cache block is loaded, attended over and stored back.
Seconds are charged to the resource that does the work:
  disk      weight reads, cache block reads and whole-block rewrites, activation spills (one device: they add up)
  h2d, d2h  host <-> device copies (CUDA only; PCIe is full duplex, so the two directions are separate resources)
  compute   matmuls, attention, per-op overhead; on a CPU-only run also the host memory passes (dtype conversion,
            cache copies), since they share the cores and the memory bus
  cpu       host-side decode attention next to a cpu-tier cache (--cpu-cache-compute on CUDA)
With overlap each layer takes as long as its busiest resource (the schedule prefetches the next layer's weights and
the next batch's cache while computing); without overlap it takes the sum. A phase sums its layers.
Throughput is FlexGen's: generated tokens (num_seqs x gen_len) / (prefill + decode).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from flexh2o.memory_plan import MemoryPlan, cache_block_bytes, plan_memory
from flexh2o.models import layer_specs
from flexh2o.placement import block_homes, weight_homes
from flexh2o.run_config import RunConfig

ALIGN = 4096  # the disk tier pads every file to this
OPS = {"embed": 11, "block": 63, "head": 19, "evict": 22, "chunk": 12}  # aten ops per (layer, batch) compute
ATT_PASSES = 7  # read+write passes over each fp32 attention probability (scale, mask, softmax, casts, scores)
POLICY_BYTES = {False: 24, True: 64}  # bytes touched per cached slot by slot/mask bookkeeping (evicting or not)


@dataclass(frozen=True)
class Rates:
    """The profile's figures for one compute dtype (per second). h2d/d2h None: host and device share memory."""

    matmul: float
    decode_matmul: float
    attention: float
    decode_attention: float
    gpu_mem: float
    cpu_mem: float
    convert: float
    h2d: Optional[float]
    d2h: Optional[float]
    disk_read: Optional[float]
    disk_write: Optional[float]
    cpu_flops: float
    op_overhead: float

    @staticmethod
    def from_profile(hw: dict, dtype: torch.dtype) -> "Rates":
        """Rates for `dtype` from a profile dict; per-dtype figures may be {dtype name: value} or one number."""
        name = str(dtype).replace("torch.", "")

        def f(*keys: str, default: Optional[float] = None) -> Optional[float]:
            for key in keys:
                v = _figure(hw, key, name)
                if v is not None:
                    return v
            return default
        mm, cpu_mem = f("matmul_flops"), f("cpu_mem_bw")
        if mm is None or cpu_mem is None:
            raise ValueError(f"hardware profile {hw.get('name', '?')} needs at least matmul_flops and cpu_mem_bw")
        return Rates(mm, f("decode_matmul_flops", default=mm), f("attention_flops", default=mm),
                     f("decode_attention_flops", "attention_flops", default=mm),
                     f("gpu_mem_bw", default=cpu_mem), cpu_mem, f("convert_bw", default=cpu_mem),
                     f("h2d_bw"), f("d2h_bw"), f("disk_read_bw"), f("disk_write_bw"),
                     f("cpu_flops", default=mm), f("op_overhead_s", default=0.0))


def _figure(hw: dict, key: str, dtype: str) -> Optional[float]:
    v = hw.get(key)
    if isinstance(v, dict):
        if dtype not in v:
            raise ValueError(f"hardware profile {hw.get('name', '?')} has no {key} for {dtype} (it has "
                             f"{', '.join(v)}): run flexh2o-profile --dtype {dtype}")
        v = v[dtype]
    return None if v is None else float(v)


@dataclass
class Prediction:
    """Predicted seconds and throughput; terms[phase][resource.what] in seconds (decode: per token)."""

    prefill_s: float
    decode_s_per_token: float
    decode_s: float
    total_s: float
    total_throughput: float
    prefill_throughput: float
    decode_throughput: float
    terms: dict = field(default_factory=dict)
    bytes: dict = field(default_factory=dict)  # tier -> kind -> bytes, from plan_memory
    bottleneck: dict = field(default_factory=dict)  # phase -> busiest resource

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("prefill_s", "decode_s_per_token", "decode_s", "total_s",
                                              "total_throughput", "prefill_throughput", "decode_throughput",
                                              "bottleneck")}


class _Step:
    """Seconds per resource for one layer of one step, collected as named terms."""

    def __init__(self):
        self.terms: dict = {}

    def add(self, name: str, seconds: float) -> None:
        self.terms[name] = self.terms.get(name, 0.0) + seconds

    def resources(self) -> dict:
        out: dict = {}
        for name, s in self.terms.items():
            res = name.split(".")[0]
            out[res] = out.get(res, 0.0) + s
        return out


def _div(nbytes: float, rate: Optional[float], what: str) -> float:
    if nbytes == 0:
        return 0.0
    if rate is None or rate <= 0:
        raise ValueError(f"the hardware profile has no {what} figure, but this placement needs it")
    return nbytes / rate


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def weight_layout(cfg, shares: tuple, dtype: torch.dtype) -> tuple:
    """Per layer: ((tier, bytes) of each weight, elements of the matrices used in matmuls). Depends only on the
    model, the weight shares and the storage dtype, so a search computes it once per weight split."""
    specs = layer_specs(cfg)
    homes = weight_homes(specs, shares)
    weights, params2d = [], []
    for i, layer in enumerate(specs):
        weights.append(tuple((homes[s.name], s.numel * dtype.itemsize) for s in layer))
        params2d.append(sum(s.numel for s in layer if len(s.shape) == 2 and not (i == 0 and "embed" in s.name)))
    return tuple(weights), tuple(params2d)


class _Model:
    """Everything predict() needs about one RunConfig, computed once."""

    def __init__(self, rc: RunConfig, r: Rates, layout: tuple):
        self.rc, self.r, self.cfg = rc, r, rc.model
        self.cuda = torch.device(rc.device).type == "cuda"
        self.w, self.c = rc.dtype.itemsize, rc.compute.itemsize
        self.weights, self.params2d = layout
        L = self.cfg.num_layers
        rows = block_homes(L, rc.num_gpu_batches, rc.percent.shares("cache"))
        self.cache_counts = [tuple(sorted((t, row.count(t)) for t in set(row))) for row in rows]
        acts = block_homes(1, rc.num_gpu_batches, rc.percent.shares("activations"))[0]
        self.act_counts = {t: acts.count(t) for t in set(acts)}
        self.slots = rc.cache_slots()
        self.block = cache_block_bytes(rc)
        b, kv, s, d = rc.gpu_batch_size, self.cfg.kv_heads, self.slots, self.cfg.head_dim
        self.block_padded = 2 * _padded(b * kv * s * d * self.w) + _padded(b * kv * s * 8) + _padded(b * kv * s * 4)
        self.evicts = rc.budget is not None and self.slots < rc.prompt_len + rc.gen_len

    # ---- per layer ---------------------------------------------------------------------------------------------
    def layer(self, layer: int, prefill: bool) -> _Step:
        st = _Step()
        self.weight_io(st, layer)
        nb = self.rc.num_gpu_batches
        t = self.rc.prompt_len if prefill else 1
        if layer == 0:
            self.matmul(st, self.params2d[0], t, prefill, nb)
            self.overhead(st, OPS["embed"] * nb)
        elif layer <= self.cfg.num_layers:
            self.matmul(st, self.params2d[layer], t, prefill, nb)
            self.elementwise(st, t, nb)
            for tier, n in self.cache_counts[layer - 1]:
                self.cache(st, tier, n, prefill)
            ops = OPS["block"] + (OPS["evict"] if self.evicts else 0)
            if prefill:
                ops += OPS["chunk"] * (-(-t // self.rc.attn_chunk) - 1)
            self.overhead(st, ops * nb)
        else:
            self.matmul(st, self.params2d[layer], 1, False, nb)  # the head sees the last token only
            st.add("compute.sample", nb * _div(4 * self.rc.gpu_batch_size * self.cfg.vocab * 4, self.mem(), "mem"))
            self.overhead(st, OPS["head"] * nb)
        if layer >= 1:
            self.activations(st, t, load=True)
        if layer <= self.cfg.num_layers:
            self.activations(st, t, load=False)
        return st

    def mem(self) -> float:
        return self.r.gpu_mem if self.cuda else self.r.cpu_mem

    def weight_io(self, st: _Step, layer: int) -> None:
        """Weights of one layer, loaded once for all GPU batches, converted to the compute dtype."""
        r = self.r
        for tier, nbytes in self.weights[layer]:
            if tier == "disk":
                st.add("disk.weights_read", _div(_padded(nbytes), r.disk_read, "disk_read_bw"))
            if self.cuda and tier != "gpu":
                st.add("h2d.weights", _div(nbytes, r.h2d, "h2d_bw"))
            if self.w != self.c:  # a memory pass: on the host for a CPU run, on the device otherwise
                rate = r.gpu_mem if self.cuda else r.convert
                st.add("compute.convert_weights", _div(nbytes, rate, "convert_bw"))

    def matmul(self, st: _Step, params: int, t: int, prefill: bool, nb: int) -> None:
        """Dense layers: 2 FLOPs per parameter per token; decode-shaped ones also read the weights once per batch."""
        b, r = self.rc.gpu_batch_size, self.r
        flops = 2 * b * t * params
        if prefill and t > 1:
            sec = flops / r.matmul
        else:
            sec = max(flops / r.decode_matmul, _div(params * self.c, self.mem(), "mem"))
        st.add("compute.matmul", nb * sec)

    def elementwise(self, st: _Step, t: int, nb: int) -> None:
        """Layer norms, residual adds, head merge, activation: ~5 passes over hidden and one over ffn."""
        n = self.rc.gpu_batch_size * t * (5 * self.cfg.hidden + self.cfg.ffn) * self.c * 2
        st.add("compute.elementwise", nb * _div(n, self.mem(), "mem"))

    def overhead(self, st: _Step, ops: int) -> None:
        st.add("compute.overhead", ops * self.r.op_overhead)

    def attention(self, st: _Step, n: int, prefill: bool, on_cpu: bool) -> None:
        """Attention of `n` batches. Prefill: all prompt tokens against each other (chunked, unmasked FLOPs);
        decode: one query against every cache slot, on the cache's side when on_cpu."""
        cfg, r, b = self.cfg, self.r, self.rc.gpu_batch_size
        d, heads, kv = cfg.head_dim, cfg.num_heads, cfg.kv_heads
        if prefill:
            s = self.rc.prompt_len
            sec = 4 * b * heads * s * s * d / r.attention + b * heads * s * s * 4 * 2 * ATT_PASSES / self.mem()
            st.add("compute.attention", n * sec)
            return
        s = self.slots
        mem = r.cpu_mem if on_cpu else self.mem()
        flops_rate = r.cpu_flops if on_cpu else r.decode_attention
        sec = 4 * b * heads * s * d / flops_rate
        sec += (b * heads * s * 4 * 2 * ATT_PASSES + b * kv * s * POLICY_BYTES[self.evicts]) / mem
        if self.w != self.c:  # K and V cast to the query's dtype first
            sec += 2 * b * kv * s * d * self.w / (r.gpu_mem if self.cuda and not on_cpu else r.convert)
        st.add("cpu.attention" if on_cpu else "compute.attention", n * sec)

    def cache(self, st: _Step, tier: str, n: int, prefill: bool) -> None:
        """`n` cache blocks of one layer homed on `tier`: load before, store after (prefill: store the new block)."""
        r, blk, padded = self.r, self.block, self.block_padded
        on_cpu = self.cuda and tier == "cpu" and self.rc.cpu_cache_compute and not prefill
        self.attention(st, n, prefill, on_cpu)
        if prefill:  # the block is built on the compute device, then copied home
            if tier == "gpu" or (tier == "cpu" and not self.cuda):
                st.add("compute.cache_copy", n * _div(blk, self.mem(), "mem"))
            elif self.cuda:
                st.add("d2h.cache", n * _div(blk, r.d2h, "d2h_bw"))
            if tier == "disk":
                st.add("disk.cache_write", n * _div(padded, r.disk_write, "disk_write_bw"))
            return
        if tier == "disk":
            st.add("disk.cache_read", n * _div(padded, r.disk_read, "disk_read_bw"))
            st.add("disk.cache_write", n * _div(padded, r.disk_write, "disk_write_bw"))
        if not self.cuda or tier == "gpu" or on_cpu:
            return  # memory homes on the compute side are used in place
        st.add("h2d.cache", n * _div(blk, r.h2d, "h2d_bw"))
        if tier == "disk":
            st.add("d2h.cache", n * _div(blk, r.d2h, "d2h_bw"))
        else:  # memory tier: only the written slot of K/V, plus the whole pos/score arrays
            b, kv, d = self.rc.gpu_batch_size, self.cfg.kv_heads, self.cfg.head_dim
            st.add("d2h.cache", n * _div(b * kv * (2 * d * self.w + 12 * self.slots), r.d2h, "d2h_bw"))

    def activations(self, st: _Step, t: int, load: bool) -> None:
        """Hidden states between layers, for batches whose activation home is not the compute device."""
        r = self.r
        nbytes = self.rc.gpu_batch_size * t * self.cfg.hidden * self.c
        for tier, n in self.act_counts.items():
            if tier == "disk":
                rate, name = (r.disk_read, "disk.act_read") if load else (r.disk_write, "disk.act_write")
                st.add(name, n * _div(_padded(nbytes), rate, "disk bandwidth"))
            if tier != "gpu" and self.cuda:
                st.add("h2d.act" if load else "d2h.act", n * _div(nbytes, r.h2d if load else r.d2h, "h2d/d2h"))
            elif tier == "cpu" and not load:
                st.add("compute.act_copy", n * _div(nbytes, r.cpu_mem, "cpu_mem_bw"))

    # ---- per phase ---------------------------------------------------------------------------------------------
    def phase(self, prefill: bool) -> tuple:
        """(seconds, {term: seconds}, busiest resource) of one step. Decoder layers with the same weight homes and
        cache homes cost the same, so each kind is evaluated once and counted."""
        L = self.cfg.num_layers
        kinds: dict = {}
        for layer in range(1, L + 1):
            key = (self.weights[layer], self.cache_counts[layer - 1])
            kinds.setdefault(key, [layer, 0])[1] += 1
        total, terms, busy = 0.0, {}, {}
        for layer, count in [(0, 1), (L + 1, 1)] + list(kinds.values()):
            st = self.layer(layer, prefill)
            res = st.resources()
            total += count * (max(res.values(), default=0.0) if self.rc.overlap else sum(res.values()))
            for k, v in st.terms.items():
                terms[k] = terms.get(k, 0.0) + count * v
            for k, v in res.items():
                busy[k] = busy.get(k, 0.0) + count * v
        return total, terms, max(busy, key=busy.get) if busy else None


def predict(rc: RunConfig, hw: dict, plan: Optional[MemoryPlan] = None) -> Prediction:
    """Predicted prefill and decode time of `rc` on the hardware profile `hw` (a dict as flexh2o-profile writes)."""
    layout = weight_layout(rc.model, rc.percent.shares("weights"), rc.dtype)
    plan = plan or plan_memory(rc)
    return predict_with(rc, Rates.from_profile(hw, rc.compute), layout, plan.bytes)


def predict_with(rc: RunConfig, rates: Rates, layout: tuple, tier_bytes: dict) -> Prediction:
    """predict() from parts a search computes once: the rates, the weight layout and the bytes per tier."""
    m = _Model(rc, rates, layout)
    prefill, pre_terms, pre_busy = m.phase(prefill=True)
    per_token, dec_terms, dec_busy = m.phase(prefill=False)
    decode = per_token * (rc.gen_len - 1)  # FlexGen's decode phase: the tokens after the first
    total = prefill + decode
    n = rc.num_seqs
    return Prediction(prefill, per_token, decode, total, n * rc.gen_len / total, n * rc.prompt_len / prefill,
                      n / per_token, {"prefill": pre_terms, "decode": dec_terms},
                      {t: dict(kinds) for t, kinds in tier_bytes.items()},
                      {"prefill": pre_busy, "decode": dec_busy})
