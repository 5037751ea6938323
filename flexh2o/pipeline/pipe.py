"""What an engine running one pipeline stage is handed: its schedule and the boundary messages of its layers.

The engine stays a single-stage engine: it runs the ops it is given, posts the receives and sends the outputs the
schedule names, and asks `feeds(op)` whether a compute reads its input from the previous stage.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from flexh2o.pipeline.split import Stage
from flexh2o.pipeline.group import ignore_stop_signals
from flexh2o.pipeline.transport import Ring, StageLost
from flexh2o.models import layer_specs
from flexh2o.placement import Placement, WeightHomes, block_homes
from flexh2o.run_config import RunConfig
from flexh2o.schedule.stage_plan import batch_groups, source, stage_schedule


class StagePipe:
    def __init__(self, stage: Stage, ring: Ring, total_layers: int):
        self.stage, self.ring, self.total = stage, ring, total_layers

    def schedule(self, num_steps: int, num_batches: int, has_cache):
        s = self.stage
        return stage_schedule(num_steps, s.layers, self.total, batch_groups(num_batches, s.num_stages), has_cache,
                              s.num_stages)

    def feeds(self, op) -> bool:
        """Does this compute read the previous stage's output (hidden states, or the last stage's tokens)?"""
        return (self.stage.num_stages > 1 and op.layer == self.stage.first and (op.step, op.layer) != (0, 0))

    def post(self, op, shape: tuple, dtype: torch.dtype) -> None:
        self._lost_ends_quietly(self.ring.post, (op.step, op.layer, op.batch), shape, dtype)

    def take(self, op) -> torch.Tensor:
        return self._lost_ends_quietly(self.ring.take, (*source(op.step, op.layer, self.total), op.batch))

    def send(self, op, tensor: torch.Tensor) -> None:
        self._lost_ends_quietly(self.ring.send, (op.step, op.layer, op.batch), tensor)

    def close(self) -> None:
        self._lost_ends_quietly(self.ring.close)

    @staticmethod
    def _lost_ends_quietly(fn, *args):
        try:
            return fn(*args)
        except StageLost:
            ignore_stop_signals()  # torchrun is about to stop this rank too: let the cleanup finish first
            raise


def stage_placement(rc: RunConfig, stage: Stage) -> Placement:
    """Homes of the stage's own tensors only: --percent applies within the stage (its weights split by bytes, its
    cache blocks and the activation blocks by count); layers of other stages have no weights and no cache here."""
    specs = [sp if layer in stage.layers else [] for layer, sp in enumerate(layer_specs(rc.model))]
    nb, L = rc.num_gpu_batches, rc.model.num_layers
    own = [layer - 1 for layer in stage.layers if 1 <= layer <= L]  # cache layers of this stage
    rows = block_homes(len(own), nb, rc.percent.shares("cache"))
    cache = tuple(tuple(rows[own.index(i)]) if i in own else () for i in range(L))
    acts = tuple(block_homes(1, nb, rc.percent.shares("activations"))[0])
    return Placement(WeightHomes.build(specs, rc.percent.shares("weights")), cache, acts)


def stage_config(rc: RunConfig, stage: Stage, device: torch.device) -> RunConfig:
    """The RunConfig of one stage: its placement and its compute device (a rank's own GPU on CUDA)."""
    return replace(rc, device=str(device)).placed(stage_placement(rc, stage))
