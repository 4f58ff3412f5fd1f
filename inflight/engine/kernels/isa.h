/* The ISA level this translation unit is compiled for, from the compiler's own macros (the
 * loader passes -march=x86-64-v4 | x86-64-v3 | x86-64, or nothing off x86). Every kernel picks its
 * code path with these and nothing else, so a library holds exactly one level's code.
 *   INFLIGHT_AVX512: AVX-512 F/BW/VL/DQ (with AVX2 and FMA)
 *   INFLIGHT_AVX2:   AVX2 and FMA, no AVX-512
 *   neither:         portable C11 (any CPU; OpenMP simd loops the compiler may vectorise) */
#ifndef INFLIGHT_ISA_H
#define INFLIGHT_ISA_H

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define INFLIGHT_AVX512 1
#define INFLIGHT_AVX2 0
#elif defined(__AVX2__) && defined(__FMA__)
#define INFLIGHT_AVX512 0
#define INFLIGHT_AVX2 1
#else
#define INFLIGHT_AVX512 0
#define INFLIGHT_AVX2 0
#endif

/* Index into inflight.engine.cpu.ISA_LEVELS: 0 = avx512, 1 = avx2, 2 = portable. */
#define INFLIGHT_ISA_INDEX (INFLIGHT_AVX512 ? 0 : INFLIGHT_AVX2 ? 1 : 2)

#endif
