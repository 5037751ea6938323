"""Numba kernels of the fused quantized-cache attention (compress/fused_attend.py calls them; imported only there,
lazily: numba may be missing, and then that module falls back to compress/attend.py).

Each kernel reads a slot's packed levels (uint8, compress/bits.py's order) straight into its products (`dot`,
`axpy`), so no slot is ever expanded: at `bits` a unit of U bytes (1, or 3 at 3 bits) holds P values (P = 8 / bits,
or 8 at 3 bits), unit u's value k being channel u P + k; the queries and the values' output are kept in *phase
order*, value k of every unit together (position k (d / P) + u), so the loop over a slot's units reads contiguous
memory on both sides and vectorises. The caller hands queries in phase order (fused_attend.phase_order) and puts
the values' output back in channel order; packed data comes as its flat bytes and element strides (a cut block's
slots are strided, each slot's bytes contiguous). Arithmetic in fp32 (fastmath: sums reassociated); the kernels are
compiled when this module is imported, once for every signature below (explicit signatures: no compile in the middle
of a run), and cached on disk.
Work is split over (row, KV head) pairs with numba's thread pool, as many threads as torch uses.
"""
from __future__ import annotations

import numba
import numpy as np

F4 = "float32[:, :, :, ::1]"  # made contiguous by the caller (queries, outputs, scales: small)
A4 = "float32[:, :, :, :]"  # any strides (the probabilities, the outliers' values of a cut block)
STRIDES = "uint8[::1], int64, int64, int64, int64"  # packed data: flat bytes, its (row, head, slot) strides, width
OPTS = dict(fastmath=True, cache=True, nogil=True)


@numba.njit(inline="always", **OPTS)
def dot(row, q, bits):
    """q (n,) fp32 in phase order . the n levels packed in `row` (module docstring)."""
    n = q.shape[0]
    acc = np.float32(0.0)
    if bits == 4:
        h = n // 2
        for u in range(h):
            x = row[u]
            acc += q[u] * np.float32(x & 15) + q[h + u] * np.float32(x >> 4)
    elif bits == 8:
        for u in range(n):
            acc += q[u] * np.float32(row[u])
    elif bits == 2:
        h = n // 4
        for u in range(h):
            x = row[u]
            acc += (q[u] * np.float32(x & 3) + q[h + u] * np.float32((x >> 2) & 3)
                    + q[2 * h + u] * np.float32((x >> 4) & 3) + q[3 * h + u] * np.float32(x >> 6))
    else:  # 3 bits: 8 values in each 3 bytes, read as one little-endian word
        h = n // 8
        for u in range(h):
            w = np.int32(row[3 * u]) | (np.int32(row[3 * u + 1]) << 8) | (np.int32(row[3 * u + 2]) << 16)
            for k in range(8):
                acc += q[k * h + u] * np.float32((w >> (3 * k)) & 7)
    return acc


@numba.njit(inline="always", **OPTS)
def axpy(row, w, out, bits):
    """out (n,) fp32 in phase order += w * the n levels packed in `row`."""
    n = out.shape[0]
    if bits == 4:
        h = n // 2
        for u in range(h):
            x = row[u]
            out[u] += w * np.float32(x & 15)
            out[h + u] += w * np.float32(x >> 4)
    elif bits == 8:
        for u in range(n):
            out[u] += w * np.float32(row[u])
    elif bits == 2:
        h = n // 4
        for u in range(h):
            x = row[u]
            out[u] += w * np.float32(x & 3)
            out[h + u] += w * np.float32((x >> 2) & 3)
            out[2 * h + u] += w * np.float32((x >> 4) & 3)
            out[3 * h + u] += w * np.float32(x >> 6)
    else:
        h = n // 8
        for u in range(h):
            x = np.int32(row[3 * u]) | (np.int32(row[3 * u + 1]) << 8) | (np.int32(row[3 * u + 2]) << 16)
            for k in range(8):
                out[k * h + u] += w * np.float32((x >> (3 * k)) & 7)


def _channel_logits(qs, c0, qf, middle, data, sb, sh, st, width, index, exact, bits, out):
    """Keys per channel (compress/channel.py), q (b, h, g, d) -> out (b, h, g, slots): qs = q * scale in phase
    order, c0 = q . minimum (b, h, g, 1), qf = q in channel order, middle = minimum + 2**(bits-1) scale
    (b, h, 1, d), data the packed levels (flat, strides), index / exact (b, h, s, outliers): the outliers' channels
    and their values (fp32). out[s] = qs . levels[s] + c0 + sum over outliers j of qf[c_j] (exact_j - middle[c_j])."""
    b, h, g, d = qs.shape
    s, n = out.shape[3], index.shape[3]
    for r in numba.prange(b * h):
        bi, hi = r // h, r % h
        for t in range(s):
            o = bi * sb + hi * sh + t * st
            row = data[o:o + width]
            for gi in range(g):
                acc = c0[bi, hi, gi, 0] + dot(row, qs[bi, hi, gi], bits)
                for j in range(n):
                    c = index[bi, hi, t, j]
                    acc += qf[bi, hi, gi, c] * (exact[bi, hi, t, j] - middle[bi, hi, 0, c])
                out[bi, hi, gi, t] = acc


