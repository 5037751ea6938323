"""One-pass expansion of a 4-bit weight held in the int4 kernel's order straight into the compute dtype, in C.

The generic path of a weight in the kernel's order (compress/kernels.py) writes its levels through permuted views
of an fp32 buffer, scales and shifts it in place and converts it to the compute dtype: four passes over the
expanded weight, two of them strided. Here each (group, row block) tile of bytes is transposed in a small buffer,
then every output row's group is written once, as fp32, bf16 or fp16, with the same arithmetic as the codec's
`dequantize` (level as fp32, times the scale, plus the minimum: two fp32 roundings, no fused multiply-add; then
one round to nearest even into bf16 or fp16), so the result is bitwise the reference's. The int4 kernel's scales
and zeros, built from the meta at each load of a weight the kernel multiplies, are written here in one pass too
(`scales_into`).

The C source is compiled once per machine, instruction set and source into the cache directory with the system's
C compiler and loaded with ctypes (the call releases the GIL, so a weight load on an I/O thread expands while the
main thread computes). The instruction set follows torch's own (ATEN_CPU_CAPABILITY), so the AVX2 path of an
AVX-512 CPU is the AVX2 build. Where no compiler or build works `available()` is False and the callers keep the
torch path.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
from typing import Optional

import torch

from flexh2o.paths import cache_dir

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

static inline uint16_t to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? 0x7fc0u : r);
}

/* n fp32 values rounded to nearest even into bf16 (NaN -> 0x7fc0, as torch), 8 at a time where AVX2 is built. */
static void store_bf16(const float *v, uint16_t *o, int64_t n) {
    int64_t t = 0;
#ifdef __AVX2__
    const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff), qnan = _mm256_set1_epi32(0x7fc0);
    const __m256i abs = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    for (; t + 8 <= n; t += 8) {
        __m256i u = _mm256_castps_si256(_mm256_loadu_ps(v + t));
        __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, bias), lsb), 16);
        __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs), inf);
        r = _mm256_blendv_epi8(r, qnan, nan);
        __m128i p = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
        _mm_storeu_si128((__m128i *)(o + t), p);
    }
#endif
    for (; t < n; t++) o[t] = to_bf16(v[t]);
}

/* n fp32 values rounded to nearest even into fp16 (vcvtps2ph where F16C is built, else the compiler's _Float16). */
static void store_fp16(const float *v, uint16_t *o, int64_t n) {
    int64_t t = 0;
#ifdef __F16C__
    for (; t + 8 <= n; t += 8)
        _mm_storeu_si128((__m128i *)(o + t), _mm256_cvtps_ph(_mm256_loadu_ps(v + t), _MM_FROUND_TO_NEAREST_INT));
    for (; t < n; t++) o[t] = _cvtss_sh(v[t], _MM_FROUND_TO_NEAREST_INT);
#elif defined(__FLT16_MAX__)
    for (; t < n; t++) { _Float16 h = (_Float16)v[t]; memcpy(o + t, &h, 2); }
#endif
}

/* An 8 x 8 tile of bytes transposed (rows `ss` apart in src, `ds` apart in dst) by three rounds of swaps. */
static inline void transpose8(const uint8_t *src, int64_t ss, uint8_t *dst, int64_t ds) {
    uint64_t x[8], t;
    for (int r = 0; r < 8; r++) memcpy(&x[r], src + r * ss, 8);
    for (int r = 0; r < 4; r++) {
        t = ((x[r] >> 32) ^ x[r + 4]) & 0x00000000FFFFFFFFull; x[r] ^= t << 32; x[r + 4] ^= t;
    }
    for (int r = 0; r < 8; r += (r % 2 ? 3 : 1)) {  /* 0, 1, 4, 5 */
        t = ((x[r] >> 16) ^ x[r + 2]) & 0x0000FFFF0000FFFFull; x[r] ^= t << 16; x[r + 2] ^= t;
    }
    for (int r = 0; r < 8; r += 2) {
        t = ((x[r] >> 8) ^ x[r + 1]) & 0x00FF00FF00FF00FFull; x[r] ^= t << 8; x[r + 1] ^= t;
    }
    for (int r = 0; r < 8; r++) memcpy(dst + r * ds, &x[r], 8);
}

/* One block of R rows: bytes (K, R / 2), byte i of input k holds rows lo(i) (low nibble) and hi(i) (high).
   interleaved: lo(i) = 2i, hi(i) = 2i + 1 (the last, shorter block); else lo(i) = i, hi(i) = i + R / 2. */
static void expand_block(const uint8_t *src, const float *meta, int64_t K, int64_t g, int64_t R, int interleaved,
                         int kind, char *out, int64_t row0) {
    int64_t h = R / 2, G = K / g;
    uint8_t tile[32 * 256];
    for (int64_t gi = 0; gi < G; gi++) {
        const uint8_t *b = src + gi * g * h;  /* (g, h) bytes -> tile (h, g) */
        if (h % 8 == 0 && g % 8 == 0) {
            for (int64_t t = 0; t < g; t += 8)
                for (int64_t i = 0; i < h; i += 8) transpose8(b + t * h + i, h, tile + i * g + t, g);
        } else {
            for (int64_t t = 0; t < g; t++)
                for (int64_t i = 0; i < h; i++) tile[i * g + t] = b[t * h + i];
        }
        for (int64_t i = 0; i < h; i++) {
            int64_t rows[2] = {interleaved ? 2 * i : i, interleaved ? 2 * i + 1 : i + h};
            const uint8_t *q = tile + i * g;
            for (int half = 0; half < 2; half++) {
                int64_t r = row0 + rows[half];
                float s = meta[(r * G + gi) * 2], m = meta[(r * G + gi) * 2 + 1];
                int shift = half ? 4 : 0;
                float vals[256];
                float *o = kind == 0 ? (float *)out + r * K + gi * g : vals;
                for (int64_t t = 0; t < g; t++) {
                    float v = (float)((q[t] >> shift) & 15) * s;
                    o[t] = v + m;
                }
                if (kind == 1) store_bf16(vals, (uint16_t *)out + r * K + gi * g, g);
                else if (kind == 2) store_fp16(vals, (uint16_t *)out + r * K + gi * g, g);
            }
        }
    }
}

static inline float from_bf16(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

/* The int4 kernel's scales and zeros: meta (N, G, 2) (scale, minimum) as fp32 (kind 0) or bf16 (kind 1) ->
   out (G, N, 2) bf16 (scale, minimum + 8 scale), as torch computes them (fp32, 8 scale exact: one rounding). */
int scales4(const void *meta, int kind, int64_t N, int64_t G, uint16_t *out, int threads) {
    if (kind < 0 || kind > 1) return 1;
    /* tiles of 64 rows: the tile's meta rows stay in cache while each group's 64 pairs are written in a row */
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += 64) {
        int64_t n1 = n0 + 64 < N ? n0 + 64 : N;
        for (int64_t g = 0; g < G; g++) {
            for (int64_t n = n0; n < n1; n++) {
                int64_t i = (n * G + g) * 2;
                float s = kind ? from_bf16(((const uint16_t *)meta)[i]) : ((const float *)meta)[i];
                float m = kind ? from_bf16(((const uint16_t *)meta)[i + 1]) : ((const float *)meta)[i + 1];
                out[(g * N + n) * 2] = to_bf16(s);
                out[(g * N + n) * 2 + 1] = to_bf16(m + 8.0f * s);
            }
        }
    }
    return 0;
}

/* Which outputs this build writes: fp32 and bf16 always, fp16 where F16C is built or the compiler has _Float16. */
int expand4_kinds(void) {
#if defined(__F16C__) || defined(__FLT16_MAX__)
    return 3;
#else
    return 2;
#endif
}

int expand4(const uint8_t *packed, const float *meta, int64_t N, int64_t K, int64_t g, int64_t block,
            int kind, void *out, int threads) {
    if (kind < 0 || kind >= expand4_kinds() || block > 64 || g > 256 || (block / 2) * g > 32 * 256 || K % g) return 1;
    int64_t whole = N - N % block, nb = whole / block, last = N % block;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b <= nb; b++) {
        if (b < nb)
            expand_block(packed + b * block * K / 2, meta, K, g, block, 0, kind, (char *)out, b * block);
        else if (last)
            expand_block(packed + whole * K / 2, meta, K, g, last, 1, kind, (char *)out, whole);
    }
    return 0;
}
"""
ISA_FLAGS = (("AVX512", ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c")),
             ("AVX2", ("-mavx2", "-mfma", "-mf16c")))  # torch's capability -> the build's; others: the default
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # in the C code's order of `kind`
MAX_GROUP = 256  # the C tile holds a group of up to this many inputs for 32 byte rows
MAX_BLOCK = 64
META_DTYPES = (torch.float32, torch.bfloat16)  # the meta `scales_into` reads, in the C code's order of `kind`


def _isa() -> str:
    return torch.backends.cpu.get_cpu_capability()


@functools.lru_cache(maxsize=None)
def _library(isa: str) -> Optional[ctypes.CDLL]:
    """The built library for `isa` (built once into the cache directory), None where it cannot be built."""
    flags = ["-O3", "-fopenmp", "-fPIC", "-shared", "-ffp-contract=off", *dict(ISA_FLAGS).get(isa, ())]
    lib = built(f"expand4-{isa.lower()}", SOURCE, flags)
    if lib is None:
        return None
    lib.expand4.restype = ctypes.c_int
    lib.expand4.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                            ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    lib.expand4_kinds.restype = ctypes.c_int
    lib.scales4.restype = ctypes.c_int
    lib.scales4.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                            ctypes.c_int]
    return lib


def built(name: str, source: str, flags: list) -> Optional[ctypes.CDLL]:
    """C `source` compiled with `flags` into the cache directory once (`name`-<hash of both>.so) and loaded; None
    where it cannot be built (no compiler) or loaded."""
    key = hashlib.sha256((source + " ".join(flags)).encode()).hexdigest()[:16]
    path = os.path.join(cache_dir(), "native", f"{name}-{key}.so")
    try:
        if not os.path.exists(path):
            _build(path, list(flags), source)
        return ctypes.CDLL(path)
    except (OSError, subprocess.SubprocessError):
        return None


def _build(path: str, flags: list, source: str = SOURCE) -> None:
    """Compile `source` (C) into `path` (written under a temporary name beside it, then renamed: concurrent builds of
    several processes are safe)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with tempfile.TemporaryDirectory() as work:
        src = os.path.join(work, "expand4.c")
        with open(src, "w") as f:
            f.write(source)
        try:
            subprocess.run([os.environ.get("CC", "cc"), *flags, src, "-o", tmp], check=True, capture_output=True,
                           timeout=120)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)


def out_dtypes() -> tuple:
    """The dtypes the C expansion writes on this machine (fp32 and bf16, fp16 where F16C is built or the compiler has _Float16);
    () where it cannot be built or loaded for torch's instruction set."""
    lib = _library(_isa())
    return OUT_DTYPES[:lib.expand4_kinds()] if lib is not None else ()


