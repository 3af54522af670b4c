/* A register tile of float32 fused multiply-adds for AVX2 and FMA: up to 6 rows of a
 * times 16 columns of b, the loop of a GEMM's inner kernel (6 rows x 2 vectors are 12 of
 * the 16 registers; the two column vectors and a broadcast input take 3).
 *
 * Each output is its row of a dotted with its column of b in the order of the positions,
 * one fused multiply-add a position, so a row's sums have the same bits whatever rows
 * share its tile. */
#ifndef SEQSERVE_FMA_TILE_H
#define SEQSERVE_FMA_TILE_H

#include <stdint.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define FMA_TILE_ROWS 6

/* The sums as named registers: an array of them was spilled by GCC at every step. */
#define FMA_SUMS(m) __m256 s0##m = _mm256_setzero_ps(), s1##m = _mm256_setzero_ps();
#define FMA_STEP(m)                                                                  \
    if (mr > m) {                                                                    \
        const __m256 x_ = _mm256_broadcast_ss(a + m * as + i);                       \
        s0##m = _mm256_fmadd_ps(x_, lo, s0##m);                                      \
        s1##m = _mm256_fmadd_ps(x_, hi, s1##m);                                      \
    }
#define FMA_KEEP(m)                                                                  \
    if (mr > m) {                                                                    \
        _mm256_storeu_ps(c + m * cs, s0##m);                                         \
        _mm256_storeu_ps(c + m * cs + 8, s1##m);                                     \
    }

#define FMA_LOAD(m)                                                                  \
    if (mr > m && !first) {                                                          \
        s0##m = _mm256_loadu_ps(c + m * cs);                                         \
        s1##m = _mm256_loadu_ps(c + m * cs + 8);                                     \
    }

/* c[m][0..16) = sum over i < n of a[m * as + i] * b[i * bs + 0..16), for m < mr <= 6, row
 * m of c at c + m * cs; unless `first`, the sums continue from c's values (stored and
 * loaded as they are: a sum split over several calls has the bits of one call's). */
static inline __attribute__((always_inline)) void
fma_tile_more(const float *a, int64_t as, const float *b, int64_t bs, int64_t n, const int mr,
              float *c, int64_t cs, const int first) {
    FMA_SUMS(0) FMA_SUMS(1) FMA_SUMS(2) FMA_SUMS(3) FMA_SUMS(4) FMA_SUMS(5)
    FMA_LOAD(0) FMA_LOAD(1) FMA_LOAD(2) FMA_LOAD(3) FMA_LOAD(4) FMA_LOAD(5)
    for (int64_t i = 0; i < n; i++) {
        const __m256 lo = _mm256_loadu_ps(b + i * bs), hi = _mm256_loadu_ps(b + i * bs + 8);
        FMA_STEP(0) FMA_STEP(1) FMA_STEP(2) FMA_STEP(3) FMA_STEP(4) FMA_STEP(5)
    }
    FMA_KEEP(0) FMA_KEEP(1) FMA_KEEP(2) FMA_KEEP(3) FMA_KEEP(4) FMA_KEEP(5)
}

/* fma_tile_more from zero. */
static inline __attribute__((always_inline)) void
fma_tile(const float *a, int64_t as, const float *b, int64_t bs, int64_t n, const int mr,
         float *c, int64_t cs) {
    fma_tile_more(a, as, b, bs, n, mr, c, cs, 1);
}

/* fma_tile over rows [0, rows) of a, 6 at a time, with mr a constant in each call so
 * that the row tests fold away. */
static inline __attribute__((always_inline)) void
fma_rows(const float *a, int64_t as, const float *b, int64_t bs, int64_t n, int64_t rows,
         float *c, int64_t cs) {
    for (int64_t r = 0; r < rows; r += FMA_TILE_ROWS) {
        const float *ar = a + r * as;
        float *cr = c + r * cs;
        switch (rows - r < FMA_TILE_ROWS ? rows - r : FMA_TILE_ROWS) {
        case 6: fma_tile(ar, as, b, bs, n, 6, cr, cs); break;
        case 5: fma_tile(ar, as, b, bs, n, 5, cr, cs); break;
        case 4: fma_tile(ar, as, b, bs, n, 4, cr, cs); break;
        case 3: fma_tile(ar, as, b, bs, n, 3, cr, cs); break;
        case 2: fma_tile(ar, as, b, bs, n, 2, cr, cs); break;
        default: fma_tile(ar, as, b, bs, n, 1, cr, cs); break;
        }
    }
}
#endif
#endif
