"""Numba kernels that write a quantized cache's stored form in one pass (compress/fused_write.py calls them;
imported only there, lazily, where compress/fused_attend.py's reader is the fused one).

The arithmetic is the torch code's, operation for operation, in fp32 without fastmath (no reassociation, no fused
multiply-add): the levels, the outliers and the packed bytes equal compress/channel.py's `quantize_token` and
compress/codec.py's `quantize` bit for bit (tests/kv/test_kv_fused_write.py checks them against those and
tests/reference_quant.py). Levels are packed as compress/bits.py says: value i of a row at bits
[i bits, (i + 1) bits) of its little-endian bit stream. Work is split over tokens with numba's thread pool where
there is enough of it (fused_write.PARALLEL_FROM).
"""
from __future__ import annotations

import numba
import numpy as np

OPTS = dict(cache=True, nogil=True)  # no fastmath: the results must equal torch's bit for bit


@numba.njit(inline="always", **OPTS)
def put_levels(q, out, bits):
    """Pack levels q (n,) (float, whole numbers below 2**bits) into out (n * bits / 8,) uint8."""
    acc = np.uint32(0)
    have = 0
    o = 0
    for i in range(q.shape[0]):
        acc |= np.uint32(np.int32(q[i])) << np.uint32(have)
        have += bits
        while have >= 8:
            out[o] = np.uint8(acc & np.uint32(255))
            acc >>= np.uint32(8)
            have -= 8
            o += 1


@numba.njit(inline="always", **OPTS)
def level(x, lo, scale, top):
    """round((x - lo) / scale) clamped to [0, top] (scale 0: divided by 1), as compress/codec.py's quantize."""
    q = np.rint((x - lo) / (scale if scale > np.float32(0.0) else np.float32(1.0)))
    return min(max(q, np.float32(0.0)), top)


def _channel_quant(x, calib, per, bits, data, index, exact):
    """Keys per channel (compress/channel.py's quantize_token): x (N, d) fp32, calib (N / per, d, 2) fp32 (token t
    reads calib[t // per]) -> data (N, d * bits / 8) levels, index (N, n) the n channels of largest error (ties to
    the lower channel, decreasing), exact (N, n) their values; an outlier's level is the middle one."""
    tokens, d = x.shape
    n = index.shape[1]
    top = np.float32((1 << bits) - 1)
    middle = np.float32(1 << (bits - 1))
    for t in numba.prange(tokens):
        c = calib[t // per]
        q = np.empty(d, np.float32)
        err = np.empty(d, np.float32)
        for j in range(d):
            s, lo = c[j, 0], c[j, 1]
            q[j] = level(x[t, j], lo, s, top)
            err[j] = abs(q[j] * s + lo - x[t, j])
        for k in range(n):
            best = -1
            for j in range(d):  # the largest error left; an equal one keeps the lower channel
                if err[j] >= np.float32(0.0) and (best < 0 or err[j] > err[best]):
                    best = j
            index[t, k] = best
            exact[t, k] = x[t, best]
            err[best] = np.float32(-1.0)  # taken
            q[best] = middle
        put_levels(q, data[t], bits)


def _group_minmax(x, size, out):
    """x (N, d) fp32 -> out (N, d / size, 2): each group's minimum and maximum."""
    tokens, d = x.shape
    for t in numba.prange(tokens):
        for g in range(d // size):
            lo = x[t, g * size]
            hi = lo
            for j in range(g * size + 1, (g + 1) * size):
                v = x[t, j]
                lo = min(lo, v)
                hi = max(hi, v)
            out[t, g, 0] = lo
            out[t, g, 1] = hi


def _group_levels(x, lo, scale, bits, data):
    """x (N, d) fp32, lo / scale (N, groups) fp32 (as stored, widened) -> data (N, groups, size * bits / 8)."""
    tokens, d = x.shape
    groups = lo.shape[1]
    size = d // groups
    top = np.float32((1 << bits) - 1)
    for t in numba.prange(tokens):
        q = np.empty(size, np.float32)
        for g in range(groups):
            for j in range(size):
                q[j] = level(x[t, g * size + j], lo[t, g], scale[t, g], top)
            put_levels(q, data[t, g], bits)


def _group_quant32(x, bits, data, meta):
    """_group_minmax and _group_levels in one pass for fp32 storage (where rounding a minimum down and a scale up
    to the storage dtype changes nothing): meta (N, groups, 2) = (scale, minimum), scale = (max - min) / levels."""
    tokens, d = x.shape
    groups = meta.shape[1]
    size = d // groups
    top = np.float32((1 << bits) - 1)
    for t in numba.prange(tokens):
        q = np.empty(size, np.float32)
        for g in range(groups):
            lo = x[t, g * size]
            hi = lo
            for j in range(g * size + 1, (g + 1) * size):
                lo = min(lo, x[t, j])
                hi = max(hi, x[t, j])
            scale = (hi - lo) / top
            meta[t, g, 0] = scale
            meta[t, g, 1] = lo
            for j in range(size):
                q[j] = level(x[t, g * size + j], lo, scale, top)
            put_levels(q, data[t, g], bits)


def _ring_put(rslot, recent, slot, pos, window, sinks, values):
    """A decode step's token into the exact ring (compress/recent.py's remember): rslot (b, h, E) int32, recent
    (b, h, E, w) the entries' bytes, slot (b, h) int32, pos (b,) the token's position, values (b, h, w) its bytes.
    An entry naming the slot is dropped first; the token takes sink entry window + pos when pos < sinks, else ring
    entry pos % window (none without a window)."""
    b, h, e = rslot.shape
    for r in numba.prange(b * h):
        bi, hi = r // h, r % h
        s = slot[bi, hi]
        for j in range(e):
            if rslot[bi, hi, j] == s:
                rslot[bi, hi, j] = -1
        p = pos[bi]
        en = window + p if p < sinks else (p % window if window > 0 else -1)
        if en >= 0:
            rslot[bi, hi, en] = s
            recent[bi, hi, en, :] = values[bi, hi, :]


PAR = dict(parallel=True, **OPTS)
X2 = "float32[:, ::1]"
CHANNEL = f"void({X2}, float32[:, :, ::1], int64, int64, uint8[:, ::1], int64[:, ::1], {X2})"
MINMAX = f"void({X2}, int64, float32[:, :, ::1])"
LEVELS = f"void({X2}, {X2}, {X2}, int64, uint8[:, :, ::1])"
# each over numba's threads (a prompt's tokens), and on the calling thread alone (`_1`: a decode step's few tokens,
# where waking the pool costs more than the work)
channel_quant, channel_quant_1 = (numba.njit(CHANNEL, **o)(_channel_quant) for o in (PAR, OPTS))
group_minmax, group_minmax_1 = (numba.njit(MINMAX, **o)(_group_minmax) for o in (PAR, OPTS))
group_levels, group_levels_1 = (numba.njit(LEVELS, **o)(_group_levels) for o in (PAR, OPTS))
QUANT32 = f"void({X2}, int64, uint8[:, :, ::1], float32[:, :, ::1])"
group_quant32, group_quant32_1 = (numba.njit(QUANT32, **o)(_group_quant32) for o in (PAR, OPTS))
ring_put = numba.njit("void(int32[:, :, :], uint8[:, :, :, :], int32[:, ::1], int64[::1], int64, int64, "
                      "uint8[:, :, ::1])", **OPTS)(_ring_put)  # a decode step's: small