def _group_logits(qp, qsum, data, sb, sh, st, width, scale, lo, bits, out):
    """Keys per token in groups (compress/codec.py), q (b, h, g, d) -> out (b, h, g, slots): qp = q in phase order
    within each group, qsum (b, h, g, groups) its sums per group, data the packed levels (flat, strides; a slot's
    groups one after another, `width` bytes each), scale / lo (b, h, s, groups) fp32.
    out[s] = sum over groups G of scale[s, G] (qp_G . levels[s, G]) + lo[s, G] qsum_G."""
    b, h, g, d = qp.shape
    s, groups = out.shape[3], scale.shape[3]
    size = d // groups
    for r in numba.prange(b * h):
        bi, hi = r // h, r % h
        for t in range(s):
            for gi in range(g):
                acc = np.float32(0.0)
                for G in range(groups):
                    o = bi * sb + hi * sh + t * st + G * width
                    part = dot(data[o:o + width], qp[bi, hi, gi, G * size:(G + 1) * size], bits)
                    acc += scale[bi, hi, t, G] * part + lo[bi, hi, t, G] * qsum[bi, hi, gi, G]
                out[bi, hi, gi, t] = acc


def _group_mix(p, data, sb, sh, st, width, scale, lo, bits, out):
    """Values per token in groups, p (b, h, g, slots) fp32 -> out (b, h, g, d) in phase order within each group:
    out_G = sum over slots t of (p[t] scale[t, G]) levels[t, G] + p[t] lo[t, G]. A slot given probability 0 (an
    empty or masked one) is skipped."""
    b, h, g, d = out.shape
    s, groups = p.shape[3], scale.shape[3]
    size = d // groups
    for r in numba.prange(b * h):
        bi, hi = r // h, r % h
        low = np.zeros((g, groups), np.float32)
        for gi in range(g):
            out[bi, hi, gi, :] = 0.0
        for t in range(s):
            for gi in range(g):
                pr = p[bi, hi, gi, t]
                if pr == 0.0:
                    continue
                for G in range(groups):
                    o = bi * sb + hi * sh + t * st + G * width
                    axpy(data[o:o + width], pr * scale[bi, hi, t, G], out[bi, hi, gi, G * size:(G + 1) * size], bits)
                    low[gi, G] += pr * lo[bi, hi, t, G]
        for gi in range(g):
            for G in range(groups):
                out[bi, hi, gi, G * size:(G + 1) * size] += low[gi, G]


def _ring_logits(qm, ring, rslot, out):
    """The exact ring over logits `out` (b, h, g, slots) (compress/recent.py's ring_logits): qm (b, h, g, d) the
    query in the model's basis, ring (b, h, E, d) the entries' values, rslot (b, h, E) the slot each names (-1 or
    past the slots: none); a named slot's logit becomes qm . its entry's values."""
    b, h, g, d = qm.shape
    s, e = out.shape[3], rslot.shape[2]
    for r in numba.prange(b * h):
        bi, hi = r // h, r % h
        for j in range(e):
            t = rslot[bi, hi, j]
            if t < 0 or t >= s:
                continue
            for gi in range(g):
                acc = np.float32(0.0)
                for c in range(d):
                    acc += qm[bi, hi, gi, c] * ring[bi, hi, j, c]
                out[bi, hi, gi, t] = acc


def _ring_split(p, ring, rslot, rest, exact):
    """The exact ring's share of a value mix (compress/recent.py's ring_mix): p (b, h, g, slots) -> rest = p with
    the ring's slots at 0, exact (b, h, g, d) = sum over entries of p[its slot] times its values (model basis)."""
    b, h, g, s = p.shape
    e, d = rslot.shape[2], ring.shape[3]
    for r in numba.prange(b * h):
        bi, hi = r // h, r % h
        for gi in range(g):
            rest[bi, hi, gi, :] = p[bi, hi, gi, :]
            exact[bi, hi, gi, :] = 0.0
        for j in range(e):
            t = rslot[bi, hi, j]
            if t < 0 or t >= s:
                continue
            for gi in range(g):
                w = p[bi, hi, gi, t]
                rest[bi, hi, gi, t] = 0.0
                for c in range(d):
                    exact[bi, hi, gi, c] += w * ring[bi, hi, j, c]


PAR = dict(parallel=True, **OPTS)
channel_logits = numba.njit([f"void({F4}, {F4}, {F4}, {F4}, {STRIDES}, {ix}[:, :, :, :], {A4}, int64, {F4})"
                             for ix in ("uint8", "int16")], **PAR)(_channel_logits)
group_logits = numba.njit(f"void({F4}, {F4}, {STRIDES}, {F4}, {F4}, int64, {F4})", **PAR)(_group_logits)
group_mix = numba.njit(f"void({A4}, {STRIDES}, {F4}, {F4}, int64, {F4})", **PAR)(_group_mix)
# the ring's: a few entries a row and head, on the calling thread (waking numba's pool costs more)
ring_logits = numba.njit(f"void({F4}, {A4}, int32[:, :, :], {F4})", **OPTS)(_ring_logits)
ring_split = numba.njit(f"void({A4}, {A4}, int32[:, :, :], {F4}, {F4})", **OPTS)(_ring_split)
