"""Plain quantize-dequantize of a KV cache's keys and values, written apart from flexh2o/compress (loops over
heads, groups and tokens; fp32 storage, where rounding a scale or minimum to the storage dtype changes nothing).

Each function takes the K or V of one layer, x (T, kv, d), and prompt_len (the first tokens are the prompt) and
returns what a cache holding every token of x would give back. Given a list `margins`, each call also appends the
smallest distance of a level it rounded (unclamped, before rounding) from a rounding half (`near_half`): the engine
computes K and V in another order of summation, a few fp32 ulps away, so a level within float noise of a half may
round the other way there (one step's difference in one value; tests/kv/test_kv_sinks.py's vatp case met one).
Given a set `ties`, each call also adds the tokens (positions along x's first dimension) holding a level within
`tie_bound` of a half: the rounding of those the data decides, not the definition (`first_unsure_step`).
"""
from __future__ import annotations

from typing import Optional

import torch


def near_half(level: torch.Tensor, levels: int) -> float:
    """The smallest |level - (floor(level) + 1/2)| over the levels that rounding decides (those within [0, levels]);
    1 when there is none."""
    inside = (level >= 0) & (level <= levels)
    gap = (level - level.floor() - 0.5).abs()
    return float(torch.where(inside, gap, 1.0).min()) if level.numel() else 1.0


# fp32's unit roundoff, and how many of them the engine's and the reference's K/V may be apart relative to the
# magnitudes a level is computed from (|x| + |lo|): both compute each K/V value from the same fp32 operations in other
# orders of summation (hidden-64 dot products, a 16-term rotation, two layers), each within a few units of the exact
# value; measured: 9.3e-8 apart where |x| + |lo| ~ 0.5 (tests/kv/test_kv_sinks.py's vatp token: 3 units, 3.1e-6 of a
# 4-bit step). 8 units is about 3x that, the headroom NEAR_HALF takes in tests/kv/test_kv_sinks.py and test_kv_rotate.py.
FP32_UNIT = 2.0 ** -24
TIE_UNITS = 8


def tie_bound(x: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, levels: int) -> torch.Tensor:
    """In steps, per value: how far the engine's level (x - lo) / step may lie from the reference's when x, lo and
    hi = lo + levels * step each carry a relative error of TIE_UNITS units: (|dx| + |dlo|) / step for the
    numerator, plus level * |dstep| / step = level * (|dhi| + |dlo|) / (levels * step) for the step."""
    hi = lo + levels * step
    level = ((x - lo) / step).abs()
    return TIE_UNITS * FP32_UNIT * ((x.abs() + lo.abs()) / step + level * (hi.abs() + lo.abs()) / (levels * step))


def _add_ties(ties: Optional[set], x, level, lo, step, levels: int) -> None:
    """Add to `ties` the positions (x's first dimension) with a level (inside [0, levels]) within tie_bound of a
    rounding half: the engine may round it the other way (one step in one value). Not at 8 bits: there a flip moves
    one value by 1/255 of its range, against 1/3 at 2 bits and 1/7 at 3 bits, whose flips moved later logits by at
    most 3.1e-3 and 2.4e-3 under h2o (tests/kv/test_kv_rotate.py); scaled, 3.6e-5 and 6.6e-5, under the suite's 1e-4
    (and 8-bit levels lie within tie_bound of a half in most tokens, which would leave nothing to compare)."""
    if ties is None or levels >= 255:
        return
    safe = torch.where(step > 0, step, 1.0)
    near = ((level - level.floor() - 0.5).abs() < tie_bound(x, lo, safe, levels)) & (level >= 0) & \
        (level <= levels) & (step > 0)
    ties.update(near.reshape(near.shape[0], -1).any(-1).nonzero()[:, 0].tolist())


def first_unsure_step(ties: set, prompt_len: int, window: int, sinks: int) -> Optional[int]:
    """The first generation step whose logits may read a tied level (None: none): a quantized token j (not one of
    the sinks, which are read exact or through the 8-bit copy) is first read so by the query at
    max(j + window, prompt_len) (prefill's queries read exact K/V); step s's query sits at prompt_len - 1 + s."""
    first = [max(j + window, prompt_len) for j in ties if j >= sinks]
    return min(first) - (prompt_len - 1) if first else None


def fp8(value: float) -> float:
    """value as an fp8 e4m3 number holds it (3 mantissa bits; the cache clamps to +-448 first)."""
    return float(torch.tensor(min(max(value, -448.0), 448.0)).to(torch.float8_e4m3fn).float())


def per_token(bits: int, group: Optional[int], margins: Optional[list] = None, ties: Optional[set] = None):
    """FlexGen's scheme: every token and head in groups of `group` values along head_dim (None: the whole head_dim),
    each group's minimum and (max - min) / (2**bits - 1) step; a value becomes min + step * round((x - min) / step)."""
    levels = 2 ** bits - 1

    def quant(x: torch.Tensor, prompt_len: int) -> torch.Tensor:
        out = x.clone()
        T, kv, d = x.shape
        size = group or d
        for start in range(0, d, size):
            g = x[:, :, start:start + size]  # (T, kv, group): one group of every token and head
            lo = g.min(-1, keepdim=True).values
            step = (g.max(-1, keepdim=True).values - lo) / levels
            level = (g - lo) / torch.where(step > 0, step, 1.0)
            if margins is not None:
                margins.append(near_half(torch.where(step > 0, level, 0.0), levels))
            _add_ties(ties, g, level, lo, step, levels)
            out[:, :, start:start + size] = torch.round(level).clamp(0, levels) * step + lo
        return out
    return quant


