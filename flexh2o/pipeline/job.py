"""One batch job across pipeline stages (one per rank, launched by torchrun): split, agree on the pre-flight plan,
run every stage's engine over its layers, and report from the rank holding the head."""
from __future__ import annotations

import os
import sys
from dataclasses import replace
from typing import Optional

from flexh2o.pipeline.group import StageGroup, env_rank, local_rank, rank_device, terminate_as_interrupt
from flexh2o.pipeline.pipe import StagePipe, stage_config
from flexh2o.pipeline.split import Stage, parse_stage_layers, split_stages
from flexh2o.pipeline.transport import Ring
from flexh2o.engine import Engine
from flexh2o.errors import one_line
from flexh2o.job import Job, Measured, finish, measure_job, policy_flags
from flexh2o.metrics import RunReport, thread_settings
from flexh2o.planning.memory_plan import MemoryPlan, act_block_bytes, plan_memory
from flexh2o.run_config import RunConfig
from flexh2o.schedule.plan import COMPUTE
from flexh2o.storage.offload_dir import remove_stale_run_dirs

DEFAULT_TIMEOUT_S = 300.0


class Refusal(ValueError):
    """A pre-flight refusal every rank agreed on (said once per machine, by its local rank 0)."""


def run_stages(rc: RunConfig, job: Job, stage_layers: Optional[str] = None,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> Optional[RunReport]:
    """This rank's part of the job; the report on the rank holding the head, None elsewhere."""
    terminate_as_interrupt()
    group = StageGroup.start(rc.device, timeout_s)
    try:
        stage, src = preflight(group, rc, stage_layers)
        report = _run_stage(group, stage, src, job, timeout_s)
    except BaseException:
        # this rank's engine has removed its own files; a rank killed on this machine could not: remove those of
        # dead owners too. No goodbye to the group: a peer may be gone.
        if os.path.isdir(rc.offload_dir):
            remove_stale_run_dirs(rc.offload_dir)
        raise
    group.close()
    return report


def preflight(group: StageGroup, rc: RunConfig, stage_layers: Optional[str]) -> tuple:
    """The split and every stage's memory plan, before anything is allocated; any refusal stops every rank."""
    refusal, stage, src = None, None, None
    try:
        counts = parse_stage_layers(stage_layers) if stage_layers else None
        stage = split_stages(rc.model, group.world, counts)[group.rank]
        src = stage_config(rc, stage, group.device)
        stage_memory_plan(src, stage).check()
    except ValueError as e:
        refusal = one_line(e)
    try:
        group.agree(refusal)
    except ValueError as e:
        raise Refusal(str(e)) from None
    return stage, src


def dry_run_stage(rc: RunConfig, stage_layers: Optional[str]) -> tuple:
    """--dry-run under torchrun: (this rank's Stage, its RunConfig, its plan function rc -> MemoryPlan). No process
    group is joined: the split is the same on every rank, so a bad split is refused on each one alike."""
    rank, world = env_rank()
    counts = parse_stage_layers(stage_layers) if stage_layers else None
    stage = split_stages(rc.model, world, counts)[rank]
    return stage, stage_config(rc, stage, rank_device(rc.device)), lambda r: stage_memory_plan(r, stage)


def stage_generate(eng: Engine, group: StageGroup, stage: Stage, prompts: list, gen_len: int, timeout_s: float,
                   **kw) -> tuple:
    """One generate() of this rank's stage engine, its messages on a fresh ring: (Generation, LinkStats). The
    tokens and logits are those of the job on the last stage only."""
    ring = Ring(group.rank, stage.prev, stage.next, eng.rc.num_gpu_batches, timeout_s, group.device)
    gen = eng.generate(prompts, gen_len, pipe=StagePipe(stage, ring, eng.cfg.num_layers + 2), **kw)
    return gen, ring.stats


def stage_memory_plan(rc: RunConfig, stage: Stage) -> MemoryPlan:
    """A stage's pre-flight plan (rc: the stage's config): its own tensors, plus on the compute side the ring's
    buffers, a group's hidden states received one unit ahead and a group's in flight to the next stage."""
    plan = plan_memory(rc)
    group = -(-rc.num_gpu_batches // min(rc.num_gpu_batches, stage.num_stages))
    plan.bytes["gpu"]["buffers"] += 2 * group * act_block_bytes(rc)
    return plan


def _run_stage(group: StageGroup, stage: Stage, rc: RunConfig, job: Job, timeout_s: float) -> Optional[RunReport]:
    """The job loop (job.measure_job), its generate() on this stage's ring; the report on the last stage. One round:
    the first rc.num_seqs prompts (as before the loop was shared; rounds over a ring are not tested yet)."""
    links = []

    def generate(eng: Engine, prompts: list, steps: int, **kw):
        gen, link = stage_generate(eng, group, stage, prompts, steps, timeout_s, **kw)
        links.append(link)
        return gen
    m = measure_job(rc, replace(job, prompts=job.prompts[:rc.num_seqs], progress=False), generate)
    mine = _stage_record(stage, rc, m, links[-1])
    records = group.gather(mine, dst=group.world - 1)
    if not stage.is_last:
        return None
    return _report(rc, job, m, records)


def _stage_record(stage: Stage, rc: RunConfig, m: Measured, link) -> dict:
    """Where one stage's time went: compute, I/O between its tiers, waiting for the previous stage."""
    busy = m.busy_s
    compute = busy.pop(COMPUTE, 0.0) - link.wait_s  # waits for messages happen inside the stage's first compute
    stall = busy.pop("stall", 0.0)
    decode = [b for step, b in sorted(link.sent_by_step.items()) if step > 0]
    return {"stage": stage.index, "layers": stage.describe(rc.model.num_layers), "compute_s": compute,
            "io_s": sum(busy.values()), "io_stall_s": stall, "wait_s": link.wait_s, "sent_bytes": link.sent_bytes,
            "sent_bytes_prefill": link.sent_by_step.get(0, 0),
            "sent_bytes_per_decode_step": decode[0] if decode else 0, "received_bytes": link.received_bytes,
            "moved_bytes_per_step": m.moved, "peak_bytes": m.peaks, "plan_bytes": m.plan}


def _report(rc: RunConfig, job: Job, m: Measured, records: list) -> RunReport:
    """The head's report: its timings (the last stage emits every token), the placement and traffic summed over
    stages, the largest per-process peaks, and one record per stage."""
    def summed(key: str) -> dict:
        out: dict = {}
        for r in records:
            for tier, v in r[key].items():
                out[tier] = (out.get(tier, 0) + v) if not isinstance(v, dict) else {
                    k: out.get(tier, {}).get(k, 0) + x for k, x in v.items()}
        return out
    peaks = {t: max(r["peak_bytes"][t] for r in records) for t in records[0]["peak_bytes"]}
    report = RunReport(rc.model.name, policy_flags(rc), rc.num_seqs * len(m.rounds), rc.prompt_len, rc.gen_len,
                       m.prefill_s, m.decode_s, peaks, summed("moved_bytes_per_step"),
                       summed("plan_bytes"), threads=thread_settings(), predicted=job.predicted or {},
                       dtype_reason=job.dtype_reason, measured_steps=rc.gen_len, measured_decode_s=m.decode_s,
                       stages=records)
    return finish(job, report, m)


def refusal_exit(e: Refusal) -> int:
    """Every rank exits 2; only local rank 0 of each machine prints the line (so one machine shows it once)."""
    if local_rank() == 0:
        print(f"flexh2o-run: error: {one_line(e)}", file=sys.stderr)
    return 2
