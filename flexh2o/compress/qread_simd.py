"""The vector kernels of compress/qread_c.py's C source: a slot's logit from its packed key levels and outliers, four
slots at a time (one reduction for four), the value mix of two 16-byte chunks of every slot, and small dot and axpy
loops. Each is written three times: AVX-512 intrinsics (the outliers' channels picked by permutes from the query's
parts held in registers, where d <= 64), AVX2 intrinsics, and plain C for the generic build; the build's flags
(compress/qread_native.py) choose one. A 4-bit slot's byte u holds channel 2u in its low nibble and 2u + 1 in its
high one: the query is split into its even and odd channels once, so no byte is reordered per slot.
"""

KERNELS = r"""
/* a . b over d floats (d a multiple of 16 where AVX2 is built). */
static inline float dotf(const float *a, const float *b, int64_t d) {
#if defined(__AVX2__)
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; c += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + c), _mm256_loadu_ps(b + c), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + c + 8), _mm256_loadu_ps(b + c + 8), s1);
    }
    s0 = _mm256_add_ps(s0, s1);
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(s0), _mm256_extractf128_ps(s0, 1));
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
#else
    float s = 0.0f;
    for (int64_t c = 0; c < d; c++) s += a[c] * b[c];
    return s;
#endif
}

/* y (d) += w x (d). */
static inline void axpyf(float w, const float *x, float *y, int64_t d) {
#if defined(__AVX2__)
    __m256 wv = _mm256_set1_ps(w);
    for (int64_t c = 0; c < d; c += 8) _mm256_storeu_ps(y + c, _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + c), _mm256_loadu_ps(y + c)));
#else
    for (int64_t c = 0; c < d; c++) y[c] += w * x[c];
#endif
}

/* The n outliers' share of a slot's logit: sum over j of r[c_j] x[j] - m[c_j], C the channel type; four sums
   apart (no chain of dependent additions). */
#define OUTLIERS(C)                                                                                                \
    static inline float outliers_##C(const C *idx, const float *x, int64_t n, const float *r, const float *m) {  \
        float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};                                                                 \
        int64_t j = 0;                                                                                        \
        for (; j + 4 <= n; j += 4)                                                                            \
            for (int k = 0; k < 4; k++) s[k] += r[idx[j + k]] * x[j + k] - m[idx[j + k]];                     \
        for (; j < n; j++) s[0] += r[idx[j]] * x[j] - m[idx[j]];                                              \
        return (s[0] + s[1]) + (s[2] + s[3]);                                                                 \
    }
OUTLIERS(uint8_t)
OUTLIERS(int16_t)

static inline float outliers(const void *idx, int idx16, const float *x, int64_t n, const float *r, const float *m) {
    return idx16 ? outliers_int16_t(idx, x, n, r, m) : outliers_uint8_t(idx, x, n, r, m);
}

#if defined(__AVX2__)
/* q . the levels of one slot, 8 lanes to be summed: qe / qo the scaled query at even / odd channels, h = d / 2
   bytes (a multiple of 16). */
static inline __m256 dot8(const uint8_t *row, const float *qe, const float *qo, int64_t h) {
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps(), acc2 = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi32(15);
    for (int64_t u = 0; u < h; u += 16) {
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + u)));
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(qe + u), _mm512_cvtepi32_ps(_mm512_and_si512(v, low)), acc);
        acc2 = _mm512_fmadd_ps(_mm512_loadu_ps(qo + u), _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), acc2);
    }
    acc = _mm512_add_ps(acc, acc2);
    return _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
#else
    __m256 acc = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi32(15);
    for (int64_t u = 0; u < h; u += 8) {
        __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + u)));
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(qe + u), _mm256_cvtepi32_ps(_mm256_and_si256(v, low)), acc);
        acc2 = _mm256_fmadd_ps(_mm256_loadu_ps(qo + u), _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), acc2);
    }
    return _mm256_add_ps(acc, acc2);
#endif
}
#endif

/* q . the levels of one slot. */
static inline float dot1(const uint8_t *row, const float *qe, const float *qo, int64_t h) {
#if defined(__AVX2__)
    __m256 v = dot8(row, qe, qo, h);
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
#else
    float s = 0.0f;
    for (int64_t u = 0; u < h; u++) s += qe[u] * (float)(row[u] & 15) + qo[u] * (float)(row[u] >> 4);
    return s;
#endif
}

/* out[0..4) = q . the levels of the 4 slots from row, kt bytes apart (summed 4 at a time: one reduction). */
static inline void dots4(const uint8_t *row, int64_t kt, const float *qe, const float *qo, int64_t h, float *out) {
#if defined(__AVX2__)
    __m256 h1 = _mm256_hadd_ps(dot8(row, qe, qo, h), dot8(row + kt, qe, qo, h));
    __m256 h2 = _mm256_hadd_ps(dot8(row + 2 * kt, qe, qo, h), dot8(row + 3 * kt, qe, qo, h));
    __m256 hh = _mm256_hadd_ps(h1, h2);
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(hh), _mm256_extractf128_ps(hh, 1)));
#else
    for (int k = 0; k < 4; k++) {
        const uint8_t *r = row + k * kt;
        float s = 0.0f;
        for (int64_t u = 0; u < h; u++) s += qe[u] * (float)(r[u] & 15) + qo[u] * (float)(r[u] >> 4);
        out[k] = s;
    }
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* The query's parts r and m (d <= 64 channels, zero past d) held in registers: an outlier's r[c] and m[c] picked
   by permutes, 16 outliers at once, not loaded one by one. */
typedef struct { __m512 r[4], m[4]; } Tables;

static inline Tables tables(const float *r, const float *m, int64_t d) {
    Tables tb;
    for (int k = 0; k < 4; k++) {
        __mmask16 km = 16 * k < d ? 0xffff : 0;
        tb.r[k] = _mm512_maskz_loadu_ps(km, r + (16 * k < d ? 16 * k : 0));
        tb.m[k] = _mm512_maskz_loadu_ps(km, m + (16 * k < d ? 16 * k : 0));
    }
    return tb;
}

/* The outliers' terms r[c_j] x[j] - m[c_j] of one slot as lanes (n <= 16; the rest 0), each rounded as the
   scalar sum's (a product, then a difference). */
static inline __m512 outl16(const Tables *tb, const void *idx, int idx16, const float *x, int64_t n) {
    __mmask16 km = (__mmask16)((1u << n) - 1);
    __m512i c = idx16 ? _mm512_cvtepi16_epi32(_mm256_maskz_loadu_epi16(km, idx))
                      : _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(km, idx));
    __mmask16 high = _mm512_test_epi32_mask(c, _mm512_set1_epi32(32));
    __m512 r = _mm512_mask_blend_ps(high, _mm512_permutex2var_ps(tb->r[0], c, tb->r[1]),
                                    _mm512_permutex2var_ps(tb->r[2], c, tb->r[3]));
    __m512 m = _mm512_mask_blend_ps(high, _mm512_permutex2var_ps(tb->m[0], c, tb->m[1]),
                                    _mm512_permutex2var_ps(tb->m[2], c, tb->m[3]));
    return _mm512_maskz_sub_ps(km, _mm512_mul_ps(r, _mm512_maskz_loadu_ps(km, x)), m);
}

/* out[0..4) = 4 slots' logits before scaling (levels and outliers), one reduction for the four. */
static inline void logits4(const uint8_t *row, int64_t kt, const float *qe, const float *qo, int64_t h,
                           const Tables *tb, const char *idx, int64_t ib, int idx16, const float *x, int64_t xt,
                           int64_t n, float *out) {
    __m256 s[4];
    for (int k = 0; k < 4; k++) {
        __m512 o = outl16(tb, idx + k * ib, idx16, x + k * xt, n);
        __m256 f = _mm256_add_ps(_mm512_castps512_ps256(o), _mm512_extractf32x8_ps(o, 1));
        s[k] = _mm256_add_ps(dot8(row + k * kt, qe, qo, h), f);
    }
    __m256 hh = _mm256_hadd_ps(_mm256_hadd_ps(s[0], s[1]), _mm256_hadd_ps(s[2], s[3]));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(hh), _mm256_extractf128_ps(hh, 1)));
}
#endif

/* Two 16-byte chunks of each slot's values (chunk c at row + 16 c + t * vt, group meta mc: scale mc[t * st],
   minimum mc[t * st + 1]; the second only where `two`), over slots t with p[t] != 0: e[16 c + i] = sum of p[t]
   scale times byte i's low nibble (even channels), o[16 c + i] its high one's (odd channels), low[c] = sum of p[t]
   minimum. Both chunks in one pass: their sums are independent chains. */
static void mix32(const uint8_t *row, int64_t vt, const float *m0, const float *m1, int64_t st, const float *p,
                  int64_t used, int two, float *e, float *o, float *low) {
    float l0 = 0.0f, l1 = 0.0f;
#if defined(__AVX512F__)
    __m512 e0 = _mm512_setzero_ps(), o0 = e0, e1 = e0, o1 = e0;
    const __m512i lo = _mm512_set1_epi32(15);
    for (int64_t t = 0; t < used; t++) {
        float pr = p[t];
        if (pr == 0.0f) continue;
        const uint8_t *r = row + t * vt;
        __m512 w = _mm512_set1_ps(pr * m0[t * st]), w1 = _mm512_set1_ps(pr * m1[t * st]);
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)r));
        __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(r + (two ? 16 : 0))));
        e0 = _mm512_fmadd_ps(w, _mm512_cvtepi32_ps(_mm512_and_si512(v, lo)), e0);
        o0 = _mm512_fmadd_ps(w, _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), o0);
        e1 = _mm512_fmadd_ps(w1, _mm512_cvtepi32_ps(_mm512_and_si512(v1, lo)), e1);
        o1 = _mm512_fmadd_ps(w1, _mm512_cvtepi32_ps(_mm512_srli_epi32(v1, 4)), o1);
        l0 += pr * m0[t * st + 1]; l1 += pr * m1[t * st + 1];
    }
    _mm512_storeu_ps(e, e0); _mm512_storeu_ps(o, o0); _mm512_storeu_ps(e + 16, e1); _mm512_storeu_ps(o + 16, o1);
#elif defined(__AVX2__)
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    const __m256i lo = _mm256_set1_epi32(15);
    for (int64_t t = 0; t < used; t++) {
        float pr = p[t];
        if (pr == 0.0f) continue;
        const uint8_t *r = row + t * vt;
        for (int c = 0; c < 2; c++) {
            __m256 w = _mm256_set1_ps(pr * (c ? m1 : m0)[t * st]);
            const uint8_t *rc = r + (c && two ? 16 : 0);
            for (int k = 0; k < 2; k++) {
                __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(rc + 8 * k)));
                a[4 * c + k] = _mm256_fmadd_ps(w, _mm256_cvtepi32_ps(_mm256_and_si256(v, lo)), a[4 * c + k]);
                a[4 * c + 2 + k] = _mm256_fmadd_ps(w, _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), a[4 * c + 2 + k]);
            }
        }
        l0 += pr * m0[t * st + 1]; l1 += pr * m1[t * st + 1];
    }
    for (int c = 0; c < 2; c++)
        for (int k = 0; k < 2; k++) {
            _mm256_storeu_ps(e + 16 * c + 8 * k, a[4 * c + k]);
            _mm256_storeu_ps(o + 16 * c + 8 * k, a[4 * c + 2 + k]);
        }
#else
    memset(e, 0, 32 * sizeof(float)); memset(o, 0, 32 * sizeof(float));
    for (int64_t t = 0; t < used; t++) {
        float pr = p[t];
        if (pr == 0.0f) continue;
        for (int c = 0; c < 2; c++) {
            const uint8_t *r = row + t * vt + (c && two ? 16 : 0);
            float w = pr * (c ? m1 : m0)[t * st];
            for (int i = 0; i < 16; i++) { e[16 * c + i] += w * (float)(r[i] & 15); o[16 * c + i] += w * (float)(r[i] >> 4); }
        }
        l0 += pr * m0[t * st + 1]; l1 += pr * m1[t * st + 1];
    }
#endif
    low[0] = l0; low[1] = l1;
}

"""
