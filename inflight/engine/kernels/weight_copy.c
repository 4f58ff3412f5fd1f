/* A received weight copied into engine memory, counting on the way the values that are not finite.
 *
 * Refusing NaN and inf in a weight update used to cost a second pass over the weights (a sum) on the
 * sync's pause; here the check rides on the copy, which is bound by memory bandwidth anyway. The test
 * is on the bits (an exponent of all ones is inf or NaN in every IEEE-style format), so it holds under
 * -ffast-math, which lets the compiler assume floats are finite. Plain C: the compiler vectorises the
 * loop with each ISA level's flags.
 *
 * width: bytes per element (4 or 2); exp_mask: the format's exponent bits (float32 0x7f800000,
 * bfloat16 0x7f80, float16 0x7c00). Returns how many elements are not finite; the copy is complete
 * either way (the caller decides what a refused buffer becomes).
 */
#include <stdint.h>

#define PARALLEL_MIN (1L << 20)

long copy_count_nonfinite(void *dst, const void *src, long n, int width, unsigned exp_mask, int threads) {
    long bad = 0;
    if (width == 4) {
        const uint32_t *s = (const uint32_t *)src;
        uint32_t *d = (uint32_t *)dst;
        const uint32_t m = exp_mask;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : bad) if (n >= PARALLEL_MIN)
        for (long i = 0; i < n; i++) {
            const uint32_t x = s[i];
            d[i] = x;
            bad += (x & m) == m;
        }
    } else if (width == 2) {
        const uint16_t *s = (const uint16_t *)src;
        uint16_t *d = (uint16_t *)dst;
        const uint16_t m = (uint16_t)exp_mask;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : bad) if (n >= PARALLEL_MIN)
        for (long i = 0; i < n; i++) {
            const uint16_t x = s[i];
            d[i] = x;
            bad += (x & m) == m;
        }
    } else {
        return -1;
    }
    return bad;
}
