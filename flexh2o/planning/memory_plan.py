"""Pre-flight plan: the bytes each tier needs (weights, KV cache, activations, buffers), before any allocation."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from flexh2o.kv.attention import prefill_chunk
from flexh2o.kv.layout import CacheLayout
from flexh2o.models.common import MLP_ELEMENTS
from flexh2o.placement import TIERS, Placement, tensor_bytes, tier_words
from flexh2o.run_config import RunConfig
from flexh2o.units import fmt_bytes
from flexh2o.compress.choice import PHASES
from flexh2o.compress import fused_attend
from flexh2o.compress.codec import stored_parts, weight_spec
from flexh2o.compress.kept import compresses_others
from flexh2o.compress.tier import SLAB_BYTES, slab_rows
from flexh2o.weights.forms import WeightForms

KINDS = ("weights", "cache", "activations", "buffers")
PY_TOKEN_BYTES = 36  # a token id in a Python list: an 8-byte slot and a 28-byte int object


def cache_block_bytes(rc: RunConfig) -> int:
    """One (layer, GPU batch) cache block of the largest layer, as its layout (kv/layout.py) says."""
    return CacheLayout.of_run(rc).nbytes


def act_block_bytes(rc: RunConfig) -> int:
    """Hidden states of one GPU batch between layers (prefill is the largest)."""
    return rc.gpu_batch_size * rc.prompt_len * rc.model.hidden * rc.compute.itemsize


@dataclass
class MemoryPlan:
    """Bytes per tier and kind of one run as its WeightForms take the weights (`forms`); `with_forms` is the same
    plan with other forms (only the weights in flight and the kept scales differ)."""

    rc: RunConfig
    bytes: dict = field(default_factory=lambda: {t: dict.fromkeys(KINDS, 0) for t in TIERS})
    kept_scales: int = 0  # bytes of int4-kernel scales kept built for the run (weights/forms.py), in gpu buffers
    forms: Optional[WeightForms] = field(default=None, repr=False, compare=False)
    where: Optional[Placement] = field(default=None, repr=False, compare=False)
    working: int = field(default=0, repr=False, compare=False)  # gpu buffers besides the weights in flight
    store_transient: int = 0  # host bytes of storing the largest 4-bit weight, at the load (store_transient_bytes)

    def with_forms(self, forms: WeightForms) -> "MemoryPlan":
        """This plan as `forms` take the weights: the weights in flight at each phase, and the kept int4-kernel
        scales where the gpu tier still has room for them after everything else."""
        tiers = {t: dict(kinds) for t, kinds in self.bytes.items()}
        tiers["gpu"]["buffers"] = self.working + max(in_flight_bytes(self.rc, self.where, forms, p) for p in PHASES)
        plan = replace(self, bytes=tiers, kept_scales=0, forms=forms)
        kept = forms.kept_scales_bytes(self.where.weights)
        if kept and plan.overflow() is None and plan.total("gpu") + kept <= plan.capacity("gpu"):
            plan.bytes["gpu"]["buffers"] += kept
            plan.kept_scales = kept
        return plan

    def fits(self, forms: WeightForms) -> bool:
        """Whether every tier fits this plan with the weights in `forms`."""
        return self.with_forms(forms).overflow() is None

    def total(self, tier: str) -> int:
        """The tier's bytes at its peak: in the run, or at the load (the weights stored into their homes before any
        activation or buffer exists) where storing the largest 4-bit weight needs more, in host memory (the gpu
        tier of a CPU-only run, else the cpu tier)."""
        run = sum(self.bytes[tier].values())
        if tier != ("cpu" if self.rc.device.startswith("cuda") else "gpu"):
            return run
        return max(run, self.bytes[tier]["weights"] + self.bytes[tier]["cache"] + self.store_transient)

    def capacity(self, tier: str) -> int:
        return getattr(self.rc, f"{tier}_mem")

    def overflow(self):
        """(tier, needed, available) of the first tier that does not fit, or None."""
        for t in TIERS:
            if self.total(t) > self.capacity(t):
                return t, self.total(t), self.capacity(t)
        return None

    def check(self) -> None:
        over = self.overflow()
        if over:
            t, need, have = over
            if t == self.load_tier():
                raise ValueError(f"{tier_words(t, self.rc.device)} needs {fmt_bytes(need)} at the load but --{t}-mem "
                                 f"allows {fmt_bytes(have)} ({self.load_words()}): raise --{t}-mem, or move "
                                 "more of --percent's weights to another tier")
            if t == "gpu" and not self.rc.device.startswith("cuda"):  # no GPU: the tier computed in is host memory
                raise ValueError(f"{tier_words(t, self.rc.device)} needs {fmt_bytes(need)} but --gpu-mem allows "
                                 f"{fmt_bytes(have)} (no GPU here): lower --gpu-batch-size, move more of --percent to "
                                 "the cpu or disk tier, or raise --gpu-mem")
            raise ValueError(f"{t} tier needs {fmt_bytes(need)} but --{t}-mem allows {fmt_bytes(have)}: raise "
                             f"--{t}-mem, lower --gpu-batch-size, or move more of --percent to another tier")

    def describe(self) -> str:
        rows = [f"{'tier':<5} {'weights':>10} {'cache':>10} {'activ.':>10} {'buffers':>10} {'total':>10} "
                f"{'capacity':>10}"]
        for t in TIERS:
            b = self.bytes[t]
            rows.append(f"{t:<5} " + " ".join(f"{fmt_bytes(b[k]):>10}" for k in KINDS)
                        + f" {fmt_bytes(self.total(t)):>10} {fmt_bytes(self.capacity(t)):>10}")
        load = self.load_tier()
        if load:
            rows.append(f"({load} total at the load: {self.load_words()})")
        return "\n".join(rows)

    def load_tier(self) -> Optional[str]:
        """The tier whose total is decided by storing the largest 4-bit weight at the load, or None."""
        for t in TIERS:
            if self.store_transient and self.total(t) > sum(self.bytes[t].values()):
                return t
        return None

    def load_words(self) -> str:
        return (f"storing the largest 4-bit weight takes {fmt_bytes(self.store_transient)} beside the tier's weights "
                "and cache")


def plan_memory(rc: RunConfig, placement: Optional[Placement] = None,
                forms: Optional[WeightForms] = None) -> MemoryPlan:
    """Bytes per tier of `rc` (homes from `placement`, by default rc.placement) as `forms` take the weights
    (weights/forms.py; by default what the plan assumes before the engine's choice, WeightForms.planned, with the
    weights converted on use where that does not fit, as the engine converts them: WeightForms.fitting_on_use)."""
    if forms is not None:
        return plan_for(rc, placement or rc.placement, forms)
    plan, plans = plan_for(rc, placement or rc.placement, WeightForms.planned(rc)), {}
    if plan.overflow() is None or plan.overflow()[0] != "gpu":  # converting on use spares only compute memory
        return plan

    def fits(forms: WeightForms) -> bool:
        plans[forms] = plan.with_forms(forms)
        return plans[forms].overflow() is None
    return plans.get(plan.forms.fitting_on_use(fits), plan)


def plan_for(rc: RunConfig, where: Placement, forms: WeightForms) -> MemoryPlan:
    """Bytes per tier of `rc` with the homes of `where` as `forms` take the weights."""
    plan = MemoryPlan(rc, where=where, working=working_bytes(rc), store_transient=store_transient_bytes(rc, where))
    for tier, nbytes in where.weights.bytes_by_tier(rc.dtype, rc.compress_weight).items():
        plan.bytes[tier]["weights"] += nbytes
    for tier, nbytes in where.cache_bytes_by_tier(CacheLayout.layer_bytes_of_run(rc)).items():
        plan.bytes[tier]["cache"] = nbytes
    for tier in where.activations:
        plan.bytes[tier]["activations"] += act_block_bytes(rc)
    plan.bytes["cpu"]["buffers"] = host_bytes(rc)
    return plan.with_forms(forms)


def host_bytes(rc: RunConfig) -> int:
    """Host memory the run keeps per sequence wherever the tiers are: the last logits (fp32, vocab wide), the
    padded ids and positions and the generated tokens (int64), and the prompts and outputs as Python lists."""
    tokens = rc.prompt_len + rc.gen_len
    per_seq = rc.model.vocab * 4 + (2 * rc.prompt_len + rc.gen_len) * 8 + tokens * PY_TOKEN_BYTES
    return rc.num_seqs * per_seq


def working_bytes(rc: RunConfig) -> int:
    """Compute-side buffers besides the weights in flight (`in_flight_bytes`): the cache blocks being built or
    loaded, what decode holds to read one (CacheLayout.read_bytes: an expanded copy only where the read makes one)
    and the fp32 keys or values an eviction policy reads, and the largest transient of a layer (prefill attention,
    MLP, logits)."""
    cfg, c = rc.model, rc.compute.itemsize
    b, t, m = rc.gpu_batch_size, rc.prompt_len, rc.prefill_rows()  # prefill runs m sequences at a time
    g, cpu, _ = rc.percent.shares("cache")
    layout = CacheLayout.of_run(rc)
    block = layout.nbytes
    attend_on_cpu = rc.cpu_cache_compute and cpu == 100
    cache = block if g == 100 or attend_on_cpu else 2 * block  # prefill builds one; decode prefetches the next
    cache += layout.read_bytes(rc.compute, fused_attend.reads_packed(rc.compress_cache, rc.device, layout.head_dim))
    policy = rc.kv.make(cfg.num_layers)
    cache += layout.policy_copy_bytes(policy.needs_keys or policy.merges, policy.needs_values)
    chunk = prefill_chunk(m, cfg.num_heads, t, rc.attn_chunk, rc.device)
    qkv = 4 * m * t * cfg.token_width * c  # q, k, v, attention output (sub-batch)
    probs = 3 if rc.kv.needs_scores else 1  # scoring policies materialise fp32 probabilities
    attention = probs * m * cfg.num_heads * chunk * t * 4 + qkv
    decode_attn = 3 * b * cfg.num_heads * rc.cache_slots() * 4
    mlp = min(m * t, max(1, MLP_ELEMENTS // cfg.ffn)) * cfg.ffn * c * 2 + m * t * cfg.hidden * c
    logits = b * cfg.vocab * 4 * 2
    acts = (1 if rc.percent.act_gpu == 100 else 2) * act_block_bytes(rc)  # a layer's output beside its input
    sub_batches = m * t * cfg.hidden * c if m < b else 0  # a sub-batch's output before it is copied into the layer's
    return cache + max(attention, decode_attn, mlp) + logits + acts + sub_batches


SLAB_COPIES = 3  # fp32 slabs live at once in the codec's quantize: the input as fp32, x - minimum, its quotient
SLAB_LEVEL_COPIES = 3  # a slab's compressed bytes live at once: its data, its levels (two a byte) for the kernel order


def store_transient_bytes(rc: RunConfig, where: Placement) -> int:
    """The largest transient of putting one weight in its home under --compress-weight, before any compute buffer
    exists (compress/tier.py). A (N, K) weight grouped along K is quantized a slab of rows at a time (slab_rows,
    SLAB_BYTES of fp32 input) and each slab's bytes written as made: its input (the slab regathered from seeded
    pieces, or a checkpoint's tensor whole), SLAB_COPIES fp32 slabs, SLAB_LEVEL_COPIES times the slab's compressed
    bytes, and the meta of every slab twice (the slabs' and their join). Another weight is gathered whole in the
    storage dtype and quantized a slab at a time, its parts joined: the parts, the join and a kernel-order copy,
    three times its compressed bytes. 0 without --compress-weight."""
    if not compresses_others(rc.compress_weight):  # none, or a checkpoint's kept blocks stored as they are
        return 0
    most = 0
    for s in where.weights.unique_specs():
        spec = weight_spec(s.shape, rc.compress_weight, s.name)
        if spec is None:
            continue
        numel = tensor_bytes(s.shape, torch.float32) // 4
        copies = SLAB_COPIES - (rc.dtype == torch.float32)  # an fp32 input is used as it is, not copied
        rows = slab_rows(s.shape, spec)
        if rows is None:
            slabs = copies * min(SLAB_BYTES, 4 * numel)
            most = max(most, numel * rc.dtype.itemsize + 3 * tensor_bytes(s.shape, rc.dtype, spec) + slabs)
            continue
        slab = (min(rows, s.shape[0]), s.shape[1])
        whole_input = rc.checkpoint is not None  # its tensor is read whole; seeded pieces are regathered by slabs
        held = numel * rc.dtype.itemsize if whole_input else tensor_bytes(slab, rc.dtype)
        meta = stored_parts(s.shape, rc.dtype, spec)[1]
        most = max(most, held + copies * tensor_bytes(slab, torch.float32)
                   + SLAB_LEVEL_COPIES * tensor_bytes(slab, rc.dtype, spec) + 2 * meta)
    return most


def in_flight_bytes(rc: RunConfig, where: Placement, forms: WeightForms, phase: str) -> int:
    """Two layers of weights in flight at `phase` as `forms` bring them to the compute side (weights/forms.py:
    copied, expanded, in the int4 kernel's form, kept stored or converted on use): the one computing at its peak
    (with the chunk a stored table multiplies), the prefetched one as loaded; the weight store's two read arenas
    for the plain weights streamed from disk (storage/read_buffers.py: each the largest streamed layer's stored
    bytes, kept for the run): a streamed weight used as read (in the compute dtype, kept stored or converted on
    use) lives in its arena, so it is counted there once; a converted one is in both; the compressed reads of the
    disk weights expanded whole (WeightForms.expanded_read_bytes), a layer's held until its load ends and two
    loads at once (the schedule's two I/O threads: measured, tests/compress/test_compress_forms.py); and the run's
    one ChunkBuffer of the weights converted on use (weights/on_use.py)."""
    sizes, passing = forms.compute_side_bytes(where.weights, phase), forms.transient_bytes(where.weights, phase)
    streamed, views = forms.streamed_bytes(where.weights, phase)
    held = [size - view for size, view in zip(sizes, views)]  # views are 0 where nothing streams
    pair = max(held) + max(h - p for h, p in zip(held, passing))
    reads = max(forms.expanded_read_bytes(where.weights, phase), default=0)
    return 2 * max(streamed) + pair + 2 * reads + forms.chunk_buffer_bytes(where.weights)


def largest_batch(rc: RunConfig, limit: int = 1 << 20, plan_of=plan_memory) -> int:
    """Largest --gpu-batch-size up to `limit` that fits every tier (0 when even 1 does not). The one batch search:
    --gpu-batch-size auto, --dry-run and the policy search use it; `plan_of` (rc -> MemoryPlan) is a pipeline
    stage's plan under torchrun. A plan is nearly affine in the batch: the plans at b and b + 1 give each tier's
    bytes per sequence there, and the batch where the first tier would fill at that rate is the next guess (from
    b = 1, at most three times); the search then starts from the last guess, so a few plans bracket the answer
    instead of ~2 log2(answer). The answer is the same as without a guess."""
    plans: dict = {}

    def ok(b: int) -> bool:
        if b not in plans:
            plans[b] = plan_of(rc.with_(gpu_batch_size=b))
        return plans[b].overflow() is None

    if limit < 2 or not ok(1) or not ok(2):
        return largest_passing(ok, limit)  # 0 or 1 (the plans are kept: nothing is planned twice)
    guess = b = 1
    for _ in range(3):
        if plans[b].forms != plans[b + 1].forms and b + 2 <= limit:  # weights converted on use from b + 1 on
            b += 1
            ok(b + 1)
        nxt = _affine_guess(b, plans[b], plans[b + 1])
        if nxt is None or nxt == b:
            break
        guess = b = min(max(nxt, 1), limit - 1)
        ok(b), ok(b + 1)
    return largest_passing(ok, limit, guess=guess)


def _affine_guess(b: int, at_b: MemoryPlan, at_next: MemoryPlan) -> Optional[int]:
    """The batch at which the first tier fills, extrapolating each tier's total from batch b to b + 1 (None when
    no tier grows there, or where the weights' forms change between the two: the plan is not affine there)."""
    if at_b.forms != at_next.forms:
        return None
    fills = [b + (at_b.capacity(t) - at_b.total(t)) // (at_next.total(t) - at_b.total(t))
             for t in TIERS if at_next.total(t) > at_b.total(t)]
    return min(fills) if fills else None


def largest_passing(ok, limit: int, guess: Optional[int] = None) -> int:
    """Largest b in 1..limit with ok(b), for an ok that holds up to some b and fails above (0 when ok(1) fails):
    from a guess (or from 1), steps doubling away from it until ok changes, then bisection between the last success
    and the first failure."""
    if limit < 1 or not ok(1):
        return 0
    g = min(max(guess or 1, 1), limit)
    if g == 1 or ok(g):
        lo, step = g, 1
        while lo + step <= limit and ok(lo + step):
            lo, step = lo + step, step * 2
        hi = min(lo + step, limit + 1)
    else:
        hi, step = g, 1
        while hi - step > 1 and not ok(hi - step):
            hi, step = hi - step, step * 2
        lo = max(hi - step, 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo
