"""Phi-3: Llama's computation with fused projections (HF names self_attn.qkv_proj: q, k, v rows in that order;
mlp.gate_up_proj: gate rows then up rows), split after the matmul; an optional sliding window (ModelConfig.window)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from flexh2o.config import ModelConfig
from flexh2o.models.common import WeightSpec, linear, rowwise
from flexh2o.models.family import Family
from flexh2o.models.llama import HF_FIELDS, HF_WINDOWED, P, attention_specs, gguf_window, rms, self_attention
from flexh2o.models.llama import embed, head  # noqa: F401  (the family's embed and head are Llama's)
from flexh2o.models.llama import layer_specs as llama_specs

FAMILIES = (  # GGUF keeps the fused qkv (attn_qkv) and gate_up (ffn_up) tensors as Hugging Face has them
    Family("phi3", hf_model_types=("phi3",), hf_fields=HF_FIELDS + HF_WINDOWED, gguf_arch="phi3",
           gguf_keys=("attention.sliding_window",),
           gguf_tensors={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
           gguf_facts=lambda a, *_: gguf_window(a)),
)


def layer_specs(cfg: ModelConfig) -> list:
    specs = llama_specs(cfg)
    return [specs[0]] + [_block_specs(cfg, i) for i in range(cfg.num_layers)] + [specs[-1]]


def _block_specs(cfg: ModelConfig, i: int) -> list:
    h, f = cfg.hidden, cfg.ffn
    p = f"{P}layers.{i}."
    return ([WeightSpec(p + "input_layernorm.weight", (h,), "ones")] +
            attention_specs(cfg, p + "self_attn.", fused=True) +
            [WeightSpec(p + "post_attention_layernorm.weight", (h,), "ones"),
             WeightSpec(p + "mlp.gate_up_proj.weight", (2 * f, h)),
             WeightSpec(p + "mlp.down_proj.weight", (h, f))])


def block(cfg: ModelConfig, w: dict, i: int, x: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
    p = f"{P}layers.{i}."
    y = rms(x, w[p + "input_layernorm.weight"], cfg.norm_eps)
    q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    q, k, v = linear(y, w[p + "self_attn.qkv_proj.weight"]).split([q_rows, kv_rows, kv_rows], -1)
    x = x + self_attention(cfg, w, i, q, k, v, positions, attend)
    y = rms(x, w[p + "post_attention_layernorm.weight"], cfg.norm_eps)
    gate_up, down = w[p + "mlp.gate_up_proj.weight"], w[p + "mlp.down_proj.weight"]
    return x + rowwise(lambda r: linear(_swiglu(linear(r, gate_up)), down), y, 2 * cfg.ffn)


def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return up * F.silu(gate)
