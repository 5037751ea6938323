"""The text of --dry-run: a run's memory plan per tier, whether it fits, the largest batch that fits; under torchrun
the plan of this rank's stage."""
from __future__ import annotations

from typing import Optional

from flexh2o.kv.spec import KVSpec
from flexh2o.planning.memory_plan import largest_batch, plan_memory
from flexh2o.run_config import RunConfig
from flexh2o.units import GiB, fmt_bytes


def describe_stage_plan(rc: RunConfig, stage_layers: Optional[str]) -> str:
    """One rank's --dry-run under torchrun: its stage's layers and plan (one string: one write per rank)."""
    from flexh2o.pipeline.job import dry_run_stage
    stage, src, plan_of = dry_run_stage(rc, stage_layers)
    return (f"rank {stage.index} of {stage.num_stages}, {stage.describe(rc.model.num_layers)} (its own tensors; "
            f"--percent applies within the stage)\n" + describe_plan(src, plan_of))


def describe_plan(rc: RunConfig, plan_of=plan_memory) -> str:
    plan = plan_of(rc)
    lines = [f"model {rc.model.name}  percent {rc.percent}  batch {rc.gpu_batch_size}x{rc.num_gpu_batches}  "
             f"prompt {rc.prompt_len} gen {rc.gen_len}  kv policy {rc.kv.describe()}"
             f"  cache slots {_slots_text(rc)}" + _compression_note(rc), _dtype_line(rc), plan.describe()]
    if plan.kept_scales:
        lines.append(f"gpu buffers include {fmt_bytes(plan.kept_scales)} of int4-kernel scales kept for the weights "
                     "used in place (built once, not at every step)")
    if plan.forms is not None and plan.forms.on_use:
        chunk = plan.forms.chunk_buffer_bytes(rc.placement.weights)
        lines.append(f"matmul weights converted on use at {', '.join(sorted(plan.forms.on_use, reverse=True))}, a "
                     f"chunk at a time into one {fmt_bytes(chunk)} buffer (whole layers converted would not fit)")
    over = plan.overflow()
    lines.append("fits" if over is None else f"does NOT fit: {over[0]} tier needs {over[1]} > {over[2]} bytes")
    best = {rc.kv.policy: (rc, largest_batch(rc, plan_of=plan_of))}
    if rc.kv.policy != "full":
        full = rc.with_(kv=KVSpec())
        best["full"] = (full, largest_batch(full, plan_of=plan_of))
    lines.append("largest --gpu-batch-size that fits: " + ", ".join(f"{k} {n}" for k, (_, n) in best.items()))
    none = [(k, r) for k, (r, n) in best.items() if n == 0]
    if none:
        lines.append(why_no_batch(*none[0], plan_of))
    return "\n".join(lines)


def why_no_batch(policy: str, rc: RunConfig, plan_of=plan_memory) -> str:
    """Why no batch of rc fits: the tier that one sequence overflows, and what would hold it."""
    over = plan_of(rc.with_(gpu_batch_size=1)).overflow()
    if over is None:
        return f"{policy} 0: no --gpu-batch-size fits with {rc.num_gpu_batches} GPU batches"
    tier, need, have = over
    dtype = ", a 16-bit --dtype" if rc.dtype.itemsize > 2 else ""
    return (f"{policy} 0 because one sequence already overflows the {tier} tier ({fmt_bytes(need)} > "
            f"{fmt_bytes(have)}): give --{tier}-mem {_gib_ceil(need)} or more{dtype}, or move --percent to another "
            "tier (a dry run may plan for a larger machine than this one, e.g. the paper's: --cpu-mem 200GB "
            "--dtype float16)")


def _slots_text(rc: RunConfig) -> str:
    """The largest layer's cache slots, and those of the windowed layers that hold fewer."""
    slots = rc.layer_slots()
    fewer = sorted({s for s in slots if s < max(slots)})
    return f"{max(slots)}" + "".join(f" ({slots.count(s)} windowed layers {s})" for s in fewer)


def _gib_ceil(n: int) -> str:
    return f"{-(-n // GiB)}GB"


def _dtype_line(rc: RunConfig) -> str:
    from flexh2o.dtypes import dtype_name
    dec = "" if rc.decode_compute == rc.compute else f" (prefill), {dtype_name(rc.decode_compute)} (decode)"
    return f"dtype {dtype_name(rc.dtype)} storage, {dtype_name(rc.compute)} compute{dec}"


def _compression_note(rc: RunConfig) -> str:
    from flexh2o.compress.kept import compresses_others, describe_kept
    weights = rc.compress_weight if compresses_others(rc.compress_weight) else None
    parts = [f"weights {weights.bits}-bit/{weights.group_size}"] if weights else []
    if rc.compress_cache:
        parts.append(f"cache {rc.compress_cache.describe()}")  # kv/layout.py's one description
    parts += [describe_kept(rc.compress_weight)] * bool(describe_kept(rc.compress_weight))
    return f"  compressed {', '.join(parts)}" if parts else ""
