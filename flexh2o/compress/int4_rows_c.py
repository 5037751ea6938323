'''The C source of compress/int4_rows.py's product: x (M, K) times a 4-bit (N, K) weight held in the int4 kernel's
order (compress/int4_order.py), read from its packed bytes once a call, for the few rows of a decode step.

Each thread takes whole row blocks of the weight. For each group of inputs of a block, the block's levels are
unpacked once into a small buffer (in L1), then every tile of activation rows multiplies it from registers:
  kind 2 (AVX512-BF16): the levels 0..15 (exact in bf16) in pairs of inputs times the bf16 activations by
    vdpbf16ps, fp32 sums over the group, then out += scale * sum + minimum * (the group's sum of x);
  kind 1 (AVX2 + FMA): the levels as fp32 times fp32 activations by FMAs, then scale and minimum as for kind 2.
Threads take the blocks one at a time (dynamic): on busy cores one late thread does not hold the other's share.
'''

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

#define MAXG 256  /* the largest group taken */
#define MAXR 64   /* the largest row block */
#define UNROLL _Pragma("GCC unroll 16")

/* An fp16 value as fp32, exactly (subnormals as man * 2^-24). */
static inline float half_f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (e == 0x1fu) u = sign | 0x7f800000u | (man << 13);
    else if (e) u = sign | ((e + 112u) << 23) | (man << 13);
    else { float f = (float)man * 0x1p-24f; memcpy(&u, &f, 4); u |= sign; }
    float f; memcpy(&f, &u, 4); return f;
}

/* Element i of meta held as fp32 (kind 0), bf16 (1) or fp16 (2). */
static inline float meta_f(const void *meta, int kind, int64_t i) {
    if (kind == 2) return half_f(((const uint16_t *)meta)[i]);
    if (kind) { uint32_t u = (uint32_t)((const uint16_t *)meta)[i] << 16; float f; memcpy(&f, &u, 4); return f; }
    return ((const float *)meta)[i];
}

/* Row j's level at input k of a block of R rows (bytes (K, R / 2)): rows i and i + R / 2 in byte i (low, high
   nibble), or rows 2i and 2i + 1 where `paired` (the last, shorter block). */
static inline int level_at(const uint8_t *blk, int64_t R, int paired, int64_t k, int64_t j) {
    int64_t h = R / 2;
    if (paired) { uint8_t b = blk[k * h + j / 2]; return (j & 1) ? b >> 4 : b & 15; }
    uint8_t b = blk[k * h + (j < h ? j : j - h)];
    return j < h ? b & 15 : b >> 4;
}

/* Scales and minimums of rows r0 .. r0 + R in group g, from meta (N, G, 2) (meta_f's kinds). */
static void group_meta(const void *meta, int kind, int64_t G, int64_t r0, int64_t R, int64_t g, float *s, float *mn) {
    for (int64_t j = 0; j < R; j++) {
        s[j] = meta_f(meta, kind, ((r0 + j) * G + g) * 2);
        mn[j] = meta_f(meta, kind, ((r0 + j) * G + g) * 2 + 1);
    }
}

/* kind 1: w (gs, R) fp32 = the levels of a group of a block. */
__attribute__((target("avx2,fma")))
static void deq_f32(const uint8_t *blk, int64_t R, int paired, int64_t k0, int64_t gs, float *w) {
    int64_t h = R / 2;
    if (!paired && h % 8 == 0) {
        const __m256i f = _mm256_set1_epi32(15);
        for (int64_t t = 0; t < gs; t++) {
            const uint8_t *b = blk + (k0 + t) * h;
            for (int64_t i = 0; i < h; i += 8) {
                __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + i)));
                _mm256_storeu_ps(w + t * R + i, _mm256_cvtepi32_ps(_mm256_and_si256(v, f)));
                _mm256_storeu_ps(w + t * R + h + i, _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)));
            }
        }
        return;
    }
    for (int64_t t = 0; t < gs; t++)
        for (int64_t j = 0; j < R; j++) w[t * R + j] = (float)level_at(blk, R, paired, k0 + t, j);
}

