"""Model families. Each module describes its tensors per layer and computes a layer from tensors it is handed.

Layer indices are shared by every family: 0 is the input embedding, 1..num_layers are decoder blocks,
num_layers + 1 is the output head. Families know nothing of tiers, buffers or schedules.
"""
from __future__ import annotations

from types import ModuleType

from flexh2o.config import ModelConfig
from flexh2o.models import llama, opt
from flexh2o.models.common import WeightSpec  # noqa: F401  (re-exported)

_FAMILIES = {"opt": opt, "llama": llama}


def family(cfg: ModelConfig) -> ModuleType:
    return _FAMILIES[cfg.family]


def layer_specs(cfg: ModelConfig) -> list:
    """List (one entry per layer index) of lists of WeightSpec."""
    return family(cfg).layer_specs(cfg)


def unique_specs(cfg: ModelConfig) -> dict:
    """name -> WeightSpec over all layers (tied tensors appear in two layers but are stored once)."""
    out = {}
    for specs in layer_specs(cfg):
        for s in specs:
            out[s.name] = s
    return out
