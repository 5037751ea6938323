"""Numba kernel of a whole decode attention over a quantized block: keys per channel, values per token in whole
groups, either rotated or not, with or without the exact ring (compress/fused_decode.py calls it; imported only
there, lazily, where compress/fused_kernels.py already runs).

One parallel region a layer and segment, each (row, KV head) pair on one thread from the query to the output:
  the query rotated (q H, in fp32) and scaled per channel in phase order (fused_kernels' dot reads it so),
  logits of every slot from the packed key levels and the outliers (compress/fused_attend.py's channel read),
  the ring's slots' logits from its exact keys (model basis: the query as given), scaled by 1/sqrt(d) (and
  soft-capped), -inf where the slot is empty, softmax (sum over the query heads written out for a scoring policy),
  the ring's slots' probabilities moved onto its exact values, the rest mixed from the packed value levels
  (fused_attend.py's group mix), put back in channel order and rotated back (y H^T) with the exact share added.
The torch ops and four small matmuls around the separate kernels (about 30 passes, each waking the thread pool)
become one call. Arithmetic in fp32 (fastmath: sums reassociated), as the separate kernels'. Both rotations are fast
Walsh-Hadamard transforms (`_fwht`). `step_attend` first writes the step's new token of each pair (compress/
fused_quant_kernels.py's put_pair, compiled apart without fastmath: step_put's bytes) and then reads it, one thread
a pair: kv/decode.py takes it where the rows hold their tokens in order.
"""
from __future__ import annotations

import numba
import numpy as np

from flexh2o.compress.fused_kernels import OPTS, axpy, dot
from flexh2o.compress.fused_quant_kernels import STEP_ARGS, put_pair

F32 = np.float32


@numba.njit(inline="always", **OPTS)
def _fwht(x, hm, out):
    """out (d,) = x (d,) H (compress/rotation.py's block diagonal of Sylvester matrices scaled by 1 / sqrt(n),
    largest block first; symmetric, so H^T too) by a fast Walsh-Hadamard transform per block, n log n sums and
    differences and the block's scale as H holds it (hm[start, start]), as compress/fused_quant_kernels.py's
    rotate_token (kept here: numba's cache is keyed on the file that defines a kernel). The product within fp32
    rounding, about 10x fewer operations at head_dim 64."""
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


@numba.njit(**OPTS)
def _queries(q, hm, rot, ph, calib, half, qr, qs, c0, qm):
    """q (g, d) -> qr (g, d) in the stored basis (q H when rot), qs (g, d) = qr * scale in phase order (ph: the
    channel at each position), c0 (g,) = qr . minimum, qm (g, d) = qr * the middle level's value (an outlier's
    stored level: minimum + half scale); calib (d, 2) the keys' (scale, minimum)."""
    g, d = q.shape
    for gi in range(g):
        if rot:
            _fwht(q[gi], hm, qr[gi])
        else:
            qr[gi, :] = q[gi, :]
        acc = F32(0.0)
        for c in range(d):
            acc += qr[gi, c] * calib[c, 1]
            qm[gi, c] = qr[gi, c] * (calib[c, 1] + half * calib[c, 0])
        c0[gi] = acc
        for j in range(d):
            qs[gi, j] = qr[gi, ph[j]] * calib[ph[j], 0]


@numba.njit(**OPTS)
def _logits(qs, c0, qr, qm, data, base, st, width, index, exact, bits, lg):
    """lg (g, used) = each slot's q . k from its packed levels, each outlier's q[c] exact - qm[c] added (its
    exact value in place of the middle level's)."""
    g, used = lg.shape
    n = index.shape[1]
    for gi in range(g):  # a query head's rows hoisted: measured 1.4x faster than the slot loop outside
        qh, rh, mh, ch = qs[gi], qr[gi], qm[gi], c0[gi]
        for t in range(used):
            o = base + t * st
            acc = ch + dot(data[o:o + width], qh, bits)
            for j in range(n):
                c = index[t, j]
                acc += rh[c] * exact[t, j] - mh[c]
            lg[gi, t] = acc


