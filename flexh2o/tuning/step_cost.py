"""The cost model's step: seconds of each layer of a prefill or decode step, charged to the resource doing the work
(pure Python; tuning/cost_model.py sums them into a Prediction).

Each generation step walks every layer once (0 = embedding, 1..L decoder blocks, L+1 = head): the layer's weights
are loaded once for all GPU batches, then per batch its cache block is loaded, attended over and stored back.
Seconds are charged to the resource that does the work:
  disk      weight reads, cache block reads and whole-block rewrites, activation spills (one device: they add up)
  h2d, d2h  host <-> device copies (CUDA only; PCIe is full duplex, so the two directions are separate resources)
  compute   matmuls, attention, per-op overhead; on a CPU-only run also the host memory passes (dtype conversion,
            cache copies), since they share the cores and the memory bus; with --cpu-cache-compute on CUDA also the
            host-side decode attention, which the compute thread waits for (the GPU idles meanwhile)
With overlap each layer takes as long as its busiest resource (the schedule prefetches the next layer's weights and
the next batch's cache while computing); without overlap it takes the sum. A phase sums its layers. On a CPU-only
run the I/O thread and the compute share the cores: while a layer both reads the disk and computes, each runs at
the profile's busy rate (disk_read_bw_busy, compute_busy), and the one left runs at its idle rate (contended()).
Matmul rates depend on the rows multiplied at once (batch x tokens): the profile's matmul_flops_by_rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from flexh2o.compress import fused_attend
from flexh2o.compress.kernels import row_block
from flexh2o.kv.layout import CacheLayout
from flexh2o.planning.weight_layout import layout_of
from flexh2o.run_config import RunConfig
from flexh2o.tuning.hardware import GRAIN, Rates
from flexh2o.tuning.overlap import contended
from flexh2o.tuning.kernel_cost import EXPAND_PASSES
from flexh2o.units import padded
from flexh2o.weights.forms import WeightForms
from flexh2o.weights.on_use import reconverted_bytes
from flexh2o.weights.stored_form import disk_table_reads, disk_tables_of_run, stored_of_run

OPS = {"embed": 11, "block": 63, "head": 19, "evict": 22, "chunk": 12}  # aten ops per (layer, batch) compute
ATT_PASSES = 7  # read+write passes over each fp32 attention probability (scale, mask, softmax, casts)
SCORE_PASSES = 2  # more of them when the policy accumulates attention scores (H2O)
POLICY_BYTES = {False: 24, True: 64}  # bytes touched per cached slot by slot/mask bookkeeping (evicting or not)


class _Terms(dict):
    """Seconds of one layer of one step by term name ('resource.what')."""

    def add(self, name: str, seconds: float) -> None:
        self[name] = self.get(name, 0.0) + seconds

    def resources(self) -> dict:
        out: dict = {}
        for name, s in self.items():
            out[name.split(".")[0]] = out.get(name.split(".")[0], 0.0) + s
        return out


def _div(nbytes: float, rate: Optional[float], what: str) -> float:
    if nbytes != 0 and (rate is None or rate <= 0):
        raise ValueError(f"the hardware profile has no {what} figure, but this placement needs it")
    return nbytes / rate if nbytes != 0 else 0.0


@dataclass(frozen=True)
class BlockFacts:
    """One layer's cache block as the cost model reads it: slots per row and KV head, bytes, files on the disk tier
    (one per part), their 4 KiB-padded bytes, and the K/V bytes a decode step stores per row and KV head (its
    slot(s) and any per-row key calibration)."""

    slots: int
    nbytes: int
    files: int
    padded: int
    slot_kv: int

    @staticmethod
    def of(layout: CacheLayout, merges: bool) -> "BlockFacts":
        parts = layout.parts()
        return BlockFacts(layout.slots, layout.nbytes, len(parts), sum(padded(p.nbytes) for p in parts),
                          layout.kv_slot_bytes() * (2 if merges else 1) + layout.kv_row_bytes())


class StepCost:
    """Everything predict() needs about one RunConfig, computed once."""

    def __init__(self, rc: RunConfig, r: Rates, memo: Optional[dict] = None, forms: Optional[WeightForms] = None):
        self.rc, self.r, self.cfg = rc, r, rc.model
        self.cuda = torch.device(rc.device).type == "cuda"
        self.w, self.c = rc.dtype.itemsize, rc.compute.itemsize
        self.weights, self.params2d, self.packed, self.kernel_parts = layout_of(rc, memo)
        self.stored = stored_of_run(rc, memo)  # weights/stored_form.py
        self.tables = disk_tables_of_run(rc, memo)  # tables read from disk by rows and chunks (DiskTable)
        self.forms = forms or WeightForms.of_run(rc)  # where the blocks' matmuls run the int4 kernel
        self.cache_counts = rc.placement.cache_counts()
        self.act_counts = rc.placement.activation_counts()
        merges = rc.kv.make(rc.model.num_layers).merges  # merging also stores the merged slot
        layouts = CacheLayout.layers_of_run(rc)  # per decoder layer: a windowed layer's blocks hold fewer slots
        facts = {lay: BlockFacts.of(lay, merges) for lay in set(layouts)}
        self.blocks = tuple(facts[lay] for lay in layouts)
        big = max(self.blocks, key=lambda f: f.slots)  # the largest layer's block, under the names it always had
        self.slots, self.block, self.block_files, self.slot_kv = big.slots, big.nbytes, big.files, big.slot_kv
        self.evicts = rc.kv.evicts(rc.prompt_len, rc.gen_len, rc.model.num_layers)
        self.passes = ATT_PASSES + (SCORE_PASSES if rc.kv.needs_scores else 0)
        q = rc.compress_cache  # decode reads a quantized CPU block from its packed bytes where the kernels run
        self.fused = fused_attend.reads_packed(q, rc.device, self.cfg.head_dim)
        # CPU-only overlap: the I/O thread competes with compute for the cores (profile's busy rates)
        self.contended = not self.cuda and rc.overlap and r.disk_read_busy is not None

    # ---- per layer ---------------------------------------------------------------------------------------------
    def layer(self, layer: int, prefill: bool) -> _Terms:
        st, nb, t = _Terms(), self.rc.num_gpu_batches, self.rc.prompt_len if prefill else 1
        self.weight_io(st, layer, prefill, t)
        if layer == 0:
            self.matmul(st, layer, t, prefill, nb)
            self.overhead(st, OPS["embed"] * nb, t)
        elif layer <= self.cfg.num_layers:
            self.matmul(st, layer, t, prefill, nb)
            self.elementwise(st, t, nb)
            for tier, n in self.cache_counts[layer - 1]:
                self.cache(st, tier, n, prefill, self.blocks[layer - 1])
            ops = OPS["block"] + (OPS["evict"] if self.evicts else 0)
            if prefill:
                ops += OPS["chunk"] * (-(-t // self.rc.attn_chunk) - 1)
            self.overhead(st, ops * nb, t)
        else:
            self.matmul(st, layer, 1, False, nb)  # the head sees the last token only
            st.add("compute.sample", nb * _div(4 * self.rc.gpu_batch_size * self.cfg.vocab * 4, self.mem(), "mem"))
            self.overhead(st, OPS["head"] * nb)
        if layer >= 1:
            self.activations(st, t, load=True)
        if layer <= self.cfg.num_layers:
            self.activations(st, t, load=False)
        return st

    def layer_seconds(self, res: dict) -> float:
        """A layer's time from its resources' seconds: the sum without overlap, else the busiest one; on a CPU-only
        run disk and compute share the cores while both run, each at its busy rate, and whichever finishes first
        leaves the other its idle rate for the rest (see contended())."""
        if not self.rc.overlap:
            return sum(res.values())
        disk, compute = res.get("disk", 0.0), res.get("compute", 0.0)
        if self.contended and disk > 0 and compute > 0:
            both = contended(disk, compute, self.r.disk_read / self.r.disk_read_busy, 1.0 / self.r.compute_busy)
            return max([both] + [v for k, v in res.items() if k not in ("disk", "compute")])
        return max(res.values(), default=0.0)

    def disk_write(self, padded: int, files: int) -> float:
        return _div(padded, self.r.disk_write, "disk_write_bw") + files * self.r.write_latency

    def mem(self) -> float:
        return self.r.gpu_mem if self.cuda else self.r.cpu_mem

    def kernel_on(self, layer: int, prefill: bool) -> bool:
        """Whether the layer's matmul weights in the kernel's order run the kernel (the head's follow decode)."""
        return self.forms.runs_kernel("decode" if layer > self.cfg.num_layers or not prefill else "prefill")

    def weight_io(self, st: _Terms, layer: int, prefill: bool, t: int) -> None:
        """Weights of one layer, loaded once for all GPU batches, converted or expanded to the compute dtype where
        the int4 kernel does not run them (weights/forms.py): lookups expand the row blocks they read and the head
        its blocks, per GPU batch; plain tables kept stored likewise, weights converted on use at each use."""
        r, (table, shapes) = self.r, self.tables[layer]
        rate = r.gpu_mem if self.cuda else r.convert  # a memory pass: host (CPU run) or device
        for tier, nbytes, on_disk, files in self.weights[layer]:
            if tier == "disk":  # less the tables read by rows and chunks, per GPU batch (stored_form.disk_table_reads)
                reads, spans = disk_table_reads(layer, shapes, self.rc.dtype, self.rc.gpu_batch_size * t,
                                                self.rc.num_gpu_batches)
                st.add("disk.weights_read", _div(on_disk - table + reads, r.disk_read, "disk_read_bw")
                       + (files - len(shapes) + spans) * r.read_latency)
            if self.cuda and tier != "gpu":
                st.add("h2d.weights", _div(nbytes, r.h2d, "h2d_bw"))
            if self.w != self.c and not self.packed[layer]:
                st.add("compute.convert_weights", _div(nbytes, rate, "convert_bw"))
        looked, chunked = self.stored[layer]  # tables kept stored: rows gathered, the head's chunks per GPU batch
        again = reconverted_bytes(self.rc, self.forms, layer, prefill)  # weights/on_use.py
        if (looked or chunked or again) and not self.packed[layer]:
            st.add("compute.convert_weights", _div((self.rc.num_gpu_batches - 1) * chunked - looked + again, rate,
                                                   "convert_bw"))
        if self.packed[layer]:  # compressed weights are expanded into the compute dtype where they are used
            kern, lookups = self.kernel_parts[layer]
            rows = self.rc.gpu_batch_size * t * row_block()  # at most a row block a token looked up
            n = self.packed[layer] - (kern if self.kernel_on(layer, prefill) else 0) - sum(e for e, _ in lookups)
            nb = self.rc.num_gpu_batches
            n += nb * sum(min(e, rows * k) for e, k in lookups)
            if layer > self.cfg.num_layers and not self.kernel_on(layer, prefill):
                n += (nb - 1) * kern  # the head's expanded block by block at each GPU batch's call
            st.add("compute.expand_weights", _div(n * self.w * EXPAND_PASSES, rate, "convert_bw"))

    def matmul(self, st: _Terms, layer: int, t: int, prefill: bool, nb: int) -> None:
        """Dense layers: 2 FLOPs per parameter per token, at the rate of the rows multiplied at once (a GPU batch's
        tokens; prefill runs sub-batches of rc.prefill_rows() sequences); decode-shaped ones also read the weights
        once per batch. Weights run by the int4 kernel go at its rate (the dense one if the profile has none)."""
        b, r = self.rc.gpu_batch_size, self.r
        kern = self.kernel_parts[layer][0] if self.kernel_on(layer, prefill) else 0
        params = self.params2d[layer] - kern
        if prefill and t > 1:
            rows = min(b, self.rc.prefill_rows()) * t
            sec = 2 * b * t * params / r.matmul_rate(rows, prefill=True)
        else:
            rows = b * t
            sec = max(2 * rows * params / r.matmul_rate(rows, prefill=False), _div(params * self.c, self.mem(), "mem"))
        st.add("compute.matmul", nb * sec)
        if kern:
            rate = r.int4_rate(rows) or r.matmul_rate(rows, prefill and t > 1)
            st.add("compute.int4_matmul", nb * 2 * b * t * kern / rate)

    def elementwise(self, st: _Terms, t: int, nb: int) -> None:
        """Layer norms, residual adds, head merge, activation: ~5 passes over hidden and one over ffn."""
        n = self.rc.gpu_batch_size * t * (5 * self.cfg.hidden + self.cfg.ffn) * self.c * 2
        st.add("compute.elementwise", nb * _div(n, self.mem(), "mem"))

    def overhead(self, st: _Terms, ops: int, t: int = 1) -> None:
        """Per-op cost. Ops on a GPU batch's hidden states (b x t x hidden elements) at or above torch's parallel
        grain wake the OpenMP threads each time (parallel_op_s); smaller ones run on one thread (op_overhead_s)."""
        big = self.rc.gpu_batch_size * t * self.cfg.hidden >= GRAIN and self.r.parallel_op is not None
        st.add("compute.overhead", ops * (self.r.parallel_op if big else self.r.op_overhead))

    def attention(self, st: _Terms, n: int, prefill: bool, on_cpu: bool, block: BlockFacts) -> None:
        """Attention of `n` batches. Prefill: all prompt tokens against each other (chunked, unmasked FLOPs);
        decode: one query against each of the layer's block.slots cache slots, on the cache's side when on_cpu; a
        quantized block read fused (compress/fused_attend.py) is read once from its packed bytes, else its K and V
        are first cast or expanded to the query's dtype."""
        cfg, r, b = self.cfg, self.r, self.rc.gpu_batch_size
        d, heads, kv = cfg.head_dim, cfg.num_heads, cfg.kv_heads
        if prefill:
            s = self.rc.prompt_len
            sec = 4 * b * heads * s * s * d / r.attention + b * heads * s * s * 4 * 2 * self.passes / self.mem()
            st.add("compute.attention", n * sec)
            return
        s = block.slots
        mem = r.cpu_mem if on_cpu else self.mem()
        flops_rate = r.cpu_flops if on_cpu else r.decode_attention
        sec = 4 * b * heads * s * d / flops_rate
        sec += (b * heads * s * 4 * 2 * self.passes + b * kv * s * POLICY_BYTES[self.evicts]) / mem
        if self.fused:
            sec += block.nbytes / mem
        elif self.w != self.c or self.rc.compress_cache:  # K and V cast (or expanded) to the query's dtype first
            passes = EXPAND_PASSES if self.rc.compress_cache else 1
            sec += 2 * b * kv * s * d * self.w * passes / (r.gpu_mem if self.cuda and not on_cpu else r.convert)
        st.add("compute.cpu_attention" if on_cpu else "compute.attention", n * sec)

    def cache(self, st: _Terms, tier: str, n: int, prefill: bool, block: BlockFacts) -> None:
        """`n` cache blocks of one layer homed on `tier`: load before, store after (prefill: store the new block)."""
        r, blk, padded = self.r, block.nbytes, block.padded
        on_cpu = self.cuda and tier == "cpu" and self.rc.cpu_cache_compute and not prefill
        self.attention(st, n, prefill, on_cpu, block)
        if prefill:  # the block is built on the compute device, then copied home
            if tier == "gpu" or (tier == "cpu" and not self.cuda):
                st.add("compute.cache_copy", n * _div(blk, self.mem(), "mem"))
            elif self.cuda:
                st.add("d2h.cache", n * _div(blk, r.d2h, "d2h_bw"))
            if tier == "disk":
                st.add("disk.cache_write", n * self.disk_write(padded, block.files))
            return
        if tier == "disk":  # K, V, pos and score: four files per block (six with K and V compressed)
            files = block.files
            st.add("disk.cache_read", n * (_div(padded, r.disk_read, "disk_read_bw") + files * r.read_latency))
            st.add("disk.cache_write", n * self.disk_write(padded, files))
        if not self.cuda or tier == "gpu" or on_cpu:
            return  # memory homes on the compute side are used in place
        st.add("h2d.cache", n * _div(blk, r.h2d, "h2d_bw"))
        if tier == "disk":
            st.add("d2h.cache", n * _div(blk, r.d2h, "d2h_bw"))
        else:  # memory tier: only the written slot(s) of K/V, plus the whole pos/score arrays
            b, kv = self.rc.gpu_batch_size, self.cfg.kv_heads
            st.add("d2h.cache", n * _div(b * kv * (block.slot_kv + 12 * block.slots), r.d2h, "d2h_bw"))

    def activations(self, st: _Terms, t: int, load: bool) -> None:
        """Hidden states between layers, for batches whose activation home is not the compute device."""
        r = self.r
        nbytes = self.rc.gpu_batch_size * t * self.cfg.hidden * self.c
        for tier, n in self.act_counts:
            if tier == "disk" and load:
                st.add("disk.act_read", n * (_div(padded(nbytes), r.disk_read, "disk_read_bw") + r.read_latency))
            elif tier == "disk":
                st.add("disk.act_write", n * self.disk_write(padded(nbytes), 1))
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
            key = (self.weights[layer], self.cache_counts[layer - 1], self.blocks[layer - 1])
            kinds.setdefault(key, [layer, 0])[1] += 1
        total, terms, busy = 0.0, {}, {}
        for layer, count in [(0, 1), (L + 1, 1)] + list(kinds.values()):
            st = self.layer(layer, prefill)
            res = st.resources()
            total += count * self.layer_seconds(res)
            for k, v in st.items():
                terms[k] = terms.get(k, 0.0) + count * v
            for k, v in res.items():
                busy[k] = busy.get(k, 0.0) + count * v
        return total, terms, max(busy, key=busy.get) if busy else None

