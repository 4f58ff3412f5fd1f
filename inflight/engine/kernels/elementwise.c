/* Fused elementwise steps of a decoder layer: RMSNorm (optionally after the residual add), rotary
 * embedding in place, and silu(gate) * up.
 *
 * Each replaces three to eight PyTorch ops (and their temporaries) with one pass over the data. The
 * arithmetic follows `transformers` step by step: math in float32, and for bfloat16 tensors every
 * intermediate that transformers stores in bfloat16 is rounded to bfloat16 at the same point
 * (round to nearest even), so bf16 results stay as close to the oracle as PyTorch's own ops.
 *
 * dtype: 0 = float32, 1 = bfloat16. Tensors are contiguous row-major; `threads` bounds OpenMP.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "isa.h"

static inline float bf16_load(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t bf16_store(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even; inputs are finite */
    return (uint16_t)(u >> 16);
}

static inline float bf16_round(float f) { return bf16_load(bf16_store(f)); }

/* Work below this many elements runs on one thread: waking the others costs more. */
#define PARALLEL_MIN 32768L

#define F32_LOAD(x) (x)
#define F32_STORE(x) (x)
#define F32_ROUND(x) (x)
#define BF16_ROUND(x) bf16_round(x)

/* out = weight * dtype(x * rsqrt(mean(x^2) + eps)); with delta: x = dtype(x + delta) first, stored back. */
#define DEFINE_NORM(NAME, T, LOAD, STORE, ROUND)                                                   \
static void NAME(T *x, const T *delta, const T *weight, T *out, long rows, int dim, float eps,     \
                 int threads) {                                                                    \
    _Pragma("omp parallel for num_threads(threads) schedule(static) if(rows * dim >= PARALLEL_MIN)") \
    for (long r = 0; r < rows; r++) {                                                              \
        T *xr = x + r * dim;                                                                       \
        T *orow = out + r * dim;                                                                   \
        float sumsq = 0.f;                                                                         \
        if (delta) {                                                                               \
            const T *dr = delta + r * dim;                                                         \
            for (int i = 0; i < dim; i++) {                                                        \
                float v = ROUND(LOAD(xr[i]) + LOAD(dr[i]));                                        \
                xr[i] = STORE(v);                                                                  \
                sumsq += v * v;                                                                    \
            }                                                                                      \
        } else {                                                                                   \
            _Pragma("omp simd reduction(+:sumsq)")                                                 \
            for (int i = 0; i < dim; i++) { float v = LOAD(xr[i]); sumsq += v * v; }              \
        }                                                                                          \
        /* -ffast-math makes this rsqrtss and a Newton step, NaN for inf: a sum of squares that   \
         * overflowed gives 0, as PyTorch's rsqrt(inf) */                                          \
        const float ms = sumsq / dim + eps, inv = ms < 3e38f ? 1.f / sqrtf(ms) : 0.f;              \
        for (int i = 0; i < dim; i++)                                                              \
            orow[i] = STORE(LOAD(weight[i]) * ROUND(LOAD(xr[i]) * inv));                           \
    }                                                                                              \
}

/* x [tokens, heads, dim] in place: x * cos + rotate_half(x) * sin, cos/sin from the float32 table
 * [max_pos, 2, dim] at each token's position (cast to the tensor's dtype first, as transformers does).
 * A token's heads are contiguous; tokens are `token_stride` elements apart (x may be a column slice
 * of a fused q|k|v matrix). */