@numba.njit(**OPTS)
def _ring_softmax(q, ring, rslot, pos, inv, cap, lg):
    """The ring's slots' logits from its exact keys (q in the model's basis), all scaled by inv (soft-capped when
    cap > 0), then each query head's softmax over the slots with pos >= 0 (an empty slot gets 0), in place. No
    infinity is made (fastmath assumes none)."""
    g, used = lg.shape
    d = q.shape[1]
    for j in range(rslot.shape[0]):
        t = rslot[j]
        if t >= 0 and t < used:
            for gi in range(g):
                acc = F32(0.0)
                for c in range(d):
                    acc += q[gi, c] * ring[j, c]
                lg[gi, t] = acc
    for gi in range(g):
        row = lg[gi]
        if cap > 0.0:
            for t in range(used):
                row[t] = np.tanh(row[t] * inv / cap) * cap
        else:
            for t in range(used):
                row[t] = row[t] * inv
        top = F32(-3.0e38)
        for t in range(used):  # selects, not branches: these loops vectorise (measured 1.6x faster)
            top = max(top, row[t] if pos[t] >= 0 else F32(-3.0e38))
        total = F32(0.0)
        for t in range(used):
            e = np.exp(min(row[t] - top, F32(0.0)))  # an empty slot's logit may exceed top: no overflow
            e = e if pos[t] >= 0 else F32(0.0)
            row[t] = e
            total += e
        scale = F32(1.0) / total
        for t in range(used):
            row[t] = row[t] * scale


@numba.njit(**OPTS)
def _mix(p, data, base, st, width, meta, bits, ring, rslot, acc, low, ex):
    """acc (g, d) phase order within each group, low (g, groups), ex (g, d): the value mix of probabilities p
    (g, used), the ring's slots' share on its exact values (ex, model basis; p there set to 0), the rest from the
    packed levels: acc_G += p scale_G levels_G, low_G += p minimum_G."""
    g, used = p.shape
    groups, size = meta.shape[1], acc.shape[1] // meta.shape[1]
    acc[:, :] = 0.0
    low[:, :] = 0.0
    ex[:, :] = 0.0
    for j in range(rslot.shape[0]):
        t = rslot[j]
        if t >= 0 and t < used:
            for gi in range(g):
                w = p[gi, t]
                for c in range(ex.shape[1]):
                    ex[gi, c] += w * ring[j, c]
    for j in range(rslot.shape[0]):
        t = rslot[j]
        if t >= 0 and t < used:
            p[:, t] = 0.0
    for gi in range(g):
        ph, ah, lh = p[gi], acc[gi], low[gi]
        for t in range(used):
            pr = ph[t]
            if pr == 0.0:
                continue
            for G in range(groups):
                o = base + t * st + G * width
                axpy(data[o:o + width], pr * meta[t, G, 0], ah[G * size:(G + 1) * size], bits)
                lh[G] += pr * meta[t, G, 1]


@numba.njit(**OPTS)
def _finish(acc, low, ex, order, ht, rot, y, o, out):
    """out (g, d) = the mix in channel order (order: each channel's position in phase order within its group) plus
    its group's minimum term, rotated back (y H^T, ht = H^T) when rot, plus the ring's exact share (y, o: (d,)
    scratch)."""
    g, d = acc.shape
    size = d // low.shape[1]
    for gi in range(g):
        for c in range(d):
            G = c // size
            y[c] = acc[gi, G * size + order[c - G * size]] + low[gi, G]
        if rot:
            _fwht(y, ht, o)
        else:
            o[:] = y
        for c in range(d):
            out[gi, c] = o[c] + ex[gi, c]


@numba.njit(**OPTS)  # not inlined: a call of over 30 arguments is a *args call to numba, which it cannot inline
def _pair(bi, hi, q, hm, ht, rot, kph, kdata, ksb, ksh, kst, kw, kidx, kexact, calib, kbits, vorder, vdata, vsb, vsh,
          vst, vw, meta, vbits, pos, rk, rslotk, rv, rslotv, inv, cap, want, psum, out):
    """_attend's work of row bi, head hi."""
    g, d = q.shape[2], q.shape[3]
    used, groups = psum.shape[2], meta.shape[3]
    qr, qs, qm, c0 = np.empty((g, d), F32), np.empty((g, d), F32), np.empty((g, d), F32), np.empty(g, F32)
    lg, acc, ex = np.empty((g, used), F32), np.empty((g, d), F32), np.empty((g, d), F32)
    low, y, o = np.empty((g, groups), F32), np.empty(d, F32), np.empty(d, F32)
    _queries(q[bi, hi], hm, rot, kph, calib[bi, hi], F32(1 << (kbits - 1)), qr, qs, c0, qm)
    _logits(qs, c0, qr, qm, kdata, bi * ksb + hi * ksh, kst, kw, kidx[bi, hi], kexact[bi, hi], kbits, lg)
    _ring_softmax(q[bi, hi], rk[bi, hi], rslotk[bi, hi], pos[bi, hi], inv, cap, lg)
    if want:
        for t in range(used):
            psum[bi, hi, t] = lg[:, t].sum()
    _mix(lg, vdata, bi * vsb + hi * vsh, vst, vw, meta[bi, hi], vbits, rv[bi, hi], rslotv[bi, hi], acc, low, ex)
    _finish(acc, low, ex, vorder, ht, rot, y, o, out[bi, hi])


