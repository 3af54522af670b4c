/* Linear products of one to three rows with bfloat16 activations and weights, on CPUs
 * with AVX512-BF16.
 *
 * Built and loaded at run time by few_rows.py (plain C, no torch headers). A decoding
 * step of a few rows costs its weights' bytes: oneDNN's prepacked product streamed
 * SmolLM2's layers from memory at 11-15 GB/s there, this loop at about 22 (of 25-30).
 * Threads split the weight rows; each weight row is read once, front to back, against
 * every input row, with the AVX512-BF16 dot instruction (exact bfloat16 products, float32
 * sums in a fixed order: an output depends on its own input row and weight row only).
 */
#include <stdint.h>

#include "bf16.h"

#define MAX_ROWS 3

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

int few_rows_vectorized(void) { return 1; }

/* 32 bfloat16 at p, the first n of them (the rest zero) where n < 32. */
static inline __m512bh load32(const uint16_t *p, int64_t n) {
    return (__m512bh)(n >= 32 ? _mm512_loadu_si512(p)
                              : _mm512_maskz_loadu_epi16((__mmask32)((1u << n) - 1), p));
}

/* s[r] = x_r . wr over k, for nm (a constant where inlined) input rows; two accumulators
 * per row, so that each chain of dependent dot instructions is half as long. */
static inline __attribute__((always_inline)) void
dots(const uint16_t *const *xr, const uint16_t *wr, int64_t k, const int nm, float *s) {
    __m512 a[MAX_ROWS][2];
    for (int r = 0; r < nm; r++)
        a[r][0] = a[r][1] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 64 <= k; i += 64) {
        const __m512bh w0 = load32(wr + i, 32), w1 = load32(wr + i + 32, 32);
        for (int r = 0; r < nm; r++) {
            a[r][0] = _mm512_dpbf16_ps(a[r][0], load32(xr[r] + i, 32), w0);
            a[r][1] = _mm512_dpbf16_ps(a[r][1], load32(xr[r] + i + 32, 32), w1);
        }
    }
    for (; i < k; i += 32) {
        const __m512bh w0 = load32(wr + i, k - i);
        for (int r = 0; r < nm; r++)
            a[r][0] = _mm512_dpbf16_ps(a[r][0], load32(xr[r] + i, k - i), w0);
    }
    for (int r = 0; r < nm; r++)
        s[r] = _mm512_reduce_add_ps(_mm512_add_ps(a[r][0], a[r][1]));
}

/* y[m, j] = bfloat16(sum_i x[m, i] * w[j, i] + bias[j]) for rows <= MAX_ROWS: x bfloat16
 * [rows, k] with row stride xs, w bfloat16 [n, k] contiguous, bias bfloat16 [n] or NULL,
 * y bfloat16 [rows, n] contiguous. Returns 0, or -1 for more rows than it takes. */
int linear_few_rows_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                         uint16_t *y, int64_t rows, int64_t n, int64_t k, int64_t xs) {
    if (rows < 1 || rows > MAX_ROWS)
        return -1;
#pragma omp parallel for schedule(static) if (n * k >= 65536)
    for (int64_t j = 0; j < n; j++) {
        const uint16_t *xr[MAX_ROWS];
        for (int64_t r = 0; r < MAX_ROWS; r++)
            xr[r] = x + (r < rows ? r : 0) * xs;
        float s[MAX_ROWS];
        /* the row count as a constant in each call, so the sums stay in registers */
        switch (rows) {
        case 3: dots(xr, w + j * k, k, 3, s); break;
        case 2: dots(xr, w + j * k, k, 2, s); break;
        default: dots(xr, w + j * k, k, 1, s); break;
        }
        const float b = bias ? bf16_to_float(bias[j]) : 0.f;
        for (int64_t r = 0; r < rows; r++)
            y[r * n + j] = float_to_bf16(s[r] + b);
    }
    return 0;
}
#else
/* Without AVX512-BF16 few_rows.py does not use this library. */
int few_rows_vectorized(void) { return 0; }

int linear_few_rows_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                         uint16_t *y, int64_t rows, int64_t n, int64_t k, int64_t xs) {
    (void)x, (void)w, (void)bias, (void)y, (void)rows, (void)n, (void)k, (void)xs;
    return -1;
}
#endif