def per_channel(bits: int, outliers: int, margins: Optional[list] = None, in_fp8: bool = False,
                ties: Optional[set] = None):
    """Keys per channel: each head's channel gets the minimum and (max - min) / (2**bits - 1) step of its values over
    the prompt; each token's value becomes min + step * level, the level rounded and clamped to [0, 2**bits - 1];
    then the `outliers` values of the token (per head) that this moved the most keep their exact value (ties: the
    lower channel), or with in_fp8 their value as fp8 holds it."""
    levels = 2 ** bits - 1

    def quant(x: torch.Tensor, prompt_len: int) -> torch.Tensor:
        out = x.clone()
        T, kv, d = x.shape
        for h in range(kv):
            prompt = x[:prompt_len, h]  # (n, d)
            lo = prompt.min(0).values
            step = (prompt.max(0).values - lo) / levels
            level = (x[:, h] - lo) / torch.where(step > 0, step, 1.0)  # (T, d)
            if margins is not None:
                margins.append(near_half(torch.where(step > 0, level, 0.0), levels))
            _add_ties(ties, x[:, h], level, lo, step, levels)
            out[:, h] = torch.round(level).clamp(0, levels) * step + lo
            for t, errors in enumerate((out[:, h] - x[:, h]).abs().tolist()):
                for _, c in sorted((-e, c) for c, e in enumerate(errors))[:outliers]:
                    out[t, h, c] = fp8(float(x[t, h, c])) if in_fp8 else x[t, h, c]
        return out
    return quant


def per_channel_fitted(bits: int, outliers: int, rounds: int = 25, in_fp8: bool = False):
    """Keys per channel with fitted levels (KVQuant's non-uniform datatype): each head's channel gets 2**bits
    levels from 1-D k-means over its values in the prompt: they start at the centres of 2**bits equal bins between
    the values' minimum and maximum; for `rounds` rounds each value joins its nearest level (equidistant: the lower)
    and each level that was joined moves to the mean of its values, the others stay. Every token's value then
    becomes its nearest level (equidistant: the lower); the outliers as in per_channel."""
    n = 2 ** bits

    def nearest(value: float, lv: list) -> int:
        best = 0
        for i in range(1, n):
            if abs(value - lv[i]) < abs(value - lv[best]):
                best = i
        return best

    def fit(values: list) -> list:
        lo, hi = min(values), max(values)
        lv = [lo + (hi - lo) * (i + 0.5) / n for i in range(n)]
        for _ in range(rounds):
            groups = [[] for _ in range(n)]
            for value in values:
                groups[nearest(value, lv)].append(value)
            lv = [sum(g) / len(g) if g else lv[i] for i, g in enumerate(groups)]
        return sorted(lv)

    def quant(x: torch.Tensor, prompt_len: int) -> torch.Tensor:
        out = x.clone()
        T, kv, d = x.shape
        xd = x.double()
        for h in range(kv):
            for c in range(d):
                lv = fit(xd[:prompt_len, h, c].tolist())
                lv32 = torch.tensor(lv, dtype=torch.float64).to(x.dtype).double().tolist()  # stored as x's dtype
                for t in range(T):
                    out[t, h, c] = lv32[nearest(float(xd[t, h, c]), lv32)]
            for t, errors in enumerate((out[:, h] - x[:, h]).abs().tolist()):
                for _, c in sorted((-e, c) for c, e in enumerate(errors))[:outliers]:
                    out[t, h, c] = fp8(float(x[t, h, c])) if in_fp8 else x[t, h, c]
        return out
    return quant


def rotation(d: int) -> torch.Tensor:
    """(d, d) fp32: for d a power of 2 the Hadamard matrix H[i][j] = (-1)**popcount(i & j) / sqrt(d), written
    entry by entry; otherwise a block diagonal of those, one block per power of 2 in d's binary expansion, the
    largest first."""
    out = torch.zeros(d, d)
    start = 0
    for bit in reversed(range(d.bit_length())):
        n = 1 << bit
        if not d & n:
            continue
        for i in range(n):
            for j in range(n):
                out[start + i, start + j] = (-1) ** bin(i & j).count("1") / n ** 0.5
        start += n
    return out


def rotated(quant):
    """quant in a rotated basis (after QuaRot): each token times `rotation(d)`, then quant's quantize-dequantize
    (a per-channel key's scales from the prompt's rotated keys, its outliers those of the rotated key), then times
    the rotation's transpose."""
    def quant_rotated(x: torch.Tensor, prompt_len: int) -> torch.Tensor:
        h = rotation(x.shape[-1])
        return quant(x.float() @ h, prompt_len) @ h.T
    return quant_rotated


def recent(keys, values, window: int, sinks: int = 0, near=None) -> tuple:
    """A cache that quantizes as keys and values say but keeps each sequence's newest `window` tokens and its first
    `sinks` tokens exact: the (keys, values, window, sinks, near) tuple tests/reference_forward.attention reads (query
    i reads token j exact when j > i - window or j < sinks); `near`: a quantize-dequantize those tokens are read
    through instead of exact (per_token(8, None): --cache-exact-bits 8), in the model's basis."""
    return keys, values, window, sinks, near
