'''The C source of kv/one_query_native.py: a decode step's one-query attention over a cache block's slices read
where they lie (any row and head strides, the head dimension contiguous), in the arithmetic of kv/sdpa._one_query.

For each (row, KV head), threads taking the pairs in static shares, and each of its G queries:
  logits l_t = q.k_t summed in fp32 (products of two bf16 values are exact in fp32; fused multiply-adds only),
    rounded to bf16 in a bf16 call (round to nearest even, as torch's conversion), then times `scale` in fp32;
  p = softmax(l) in fp32: exp(l - max) by a degree-7 polynomial after range reduction (within 2 fp32 ulp of exp),
    times 1 / sum, each p rounded to bf16 in a bf16 call;
  out = sum_t p_t v_t in fp32, in token order, rounded to bf16 in a bf16 call.
dtype 0: fp32 operands and output; 1: bf16. The head dimension must be a multiple of 16 and at most MAXD.
'''

SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#define MAXD 256

static inline uint16_t round_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);  /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

__attribute__((target("avx512f")))
static inline __m512 load16(const void *p, int dtype) {
    if (dtype == 0) return _mm512_loadu_ps(p);
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* exp(x) for x <= 0 (x - max of the logits); below -87.3 it is 0 or a subnormal, as expf's. */
__attribute__((target("avx512f")))
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693145751953125f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(-1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* l[t] = round(q . k_t) * scale for T tokens of D (a multiple of 16) elements at stride kt. */
__attribute__((target("avx512f")))
static void logits(const float *qf, const char *k, int64_t kt, int64_t T, int64_t D, int dtype, float scale, float *l) {
    int64_t es = dtype ? 2 : 4;
    for (int64_t t = 0; t < T; t++) {
        const char *kr = k + t * kt * es;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < D; i += 16)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(qf + i), load16(kr + i * es, dtype), acc);
        float s = _mm512_reduce_add_ps(acc);
        if (dtype) { uint32_t u = (uint32_t)round_bf16(s) << 16; memcpy(&s, &u, 4); }
        l[t] = s * scale;
    }
}

/* l[0..T) -> softmax in place, each rounded to bf16 where dtype is 1. */
__attribute__((target("avx512f")))
static void softmax(float *l, int64_t T, int dtype) {
    __m512 m = _mm512_set1_ps(-__builtin_inff());
    for (int64_t t = 0; t < T; t += 16) {
        __mmask16 k = T - t >= 16 ? 0xffff : (__mmask16)((1u << (T - t)) - 1);
        m = _mm512_mask_max_ps(m, k, m, _mm512_maskz_loadu_ps(k, l + t));
    }
    __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m)), sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < T; t += 16) {
        __mmask16 k = T - t >= 16 ? 0xffff : (__mmask16)((1u << (T - t)) - 1);
        __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, l + t), mx));
        _mm512_mask_storeu_ps(l + t, k, e);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(k, e));
    }
    float inv = 1.0f / _mm512_reduce_add_ps(sum);
    for (int64_t t = 0; t < T; t++) {
        float p = l[t] * inv;
        if (dtype) { uint32_t u = (uint32_t)round_bf16(p) << 16; memcpy(&p, &u, 4); }
        l[t] = p;
    }
}

/* out (D) = sum_t p[t] v_t in fp32, stored in the dtype. */
__attribute__((target("avx512f")))
static void mix(const float *p, const char *v, int64_t vt, int64_t T, int64_t D, int dtype, char *out) {
    int64_t es = dtype ? 2 : 4;
    __m512 acc[MAXD / 16];
    for (int64_t j = 0; j < D / 16; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t t = 0; t < T; t++) {
        __m512 pt = _mm512_set1_ps(p[t]);
        const char *vr = v + t * vt * es;
        for (int64_t j = 0; j < D / 16; j++) acc[j] = _mm512_fmadd_ps(pt, load16(vr + j * 16 * es, dtype), acc[j]);
    }
    for (int64_t j = 0; j < D / 16; j++) {
        if (dtype == 0) { _mm512_storeu_ps(out + j * 64, acc[j]); continue; }
        float f[16];
        _mm512_storeu_ps(f, acc[j]);
        for (int i = 0; i < 16; i++) ((uint16_t *)out)[j * 16 + i] = round_bf16(f[i]);
    }
}

/* q (B, H, G, D) at strides (qb, qh, qg), k and v (B, H, T, D) at theirs, out (B, H, G, D) contiguous; strides in
   elements. Returns 1 where D is not taken, 2 where a thread's buffer could not be had. */
__attribute__((target("avx512f")))
int one_query(int dtype, int64_t B, int64_t H, int64_t G, int64_t T, int64_t D, const void *q, int64_t qb,
              int64_t qh, int64_t qg, const void *k, int64_t kb, int64_t kh, int64_t kt, const void *v, int64_t vb,
              int64_t vh, int64_t vt, void *out, float scale, int threads) {
    if (D % 16 || D > MAXD || dtype < 0 || dtype > 1) return 1;
    int64_t es = dtype ? 2 : 4;
    int failed = 0;
    #pragma omp parallel num_threads(threads) reduction(|:failed)
    {
        float *l = malloc((size_t)T * sizeof(float)), qf[MAXD];
        if (!l) failed = 2;
        #pragma omp for schedule(static)
        for (int64_t bh = 0; bh < B * H; bh++) {
            if (!l) continue;
            int64_t b = bh / H, h = bh % H;
            const char *kp = (const char *)k + (b * kb + h * kh) * es, *vp = (const char *)v + (b * vb + h * vh) * es;
            for (int64_t g = 0; g < G; g++) {
                const char *qp = (const char *)q + (b * qb + h * qh + g * qg) * es;
                for (int64_t i = 0; i < D; i += 16) _mm512_storeu_ps(qf + i, load16(qp + i * es, dtype));
                logits(qf, kp, kt, T, D, dtype, scale, l);
                softmax(l, T, dtype);
                mix(l, vp, vt, T, D, dtype, (char *)out + ((bh * G + g) * D) * es);
            }
        }
        free(l);
    }
    return failed;
}

int one_query_runs(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f");
}
"""
