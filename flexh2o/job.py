"""One batch job: build the engine, warm up, generate with a progress bar, write outputs and the report."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, Optional

from tqdm import tqdm

from flexh2o.engine import Engine
from flexh2o.jsonfile import write_json
from flexh2o.metrics import RssPeak, RunReport, append_json_line, peak_bytes, thread_settings
from flexh2o.prompts import fill_batch
from flexh2o.run_config import RunConfig
from flexh2o.sampling import Sampler


@dataclass
class Job:
    prompts: list
    sampler: Sampler
    output_file: Optional[str] = None
    log_file: Optional[str] = None
    tokenizer: object = None
    warmup: bool = True
    progress: bool = False
    predicted: Optional[dict] = None
    dtype_reason: str = ""  # why these storage/compute dtypes (planning/dtype_choice.py)
    measured_steps: Optional[int] = None  # --cut-gen-len: steps actually run; decode is projected to gen_len


def rounds_of(prompts: list, num_seqs: int) -> list:
    """The prompts in rounds of at most num_seqs (every prompt runs; the last round is filled by fill_batch)."""
    return [prompts[i:i + num_seqs] for i in range(0, len(prompts), num_seqs)]


def warm_up(eng: Engine, prompts: list, num_seqs: int, generate: Optional[Callable] = None) -> None:
    """The untimed warm-up of a job (this loop's and batch/run.py's): 2 steps over the first round's prompts cut
    to 8 tokens. generate: as measure_job's."""
    (generate or _engine_generate)(eng, fill_batch([list(p[:8]) for p in prompts[:num_seqs]], num_seqs), 2)


@dataclass
class Measured:
    """What the job loop measured: one Generation per round, bytes loaded per step from each tier, peaks."""
    rounds: list
    gens: list
    steps: int  # decode steps run per round (--cut-gen-len may run fewer than gen_len)
    moved: dict
    peaks: dict
    plan: dict  # the engine's memory plan, bytes per tier and kind
    weight_seconds: dict
    kernel: dict

    @property
    def prefill_s(self) -> float:
        return sum(g.prefill_s for g in self.gens)

    @property
    def decode_s(self) -> float:
        return sum(g.decode_s for g in self.gens)

    @property
    def busy_s(self) -> dict:
        """op kind -> seconds in its handlers over every round ('stall': waiting for loads)."""
        return _summed(g.busy_s for g in self.gens)

    @property
    def decode_busy_s(self) -> dict:
        return _summed(g.decode_busy_s for g in self.gens)


def run_job(rc: RunConfig, job: Job) -> RunReport:
    m = measure_job(rc, job)
    measured, steps = m.decode_s, m.steps
    decode_s = measured if steps == rc.gen_len else measured / (steps - 1) * (rc.gen_len - 1)
    report = RunReport(rc.model.name, policy_flags(rc), rc.num_seqs * len(m.rounds), rc.prompt_len, rc.gen_len,
                       m.prefill_s, decode_s, m.peaks, m.moved, m.plan,
                       threads=thread_settings(), predicted=job.predicted or {}, dtype_reason=job.dtype_reason,
                       measured_steps=steps, measured_decode_s=measured)
    report.policy["rounds"] = len(m.rounds)
    report.busy_s, report.decode_busy_s = m.busy_s, m.decode_busy_s
    report.weight_seconds = m.weight_seconds
    report.weight_kernel = m.kernel
    return finish(job, report, m)


def measure_job(rc: RunConfig, job: Job, generate: Optional[Callable] = None) -> Measured:
    """The one job loop: build the engine, warm up (untimed), generate every round of the prompts with a progress
    bar. generate(eng, prompts, steps, **kw) -> Generation runs one round: Engine.generate by default, a pipeline
    stage passes its ring's (pipeline/job.py)."""
    generate = generate or _engine_generate
    rss = RssPeak()
    rounds = rounds_of(job.prompts, rc.num_seqs)
    with Engine(rc) as eng:
        if job.warmup:
            warm_up(eng, job.prompts, rc.num_seqs, generate)
        moved0 = {t: tier.bytes_loaded for t, tier in eng.tiers.items()}
        weights0 = _weight_seconds(eng)  # after the warm-up
        steps = job.measured_steps or rc.gen_len
        bar = tqdm(total=steps * len(rounds), desc="generate", unit="tok", disable=not job.progress,
                   file=sys.stderr)

        def on_step(step):
            rss.sample()
            bar.update(1)
        try:
            gens = [generate(eng, fill_batch(r, rc.num_seqs), steps, sampler=job.sampler, on_step=on_step)
                    for r in rounds]
        finally:
            bar.close()
        moved = {t: (tier.bytes_loaded - moved0[t]) // (steps * len(rounds)) for t, tier in eng.tiers.items()}
        peaks = peak_bytes(eng, rss)
        weight_s = {p: {k: v - weights0.get(p, {}).get(k, 0.0) for k, v in got.items()}
                    for p, got in _weight_seconds(eng).items()}
    return Measured(rounds, gens, steps, moved, peaks, eng.plan.bytes, weight_s, dict(eng.kernel))


def finish(job: Job, report: RunReport, m: Measured) -> RunReport:
    """The warm-up note, --output-file (`steps` tokens per prompt, every prompt of every round), --log-file."""
    if not job.warmup:
        report.warmup = "no warm-up (--no-warmup)"
    if job.output_file:
        tokens = [t for g, r in zip(m.gens, m.rounds) for t in g.tokens[:len(r)].tolist()]
        write_outputs(job.output_file, tokens, job.tokenizer)
    if job.log_file:
        append_json_line(job.log_file, report.record())
    return report


def _engine_generate(eng: Engine, prompts: list, steps: int, **kw):
    return eng.generate(prompts, steps, **kw)


def _weight_seconds(eng) -> dict:
    return {p: dict(v) for p, v in eng.weights.seconds.items()}


def _summed(dicts) -> dict:
    out: dict = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0.0) + v
    return out


def policy_flags(rc: RunConfig) -> dict:
    b = rc.kv.budget
    return {"percent": str(rc.percent), "gpu_batch_size": rc.gpu_batch_size, "num_gpu_batches": rc.num_gpu_batches,
            "overlap": rc.overlap, "cpu_cache_compute": rc.cpu_cache_compute, "kv_policy": rc.kv.policy,
            "heavy": b.heavy if b else None, "recent": b.recent if b else None, "num_sinks": rc.kv.num_sinks,
            "dtype": str(rc.dtype).replace("torch.", ""), "compute_dtype": str(rc.compute).replace("torch.", ""),
            "decode_dtype": str(rc.decode_compute).replace("torch.", ""),
            "device": rc.device, "path": rc.path, "gpu_mem": rc.gpu_mem, "cpu_mem": rc.cpu_mem,
            "disk_mem": rc.disk_mem, "compress_weight": _spec(rc.compress_weight),
            "compress_cache": rc.compress_cache.describe() if rc.compress_cache else None}


def _spec(spec) -> Optional[str]:
    return f"{spec.bits}-bit, groups of {spec.group_size} along dim {spec.group_dim}" if spec else None


def write_outputs(path: str, tokens: list, tokenizer=None) -> None:
    """JSON list, one object per sequence; written to a temporary file and renamed (never half-written)."""
    rows = [{"tokens": t} for t in tokens]
    if tokenizer is not None:
        for r in rows:
            r["text"] = tokenizer.decode(r["tokens"])
    write_json(path, rows)
