"""Engine: wires tiers, weights, the KV cache, the policy and the block schedule; `generate` runs one batch job.

One generate() call is a `Run` (generation/run.py): the schedule's ops executed over the run's sequences, buffers and
layer compute, the rows of each compute op as the run's BatchPlan says (generation/batch_plan.py).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from flexh2o import models
from flexh2o.compress.kernels import kernel_available
from flexh2o.generation.batch_plan import BatchPlan
from flexh2o.generation.run import Generation
from flexh2o.generation.run import Run as _Run
from flexh2o.planning.kernel_phases import run_kernel_phases
from flexh2o.planning.memory_plan import plan_memory
from flexh2o.run_config import RunConfig
from flexh2o.sampling import Sampler
from flexh2o.storage.factory import make_tiers
from flexh2o.storage.freed_memory import return_freed_blocks
from flexh2o.weights.forms import kept_scale_names, kernel_layout, least_kernel
from flexh2o.weights.store import WeightStore


class Engine:
    """Holds the weights in their tiers for the engine's lifetime; use as a context manager (cleans up files)."""

    def __init__(self, rc: RunConfig, on_progress: Optional[Callable] = None):
        return_freed_blocks()  # freed transients leave the process, so its memory is what the plan counts
        plan = plan_memory(rc, kernel=least_kernel(rc))  # the least memory this run can take (weights/forms.py)
        plan.check()
        self.rc, self.cfg = rc, rc.model
        self.family = models.family(rc.model)
        self.device = torch.device(rc.device)
        self.policy = rc.kv.make(rc.model.num_layers)  # the run's one policy object
        usable = kernel_layout(rc) and kernel_available(rc.device)
        if rc.weight_kernel == "int4" and not usable:
            raise ValueError(f"--weight-kernel int4: this torch has no int4 kernel for device {rc.device} "
                             "(use --weight-kernel auto)")
        self.kernel = run_kernel_phases(rc, usable)
        self.plan = plan_memory(rc, kernel=self.kernel)  # as the phases take the weights
        self.plan.check()
        self.tiers = make_tiers(rc, need_disk=plan.total("disk") > 0)
        self.weights = None
        try:  # weights of a kernel shape grouped along the input dimension: kept in the int4 kernel's order
            kept = kept_scale_names(rc, rc.placement.weights, self.kernel) if self.plan.kept_scales else frozenset()
            self.weights = WeightStore(rc.placement.weights, self.tiers, rc.dtype, rc.compress_weight,
                                       kernel_layout(rc), kept)
            if rc.path == "_DUMMY_":
                self.weights.fill_dummy(rc.seed, on_progress)
            else:
                from flexh2o.weights.format import CheckpointReader
                self.weights.fill_from(CheckpointReader(rc.path), on_progress)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.weights is not None:
            self.weights.close()
            self.weights = None
        for tier in self.tiers.values():
            tier.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def generate(self, prompts: list, gen_len: int, sampler: Optional[Callable] = None, record_logits: bool = False,
                 on_step: Optional[Callable] = None, kept_stats: bool = False, pipe=None, stop_when=None,
                 batch_plan: Optional[BatchPlan] = None) -> Generation:
        """prompts: num_seqs lists of token ids (left-padded here). sampler(logits (b, vocab), step, rows) -> ids
        (b,): a Sampler, or a TeacherForcer to feed given tokens. kept_stats: also report tokens kept per layer.
        pipe: when this engine is one pipeline stage (pipeline/pipe.py), the stage's schedule and its messages.
        stop_when() -> True ends the run after that step (schedule/until.py; later steps' tokens stay 0).
        batch_plan: which of a GPU batch's rows are computed (generation/batch_plan.py; None: every row)."""
        return _Run(self, prompts, gen_len, sampler or Sampler(), record_logits, on_step, pipe, stop_when,
                    batch_plan).execute(kept_stats)