def _attend(q, hm, ht, rot, kph, kdata, ksb, ksh, kst, kw, kidx, kexact, calib, kbits,
            vorder, vdata, vsb, vsh, vst, vw, meta, vbits, pos, rk, rslotk, rv, rslotv, inv, cap, want, psum, out):
    """The module docstring's attention of q (b, h, g, d) fp32 (model basis) over `used` = psum.shape[2] slots:
    packed keys (flat bytes, their row, head, slot strides, bytes a slot) with outliers kidx / kexact (b, h, s, n)
    and calib (b, h, d, 2); packed values likewise, meta (b, h, s, groups, 2) their (scale, minimum); pos
    (b, h, >= used); rings rk / rv (b, h, E, d) and their slots rslotk / rslotv (b, h, E) (E may be 0). -> out
    (b, h, g, d) fp32, model basis; psum (b, h, used) the probabilities summed over g when `want`."""
    b, h = q.shape[:2]
    for r in numba.prange(b * h):
        _pair(r // h, r % h, q, hm, ht, rot, kph, kdata, ksb, ksh, kst, kw, kidx, kexact, calib, kbits, vorder, vdata,
              vsb, vsh, vst, vw, meta, vbits, pos, rk, rslotk, rv, rslotv, inv, cap, want, psum, out)


def _step_attend(k, v, cur, in_order, hk, rotk, hv, rotv, wpos, score, slot, kdata4, kidx4, kexact4, calib4, kbits4,
                 vdata5, vmeta5, vbits5, krs, krec, kwin, ksink, vrs, vrec, vwin, vsink,
                 q, hm, ht, rot, kph, kdata, ksb, ksh, kst, kw, kidx, kexact, calib, kbits,
                 vorder, vdata, vsb, vsh, vst, vw, meta, vbits, pos, rk, rslotk, rv, rslotv, inv, cap, want, psum, out):
    """A decode step's write (compress/fused_quant_kernels.py's step_put: its arguments first, the block's parts
    whole) and then _attend's read (its arguments, the same parts cut to the slots read) of each (row, KV head) pair
    on one thread: the pair's parts are in cache for its read once written, and the write runs over the pool. The
    write is put_pair itself, compiled apart without fastmath: what it stores equals step_put's bit for bit."""
    b, h, d = k.shape
    for r in numba.prange(b * h):
        bi, hi = r // h, r % h
        x, qq, err = np.empty(d, F32), np.empty(d, F32), np.empty(d, F32)
        top_err, qv = np.empty(kidx4.shape[3], F32), np.empty(d // vmeta5.shape[3], F32)
        slot[bi, hi] = put_pair(bi, hi, k, v, cur, in_order, hk, rotk, hv, rotv, wpos, score, kdata4, kidx4, kexact4,
                                calib4, kbits4, vdata5, vmeta5, vbits5, krs, krec, kwin, ksink, vrs, vrec, vwin, vsink,
                                x, qq, err, top_err, qv)
        _pair(bi, hi, q, hm, ht, rot, kph, kdata, ksb, ksh, kst, kw, kidx, kexact, calib, kbits, vorder, vdata,
              vsb, vsh, vst, vw, meta, vbits, pos, rk, rslotk, rv, rslotv, inv, cap, want, psum, out)


A4, C4, FLAT = "float32[:, :, :, :]", "float32[:, :, :, ::1]", "uint8[::1], int64, int64, int64, int64"
attend = numba.njit([f"void({C4}, float32[:, ::1], float32[:, ::1], boolean, int64[::1], {FLAT}, {ix}[:, :, :, :], "
                     f"{A4}, {A4}, int64, int64[::1], {FLAT}, float32[:, :, :, :, :], int64, int64[:, :, :], {A4}, "
                     f"int32[:, :, :], {A4}, int32[:, :, :], float32, float32, boolean, float32[:, :, ::1], {C4})"
                     for ix in ("uint8", "int16")], parallel=True, **OPTS)(_attend)
step_attend = numba.njit([f"void({STEP_ARGS[ix]}, {C4}, float32[:, ::1], float32[:, ::1], boolean, int64[::1], {FLAT}, "
                          f"{ix}[:, :, :, :], {A4}, {A4}, int64, int64[::1], {FLAT}, float32[:, :, :, :, :], int64, "
                          f"int64[:, :, :], {A4}, int32[:, :, :], {A4}, int32[:, :, :], float32, float32, boolean, "
                          f"float32[:, :, ::1], {C4})" for ix in ("uint8", "int16")],
                         parallel=True, **OPTS)(_step_attend)
