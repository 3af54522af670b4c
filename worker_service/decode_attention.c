/* Decoding attention over bfloat16 KV buffers on CPU: one query token per row.
 *
 * Built and loaded at run time by decode_attention.py (plain C, no torch headers). torch's
 * CPU kernels read bfloat16 keys one query row at a time far below memory speed; this
 * loop streams each row's keys and values once, converts them to float32 in registers,
 * and reads only the row's own slots (no padding).
 *
 * Layout (element strides, bfloat16 as uint16):
 *   q    [rows, heads, dim]                       contiguous
 *   k, v [rows, kv_heads, slots, dim]             row stride row_stride, head stride
 *                                                 head_stride, slot stride dim
 *   out  [rows, heads, dim]                       contiguous
 * Row r attends to slots [first, lengths[r]) with first = lengths[r] - window when
 * window > 0, else 0.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_float(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu))
        return (uint16_t)((bits >> 16) | 0x40); /* quiet NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest even, as torch does */
    return (uint16_t)(bits >> 16);
}

#define MAX_DIM 512
/* (row, head) pairs below which a call stays on one thread. */
#define MIN_PAIRS_PER_THREAD 16

static void attend_pair(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                        uint16_t *out, const int64_t *lengths, int64_t pair, int64_t heads,
                        int64_t group, int64_t dim, int64_t row_stride, int64_t head_stride,
                        float scale, int64_t window, float *scores) {
    const int64_t r = pair / heads, h = pair % heads;
    const int64_t end = lengths[r];
    const int64_t first = (window > 0 && end > window) ? end - window : 0;
    const uint16_t *qh = q + pair * dim;
    const uint16_t *kh = k + r * row_stride + (h / group) * head_stride;
    const uint16_t *vh = v + r * row_stride + (h / group) * head_stride;
    float qf[MAX_DIM], acc[MAX_DIM];
    for (int64_t d = 0; d < dim; d++)
        qf[d] = bf16_to_float(qh[d]) * scale;
    float best = -INFINITY;
    for (int64_t s = first; s < end; s++) {
        const uint16_t *ks = kh + s * dim;
        /* 16 partial sums: the compiler vectorizes the lanes without reordering any one
         * sum (no -ffast-math). */
        float part[16] = {0.f};
        int64_t d = 0;
        for (; d + 16 <= dim; d += 16)
            for (int i = 0; i < 16; i++)
                part[i] += qf[d + i] * bf16_to_float(ks[d + i]);
        float dot = 0.f;
        for (; d < dim; d++)
            dot += qf[d] * bf16_to_float(ks[d]);
        for (int i = 0; i < 16; i++)
            dot += part[i];
        scores[s - first] = dot;
        best = dot > best ? dot : best;
    }
    const int64_t n = end - first;
    float total = 0.f;
    for (int64_t s = 0; s < n; s++) {
        scores[s] = expf(scores[s] - best);
        total += scores[s];
    }
    for (int64_t d = 0; d < dim; d++)
        acc[d] = 0.f;
    for (int64_t s = first; s < end; s++) {
        const uint16_t *vs = vh + s * dim;
        const float p = scores[s - first];
        for (int64_t d = 0; d < dim; d++)
            acc[d] += p * bf16_to_float(vs[d]);
    }
    uint16_t *o = out + pair * dim;
    const float inv = n > 0 ? 1.f / total : 0.f;
    for (int64_t d = 0; d < dim; d++)
        o[d] = float_to_bf16(acc[d] * inv);
}

/* Returns 0, or -1 for a shape it does not take, -2 when memory ran out. Parallel over
 * (row, head) pairs with OpenMP when built with -fopenmp: the library then shares
 * torch's OpenMP runtime (same libgomp.so.1, already loaded), so the threads are torch's
 * own team, not a second set competing for the cores. */
int decode_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                          uint16_t *out, const int64_t *lengths, int64_t rows,
                          int64_t heads, int64_t kv_heads, int64_t dim,
                          int64_t row_stride, int64_t head_stride, float scale,
                          int64_t window, int64_t max_len) {
    if (dim > MAX_DIM || kv_heads <= 0 || heads % kv_heads)
        return -1;
    const int64_t pairs = rows * heads, group = heads / kv_heads;
    int status = 0;
#pragma omp parallel if (pairs >= 2 * MIN_PAIRS_PER_THREAD)
    {
        float *scores = malloc(sizeof(float) * (size_t)(max_len > 0 ? max_len : 1));
        if (!scores) {
#pragma omp atomic write
            status = -2;
        }
#pragma omp for schedule(static)
        for (int64_t pair = 0; pair < pairs; pair++)
            if (scores)
                attend_pair(q, k, v, out, lengths, pair, heads, group, dim, row_stride,
                            head_stride, scale, window, scores);
        free(scores);
    }
    return status;
}
