/* Linear products with bfloat16 weights and float32 activations, for CPUs without native
 * bfloat16 (AVX2 without AVX512).
 *
 * Built and loaded at run time by bf16_weights.py (plain C, no torch headers). A decoding
 * step's products have few rows, so their time is the weights' bytes: read as bfloat16
 * and widened in registers (exact: a shift), they cost half of what float32 weights do.
 * Every product and sum is float32, so the result is that of the float32 copy of the
 * weights up to the order of the float32 sums.
 *
 * Threads split the weight rows, so each weight byte is read once, and each thread reads
 * its share front to back as one stream: interleaving several weight rows' streams ran at
 * 8-12 GB/s on an AVX2 EPYC where one stream reached 17-19 (of about 21).
 */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

int bf16w_vectorized(void) { return 1; }

/* Input rows per pass over a weight row, and the most rows that take one-row passes. */
#define PASS_ROWS 4
#define FEW_ROWS 8

/* 8 bfloat16 widened to float32. */
static inline __m256 widen8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* Few rows: each weight row once from memory, widened in registers, against up to
 * PASS_ROWS input rows per pass (later passes find it in L1). */
static void few_rows(const float *x, const uint16_t *w, const float *bias, float *y,
                     int64_t rows, int64_t n, int64_t k, int64_t xs) {
#pragma omp parallel for schedule(static) if (n * k >= 65536)
    for (int64_t j = 0; j < n; j++) {
        const uint16_t *wr = w + j * k;
        for (int64_t m = 0; m < rows; m += PASS_ROWS) {
            const int64_t nm = m + PASS_ROWS <= rows ? PASS_ROWS : rows - m;
            const float *xr[PASS_ROWS]; /* missing rows repeat the last; not stored */
            for (int r = 0; r < PASS_ROWS; r++)
                xr[r] = x + (m + (r < nm ? r : nm - 1)) * xs;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            int64_t i = 0;
            for (; i + 8 <= k; i += 8) {
                const __m256 wv = widen8(wr + i);
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xr[0] + i), wv, a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(xr[1] + i), wv, a1);
                a2 = _mm256_fmadd_ps(_mm256_loadu_ps(xr[2] + i), wv, a2);
                a3 = _mm256_fmadd_ps(_mm256_loadu_ps(xr[3] + i), wv, a3);
            }
            float s[PASS_ROWS] = {hsum8(a0), hsum8(a1), hsum8(a2), hsum8(a3)};
            for (; i < k; i++)
                for (int r = 0; r < PASS_ROWS; r++)
                    s[r] += xr[r][i] * bf16_to_float(wr[i]);
            for (int64_t r = 0; r < nm; r++)
                y[(m + r) * n + j] = s[r] + (bias ? bias[j] : 0.f);
        }
    }
}

/* Input rows x0, x1 (x1 may repeat x0) against 4 float32 weight rows w, w + k, ...:
 * out[r][j]. */
static inline void block(const float *x0, const float *x1, const float *w, int64_t k,
                         float out[2][4]) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
    __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00;
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
        const __m256 u = _mm256_loadu_ps(x0 + i), v = _mm256_loadu_ps(x1 + i);
        const __m256 w0 = _mm256_loadu_ps(w + i), w1 = _mm256_loadu_ps(w + k + i);
        a00 = _mm256_fmadd_ps(u, w0, a00);
        a10 = _mm256_fmadd_ps(v, w0, a10);
        a01 = _mm256_fmadd_ps(u, w1, a01);
        a11 = _mm256_fmadd_ps(v, w1, a11);
        const __m256 w2 = _mm256_loadu_ps(w + 2 * k + i), w3 = _mm256_loadu_ps(w + 3 * k + i);
        a02 = _mm256_fmadd_ps(u, w2, a02);
        a12 = _mm256_fmadd_ps(v, w2, a12);
        a03 = _mm256_fmadd_ps(u, w3, a03);
        a13 = _mm256_fmadd_ps(v, w3, a13);
    }
    out[0][0] = hsum8(a00); out[0][1] = hsum8(a01); out[0][2] = hsum8(a02); out[0][3] = hsum8(a03);
    out[1][0] = hsum8(a10); out[1][1] = hsum8(a11); out[1][2] = hsum8(a12); out[1][3] = hsum8(a13);
    for (; i < k; i++)
        for (int j = 0; j < 4; j++) {
            out[0][j] += x0[i] * w[j * k + i];
            out[1][j] += x1[i] * w[j * k + i];
        }
}

/* More rows: four weight rows at a time widened into a float32 buffer (one stream), then
 * blocks of 2 input rows x 4 weight rows from it. Returns 0, or -2 when out of memory. */
static int many_rows(const float *x, const uint16_t *w, const float *bias, float *y,
                     int64_t rows, int64_t n, int64_t k, int64_t xs) {
    const int64_t blocks = (n + 3) / 4;
    int status = 0;
#pragma omp parallel if (n * k >= 65536)
    {
        float *buf = malloc(sizeof(float) * (size_t)(4 * k));
        if (!buf) {
#pragma omp atomic write
            status = -2;
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            if (!buf)
                continue;
            const int64_t j0 = b * 4, nj = j0 + 4 <= n ? 4 : n - j0, count = nj * k;
            const uint16_t *src = w + j0 * k;
            int64_t i = 0;
            for (; i + 8 <= count; i += 8)
                _mm256_storeu_ps(buf + i, widen8(src + i));
            for (; i < count; i++)
                buf[i] = bf16_to_float(src[i]);
            for (int64_t j = nj; j < 4; j++) /* a last block short of 4: repeat a row */
                for (int64_t t = 0; t < k; t++)
                    buf[j * k + t] = buf[t];
            for (int64_t m = 0; m < rows; m += 2) {
                const int64_t nm = m + 2 <= rows ? 2 : 1;
                float out[2][4];
                block(x + m * xs, x + (m + nm - 1) * xs, buf, k, out);
                for (int64_t r = 0; r < nm; r++)
                    for (int64_t j = 0; j < nj; j++)
                        y[(m + r) * n + j0 + j] = out[r][j] + (bias ? bias[j0 + j] : 0.f);
            }
        }
        free(buf);
    }
    return status;
}

/* y[m, j] = sum_i x[m, i] * w[j, i] (+ bias[j]): x float32 [rows, k] with row stride xs,
 * w bfloat16 [n, k] contiguous, bias float32 [n] or NULL, y float32 [rows, n] contiguous.
 * Returns 0, or -2 when out of memory. */
int linear_bf16w(const float *x, const uint16_t *w, const float *bias, float *y,
                 int64_t rows, int64_t n, int64_t k, int64_t xs) {
    if (rows <= FEW_ROWS) {
        few_rows(x, w, bias, y, rows, n, k, xs);
        return 0;
    }
    return many_rows(x, w, bias, y, rows, n, k, xs);
}
#else
/* Without AVX2 and FMA bf16_weights.py does not use this library. */
int bf16w_vectorized(void) { return 0; }

int linear_bf16w(const float *x, const uint16_t *w, const float *bias, float *y,
                 int64_t rows, int64_t n, int64_t k, int64_t xs) {
    (void)x, (void)w, (void)bias, (void)y, (void)rows, (void)n, (void)k, (void)xs;
    return -1;
}
#endif
