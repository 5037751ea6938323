"""Plain quantize-dequantize of a KV cache's keys and values, written apart from flexh2o/compress (loops over
heads, groups and tokens; fp32 storage, where rounding a scale or minimum to the storage dtype changes nothing).

Each function takes the K or V of one layer, x (T, kv, d), and prompt_len (the first tokens are the prompt) and
returns what a cache holding every token of x would give back.
"""
from __future__ import annotations

import torch


def per_token(bits: int, group: int):
    """FlexGen's scheme: every token and head in groups of `group` values along head_dim, each group's minimum and
    (max - min) / (2**bits - 1) step; a value becomes min + step * round((x - min) / step)."""
    levels = 2 ** bits - 1

    def quant(x: torch.Tensor, prompt_len: int) -> torch.Tensor:
        out = x.clone()
        T, kv, d = x.shape
        for start in range(0, d, group):
            g = x[:, :, start:start + group]  # (T, kv, group): one group of every token and head
            lo = g.min(-1, keepdim=True).values
            step = (g.max(-1, keepdim=True).values - lo) / levels
            q = torch.round((g - lo) / torch.where(step > 0, step, 1.0)).clamp(0, levels)
            out[:, :, start:start + group] = q * step + lo
        return out
    return quant


def per_channel(bits: int, outliers: int):
    """Keys per channel: each head's channel gets the minimum and (max - min) / (2**bits - 1) step of its values over
    the prompt; each token's value becomes min + step * level, the level rounded and clamped to [0, 2**bits - 1];
    then the `outliers` values of the token (per head) that this moved the most keep their exact value (ties: the
    lower channel)."""
    levels = 2 ** bits - 1

    def quant(x: torch.Tensor, prompt_len: int) -> torch.Tensor:
        out = x.clone()
        T, kv, d = x.shape
        for h in range(kv):
            prompt = x[:prompt_len, h]  # (n, d)
            lo = prompt.min(0).values
            step = (prompt.max(0).values - lo) / levels
            level = torch.round((x[:, h] - lo) / torch.where(step > 0, step, 1.0)).clamp(0, levels)  # (T, d)
            out[:, h] = level * step + lo
            for t, errors in enumerate((out[:, h] - x[:, h]).abs().tolist()):
                for _, c in sorted((-e, c) for c, e in enumerate(errors))[:outliers]:
                    out[t, h, c] = x[t, h, c]
        return out
    return quant


def recent(keys, values, window: int, sinks: int = 0) -> tuple:
    """A cache that quantizes as keys and values say but keeps each sequence's newest `window` tokens and its first
    `sinks` tokens exact: the (keys, values, window, sinks) tuple tests/reference_kv.attention reads (query i reads
    token j exact when j > i - window or j < sinks)."""
    return keys, values, window, sinks