/* kind 1: out[m, col .. col + 16] += scale * (x[m, group] . levels) + minimum * xs[m, g] for MT rows. */
#define TILE_F32(MT) \
__attribute__((target("avx2,fma"))) \
static void tile_f32_##MT(const float *w, int64_t R, int64_t c, int64_t gs, const float *x, int64_t K, int64_t k0, \
                          const float *s, const float *mn, const float *xs, int64_t G, int64_t g, \
                          float *out, int64_t N, int64_t col) { \
    __m256 acc[MT][2]; \
    UNROLL for (int m = 0; m < MT; m++) { acc[m][0] = _mm256_setzero_ps(); acc[m][1] = _mm256_setzero_ps(); } \
    for (int64_t t = 0; t < gs; t++) { \
        __m256 w0 = _mm256_loadu_ps(w + t * R + c), w1 = _mm256_loadu_ps(w + t * R + c + 8); \
        UNROLL for (int m = 0; m < MT; m++) { \
            __m256 xb = _mm256_broadcast_ss(x + m * K + k0 + t); \
            acc[m][0] = _mm256_fmadd_ps(xb, w0, acc[m][0]); acc[m][1] = _mm256_fmadd_ps(xb, w1, acc[m][1]); } \
    } \
    UNROLL for (int z = 0; z < 2; z++) { \
        __m256 sv = _mm256_loadu_ps(s + c + 8 * z), nv = _mm256_loadu_ps(mn + c + 8 * z); \
        UNROLL for (int m = 0; m < MT; m++) { \
            float *o = out + m * N + col + 8 * z; \
            __m256 base = _mm256_fmadd_ps(nv, _mm256_broadcast_ss(xs + m * G + g), _mm256_loadu_ps(o)); \
            _mm256_storeu_ps(o, _mm256_fmadd_ps(sv, acc[m][z], base)); } } \
}
TILE_F32(1) TILE_F32(2) TILE_F32(3) TILE_F32(4) TILE_F32(5) TILE_F32(6)
typedef void (*tile_f32_fn)(const float *, int64_t, int64_t, int64_t, const float *, int64_t, int64_t, const float *,
                            const float *, const float *, int64_t, int64_t, float *, int64_t, int64_t);
static const tile_f32_fn TILES_F32[6] = {tile_f32_1, tile_f32_2, tile_f32_3, tile_f32_4, tile_f32_5, tile_f32_6};

static void block_f32(const uint8_t *blk, int64_t R, int paired, int64_t r0, const void *meta, int kind,
                      const float *x, const float *xs, int64_t M, int64_t K, int64_t gs, float *out, int64_t N) {
    float w[MAXG * MAXR], s[MAXR], mn[MAXR];
    int64_t G = K / gs;
    for (int64_t g = 0; g < G; g++) {
        group_meta(meta, kind, G, r0, R, g, s, mn);
        deq_f32(blk, R, paired, g * gs, gs, w);
        for (int64_t c = 0; c < R; c += 16)
            for (int64_t m = 0; m < M; m += 6)
                TILES_F32[(M - m < 6 ? M - m : 6) - 1](w, R, c, gs, x + m * K, K, g * gs, s, mn, xs + m * G, G, g,
                                                      out + m * N, N, r0 + c);
    }
}