def available() -> bool:
    """Whether the C expansion is built and loaded for torch's instruction set on this machine."""
    return bool(out_dtypes())


def supports(block: int, group_size: int, out: torch.Tensor) -> bool:
    """Whether `expand_into` takes this row block, group and output (a contiguous CPU tensor of `out_dtypes`)."""
    return (out.is_contiguous() and out.device.type == "cpu" and block <= MAX_BLOCK and group_size <= MAX_GROUP
            and (block // 2) * group_size <= 32 * MAX_GROUP and out.dtype in out_dtypes())


def expand_into(packed: torch.Tensor, meta: torch.Tensor, group_size: int, block: int, out: torch.Tensor) -> None:
    """Kernel-order bytes (N, K / 2) with meta (N, groups, 2) (scale, minimum) expanded into `out` (N, K) (check
    `supports` first)."""
    n, k = out.shape
    packed = packed.contiguous()
    m = meta.to(torch.float32).contiguous()  # (N, groups, 2) fp32
    got = _library(_isa()).expand4(packed.data_ptr(), m.data_ptr(), n, k, group_size, block,
                                   OUT_DTYPES.index(out.dtype), out.data_ptr(), torch.get_num_threads())
    if got:
        raise ValueError(f"expand4: unsupported block {block} / group {group_size} / {out.dtype} for a ({n}, {k}) "
                         f"weight")


def scales_into(meta: torch.Tensor, out: torch.Tensor) -> bool:
    """The int4 kernel's scales and zeros of meta (N, groups, 2) (scale, minimum) written into `out` (groups, N, 2)
    bf16 in one pass, bit for bit compress/kernels.kernel_scales' torch ops; False (nothing written) where the
    library is not built or the meta is not fp32 or bf16 on the CPU. One thread: a pass of at most a few hundred
    microseconds, run at each load on an I/O thread while torch's threads compute (a second team of threads on the
    same cores made both wait: 8 ms a call on 2 busy cores)."""
    lib = _library(_isa())
    if lib is None or meta.dtype not in META_DTYPES or meta.device.type != "cpu" or not out.is_contiguous():
        return False
    m = meta.contiguous()
    n, groups = m.shape[:2]
    return lib.scales4(m.data_ptr(), META_DTYPES.index(m.dtype), n, groups, out.data_ptr(), 1) == 0
