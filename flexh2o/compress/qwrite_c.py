'''The C source of a decode step's write into a quantized block, for compress/qread_native.py's `step`: each (row, KV
head) pair's new token written (compress/fused_quant_kernels.py's put_pair, operation for operation: what it stores
equals that kernel's bit for bit) and then that pair read (compress/qread_c.py's `pair`), one thread a pair, so the
pair's new slot is in cache for its read and the write runs over the same threads as the read.

The write, per pair: the free slot (its position where the rows are in order, else the first empty one, 0 when
none is); the key rotated (x H, fast Walsh-Hadamard transform) where rotated; each channel's level
round((x - minimum) / scale) clamped (scale 0: divided by 1), its error |level scale + minimum - x|, the n channels of
largest error kept exact (ties to the lower channel, by insertion in one pass) and stored at the middle level; the
levels packed (value i at bits [i bits, (i + 1) bits)); the value rotated likewise, per group its minimum, scale
(max - min) / levels and levels; both exact rings (the entry naming the slot dropped, the token into sink entry
window + p or ring entry p % window); the slot's position and a score of 0. Compiled without reassociation or
contraction (qread_native.FLAGS), so each rounding is the numba kernel's.
'''

SOURCE = r"""
typedef struct {
    int64_t b, h, d, slots, n_out, groups, ek, ev, kbits, vbits, in_order, rotk, rotv, idx16, kwin, ksink, vwin, vsink;
    const float *k, *v;
    const int64_t *cur;
    const float *hm;
    int64_t *pos; int64_t pb, ph, pt;
    float *score; int64_t sb, sh, st;
    int64_t *slot;
    uint8_t *kdata; int64_t kb, kh, kt;
    void *kidx; int64_t ib, ih, it;
    float *kexact; int64_t xb, xh, xt;
    const float *calib; int64_t cb, ch;
    uint8_t *vdata; int64_t vb, vh, vt;
    float *vmeta; int64_t mb, mh, mt;
    int32_t *krs; int64_t rsb, rsh;
    float *krec; int64_t rkb, rkh, rke;
    int32_t *vrs; int64_t vsb, vsh;
    float *vrec; int64_t rvb, rvh, rve;
} QWrite;

static void put_levels(const float *q, int64_t n, uint8_t *out, int bits) {
    uint32_t acc = 0;
    int have = 0;
    int64_t o = 0;
    for (int64_t i = 0; i < n; i++) {
        acc |= (uint32_t)(int32_t)q[i] << have;
        have += bits;
        while (have >= 8) { out[o++] = (uint8_t)(acc & 255u); acc >>= 8; have -= 8; }
    }
}

static inline float level(float x, float lo, float scale, float top) {
    float q = rintf((x - lo) / (scale > 0.0f ? scale : 1.0f));
    q = q > 0.0f ? q : 0.0f;
    return q < top ? q : top;
}

/* One key x (d) with its calibration c (d, 2): packed levels, the n outliers' channels and values. */
static void key_token(const QWrite *w, const float *x, const float *c, float *q, float *err, float *top_err,
                      uint8_t *data, void *index, float *exact) {
    int64_t d = w->d, n = w->n_out, kept = 0;
    float top = (float)((1 << w->kbits) - 1), middle = (float)(1 << (w->kbits - 1));
    int64_t idx[MAXD];
    for (int64_t j = 0; j < d; j++) {
        q[j] = level(x[j], c[2 * j + 1], c[2 * j], top);
        err[j] = fabsf(q[j] * c[2 * j] + c[2 * j + 1] - x[j]);
    }
    for (int64_t j = 0; j < (n > 0 ? d : 0); j++) {
        float e = err[j];
        if (kept == n && !(e > top_err[n - 1])) continue;
        int64_t i = kept < n ? kept : n - 1;
        while (i > 0 && top_err[i - 1] < e) { top_err[i] = top_err[i - 1]; idx[i] = idx[i - 1]; i--; }
        top_err[i] = e; idx[i] = j;
        kept = kept + 1 < n ? kept + 1 : n;
    }
    for (int64_t k = 0; k < n; k++) {
        exact[k] = x[idx[k]];
        q[idx[k]] = middle;
        if (w->idx16) ((int16_t *)index)[k] = (int16_t)idx[k]; else ((uint8_t *)index)[k] = (uint8_t)idx[k];
    }
    put_levels(q, d, data, (int)w->kbits);
}

/* One value x (d) in groups: per group (scale, minimum) into meta and its packed levels. */
static void group_token(const QWrite *w, const float *x, float *q, uint8_t *data, float *meta) {
    int64_t size = w->d / w->groups, bytes = size * w->vbits / 8;
    float top = (float)((1 << w->vbits) - 1);
    for (int64_t g = 0; g < w->groups; g++) {
        float lo = x[g * size], hi = lo;
        for (int64_t j = g * size + 1; j < (g + 1) * size; j++) { lo = x[j] < lo ? x[j] : lo; hi = x[j] > hi ? x[j] : hi; }
        float scale = (hi - lo) / top;
        meta[2 * g] = scale; meta[2 * g + 1] = lo;
        for (int64_t j = 0; j < size; j++) q[j] = level(x[g * size + j], lo, scale, top);
        put_levels(q, size, data + g * bytes, (int)w->vbits);
    }
}

static void ring_one(int32_t *rslot, float *recent, int64_t re, int64_t e, int64_t d, int64_t s, int64_t p,
                     int64_t window, int64_t sinks, const float *x) {
    for (int64_t j = 0; j < e; j++) if (rslot[j] == s) rslot[j] = -1;
    int64_t en = p < sinks ? window + p : (window > 0 ? p % window : -1);
    if (en >= 0) { rslot[en] = (int32_t)s; memcpy(recent + en * re, x, d * sizeof(float)); }
}

/* The pair's write; scratch of 4 d floats. */
static void write_pair(const QWrite *w, int64_t bi, int64_t hi, float *sc) {
    int64_t d = w->d, p = w->cur[bi], s = 0;
    int64_t *pos = w->pos + bi * w->pb + hi * w->ph;
    if (w->in_order) s = p;
    else for (int64_t t = 0; t < w->slots; t++) if (pos[t * w->pt] < 0) { s = t; break; }
    const float *k = w->k + (bi * w->h + hi) * d, *v = w->v + (bi * w->h + hi) * d;
    float *x = sc, *q = sc + d, *err = sc + 2 * d, *top_err = sc + 3 * d;
    if (w->rotk) fwht(k, w->hm, d, x); else memcpy(x, k, d * sizeof(float));
    char *ix = (char *)w->kidx + (bi * w->ib + hi * w->ih + s * w->it) * (w->idx16 ? 2 : 1);
    key_token(w, x, w->calib + bi * w->cb + hi * w->ch, q, err, top_err, w->kdata + bi * w->kb + hi * w->kh + s * w->kt,
              ix, w->kexact + bi * w->xb + hi * w->xh + s * w->xt);
    ring_one(w->krs + bi * w->rsb + hi * w->rsh, w->krec + bi * w->rkb + hi * w->rkh, w->rke, w->ek, d, s, p,
             w->kwin, w->ksink, k);
    if (w->rotv) fwht(v, w->hm, d, x); else memcpy(x, v, d * sizeof(float));
    group_token(w, x, q, w->vdata + bi * w->vb + hi * w->vh + s * w->vt, w->vmeta + bi * w->mb + hi * w->mh + s * w->mt);
    ring_one(w->vrs + bi * w->vsb + hi * w->vsh, w->vrec + bi * w->rvb + hi * w->rvh, w->rve, w->ev, d, s, p,
             w->vwin, w->vsink, v);
    pos[s * w->pt] = p;
    w->score[bi * w->sb + hi * w->sh + s * w->st] = 0.0f;
    w->slot[bi * w->h + hi] = s;
}

int qwrite_struct_size(void) { return (int)sizeof(QWrite); }
"""
