"""Rotary position embeddings: the inverse frequencies of each rope type (default, linear, llama3), the cos/sin of
a layer's positions, and the rotation (rotate-half convention, as Hugging Face's checkpoints store q and k)."""
from __future__ import annotations

import math

import torch

from flexh2o.config import ModelConfig


def inv_freq(cfg: ModelConfig, layer: int, device=None) -> torch.Tensor:
    """(head_dim / 2,) fp32 inverse frequencies of decoder layer `layer`: Gemma 3's windowed layers use their own
    base (local_rope_theta) with plain RoPE; every other layer cfg.rope_theta with cfg.rope_type's scaling."""
    dim = cfg.head_dim
    local = cfg.local_rope_theta is not None and cfg.window(layer) is not None
    theta = cfg.local_rope_theta if local else cfg.rope_theta
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    if local or cfg.rope_type == "default":
        return inv
    if cfg.rope_type == "linear":
        return inv / cfg.rope_factor
    return _llama3(inv, cfg)


def _llama3(inv: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Llama 3.1: wavelengths longer than original_max / low_freq_factor are stretched by factor, those shorter than
    original_max / high_freq_factor kept, the band between interpolated smoothly."""
    old, factor = cfg.rope_original_max, cfg.rope_factor
    low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, smoothed, scaled)


def cos_sin(cfg: ModelConfig, layer: int, positions: torch.Tensor, dtype) -> tuple:
    """positions (b, t) -> cos, sin (b, 1, t, head_dim) in `dtype`."""
    ang = positions.float()[..., None] * inv_freq(cfg, layer, positions.device)  # (b, t, d/2)
    emb = torch.cat([ang, ang], dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
