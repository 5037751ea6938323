"""When no placement fits: the least each tier would need, and what that least is made of.

The least placement puts every weight, cache block and activation block off the tier that overflows where it can
(weights split between cpu and disk in the search's steps, the cache on gpu, cpu or disk, activations on gpu or
cpu) and runs one sequence; of the placements that fit the cpu and disk tiers it is the one needing the least of the
gpu tier. What is left on the gpu tier is then the working buffers: two layers of weights in flight at the compute
dtype (none on a CPU-only run for weights homed on cpu in the compute dtype: they are used where they live), the
cache blocks being loaded and the largest transient of a layer.
"""
from __future__ import annotations

from typing import Optional

from flexh2o.models import layer_specs
from flexh2o.placement import TIERS, Percent, Placement, tier_words
from flexh2o.planning.memory_plan import KINDS, MemoryPlan, plan_memory
from flexh2o.run_config import RunConfig
from flexh2o.units import fmt_bytes
from flexh2o.compress.choice import PHASES
from flexh2o.weights.forms import WeightForms
from flexh2o.weights.stored_form import stays_stored
from flexh2o.compress import weight_spec

CACHES = ((100, 0), (0, 100), (0, 0))
ACTIVATIONS = ((100, 0), (0, 100))


def weight_shares(step: int = 10) -> list:
    """Weights off the gpu tier: on cpu in steps of `step` percent (the policy search's), the rest on disk."""
    return [(0, c) for c in range(0, 101, step)]


def least_plans(rc: RunConfig, step: int = 10) -> list:
    """The memory plans of one sequence in one GPU batch at every placement that keeps the weights off the gpu
    tier (split between cpu and disk in steps of `step`; the cache and activations anywhere; --cpu-cache-compute
    both ways on CUDA)."""
    specs, memo, out = layer_specs(rc.model), {}, []
    cuda = rc.device.startswith("cuda")
    for w in weight_shares(step):
        for c in CACHES:
            for a in ACTIVATIONS:
                for ccc in ([False, True] if cuda and c[1] > 0 else [False]):
                    percent = Percent(*w, *c, *a)
                    one = rc.with_(percent=percent, num_gpu_batches=1, gpu_batch_size=1, cpu_cache_compute=ccc)
                    out.append(plan_memory(one.placed(Placement.build(specs, percent, 1, memo))))
    return out


def least_plan(rc: RunConfig) -> MemoryPlan:
    """Of least_plans: one that fits; else, of those fitting the cpu and disk tiers, the one needing the least of
    the gpu tier; else the one fitting the most tiers in order (gpu first), then needing the least of the first
    tier it overflows."""
    def key(plan: MemoryPlan) -> tuple:
        over = plan.overflow()
        if over is None:
            return (2,)
        if all(plan.total(t) <= plan.capacity(t) for t in TIERS if t != "gpu"):
            return (1, -plan.total("gpu"))
        return (0, TIERS.index(over[0]), -over[1])
    return max(least_plans(rc), key=key)


def least_message(rc: RunConfig) -> Optional[str]:
    """One line: the tier that no placement fits, the least it needs and of what; None when the least placement
    fits (then a search that found nothing was limited elsewhere, e.g. by --max-seqs)."""
    plan = least_plan(rc)
    over = plan.overflow()
    if over is None:
        return None
    tier, need, have = over
    parts = [f"{kind} {fmt_bytes(plan.bytes[tier][kind])}" for kind in KINDS if plan.bytes[tier][kind]]
    detail = in_flight(plan.rc, plan.forms) if tier == "gpu" else ""
    if tier == plan.load_tier():  # the load's transient decides the total, not the run's bytes
        parts, detail = [f"at the load: {plan.load_words()}"], ""
    return (f"no placement fits: even one sequence with {least_where(plan.rc.percent)} needs "
            f"{fmt_bytes(need)} in {tier_words(tier, plan.rc.device, the=True)} ({', '.join(parts)}{detail}) but "
            f"--{tier}-mem allows "
            f"{fmt_bytes(have)}: raise --{tier}-mem to at least {fmt_bytes(need)} ({need} bytes)")