#define DEFINE_ROTARY(NAME, T, LOAD, STORE, ROUND)                                                 \
static void NAME(T *x, long tokens, long token_stride, int heads, int dim, const float *table,     \
                 const int64_t *positions, int threads) {                                          \
    const int half = dim / 2;                                                                      \
    _Pragma("omp parallel for num_threads(threads) schedule(static) if(tokens * heads * dim >= PARALLEL_MIN)") \
    for (long t = 0; t < tokens; t++) {                                                            \
        const float *cos_row = table + positions[t] * 2 * dim;                                     \
        const float *sin_row = cos_row + dim;                                                      \
        for (int h = 0; h < heads; h++) {                                                          \
            T *v = x + t * token_stride + (long)h * dim;                                           \
            for (int i = 0; i < half; i++) {                                                       \
                const float a = LOAD(v[i]), b = LOAD(v[i + half]);                                 \
                const float c1 = ROUND(cos_row[i]), s1 = ROUND(sin_row[i]);                        \
                const float c2 = ROUND(cos_row[i + half]), s2 = ROUND(sin_row[i + half]);          \
                v[i] = STORE(ROUND(ROUND(a * c1) + ROUND(-b * s1)));                               \
                v[i + half] = STORE(ROUND(ROUND(b * c2) + ROUND(a * s2)));                         \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
}

/* out [rows, dim] = dtype(silu(gate)) * up; gate and up rows are `stride` elements apart (so one
 * [rows, 2 * dim] gate|up matrix can be passed as two pointers with stride 2 * dim).
 * The gate is clamped at -88 first: below that expf(-x) overflows to inf, and -ffast-math lowers the
 * vectorised division to x * (2r - d * r * r) with r = rcpps(d), which is inf * 0 = NaN for d = inf.
 * The clamp keeps d finite (r then flushes to 0) and the scalar tail's exact division small: silu is
 * within 6e-37 of 0 there either way. */
#define DEFINE_SILU_MUL(NAME, T, LOAD, STORE, ROUND)                                               \
static void NAME(const T *gate, const T *up, long stride, T *out, long rows, int dim, int threads) { \
    _Pragma("omp parallel for num_threads(threads) schedule(static) if(rows * dim >= PARALLEL_MIN)") \
    for (long r = 0; r < rows; r++) {                                                              \
        const T *g = gate + r * stride, *u = up + r * stride;                                      \
        T *o = out + r * dim;                                                                      \
        _Pragma("omp simd")                                                                        \
        for (int i = 0; i < dim; i++) {                                                            \
            const float x = fmaxf(LOAD(g[i]), -88.f);                                              \
            o[i] = STORE(ROUND(ROUND(x / (1.f + expf(-x))) * LOAD(u[i])));                         \
        }                                                                                          \
    }                                                                                              \
}

#if INFLIGHT_AVX512
/* silu(gate) * up, 16 lanes at a time, with an exp of its own: through libmvec's expf and a
 * division this step cost 6% of the 49M bf16 workload. Cephes' expf polynomial after range
 * reduction by ln 2 (relative error ~1e-7, like expf), a scalef for 2^n, a reciprocal estimate
 * refined by one Newton step; bf16 rounding as bf16_store (round to nearest even). 1.5-1.8x the
 * scalar-loop version on [64, 1536]. */
#include <immintrin.h>

static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-103.f)), _mm512_set1_ps(88.7f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(y, n);
}

static inline __m512 silu16(__m512 x) {
    const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), x)));
    __m512 inv = _mm512_rcp14_ps(d); /* 14 bits, then one Newton step: ~1 ulp, a third of a division's cost */
    inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(d, inv, _mm512_set1_ps(2.f)));
    return _mm512_mul_ps(x, inv);
}

static inline __m512 load16_bf16(const uint16_t *p, __mmask16 mask) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

static inline __m256i bf16x16(__m512 f) { /* round to nearest even, as bf16_store */
#if defined(__AVX512BF16__)
    return (__m256i)_mm512_cvtneps_pbh(f);
#else
    __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
#endif
}

static inline __m512 round16_bf16(__m512 f) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16x16(f)), 16));
}

