/* Decode attention straight over the paged KV cache (one new query token per sequence).
 *
 * No gather: each sequence walks its own block table and reads keys and values where they lie, a
 * token at a time (its keys for every kv head are one contiguous run, which keeps the reads
 * sequential). Scores go to a per-thread scratch row, so a step allocates nothing that grows with
 * the context. Keys/values may be float32 or bfloat16; queries, accumulation and output are
 * float32. Grouped-query attention: query head h reads kv head h / (H / KVH).
 *
 * Layouts: q, out [B, H, D]; caches [num_blocks, block_size, KVH, D]; block_tables [B, max_blocks];
 * context_lens [B]; scratch [num_threads, H * (max_context + D)].
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Blocks lie anywhere in the pool and the hardware prefetcher stops at page boundaries: while
 * reading a token's row, ask for the same row of the sequence's next block. */
static inline void prefetch_row(const void *row, long bytes) {
    for (long off = 0; off < bytes; off += 64) __builtin_prefetch((const char *)row + off, 0, 3);
}

/* HEAD_DIM > 0 fixes the head size at compile time (the common sizes): the compiler then unrolls
 * the per-head loops and keeps a head's vectors in registers. 0: any head size. */
#define DEFINE_DECODE(NAME, T, LOAD, HEAD_DIM)                                                    \
static void NAME(const float *q, const T *k_cache, const T *v_cache, const int32_t *block_tables, \
                 const int32_t *context_lens, float *out, float *scratch, int B, int H, int KVH,  \
                 int head_dim, int bs, int max_blocks, int max_context, float scale, int num_threads) { \
    const int D = HEAD_DIM > 0 ? HEAD_DIM : head_dim;                                             \
    const int G = H / KVH;                                                                        \
    const long token_stride = (long)KVH * D; /* a token's keys for all kv heads are contiguous */ \
    const long row_bytes = token_stride * (long)sizeof(T);                                        \
    _Pragma("omp parallel for num_threads(num_threads) schedule(dynamic, 1)")                     \
    for (int b = 0; b < B; b++) {                                                                 \
        const int len = context_lens[b];                                                          \
        float *scores = scratch + (long)omp_get_thread_num() * H * (max_context + D);             \
        float *acc = scores + (long)H * max_context;                                              \
        const float *qb = q + (long)b * H * D;                                                    \
        const int32_t *table = block_tables + (long)b * max_blocks;                               \
        for (int pos = 0; pos < len; pos++) {                                                     \
            const T *kp = k_cache + ((long)table[pos / bs] * bs + pos % bs) * token_stride;       \
            if (pos + bs < len) prefetch_row(k_cache + ((long)table[pos / bs + 1] * bs + pos % bs) * token_stride, row_bytes); \
            for (int h = 0; h < H; h++) {                                                         \
                const float *qh = qb + (long)h * D;                                               \
                const T *kh = kp + (long)(h / G) * D;                                             \
                float dot = 0.f;                                                                  \
                _Pragma("omp simd reduction(+:dot)")                                              \
                for (int d = 0; d < D; d++) dot += qh[d] * LOAD(kh[d]);                           \
                scores[(long)h * max_context + pos] = dot * scale;                                \
            }                                                                                     \
        }                                                                                         \
        for (int h = 0; h < H; h++) {                                                             \
            float *s = scores + (long)h * max_context, top = -FLT_MAX, total = 0.f;              \
            _Pragma("omp simd reduction(max:top)")                                                \
            for (int pos = 0; pos < len; pos++) top = s[pos] > top ? s[pos] : top;                \
            _Pragma("omp simd reduction(+:total)")                                                \
            for (int pos = 0; pos < len; pos++) { s[pos] = expf(s[pos] - top); total += s[pos]; } \
            const float inv = 1.f / total;                                                        \
            for (int pos = 0; pos < len; pos++) s[pos] *= inv;                                    \
        }                                                                                         \
        memset(acc, 0, sizeof(float) * H * D);                                                    \
        for (int pos = 0; pos < len; pos++) {                                                     \
            const T *vp = v_cache + ((long)table[pos / bs] * bs + pos % bs) * token_stride;       \
            if (pos + bs < len) prefetch_row(v_cache + ((long)table[pos / bs + 1] * bs + pos % bs) * token_stride, row_bytes); \
            for (int h = 0; h < H; h++) {                                                         \
                const float p = scores[(long)h * max_context + pos];                              \
                const T *vh = vp + (long)(h / G) * D;                                             \
                float *a = acc + (long)h * D;                                                     \
                _Pragma("omp simd")                                                               \
                for (int d = 0; d < D; d++) a[d] += p * LOAD(vh[d]);                              \
            }                                                                                     \
        }                                                                                         \
        memcpy(out + (long)b * H * D, acc, sizeof(float) * H * D);                                \
    }                                                                                             \
}

#define LOAD_F32(x) (x)
#define LOAD_BF16(x) bf16_to_f32(x)
DEFINE_DECODE(decode_f32, float, LOAD_F32, 0)
DEFINE_DECODE(decode_f32_d32, float, LOAD_F32, 32)
DEFINE_DECODE(decode_f32_d64, float, LOAD_F32, 64)
DEFINE_DECODE(decode_f32_d128, float, LOAD_F32, 128)
DEFINE_DECODE(decode_bf16, uint16_t, LOAD_BF16, 0)
DEFINE_DECODE(decode_bf16_d32, uint16_t, LOAD_BF16, 32)
DEFINE_DECODE(decode_bf16_d64, uint16_t, LOAD_BF16, 64)
DEFINE_DECODE(decode_bf16_d128, uint16_t, LOAD_BF16, 128)

typedef void (*decode_fn)(const float *, const void *, const void *, const int32_t *, const int32_t *,
                          float *, float *, int, int, int, int, int, int, int, float, int);

static decode_fn pick(int kv_dtype, int D) {
    if (kv_dtype == 0)
        return (decode_fn)(D == 32 ? decode_f32_d32 : D == 64 ? decode_f32_d64 : D == 128 ? decode_f32_d128 : decode_f32);
    if (kv_dtype == 1)
        return (decode_fn)(D == 32 ? decode_bf16_d32 : D == 64 ? decode_bf16_d64 : D == 128 ? decode_bf16_d128 : decode_bf16);
    return 0;
}

/* kv_dtype: 0 = float32, 1 = bfloat16. Returns 0, or -1 for an unsupported dtype. */
int paged_decode_attention(const float *q, const void *k_cache, const void *v_cache,
                           const int32_t *block_tables, const int32_t *context_lens, float *out,
                           float *scratch, int B, int H, int KVH, int D, int bs, int max_blocks,
                           int max_context, float scale, int kv_dtype, int num_threads) {
    decode_fn fn = pick(kv_dtype, D);
    if (!fn) return -1;
    fn(q, k_cache, v_cache, block_tables, context_lens, out, scratch, B, H, KVH, D, bs, max_blocks, max_context,
       scale, num_threads);
    return 0;
}