/* kind 2: w (gs / 2, R) pairs of bf16 levels (inputs 2p, 2p + 1) of a group of a block. */
__attribute__((target("avx512f,avx512bw,avx512bf16")))
static void deq_pairs(const uint8_t *blk, int64_t R, int paired, int64_t k0, int64_t gs, uint32_t *w) {
    int64_t h = R / 2;
    if (!paired && h % 16 == 0) {
        __m512i lo = _mm512_setzero_si512(), hi = lo;  /* dword L: bf16(L) in the low, high half (L < 16) */
        for (int l = 1; l < 16; l++) {
            float f = (float)l; uint32_t u; memcpy(&u, &f, 4);
            lo = _mm512_mask_set1_epi32(lo, (__mmask16)(1u << l), (int)(u >> 16));
            hi = _mm512_mask_set1_epi32(hi, (__mmask16)(1u << l), (int)(u & 0xffff0000u));
        }
        for (int64_t p = 0; p < gs / 2; p++) {
            const uint8_t *a = blk + (k0 + 2 * p) * h, *b = a + h;
            for (int64_t i = 0; i < h; i += 16) {  /* vpermd reads an index's low 4 bits: the low nibble as is */
                __m512i va = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(a + i)));
                __m512i vb = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + i)));
                _mm512_storeu_si512(w + p * R + i, _mm512_or_si512(_mm512_permutexvar_epi32(va, lo),
                                                                   _mm512_permutexvar_epi32(vb, hi)));
                _mm512_storeu_si512(w + p * R + h + i,
                                    _mm512_or_si512(_mm512_permutexvar_epi32(_mm512_srli_epi32(va, 4), lo),
                                                    _mm512_permutexvar_epi32(_mm512_srli_epi32(vb, 4), hi)));
            }
        }
        return;
    }
    for (int64_t p = 0; p < gs / 2; p++)
        for (int64_t j = 0; j < R; j++) {
            float a = (float)level_at(blk, R, paired, k0 + 2 * p, j), b = (float)level_at(blk, R, paired, k0 + 2 * p + 1, j);
            uint32_t ua, ub; memcpy(&ua, &a, 4); memcpy(&ub, &b, 4);
            w[p * R + j] = (ua >> 16) | (ub & 0xffff0000u);
        }
}

/* kind 2: out[m, col .. col + 16 NZ] += scale * (x[m, group] . levels) + minimum * xs[m, g] for MT rows. */
#define TILE_BF(MT, NZ) \
__attribute__((target("avx512f,avx512bw,avx512bf16"))) \
static void tile_bf_##MT##_##NZ(const uint32_t *w, int64_t R, int64_t c, int64_t gs, const uint32_t *x, int64_t K2, \
                                int64_t p0, const float *s, const float *mn, const float *xs, int64_t G, int64_t g, \
                                float *out, int64_t N, int64_t col) { \
    __m512 acc[MT][NZ]; \
    UNROLL for (int m = 0; m < MT; m++) UNROLL for (int z = 0; z < NZ; z++) acc[m][z] = _mm512_setzero_ps(); \
    for (int64_t p = 0; p < gs / 2; p++) { \
        __m512bh wv[NZ]; \
        UNROLL for (int z = 0; z < NZ; z++) wv[z] = (__m512bh)_mm512_loadu_si512(w + p * R + c + 16 * z); \
        UNROLL for (int m = 0; m < MT; m++) { \
            __m512bh xb = (__m512bh)_mm512_set1_epi32((int)x[m * K2 + p0 + p]); \
            UNROLL for (int z = 0; z < NZ; z++) acc[m][z] = _mm512_dpbf16_ps(acc[m][z], wv[z], xb); } \
    } \
    UNROLL for (int z = 0; z < NZ; z++) { \
        __m512 sv = _mm512_loadu_ps(s + c + 16 * z), nv = _mm512_loadu_ps(mn + c + 16 * z); \
        UNROLL for (int m = 0; m < MT; m++) { \
            float *o = out + m * N + col + 16 * z; \
            __m512 base = _mm512_fmadd_ps(nv, _mm512_set1_ps(xs[m * G + g]), _mm512_loadu_ps(o)); \
            _mm512_storeu_ps(o, _mm512_fmadd_ps(sv, acc[m][z], base)); } } \
}
TILE_BF(1, 4) TILE_BF(2, 4) TILE_BF(3, 4) TILE_BF(4, 4) TILE_BF(5, 4) TILE_BF(6, 4)
TILE_BF(1, 2) TILE_BF(2, 2) TILE_BF(3, 2) TILE_BF(4, 2) TILE_BF(5, 2) TILE_BF(6, 2) TILE_BF(7, 2) TILE_BF(8, 2)
typedef void (*tile_bf_fn)(const uint32_t *, int64_t, int64_t, int64_t, const uint32_t *, int64_t, int64_t,
                           const float *, const float *, const float *, int64_t, int64_t, float *, int64_t, int64_t);
