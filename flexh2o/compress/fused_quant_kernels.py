"""Numba kernels that write a quantized cache's stored form in one pass (compress/fused_write.py calls them;
imported only there, lazily, where compress/fused_attend.py's reader is the fused one).

The arithmetic is the torch code's, operation for operation, in fp32 without fastmath (no reassociation, no fused
multiply-add): the levels, the outliers and the packed bytes equal compress/channel.py's `quantize_token` and
compress/codec.py's `quantize` bit for bit (tests/kv/test_kv_fused_write.py checks them against those and
tests/reference_quant.py). Levels are packed as compress/bits.py says: value i of a row at bits
[i bits, (i + 1) bits) of its little-endian bit stream. Work is split over tokens with numba's thread pool where
there is enough of it (fused_write.PARALLEL_FROM).

A decode step's whole write (compress/fused_step.py: `step_put`) runs the same per-token bodies (`key_token`,
`group_token32`, `rotate_token`) for every row and head in one call on the calling thread, with the slot search,
both rings and the slot's position and score: about 20 torch ops and five kernel calls become one. They live in
this one file so that numba's cache, keyed on the file that defines a kernel, is renewed with any of them.
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


@numba.njit(inline="always", **OPTS)
def key_token(x, c, bits, q, err, top_err, data, index, exact):
    """One key x (d,) fp32 with its calibration c (d, 2) -> data its packed levels, index (n,) the n channels of
    largest error (ties to the lower channel, decreasing: a stable descending sort's first n, kept by insertion
    in one pass over the errors), exact (n,) their values (q, err: (d,) and top_err: (n,) scratch); an outlier's
    level is the middle one."""
    d, n = x.shape[0], index.shape[0]
    top = np.float32((1 << bits) - 1)
    middle = np.float32(1 << (bits - 1))
    for j in range(d):
        q[j] = level(x[j], c[j, 1], c[j, 0], top)
        err[j] = abs(q[j] * c[j, 0] + c[j, 1] - x[j])
    kept = 0
    for j in range(d if n > 0 else 0):
        e = err[j]
        if kept == n and not e > top_err[n - 1]:
            continue  # not among the n largest so far (an equal error keeps the lower channel)
        i = kept if kept < n else n - 1
        while i > 0 and top_err[i - 1] < e:
            top_err[i], index[i] = top_err[i - 1], index[i - 1]
            i -= 1
        top_err[i], index[i] = e, j
        kept = min(kept + 1, n)
    for k in range(n):
        exact[k] = x[index[k]]
        q[index[k]] = middle
    put_levels(q, data, bits)


def _channel_quant(x, calib, per, bits, data, index, exact):
    """Keys per channel (compress/channel.py's quantize_token): x (N, d) fp32, calib (N / per, d, 2) fp32 (token t
    reads calib[t // per]) -> data (N, d * bits / 8) levels, index (N, n) the n channels of largest error (ties to
    the lower channel, decreasing), exact (N, n) their values; an outlier's level is the middle one."""
    tokens, d = x.shape
    for t in numba.prange(tokens):
        key_token(x[t], calib[t // per], bits, np.empty(d, np.float32), np.empty(d, np.float32),
                  np.empty(index.shape[1], np.float32), data[t], index[t], exact[t])


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


@numba.njit(inline="always", **OPTS)
def group_token32(x, bits, q, data, meta):
    """One token x (d,) fp32 in groups of d / groups -> data (groups, size * bits / 8) levels, meta (groups, 2)
    (scale, minimum) for fp32 storage, scale = (max - min) / levels (q: (size,) scratch)."""
    groups = meta.shape[0]
    size = x.shape[0] // groups
    top = np.float32((1 << bits) - 1)
    for g in range(groups):
        lo = x[g * size]
        hi = lo
        for j in range(g * size + 1, (g + 1) * size):
            lo = min(lo, x[j])
            hi = max(hi, x[j])
        scale = (hi - lo) / top
        meta[g, 0] = scale
        meta[g, 1] = lo
        for j in range(size):
            q[j] = level(x[g * size + j], lo, scale, top)
        put_levels(q, data[g], bits)


def _group_quant32(x, bits, data, meta):
    """_group_minmax and _group_levels in one pass for fp32 storage (where rounding a minimum down and a scale up
    to the storage dtype changes nothing): meta (N, groups, 2) = (scale, minimum), scale = (max - min) / levels."""
    tokens, d = x.shape
    size = d // meta.shape[1]
    for t in numba.prange(tokens):
        group_token32(x[t], bits, np.empty(size, np.float32), data[t], meta[t])


@numba.njit(inline="always", **OPTS)
def rotate_token(x, hm, out):
    """out (d,) = x (d,) H (compress/rotation.py's block diagonal of Sylvester matrices scaled by 1 / sqrt(n),
    largest block first) by a fast Walsh-Hadamard transform per block: sums and differences (n log n of them),
    then times the block's scale as H holds it (hm[start, start]). Within fp32 rounding of the product x @ H (each
    output a sum of the same +-x terms, in another order); no fastmath: the same bits wherever it runs."""
    d = x.shape[0]
    out[:] = x
    start, rest = 0, d
    while rest > 0:
        n = 1
        while n * 2 <= rest:
            n *= 2
        span = 1
        while span < n:
            for i in range(start, start + n, 2 * span):
                for j in range(i, i + span):
                    a, b = out[j], out[j + span]
                    out[j], out[j + span] = a + b, a - b
            span *= 2
        scale = hm[start, start]
        for j in range(start, start + n):
            out[j] = out[j] * scale
        start += n
        rest -= n


def _rotate_rows(x, hm, out):
    """out (N, d) = x (N, d) H (`rotate_token`), on the calling thread: a decode step's few tokens, where waking a
    thread pool costs more than the product (compress/rotation.py's rotate_step)."""
    for i in range(x.shape[0]):
        rotate_token(x[i], hm, out[i])


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


@numba.njit(inline="always", **OPTS)
def _free_slot(pos, p, in_order):
    """The slot a row's new token takes: its position in order, else the first empty one (0 when none is)."""
    if in_order:
        return p
    for t in range(pos.shape[0]):
        if pos[t] < 0:
            return t
    return 0


@numba.njit(inline="always", **OPTS)
def _ring_one(rslot, recent, s, p, window, sinks, x):
    """compress/recent.py's remember for one row and head: an entry naming slot s dropped, then the token at
    position p takes sink entry window + p (p < sinks) or ring entry p % window (none without a window)."""
    for j in range(rslot.shape[0]):
        if rslot[j] == s:
            rslot[j] = -1
    en = window + p if p < sinks else (p % window if window > 0 else -1)
    if en >= 0:
        rslot[en] = s
        recent[en, :] = x


@numba.njit(**OPTS)
def put_pair(bi, hi, k, v, cur, in_order, hk, rotk, hv, rotv, pos, score, kdata, kidx, kexact, calib, kbits, vdata,
             vmeta, vbits, krs, krec, kwin, ksink, vrs, vrec, vwin, vsink, x, q, err, top_err, qv) -> int:
    """_step_put's write of row bi, head hi (x, q, err: (d,), top_err: (outliers,), qv: (group size,) scratch) ->
    the slot written. Compiled apart (not inlined), so a caller compiled with fastmath
    (compress/fused_decode_kernels.py's step_attend) runs these very operations, bit for bit."""
    p = cur[bi]
    s = _free_slot(pos[bi, hi], p, in_order)
    if rotk:
        rotate_token(k[bi, hi], hk, x)
    else:
        x[:] = k[bi, hi]
    key_token(x, calib[bi, hi], kbits, q, err, top_err, kdata[bi, hi, s], kidx[bi, hi, s], kexact[bi, hi, s])
    _ring_one(krs[bi, hi], krec[bi, hi], s, p, kwin, ksink, k[bi, hi])
    if rotv:
        rotate_token(v[bi, hi], hv, x)
    else:
        x[:] = v[bi, hi]
    group_token32(x, vbits, qv, vdata[bi, hi, s], vmeta[bi, hi, s])
    _ring_one(vrs[bi, hi], vrec[bi, hi], s, p, vwin, vsink, v[bi, hi])
    pos[bi, hi, s] = p
    score[bi, hi, s] = np.float32(0.0)
    return s


def _step_put(k, v, cur, in_order, hk, rotk, hv, rotv, pos, score, slot, kdata, kidx, kexact, calib, kbits,
              vdata, vmeta, vbits, krs, krec, kwin, ksink, vrs, vrec, vwin, vsink):
    """k, v (b, h, d) fp32 in the model's basis, cur (b,) positions -> slot (b, h) the slots written; keys' parts
    kdata / kidx / kexact (b, h, S, .) and calib (b, h, d, 2), values' vdata (b, h, S, groups, width) and vmeta
    (b, h, S, groups, 2), rings (b, h, E[, d]) (E may be 0), pos / score (b, h, S) written at each slot."""
    b, h, d = k.shape
    x, q, err = np.empty(d, np.float32), np.empty(d, np.float32), np.empty(d, np.float32)
    top_err = np.empty(kidx.shape[3], np.float32)
    qv = np.empty(d // vmeta.shape[3], np.float32)
    for r in range(b * h):
        bi, hi = r // h, r % h
        slot[bi, hi] = put_pair(bi, hi, k, v, cur, in_order, hk, rotk, hv, rotv, pos, score, kdata, kidx, kexact,
                                calib, kbits, vdata, vmeta, vbits, krs, krec, kwin, ksink, vrs, vrec, vwin, vsink,
                                x, q, err, top_err, qv)


X3, F2, A4F = "float32[:, :, ::1]", "float32[:, ::1]", "float32[:, :, :, :]"
STEP_ARGS = {ix: f"{X3}, {X3}, int64[::1], boolean, {F2}, boolean, {F2}, boolean, int64[:, :, :], float32[:, :, :], "
                 f"int64[:, ::1], uint8[:, :, :, :], {ix}[:, :, :, :], {A4F}, {A4F}, int64, uint8[:, :, :, :, :], "
                 f"float32[:, :, :, :, :], int64, int32[:, :, :], {A4F}, int64, int64, int32[:, :, :], {A4F}, int64, "
                 f"int64" for ix in ("uint8", "int16")}  # step_put's (fused_decode_kernels.py's step_attend's too)
STEP = [f"void({STEP_ARGS[ix]})" for ix in ("uint8", "int16")]
step_put = numba.njit(STEP, **OPTS)(_step_put)  # a decode step's: on the calling thread (its misses, not its
# arithmetic, bound it; over numba's threads it measured no faster on 2 busy cores)
rotate_rows = numba.njit("void(float32[:, ::1], float32[:, ::1], float32[:, ::1])", **OPTS)(_rotate_rows)