static inline __m512 load16_f32(const float *p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
static inline void store16_f32(float *p, __mmask16 mask, __m512 v) { _mm512_mask_storeu_ps(p, mask, v); }
static inline __m512 round16_f32(__m512 v) { return v; }
static inline void store16_bf16(uint16_t *p, __mmask16 mask, __m512 v) {
    _mm256_mask_storeu_epi16(p, mask, bf16x16(v));
}

#define DEFINE_SILU_MUL_AVX512(NAME, T, LOAD16, STORE16, ROUND16)                                  \
static void NAME(const T *gate, const T *up, long stride, T *out, long rows, int dim, int threads) { \
    _Pragma("omp parallel for num_threads(threads) schedule(static) if(rows * dim >= PARALLEL_MIN)") \
    for (long r = 0; r < rows; r++) {                                                              \
        const T *g = gate + r * stride, *u = up + r * stride;                                      \
        T *o = out + r * dim;                                                                      \
        for (int i = 0; i < dim; i += 16) {                                                        \
            const __mmask16 m = dim - i >= 16 ? 0xFFFF : (__mmask16)((1u << (dim - i)) - 1);       \
            const __m512 s = ROUND16(silu16(LOAD16(g + i, m)));                                    \
            STORE16(o + i, m, _mm512_mul_ps(s, LOAD16(u + i, m)));                                 \
        }                                                                                          \
    }                                                                                              \
}

DEFINE_SILU_MUL_AVX512(silu_mul_f32, float, load16_f32, store16_f32, round16_f32)
DEFINE_SILU_MUL_AVX512(silu_mul_bf16, uint16_t, load16_bf16, store16_bf16, round16_bf16)
#elif INFLIGHT_AVX2
/* silu(gate) * up, 8 lanes at a time, the AVX-512 version's arithmetic at 8 lanes: the same Cephes
 * expf polynomial, 2^n added to the exponent bits (AVX2 has no scalef), a 12-bit reciprocal
 * estimate refined by one Newton step, bf16 rounding as bf16_store. Ragged row ends: masked loads
 * and stores for float32, a zero-padded 8-lane buffer for bfloat16 (no 16-bit masked moves).
 * Measured on an AMD EPYC Zen 4 running the avx2 build on [64, 1536]: 2.6x (fp32) and 2.4x (bf16)
 * the portable build's loop; the AVX-512 version is 1.6-1.7x faster again. RMSNorm and rotary stay
 * plain C: -march=x86-64-v3 vectorises them with 32-byte vectors (1.1-1.9x portable; both together
 * take under 4% of the attention's time on the 49M decode shapes), so no intrinsics for them. */
#include <immintrin.h>

/* e^x for x in [-86, 88.7] (clamped: 2^n must stay a normal float for the exponent add); below
 * -86 it returns e^-86, which 1 + e^-x absorbs. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-86.f)), _mm256_set1_ps(88.7f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
    const __m256i scale = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(y), scale));
}

/* 1 + e^-x <= 3.3e38 stays finite, so the Newton step never meets inf * 0: past 2^126 the estimate
 * is flushed to 0 and silu to -0, as PyTorch's x / inf. */
static inline __m256 silu8(__m256 x) {
    const __m256 d = _mm256_add_ps(_mm256_set1_ps(1.f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), x)));
    __m256 inv = _mm256_rcp_ps(d); /* 12 bits, then one Newton step: ~1 ulp */
    inv = _mm256_mul_ps(inv, _mm256_fnmadd_ps(d, inv, _mm256_set1_ps(2.f)));
    return _mm256_mul_ps(x, inv);
}

static inline __m256i tail_mask8(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* Round to nearest even as bf16_store, the low 16 bits cleared: the float the bf16 stands for. */
static inline __m256i bf16_rounded_bits(__m256 f) {
    const __m256i u = _mm256_castps_si256(f);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i sum = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
    return _mm256_and_si256(sum, _mm256_set1_epi32((int)0xFFFF0000u));
}

static inline __m256 round8_bf16(__m256 f) { return _mm256_castsi256_ps(bf16_rounded_bits(f)); }
static inline __m256 round8_f32(__m256 v) { return v; }

/* n: the lanes to read or write (8, or a row's last 1..7). */
static inline __m256 load8_f32(const float *p, int n) {
    return n == 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, tail_mask8(n));
}

static inline void store8_f32(float *p, int n, __m256 v) {
    if (n == 8) _mm256_storeu_ps(p, v);
    else _mm256_maskstore_ps(p, tail_mask8(n), v);
}