def in_flight(rc: RunConfig, forms: Optional[WeightForms] = None) -> str:
    """'; the buffers hold two layers of weights in flight, 2 x N (layer i at the compute dtype; its largest
    weight W (shape): N at the prefill compute dtype)' for the layer the plan sizes them by, as `forms` (the
    plan's; by default WeightForms.planned) bring the weights to the compute side; where they convert matmul
    weights on use, the largest weight is named as stored."""
    forms = forms or WeightForms.planned(rc)
    per_phase = [_converted(forms, forms.compute_side_bytes(rc.placement.weights, p), rc, p) for p in PHASES]
    sizes = max(per_phase, key=max)
    layer = max(range(len(sizes)), key=sizes.__getitem__)
    if not sizes[layer]:
        return "; no weights in flight: every weight is used where it lives"
    specs = layer_specs(rc.model)[layer]
    big = max(specs, key=lambda s: s.numel)
    packed = weight_spec(big.shape, rc.compress_weight, big.name) is not None
    kept = stays_stored(layer, len(sizes) - 2, big, rc.dtype, rc.compute, packed) or bool(forms.on_use)
    share = big.numel * (rc.dtype if kept else rc.compute).itemsize  # a table kept stored: weights/stored_form.py
    how = ", matmul weights converted on use" if forms.on_use else ""
    return (f"; the buffers hold two layers of weights in flight, 2 x {fmt_bytes(sizes[layer])} (layer {layer}"
            f"{how}; its largest weight {big.name} {tuple(big.shape)}: {fmt_bytes(share)})" + arenas(rc, forms)
            + expanded_reads(rc, forms))


def _converted(forms: WeightForms, sizes: tuple, rc: RunConfig, phase: str) -> tuple:
    """Per layer the compute-side bytes beside the read arenas where a phase converts streamed weights (what
    memory_plan.in_flight_bytes doubles), else `sizes` as they are."""
    streamed, views = forms.streamed_bytes(rc.placement.weights, phase)
    return sizes if streamed == views else tuple(s - v for s, v in zip(sizes, views))


def arenas(rc: RunConfig, forms: Optional[WeightForms] = None) -> str:
    """', and beside the converted weights two read arenas of the weights streamed from disk, 2 x N (layer i)'
    where a phase converts a streamed weight (memory_plan.in_flight_bytes counts both); '' otherwise."""
    for phase in PHASES:
        streamed, views = (forms or WeightForms.planned(rc)).streamed_bytes(rc.placement.weights, phase)
        if streamed != views:
            layer = max(range(len(streamed)), key=streamed.__getitem__)
            return (f", and beside the converted weights two read arenas of the weights streamed from disk, "
                    f"2 x {fmt_bytes(streamed[layer])} (layer {layer})")
    return ""


def expanded_reads(rc: RunConfig, forms: WeightForms) -> str:
    """', and the compressed reads of the disk weights expanded whole, 2 x N (layer i)' where a phase expands
    compressed disk weights (memory_plan.in_flight_bytes counts two layers' loads at once); '' otherwise."""
    per_phase = [forms.expanded_read_bytes(rc.placement.weights, p) for p in PHASES]
    reads = max(per_phase, key=max)
    if not max(reads):
        return ""
    layer = max(range(len(reads)), key=reads.__getitem__)
    return (f", and the compressed reads of the disk weights expanded whole, 2 x {fmt_bytes(reads[layer])} "
            f"(layer {layer})")


def least_where(p: Percent) -> str:
    """The least placement in words, e.g. 'weights on disk, cache on cpu, activations on cpu' or 'weights 30% on
    cpu and 70% on disk, ...'."""
    def tier(what: str) -> str:
        g, c, d = p.shares(what)
        if 100 in (g, c, d):
            return "on " + ("gpu" if g == 100 else "cpu" if c == 100 else "disk")
        return " and ".join(f"{share}% on {t}" for share, t in zip((g, c, d), TIERS) if share)
    return ", ".join(f"{what} {tier(what)}" for what in ("weights", "cache", "activations")) + \
        " (--percent " + str(p) + ")"
