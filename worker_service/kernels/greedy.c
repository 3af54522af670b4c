/* The greedy token of each row of logits (float32 or bfloat16): the index of its largest
 * value.
 *
 * Built and loaded at run time by greedy.py (plain C, no torch headers). torch's argmax
 * over a [rows, vocabulary] tensor reduces one element at a time (about 1.4 ns an element
 * on this project's 2-core machines, after a float32 copy of the logits): on SmolLM2's
 * vocabulary of 49,152 that was 3% of a decoding-heavy run's samples. Here 16 values a
 * step are compared in float32 lanes, each lane keeping its largest value and where it
 * was, and the lanes are reduced at the end.
 *
 * The result is torch.argmax's: the first index of the largest value, and where a row
 * holds a NaN, the first NaN's index (torch treats NaN as the largest). Ties between
 * lanes go to the smaller index, and a lane only takes a later value when it is strictly
 * larger, so the first index of the maximum wins.
 */
#include <stdint.h>

#include "bf16.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

int greedy_vectorized(void) { return 1; }

static inline __attribute__((always_inline)) float value_at(const void *x, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

/* Values i..i+15 of x as float32 lanes (bfloat16 widened exactly). */
static inline __attribute__((always_inline)) __m512 load16_at(const void *x, int64_t i, int bf16) {
    return bf16 ? load16((const uint16_t *)x + i) : _mm512_loadu_ps((const float *)x + i);
}

/* The first NaN's index in row x of n values, or -1 where there is none. */
static inline __attribute__((always_inline)) int64_t first_nan(const void *x, int64_t n, int bf16) {
    for (int64_t i = 0; i < n; i++)
        if (value_at(x, i, bf16) != value_at(x, i, bf16))
            return i;
    return -1;
}

static inline __attribute__((always_inline)) int64_t argmax_row(const void *x, int64_t n, int bf16) {
    __m512 best = _mm512_set1_ps(-__builtin_inff());
    __m512i where = _mm512_set1_epi32(0);
    __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = 0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = load16_at(x, i, bf16);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        const __mmask16 more = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
        best = _mm512_mask_mov_ps(best, more, v);
        where = _mm512_mask_mov_epi32(where, more, at);
        at = _mm512_add_epi32(at, step);
    }
    if (nan)
        return first_nan(x, n, bf16);
    /* Lanes that never took a value (all theirs -inf) point at index 0, which is right
     * when the whole row is -inf, and loses to any larger value otherwise. */
    float top = value_at(x, 0, bf16);
    int64_t index = 0;
    if (i > 0) {
        float lane_best[16];
        int32_t lane_where[16];
        _mm512_storeu_ps(lane_best, best);
        _mm512_storeu_epi32(lane_where, where);
        top = lane_best[0];
        index = lane_where[0];
        for (int j = 1; j < 16; j++)
            if (lane_best[j] > top || (lane_best[j] == top && lane_where[j] < index)) {
                top = lane_best[j];
                index = lane_where[j];
            }
    }
    for (; i < n; i++) {
        const float v = value_at(x, i, bf16);
        if (v != v)
            return first_nan(x, n, bf16);
        if (v > top) { /* later indices only win when strictly larger */
            top = v;
            index = i;
        }
    }
    return index;
}

/* out[r] = argmax of row r of x (bfloat16 [rows, n], row stride `stride` elements). */
void argmax_rows_bf16(const uint16_t *x, int64_t rows, int64_t n, int64_t stride,
                      int64_t *out) {
#pragma omp parallel for schedule(static) if (rows * n >= 262144)
    for (int64_t r = 0; r < rows; r++)
        out[r] = argmax_row(x + r * stride, n, 1);
}

/* The same over float32 logits. */
void argmax_rows_f32(const float *x, int64_t rows, int64_t n, int64_t stride, int64_t *out) {
#pragma omp parallel for schedule(static) if (rows * n >= 131072)
    for (int64_t r = 0; r < rows; r++)
        out[r] = argmax_row(x + r * stride, n, 0);
}
#else
/* Without AVX-512 greedy.py does not use this library (torch's argmax runs instead). */
int greedy_vectorized(void) { return 0; }

void argmax_rows_bf16(const uint16_t *x, int64_t rows, int64_t n, int64_t stride,
                      int64_t *out) {
    (void)x, (void)rows, (void)n, (void)stride, (void)out;
}

void argmax_rows_f32(const float *x, int64_t rows, int64_t n, int64_t stride, int64_t *out) {
    (void)x, (void)rows, (void)n, (void)stride, (void)out;
}
#endif
