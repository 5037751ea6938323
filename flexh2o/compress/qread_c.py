'''The C source of compress/qread_native.py: a decode step's attention over a quantized block read from its stored
form, the arithmetic of compress/fused_decode_kernels.py's `_pair` (the numba kernel it replaces where it builds).

For each (row, KV head) pair, threads taking the pairs in static shares, with G query heads:
  the query rotated (q H by a fast Walsh-Hadamard transform per block, when the block is rotated), times each key
    channel's scale (deinterleaved: byte u of a slot holds channel 2u in its low nibble, 2u + 1 in its high one),
    c0 = q . minimum and qm = q * (minimum + 8 scale), an outlier's stored (middle) level;
  logits l_t = c0 + q.levels_t + sum over the slot's outliers j of (q[c_j] exact_j - qm[c_j]), the exact ring's
    slots' logits q . key from its entries (the query in the model's basis), times 1 / sqrt(d) (tanh-capped where
    cap > 0), 0 where pos < 0, then a softmax in fp32 (exp by a degree-7 polynomial after range reduction);
  psum_t = the probabilities summed over the G heads (when asked);
  the ring's slots' probabilities times their exact values (model basis), the other slots' from the value levels:
    acc_G += p scale_{t,G} levels_{t,G}, low_G += p minimum_{t,G}, in channel order, rotated back (y H^T), plus
    the ring's share.
4-bit keys and values only; the head dimension and the value group a multiple of 32, d at most MAXD. The vector
kernels (compress/qread_simd.py) are intrinsics for AVX-512 and AVX2 and plain C for the generic build; the build's
flags choose which (compress/qread_native.py).
'''

from flexh2o.compress.qread_simd import KERNELS
from flexh2o.compress.qwrite_c import SOURCE as WRITE

SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define MAXD 256

typedef struct {
    int64_t b, h, g, d, used, n_out, groups, ek, ev, rot, idx16, want;
    float inv, cap;
    const float *q, *hm;
    const uint8_t *kdata; int64_t kb, kh, kt;
    const void *kidx; int64_t ib, ih, it;
    const float *kexact; int64_t xb, xh, xt;
    const float *calib; int64_t cb, ch;
    const uint8_t *vdata; int64_t vb, vh, vt;
    const float *meta; int64_t mb, mh, mt;
    const int64_t *pos; int64_t pb, ph;
    const float *rk; int64_t rkb, rkh, rke;
    const int32_t *sk; int64_t skb, skh;
    const float *rv; int64_t rvb, rvh, rve;
    const int32_t *sv; int64_t svb, svh;
    float *psum, *out;
} QRead;

/* out = x H per block (largest power-of-two block first), scaled as H holds it (hm[s, s]). */
static void fwht(const float *x, const float *hm, int64_t d, float *out) {
    memcpy(out, x, d * sizeof(float));
    for (int64_t start = 0, rest = d; rest > 0;) {
        int64_t n = 1;
        while (n * 2 <= rest) n *= 2;
        for (int64_t span = 1; span < n; span *= 2)
            for (int64_t i = start; i < start + n; i += 2 * span)
                #pragma omp simd
                for (int64_t j = i; j < i + span; j++) {
                    float a = out[j], c = out[j + span];
                    out[j] = a + c; out[j + span] = a - c;
                }
        float scale = hm[start * d + start];
        for (int64_t j = start; j < start + n; j++) out[j] *= scale;
        start += n; rest -= n;
    }
}

/* exp(x) for x <= 0: 2^n e^r, |r| <= ln2 / 2, degree-7 Taylor polynomial (within 2 ulp); x clamped at -87. */
static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    float t = x * 1.44269504088896341f;
    float n = __builtin_rintf(t);
    float r = x - n * 0.693145751953125f;
    r = r - n * 1.428606765330187045e-06f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f; p = p * r + 1.0f / 120.0f; p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f; p = p * r + 0.5f; p = p * r + 1.0f; p = p * r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float s; memcpy(&s, &e, 4);
    return p * s;
}

"""

SOURCE += KERNELS + WRITE + r"""
/* The query's parts (module docstring) for one head: qr the query in the stored basis. */
static void queries(const QRead *a, const float *q, const float *cal, float *qr, float *qe, float *qo, float *qm,
                    float *c0) {
    int64_t d = a->d;
    if (a->rot) fwht(q, a->hm, d, qr); else memcpy(qr, q, d * sizeof(float));
    float acc = 0.0f;
    for (int64_t c = 0; c < d; c++) {
        acc += qr[c] * cal[2 * c + 1];
        qm[c] = qr[c] * (cal[2 * c + 1] + 8.0f * cal[2 * c]);
    }
    *c0 = acc;
    for (int64_t u = 0; u < d / 2; u++) { qe[u] = qr[2 * u] * cal[4 * u]; qo[u] = qr[2 * u + 1] * cal[4 * u + 2]; }
}

