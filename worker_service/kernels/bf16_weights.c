/* Linear products with bfloat16 weights and float32 activations, for CPUs without native
 * bfloat16 (AVX2 without AVX512).
 *
 * Built and loaded at run time by bf16_weights.py (plain C, no torch headers). A decoding
 * step's products have few rows, so their time is the weights' bytes: read as bfloat16
 * and widened in registers (exact: a shift), they cost half of what float32 weights do.
 * Every product and sum is float32, so the result is that of the float32 copy of the
 * weights up to the order of the float32 sums.
 */
#include <stdint.h>

#include "bf16.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

int bf16w_vectorized(void) { return 1; }

/* 8 bfloat16 widened to float32. */
static inline __m256 widen8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Rows x0, x1 (x1 may repeat x0) against weight rows w[0..3] (repeats allowed): out[r][j]. */
static inline void block(const float *x0, const float *x1, const uint16_t *const w[4],
                         int64_t k, float out[2][4]) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
    __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00;
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
        const __m256 u = _mm256_loadu_ps(x0 + i), v = _mm256_loadu_ps(x1 + i);
        const __m256 w0 = widen8(w[0] + i), w1 = widen8(w[1] + i);
        a00 = _mm256_fmadd_ps(u, w0, a00);
        a10 = _mm256_fmadd_ps(v, w0, a10);
        a01 = _mm256_fmadd_ps(u, w1, a01);
        a11 = _mm256_fmadd_ps(v, w1, a11);
        const __m256 w2 = widen8(w[2] + i), w3 = widen8(w[3] + i);
        a02 = _mm256_fmadd_ps(u, w2, a02);
        a12 = _mm256_fmadd_ps(v, w2, a12);
        a03 = _mm256_fmadd_ps(u, w3, a03);
        a13 = _mm256_fmadd_ps(v, w3, a13);
    }
    out[0][0] = hsum8(a00); out[0][1] = hsum8(a01); out[0][2] = hsum8(a02); out[0][3] = hsum8(a03);
    out[1][0] = hsum8(a10); out[1][1] = hsum8(a11); out[1][2] = hsum8(a12); out[1][3] = hsum8(a13);
    for (; i < k; i++)
        for (int j = 0; j < 4; j++) {
            const float wv = bf16_to_float(w[j][i]);
            out[0][j] += x0[i] * wv;
            out[1][j] += x1[i] * wv;
        }
}
#else
int bf16w_vectorized(void) { return 0; }

static inline void block(const float *x0, const float *x1, const uint16_t *const w[4],
                         int64_t k, float out[2][4]) {
    for (int j = 0; j < 4; j++) {
        float s0 = 0.f, s1 = 0.f;
        for (int64_t i = 0; i < k; i++) {
            const float wv = bf16_to_float(w[j][i]);
            s0 += x0[i] * wv;
            s1 += x1[i] * wv;
        }
        out[0][j] = s0;
        out[1][j] = s1;
    }
}
#endif

/* y[m, j] = sum_i x[m, i] * w[j, i] (+ bias[j]): x float32 [rows, k] with row stride xs,
 * w bfloat16 [n, k] contiguous, bias float32 [n] or NULL, y float32 [rows, n] contiguous.
 * Threads split the weight rows, four at a time, so each weight byte is read once. */
void linear_bf16w(const float *x, const uint16_t *w, const float *bias, float *y,
                  int64_t rows, int64_t n, int64_t k, int64_t xs) {
    const int64_t blocks = (n + 3) / 4;
#pragma omp parallel for schedule(static) if (n * k >= 65536)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t j0 = b * 4, nj = j0 + 4 <= n ? 4 : n - j0;
        const uint16_t *wr[4];
        for (int j = 0; j < 4; j++)
            wr[j] = w + (j0 + (j < nj ? j : nj - 1)) * k;
        for (int64_t m = 0; m < rows; m += 2) {
            const int64_t nm = m + 2 <= rows ? 2 : 1;
            float out[2][4];
            block(x + m * xs, x + (m + nm - 1) * xs, wr, k, out);
            for (int64_t r = 0; r < nm; r++)
                for (int64_t j = 0; j < nj; j++)
                    y[(m + r) * n + j0 + j] = out[r][j] + (bias ? bias[j0 + j] : 0.f);
        }
    }
}
