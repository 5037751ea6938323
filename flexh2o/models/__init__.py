"""Model families. Each module describes its tensors per layer and computes a layer from tensors it is handed.

Layer indices are shared by every family: 0 is the input embedding, 1..num_layers are decoder blocks,
num_layers + 1 is the output head. Families know nothing of tiers, buffers or schedules.

Families (ModelConfig.family -> module; what each adds, as ModelConfig fields):
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

from types import ModuleType

from flexh2o.config import ModelConfig
from flexh2o.models import gemma, llama, opt, phi3
from flexh2o.models.common import WeightSpec  # noqa: F401  (re-exported)

FAMILY_MODULES = {"opt": opt, "llama": llama, "mistral": llama, "qwen2": llama, "qwen3": llama, "phi3": phi3,
                  "gemma2": gemma, "gemma3": gemma}


def family(cfg: ModelConfig) -> ModuleType:
    return FAMILY_MODULES[cfg.family]


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