/* lg[gi * used + t]: every slot's logit of every head from the levels, outliers and ring, scaled (and capped). */
static void logits(const QRead *a, int64_t bi, int64_t hi, const float *qr, const float *qe, const float *qo,
                   const float *qm, const float *c0, float *lg) {
    int64_t d = a->d, used = a->used, n = a->n_out;
    const uint8_t *kd = a->kdata + bi * a->kb + hi * a->kh;
    const uint8_t *i8 = (const uint8_t *)a->kidx + (bi * a->ib + hi * a->ih);
    const int16_t *i16 = (const int16_t *)a->kidx + (bi * a->ib + hi * a->ih);
    const float *ex = a->kexact + bi * a->xb + hi * a->xh;
    int64_t kt = a->kt, it = a->it, xt = a->xt;
    for (int64_t gi = 0; gi < a->g; gi++) {
        const float *r = qr + gi * d, *m = qm + gi * d, *e = qe + gi * d / 2, *o = qo + gi * d / 2;
        float *l = lg + gi * used, c = c0[gi];
        int64_t t = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        if (d <= 64 && n <= 16) {  /* the outliers' terms by permutes, in the levels' sums */
            Tables tb = tables(r, m, d);
            int64_t ib = it * (a->idx16 ? 2 : 1);
            const char *ix = a->idx16 ? (const char *)i16 : (const char *)i8;
            for (; t + 4 <= used; t += 4) {
                logits4(kd + t * kt, kt, e, o, d / 2, &tb, ix + t * ib, ib, (int)a->idx16, ex + t * xt, xt, n, l + t);
                for (int k = 0; k < 4; k++) l[t + k] += c;
            }
        }
#endif
        for (; t < used; t += 4) {
            float dl[4];
            if (t + 4 <= used) dots4(kd + t * kt, kt, e, o, d / 2, dl);
            else for (int64_t k = t; k < used; k++) dl[k - t] = dot1(kd + k * kt, e, o, d / 2);
            for (int64_t k = t; k < t + 4 && k < used; k++) {
                const void *ix = a->idx16 ? (const void *)(i16 + k * it) : (const void *)(i8 + k * it);
                l[k] = c + dl[k - t] + outliers(ix, (int)a->idx16, ex + k * xt, n, r, m);
            }
        }
    }
    const int32_t *sk = a->sk + bi * a->skb + hi * a->skh;
    const float *q = a->q + (bi * a->h + hi) * a->g * d;
    for (int64_t j = 0; j < a->ek; j++) {
        int64_t t = sk[j];
        if (t < 0 || t >= used) continue;
        const float *kr = a->rk + bi * a->rkb + hi * a->rkh + j * a->rke;
        for (int64_t gi = 0; gi < a->g; gi++) lg[gi * used + t] = dotf(q + gi * d, kr, d);
    }
}

