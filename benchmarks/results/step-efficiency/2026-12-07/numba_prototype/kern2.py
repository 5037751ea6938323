import numba, numpy as np
OPTS = dict(fastmath=True, cache=True, nogil=True)
F32 = np.float32

@numba.njit(parallel=True, **OPTS)
def attend16(q, kf, ks, vf, vs, T, scale, out):
    """q (b, h, d) fp32 C-contiguous; kf/vf: the cache's bf16 bits as flat uint16 from its first element, ks/vs
    (row, head, slot) element strides (d contiguous); out (b, h, d) fp32."""
    b, h, d = q.shape
    for p in numba.prange(b * h):
        r, hh = p // h, p % h
        qq = q[r, hh]
        u = np.empty(d, np.uint32)
        f = u.view(np.float32)
        s = np.empty(T, F32)
        m = F32(-np.inf)
        kb = r * ks[0] + hh * ks[1]
        for t in range(T):
            base = kb + t * ks[2]
            for i in range(d):
                u[i] = np.uint32(kf[base + i]) << np.uint32(16)
            acc = F32(0.0)
            for i in range(d):
                acc += qq[i] * f[i]
            acc *= scale
            s[t] = acc
            if acc > m:
                m = acc
        tot = F32(0.0)
        for t in range(T):
            e = np.exp(s[t] - m)
            s[t] = e
            tot += e
        o = out[r, hh]
        for i in range(d):
            o[i] = 0.0
        vb = r * vs[0] + hh * vs[1]
        inv = F32(1.0) / tot
        for t in range(T):
            base = vb + t * vs[2]
            for i in range(d):
                u[i] = np.uint32(vf[base + i]) << np.uint32(16)
            w = s[t] * inv
            for i in range(d):
                o[i] += w * f[i]