static inline __m256 load8_bf16(const uint16_t *p, int n) {
    uint16_t buf[8] = {0};
    if (n < 8) p = memcpy(buf, p, sizeof(uint16_t) * n);
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

static inline void store8_bf16(uint16_t *p, int n, __m256 v) {
    const __m256i bits = _mm256_srli_epi32(bf16_rounded_bits(v), 16);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
    if (n == 8) { _mm_storeu_si128((__m128i *)p, packed); return; }
    uint16_t buf[8];
    _mm_storeu_si128((__m128i *)buf, packed);
    memcpy(p, buf, sizeof(uint16_t) * n);
}

#define DEFINE_SILU_MUL_AVX2(NAME, T, LOAD8, STORE8, ROUND8)                                       \
static void NAME(const T *gate, const T *up, long stride, T *out, long rows, int dim, int threads) { \
    _Pragma("omp parallel for num_threads(threads) schedule(static) if(rows * dim >= PARALLEL_MIN)") \
    for (long r = 0; r < rows; r++) {                                                              \
        const T *g = gate + r * stride, *u = up + r * stride;                                      \
        T *o = out + r * dim;                                                                      \
        int i = 0;                                                                                 \
        for (; i + 8 <= dim; i += 8)                                                               \
            STORE8(o + i, 8, _mm256_mul_ps(ROUND8(silu8(LOAD8(g + i, 8))), LOAD8(u + i, 8)));      \
        const int n = dim - i;                                                                     \
        if (n > 0) STORE8(o + i, n, _mm256_mul_ps(ROUND8(silu8(LOAD8(g + i, n))), LOAD8(u + i, n))); \
    }                                                                                              \
}

DEFINE_SILU_MUL_AVX2(silu_mul_f32, float, load8_f32, store8_f32, round8_f32)
DEFINE_SILU_MUL_AVX2(silu_mul_bf16, uint16_t, load8_bf16, store8_bf16, round8_bf16)
#else
DEFINE_SILU_MUL(silu_mul_f32, float, F32_LOAD, F32_STORE, F32_ROUND)
DEFINE_SILU_MUL(silu_mul_bf16, uint16_t, bf16_load, bf16_store, BF16_ROUND)
#endif

DEFINE_NORM(norm_f32, float, F32_LOAD, F32_STORE, F32_ROUND)
DEFINE_NORM(norm_bf16, uint16_t, bf16_load, bf16_store, BF16_ROUND)
DEFINE_ROTARY(rotary_f32, float, F32_LOAD, F32_STORE, F32_ROUND)
DEFINE_ROTARY(rotary_bf16, uint16_t, bf16_load, bf16_store, BF16_ROUND)

/* delta may be NULL (plain RMSNorm). Returns 0, or -1 for an unsupported dtype. */
int fused_rms_norm(void *x, const void *delta, const void *weight, void *out, long rows, int dim, float eps,
                   int dtype, int threads) {
    if (dtype == 0) norm_f32(x, delta, weight, out, rows, dim, eps, threads);
    else if (dtype == 1) norm_bf16(x, delta, weight, out, rows, dim, eps, threads);
    else return -1;
    return 0;
}

int fused_rotary(void *x, long tokens, long token_stride, int heads, int dim, const float *table,
                 const int64_t *positions, int dtype, int threads) {
    if (dim % 2) return -2;
    if (dtype == 0) rotary_f32(x, tokens, token_stride, heads, dim, table, positions, threads);
    else if (dtype == 1) rotary_bf16(x, tokens, token_stride, heads, dim, table, positions, threads);
    else return -1;
    return 0;
}

int fused_silu_mul(const void *gate, const void *up, long stride, void *out, long rows, int dim, int dtype,
                   int threads) {
    if (dtype == 0) silu_mul_f32(gate, up, stride, out, rows, dim, threads);
    else if (dtype == 1) silu_mul_bf16(gate, up, stride, out, rows, dim, threads);
    else return -1;
    return 0;
}
