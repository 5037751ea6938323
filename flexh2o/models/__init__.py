"""Model families. Each module describes its tensors per layer and computes a layer from tensors it is handed.

Layer indices are shared by every family: 0 is the input embedding, 1..num_layers are decoder blocks,
num_layers + 1 is the output head. Families know nothing of tiers, buffers or schedules.

Families (ModelConfig.family -> module, each declared by its module's FAMILIES (models/family.py); FAMILY_MODULES
below gathers every module of this package that declares some, so a new family is its module alone; what each
adds, as ModelConfig fields):
  opt                    learned positions, LayerNorm, ReLU MLP, biases (opt.py)
  llama                  RoPE (rope_type default / linear / llama3), RMSNorm, SwiGLU, grouped KV heads (llama.py)
  mistral                llama + a sliding window on every layer (sliding_window) (llama.py)
  qwen2                  llama + q/k/v biases (attn_bias), windowed upper layers when the config asks (llama.py)
  qwen3                  llama + per-head q/k RMSNorm (qk_norm) and an explicit head_dim (head_size) (llama.py)
  phi3                   llama with fused qkv_proj and gate_up_proj, an optional window (phi3.py)
  gemma2, gemma3         scaled embedding, (1 + w) RMSNorms around attention and MLP, gelu_tanh, query_scalar,
                         alternating windowed / full layers (layer_kinds), logit soft-caps (gemma2), (1 + w) q/k
                         norms and a local RoPE base (gemma3) (gemma.py)
"""
from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType
from typing import Optional

from flexh2o.config import ModelConfig
from flexh2o.models.common import WeightSpec  # noqa: F401  (re-exported)
from flexh2o.models.family import Family

# The order the families are listed in (--help, refusals); a family module not named here follows these, by file name
LISTED_FIRST = ("opt", "llama", "phi3", "gemma")


def listing_order(module_name: str) -> tuple:
    """Sort key of a module of this package (its file name without .py) in the family listing."""
    first = module_name in LISTED_FIRST
    return (not first, LISTED_FIRST.index(module_name) if first else 0, module_name)


def discover() -> tuple:
    """Every module of this package that declares FAMILIES (a family module), in listing order."""
    names = sorted((m.name for m in pkgutil.iter_modules(__path__)), key=listing_order)
    found = (importlib.import_module(f"{__name__}.{name}") for name in names)
    return tuple(m for m in found if hasattr(m, "FAMILIES"))


# The one table of families: each module of this package with a FAMILIES declaration (its compute beside it).
FAMILY_MODULES = discover()


def families() -> tuple:
    """Every Family declared, in FAMILY_MODULES' order."""
    return tuple(f for m in FAMILY_MODULES for f in m.FAMILIES)


def family_names() -> tuple:
    return tuple(f.name for f in families())


def family_module(name: str) -> ModuleType:
    """The module that computes family `name`; ValueError naming the families for an unknown one."""
    for m in FAMILY_MODULES:
        if any(f.name == name for f in m.FAMILIES):
            return m
    raise ValueError(f"unknown model family {name!r}: use one of {', '.join(family_names())}")


def by_hf_model_type(model_type: str) -> Optional[Family]:
    """The family a config.json's model_type converts into; None for one no family reads."""
    return next((f for f in families() if model_type in f.hf_model_types), None)


def by_gguf_arch(arch: str) -> Optional[Family]:
    """The family whose GGUF architecture (general.architecture) is `arch`; None for one no family reads."""
    return next((f for f in families() if f.gguf_arch == arch), None)


def family(cfg: ModelConfig) -> ModuleType:
    return family_module(cfg.family)


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
