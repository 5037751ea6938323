"""The text of --dry-run: a run's memory plan per tier, whether it fits, the largest batch that fits; under torchrun
the plan of this rank's stage."""
from __future__ import annotations

from typing import Optional

from flexh2o.kv.spec import KVSpec
from flexh2o.planning.memory_plan import largest_batch, plan_memory
from flexh2o.run_config import RunConfig


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
             f"  cache slots {rc.cache_slots()}" + _compression_note(rc), _dtype_line(rc), plan.describe()]
    over = plan.overflow()
    lines.append("fits" if over is None else f"does NOT fit: {over[0]} tier needs {over[1]} > {over[2]} bytes")
    lines.append(f"largest --gpu-batch-size that fits: {rc.kv.policy} {largest_batch(rc, plan_of=plan_of)}")
    if rc.kv.policy != "full":
        lines[-1] += f", full {largest_batch(rc.with_(kv=KVSpec()), plan_of=plan_of)}"
    return "\n".join(lines)


def _dtype_line(rc: RunConfig) -> str:
    from flexh2o.dtypes import dtype_name
    dec = "" if rc.decode_compute == rc.compute else f" (prefill), {dtype_name(rc.decode_compute)} (decode)"
    return f"dtype {dtype_name(rc.dtype)} storage, {dtype_name(rc.compute)} compute{dec}"


def _compression_note(rc: RunConfig) -> str:
    parts = [f"{what} {spec.bits}-bit/{spec.group_size}" for what, spec in
             (("weights", rc.compress_weight), ("cache", rc.compress_cache)) if spec]
    if rc.compress_cache and rc.compress_cache.keys == "channel":
        parts[-1] += f" (keys per channel, {rc.compress_cache.outliers} exact)"
    return f"  compressed {', '.join(parts)}" if parts else ""