static const tile_bf_fn TILES_BF4[6] = {tile_bf_1_4, tile_bf_2_4, tile_bf_3_4, tile_bf_4_4, tile_bf_5_4, tile_bf_6_4};
static const tile_bf_fn TILES_BF2[8] = {tile_bf_1_2, tile_bf_2_2, tile_bf_3_2, tile_bf_4_2, tile_bf_5_2, tile_bf_6_2,
                                        tile_bf_7_2, tile_bf_8_2};

static void block_bf(const uint8_t *blk, int64_t R, int paired, int64_t r0, const void *meta, int kind,
                     const uint16_t *x, const float *xs, int64_t M, int64_t K, int64_t gs, float *out, int64_t N) {
    uint32_t w[MAXG / 2 * MAXR];
    float s[MAXR], mn[MAXR];
    int64_t G = K / gs, cw = R % 64 ? 32 : 64, mt = cw == 64 ? 6 : 8;
    for (int64_t g = 0; g < G; g++) {
        group_meta(meta, kind, G, r0, R, g, s, mn);
        deq_pairs(blk, R, paired, g * gs, gs, w);
        for (int64_t c = 0; c < R; c += cw)
            for (int64_t m = 0; m < M; m += mt)
                (cw == 64 ? TILES_BF4 : TILES_BF2)[(M - m < mt ? M - m : mt) - 1](
                    w, R, c, gs, (const uint32_t *)x + m * (K / 2), K / 2, g * gs / 2, s, mn, xs + m * G, G, g,
                    out + m * N, N, r0 + c);
    }
}

/* The product this CPU runs: 2 the bf16 dot (AVX512-BF16, where allowed), 1 fp32 (AVX2 + FMA), 0 none. */
int mm4_kind(int allow_bf16) {
    if (allow_bf16 && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw")) return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
    return 0;
}

/* out (M, N) fp32 = x (M, K) @ W^T. W: whole blocks of `block` rows, the rest (N % block) one paired block; meta
   (N, K / gs, 2) fp32 (meta_kind 0), bf16 (1) or fp16 (2). x bf16 (kind 2) or fp32 (kind 1), xs (M, K / gs) its group sums. */
int mm4(const uint8_t *packed, const void *meta, int meta_kind, int64_t N, int64_t K, int64_t gs, int64_t block,
        int kind, const void *x, const float *xs, int64_t M, float *out, int threads) {
    if (gs > MAXG || gs % 2 || K % gs || block > MAXR || block % 32 || N % 32 || kind < 1 || kind > 2
        || meta_kind < 0 || meta_kind > 2) return 1;
    int64_t whole = N - N % block, nb = whole / block + (N % block ? 1 : 0);
    memset(out, 0, (size_t)(M * N) * sizeof(float));
    #pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t b = 0; b < nb; b++) {
        int64_t r0 = b * block, R = r0 < whole ? block : N - whole;
        const uint8_t *blk = packed + r0 * K / 2;
        if (kind == 2) block_bf(blk, R, r0 >= whole, r0, meta, meta_kind, (const uint16_t *)x, xs, M, K, gs, out, N);
        else block_f32(blk, R, r0 >= whole, r0, meta, meta_kind, (const float *)x, xs, M, K, gs, out, N);
    }
    return 0;
}
"""