/* Each head's row of lg scaled, capped, masked (pos < 0: 0) and softmaxed in place. */
static void softmax(const QRead *a, const int64_t *pos, float *lg) {
    int64_t used = a->used;
    for (int64_t gi = 0; gi < a->g; gi++) {
        float *row = lg + gi * used, top = -3.0e38f, total = 0.0f, inv = a->inv, cap = a->cap;
        if (cap > 0.0f) for (int64_t t = 0; t < used; t++) row[t] = tanhf(row[t] * inv / cap) * cap;
        else
            #pragma omp simd
            for (int64_t t = 0; t < used; t++) row[t] = row[t] * inv;
        #pragma omp simd reduction(max:top)
        for (int64_t t = 0; t < used; t++) { float x = pos[t] >= 0 ? row[t] : -3.0e38f; top = x > top ? x : top; }
        #pragma omp simd reduction(+:total)
        for (int64_t t = 0; t < used; t++) {
            float x = row[t] - top;
            float e = exp_neg(x < 0.0f ? x : 0.0f);
            e = pos[t] >= 0 ? e : 0.0f;
            row[t] = e; total += e;
        }
        float scale = 1.0f / total;
        #pragma omp simd
        for (int64_t t = 0; t < used; t++) row[t] *= scale;
    }
}
"""

SOURCE += r"""
/* The value mix of one head's probabilities p (modified: the ring's slots set to 0) into out (d), model basis. */
static void mix(const QRead *a, int64_t bi, int64_t hi, float *p, float *out) {
    int64_t d = a->d, used = a->used, groups = a->groups, size = d / groups, hs = size / 2;
    float acc[MAXD], ex[MAXD], y[MAXD];
    memset(ex, 0, d * sizeof(float));
    const int32_t *sv = a->sv + bi * a->svb + hi * a->svh;
    for (int64_t j = 0; j < a->ev; j++) {
        int64_t t = sv[j];
        if (t < 0 || t >= used) continue;
        const float *vr = a->rv + bi * a->rvb + hi * a->rvh + j * a->rve;
        axpyf(p[t], vr, ex, d);
    }
    for (int64_t j = 0; j < a->ev; j++) { int64_t t = sv[j]; if (t >= 0 && t < used) p[t] = 0.0f; }
    const uint8_t *vd = a->vdata + bi * a->vb + hi * a->vh;
    const float *mt = a->meta + bi * a->mb + hi * a->mh;
    for (int64_t k = 0; k < d / 32; k += 2) {  /* chunks k, k + 1 of 16 bytes: 32 channels each, of one group */
        int two = k + 1 < d / 32;
        int64_t G0 = 32 * k / size, G1 = two ? 32 * (k + 1) / size : G0;
        float e[32], o[32], lw[2];
        mix32(vd + 16 * k, a->vt, mt + 2 * G0, mt + 2 * G1, a->mt, p, used, two, e, o, lw);
        for (int c = 0; c < 1 + two; c++) {
            int64_t G = c ? G1 : G0, u = 16 * (k + c) - G * hs;
            for (int i = 0; i < 16; i++) {
                y[G * size + 2 * (u + i)] = e[16 * c + i] + lw[c];
                y[G * size + 2 * (u + i) + 1] = o[16 * c + i] + lw[c];
            }
        }
    }
    if (a->rot) fwht(y, a->hm, d, acc); else memcpy(acc, y, d * sizeof(float));
    for (int64_t c = 0; c < d; c++) out[c] = acc[c] + ex[c];
}

/* One (row, head) pair: lg a scratch of g * used floats, qs of g * (3 d + 1). */
static void pair(const QRead *a, int64_t bi, int64_t hi, float *lg, float *qs) {
    int64_t d = a->d, g = a->g, used = a->used;
    float *qr = qs, *qm = qr + g * d, *qe = qm + g * d, *qo = qe + g * d / 2, *c0 = qo + g * d / 2;
    const float *cal = a->calib + bi * a->cb + hi * a->ch;
    const float *q = a->q + (bi * a->h + hi) * g * d;
    for (int64_t gi = 0; gi < g; gi++)
        queries(a, q + gi * d, cal, qr + gi * d, qe + gi * d / 2, qo + gi * d / 2, qm + gi * d, c0 + gi);
    logits(a, bi, hi, qr, qe, qo, qm, c0, lg);
    softmax(a, a->pos + bi * a->pb + hi * a->ph, lg);
    if (a->want) {
        float *ps = a->psum + (bi * a->h + hi) * used;
        for (int64_t t = 0; t < used; t++) {
            float s = 0.0f;
            for (int64_t gi = 0; gi < g; gi++) s += lg[gi * used + t];
            ps[t] = s;
        }
    }
    for (int64_t gi = 0; gi < g; gi++) mix(a, bi, hi, lg + gi * used, a->out + ((bi * a->h + hi) * g + gi) * d);
}

/* Each pair written (w, where not NULL: qwrite_c.py's write_pair) and then read, one thread a pair. Returns 1 where
   the shape is not taken, 2 where a thread's scratch could not be had. */
static int run(const QWrite *w, const QRead *a, int threads) {
    if (a->d % 32 || a->d > MAXD || a->groups < 1 || a->d % a->groups || (a->d / a->groups) % 32) return 1;
    int failed = 0;
    #pragma omp parallel num_threads(threads) reduction(|:failed)
    {
        float *lg = malloc((size_t)(a->g * a->used + 1) * sizeof(float));
        float *qs = malloc((size_t)(a->g * (3 * a->d + 1) + 4 * a->d) * sizeof(float));
        if (!lg || !qs) failed = 2;
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < a->b * a->h; r++) {
            if (!lg || !qs) continue;
            if (w) write_pair(w, r / a->h, r % a->h, qs + a->g * (3 * a->d + 1));
            pair(a, r / a->h, r % a->h, lg, qs);
        }
        free(lg); free(qs);
    }
    return failed;
}

int qread(const QRead *a, int threads) { return run(NULL, a, threads); }

int qstep(const QWrite *w, const QRead *a, int threads) {
    if (w->kbits > 8 || w->vbits > 8 || w->d != a->d || w->n_out > w->d) return 1;
    return run(w, a, threads);
}

int qread_struct_size(void) { return (int)sizeof(QRead); }
"""
