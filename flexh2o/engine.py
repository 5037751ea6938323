"""Engine: wires tiers, weights, the KV cache, the policy and the block schedule; `generate` runs one batch job.

One generate() call is a `Run` (generation/run.py): the schedule's ops executed over the run's sequences, buffers and
layer compute, the rows of each compute op as the run's BatchPlan says (generation/batch_plan.py).
"""
from __future__ import annotations

from contextlib import ExitStack
from typing import Callable, Optional

import torch

from flexh2o.compress.kernels import kernel_available
from flexh2o.generation.batch_plan import BatchPlan
from flexh2o.generation.run import Generation
from flexh2o.generation.run import Run as _Run
from flexh2o.planning.kernel_probe import cached_timer
from flexh2o.planning.weight_forms import run_plan
from flexh2o.run_config import RunConfig
from flexh2o.sampling import Sampler
from flexh2o.storage.factory import close_tiers, make_tiers
from flexh2o.storage.freed_memory import return_freed_blocks
from flexh2o.weights.forms import WeightForms
from flexh2o.weights.store import WeightStore


class Engine:
    """Holds the weights in their tiers for the engine's lifetime; use as a context manager (cleans up files)."""

    def __init__(self, rc: RunConfig, on_progress: Optional[Callable] = None):
        return_freed_blocks()  # freed transients leave the process, so its memory is what the plan counts
        self.plan = run_plan(rc, cached_timer, kernel_available(rc.device))  # the one plan, with its WeightForms
        self.rc, self.cfg = rc, rc.model
        self.device = torch.device(rc.device)
        self.policy = rc.kv.make(rc.model.num_layers)  # the run's one policy object
        self.tiers = make_tiers(rc, need_disk=self.plan.total("disk") > 0)
        self.weights = None
        with ExitStack() as undo:  # the tiers are released if the weights cannot be stored (from then on: close())
            undo.callback(close_tiers, self.tiers)
            # weights of a kernel shape grouped along the input dimension: kept in the int4 kernel's order
            source = rc.seed if rc.checkpoint is None else rc.checkpoint  # seeded dummy weights, or the checkpoint's
            self.weights = WeightStore(rc.placement.weights, self.tiers, self.plan.forms, self.plan.kept_scales > 0,
                                       source, on_progress)
            undo.pop_all()

    @property
    def forms(self) -> WeightForms:
        """How the run's weights are held and reach the compute side (its plan's, which the weight store holds)."""
        return self.plan.forms

    @property
    def kernel(self) -> dict:
        """phase -> whether the decoder blocks' matmuls run the int4 kernel (as the run reports it)."""
        return self.forms.kernel_by_phase()

    def close(self) -> None:
        if self.weights is not None:
            self.weights.close()
            self.weights = None
        close_tiers(self.tiers)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def generate(self, prompts: list, gen_len: int, sampler: Optional[Callable] = None, record_logits: bool = False,
                 on_step: Optional[Callable] = None, kept_stats: bool = False, pipe=None, stop_when=None,
                 batch_plan: Optional[BatchPlan] = None) -> Generation:
        """prompts: num_seqs lists of token ids (left-padded here). sampler(logits (b, vocab), step, rows) -> ids
        (b,): a Sampler, or a TeacherForcer to feed given tokens; the logits are the engine's, valid during the
        call (a run in 16 bits refills the same tensor the next step: copy what is kept). kept_stats: also report tokens kept per layer.
        pipe: when this engine is one pipeline stage (pipeline/pipe.py), the stage's schedule and its messages.
        stop_when() -> True ends the run after that step (schedule/until.py; later steps' tokens stay 0).
        batch_plan: which of a GPU batch's rows are computed (generation/batch_plan.py; None: every row)."""
        return _Run(self, prompts, gen_len, sampler or Sampler(), record_logits, on_step, pipe, stop_when,
                    batch_plan).execute(kept_stats)
