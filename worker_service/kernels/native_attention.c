/* Attention over bfloat16 KV buffers on CPU: decoding (one query per row) and prompts;
 * decoding over float32 KV too (a model computing in float32).
 *
 * Built and loaded at run time by native_attention.py (plain C, no torch headers). torch's
 * CPU kernels read bfloat16 keys one query row at a time far below memory speed; these
 * loops stream each row's keys and values once, keep scores and sums in float32, and read
 * only the row's own slots (no padding).
 *
 * Layout (element strides, bfloat16 as uint16, or float32):
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

#include "bf16.h"
#include "amx.h"
#include "shares.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#define MAX_DIM 512
/* (row, head) pairs of a prompt below which a call stays on one thread. */
#define MIN_PAIRS_PER_THREAD 16
/* A decoding call's cost (unit_cost: slots read plus 16 a unit) below which it stays on
 * one thread: forking the team costs about what reading that many slots does. */
#define MIN_COST_PER_THREAD 512

/* Element i of a bfloat16 (uint16) or float32 buffer; `bf16` is a constant wherever this
 * is inlined, so each caller gets a loop of one type. */
static inline __attribute__((always_inline)) float load_at(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline __attribute__((always_inline)) void store_at(void *p, int64_t i, float x,
                                                           int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = float_to_bf16(x);
    else
        ((float *)p)[i] = x;
}

static inline __attribute__((always_inline)) void
attend_one_generic(const void *qh, const void *kh, const void *vh, void *o, int64_t end,
                   int64_t dim, float scale, int64_t window, float *scores, int bf16) {
    const int64_t first = (window > 0 && end > window) ? end - window : 0;
    float qf[MAX_DIM], acc[MAX_DIM];
    for (int64_t d = 0; d < dim; d++)
        qf[d] = load_at(qh, d, bf16) * scale;
    float best = -INFINITY;
    for (int64_t s = first; s < end; s++) {
        const int64_t at = s * dim;
        /* 16 partial sums: the compiler vectorizes the lanes without reordering any one
         * sum (no -ffast-math). */
        float part[16] = {0.f};
        int64_t d = 0;
        for (; d + 16 <= dim; d += 16)
            for (int i = 0; i < 16; i++)
                part[i] += qf[d + i] * load_at(kh, at + d + i, bf16);
        float dot = 0.f;
        for (; d < dim; d++)
            dot += qf[d] * load_at(kh, at + d, bf16);
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
        const float p = scores[s - first];
        for (int64_t d = 0; d < dim; d++)
            acc[d] += p * load_at(vh, s * dim + d, bf16);
    }
    const float inv = n > 0 ? 1.f / total : 0.f;
    for (int64_t d = 0; d < dim; d++)
        store_at(o, d, acc[d] * inv, bf16);
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* Lane j: the sum of a[j]'s 8 lanes. */
static inline __m256 sum8(const __m256 a[8]) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    /* u0: the low and high halves' sums of a[0..3], u1 those of a[4..7] */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* As attend_one_generic over float32 KV, for dim a multiple of 8: 8 slots' dot products
 * at a time, reduced together by sum8. */
static inline __attribute__((always_inline)) void
attend_one_f32_avx2(const float *qh, const float *kh, const float *vh, float *o, int64_t end,
                    const int64_t dim, float scale, int64_t window, float *scores) {
    const int64_t first = (window > 0 && end > window) ? end - window : 0;
    const int64_t n = end - first, vecs = dim / 8;
    kh += first * dim;
    vh += first * dim;
    __m256 qv[MAX_DIM / 8];
    for (int64_t c = 0; c < vecs; c++)
        qv[c] = _mm256_mul_ps(_mm256_loadu_ps(qh + c * 8), _mm256_set1_ps(scale));
    __m256 best = _mm256_set1_ps(-INFINITY);
    int64_t s = 0;
    for (; s + 8 <= n; s += 8) {
        __m256 acc[8];
        for (int j = 0; j < 8; j++) {
            const float *ks = kh + (s + j) * dim;
            __m256 a = _mm256_mul_ps(qv[0], _mm256_loadu_ps(ks));
            for (int64_t c = 1; c < vecs; c++)
                a = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(ks + c * 8), a);
            acc[j] = a;
        }
        const __m256 dots = sum8(acc);
        _mm256_storeu_ps(scores + s, dots);
        best = _mm256_max_ps(best, dots);
    }
    float top = hmax8(best);
    for (; s < n; s++) {
        const float *ks = kh + s * dim;
        __m256 a = _mm256_mul_ps(qv[0], _mm256_loadu_ps(ks));
        for (int64_t c = 1; c < vecs; c++)
            a = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(ks + c * 8), a);
        scores[s] = hsum8(a);
        top = scores[s] > top ? scores[s] : top;
    }
    const __m256 topv = _mm256_set1_ps(top);
    __m256 totv = _mm256_setzero_ps();
    for (s = 0; s + 8 <= n; s += 8) {
        const __m256 e = exp8_le0(_mm256_sub_ps(_mm256_loadu_ps(scores + s), topv));
        _mm256_storeu_ps(scores + s, e);
        totv = _mm256_add_ps(totv, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, totv);
    float total = 0.f;
    for (int i = 0; i < 8; i++)
        total += lanes[i];
    for (; s < n; s++) {
        scores[s] = expf(scores[s] - top);
        total += scores[s];
    }
    /* Where the head is small, 2 or 4 slots at a time into accumulators of their own: at
     * least 8 independent multiply-add chains. */
    const int64_t ways = vecs >= 8 ? 1 : vecs >= 4 ? 2 : 4;
    __m256 acc[4][MAX_DIM / 8];
    for (int u = 0; u < 4; u++)
        for (int64_t c = 0; c < vecs; c++)
            acc[u][c] = _mm256_setzero_ps();
    for (s = 0; s + ways <= n; s += ways)
        for (int u = 0; u < ways; u++) {
            const __m256 p = _mm256_set1_ps(scores[s + u]);
            const float *vs = vh + (s + u) * dim;
            for (int64_t c = 0; c < vecs; c++)
                acc[u][c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vs + c * 8), acc[u][c]);
        }
    for (; s < n; s++) {
        const __m256 p = _mm256_set1_ps(scores[s]);
        for (int64_t c = 0; c < vecs; c++)
            acc[0][c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vh + s * dim + c * 8), acc[0][c]);
    }
    const __m256 inv = _mm256_set1_ps(n > 0 ? 1.f / total : 0.f);
    for (int64_t c = 0; c < vecs; c++) {
        __m256 a = acc[0][c];
        for (int u = 1; u < ways; u++)
            a = _mm256_add_ps(a, acc[u][c]);
        _mm256_storeu_ps(o + c * 8, _mm256_mul_ps(a, inv));
    }
}
#define HAVE_AVX2_F32 1
#endif

#ifdef HAVE_AVX512_BF16

/* Sums of 16 vectors: lane j of the result is the sum of a[j]'s lanes (a transposing
 * tree of adds: 4 levels instead of 16 horizontal reductions). */
static inline __m512 sum16(__m512 a[16]) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)  /* 128-bit blocks: [a0+a2, a1+a3 | b0+b2, b1+b3] */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xee));
    for (int i = 0; i < 4; i++)  /* block k of c[i]: 4 partials of vector 4i + k */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xdd));
    for (int i = 0; i < 2; i++)  /* block k: [v, w, v, w] partials, v = 8i + k, w = v + 4 */
        d[i] = _mm512_add_ps(_mm512_unpacklo_ps(c[2 * i], c[2 * i + 1]),
                             _mm512_unpackhi_ps(c[2 * i], c[2 * i + 1]));
    /* block k, lane m: the sum of vector 4m + k */
    const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x44),
                                   _mm512_shuffle_ps(d[0], d[1], 0xee));
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1,
                                           12, 8, 4, 0);
    return _mm512_permutexvar_ps(order, e);
}

/* 32 bfloat16 at p as float32 (exact): elements 0, 2, .., 30 in *even and 1, 3, .., 31 in
 * *odd. One load and two integer instructions, where load16 spends a widening conversion
 * on every 16; sums kept in this order are the same sums, lane for lane. */
static inline __attribute__((always_inline)) void load32_split(const uint16_t *p, __m512 *even,
                                                               __m512 *odd) {
    const __m512i x = _mm512_loadu_si512(p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)));
}

static inline float exp_scores(float *scores, int64_t n, float top);

/* One query against n slots of keys: scores[s] = exp(q.k_s * scale - the largest), by
 * AVX512-BF16 dot instructions (exact bfloat16 products, float32 sums), 16 slots at a time.
 * Returns the scores' sum. */
static inline __attribute__((always_inline)) float
probabilities_avx512(const uint16_t *qh, const uint16_t *kh, int64_t n, const int64_t dim,
                     float scale, float *scores, const char *ahead, int64_t ahead_bytes) {
    const int64_t chunks = dim / 32; /* 32 bfloat16 per dot instruction */
    __m512bh qv[MAX_DIM / 32];
    for (int64_t c = 0; c < chunks; c++)
        qv[c] = (__m512bh)_mm512_loadu_si512(qh + c * 32);
    const __m512 sv = _mm512_set1_ps(scale);
    __m512 best = _mm512_set1_ps(-INFINITY);
    int64_t s = 0;
    for (; s + 16 <= n; s += 16) {
        __m512 acc[16];
        if (ahead) /* the next stream's bytes at this block's offset, into L2 */
            for (int64_t b = s * dim * 2; b < (s + 16) * dim * 2 && b < ahead_bytes; b += 64)
                _mm_prefetch(ahead + b, _MM_HINT_T1);
        for (int j = 0; j < 16; j++) {
            const uint16_t *ks = kh + (s + j) * dim;
            __m512 a = _mm512_setzero_ps();
            for (int64_t c = 0; c < chunks; c++)
                a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_loadu_si512(ks + c * 32));
            acc[j] = a;
        }
        const __m512 dots = _mm512_mul_ps(sum16(acc), sv);
        _mm512_storeu_ps(scores + s, dots);
        best = _mm512_max_ps(best, dots);
    }
    float top = _mm512_reduce_max_ps(best);
    for (; s < n; s++) {
        __m512 a = _mm512_setzero_ps();
        for (int64_t c = 0; c < chunks; c++)
            a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_loadu_si512(kh + s * dim + c * 32));
        scores[s] = _mm512_reduce_add_ps(a) * scale;
        top = scores[s] > top ? scores[s] : top;
    }
    return exp_scores(scores, n, top);
}

/* scores[s] = exp(scores[s] - top) for s < n; returns their sum. */
static inline float exp_scores(float *scores, int64_t n, float top) {
    int64_t s;
    const __m512 topv = _mm512_set1_ps(top);
    __m512 totv = _mm512_setzero_ps();
    for (s = 0; s + 16 <= n; s += 16) {
        const __m512 e = exp_le0(_mm512_sub_ps(_mm512_loadu_ps(scores + s), topv));
        _mm512_storeu_ps(scores + s, e);
        totv = _mm512_add_ps(totv, e);
    }
    if (s < n) {
        const __mmask16 m = (__mmask16)((1u << (n - s)) - 1);
        const __m512 e = _mm512_maskz_mov_ps(
            m, exp_le0(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores + s), topv)));
        _mm512_mask_storeu_ps(scores + s, m, e);
        totv = _mm512_add_ps(totv, e);
    }
    return _mm512_reduce_add_ps(totv);
}

#ifdef HAVE_AMX
/* Asks Linux for the tile registers; 1 where granted, after which decoding units of up to
 * 16 query heads and head sizes of up to AMX_DECODE_DIM take their scores on the tiles
 * (probabilities_amx). */
int amx_enable(void) { return amx_request(); }

#define AMX_DECODE_DIM 128
#define AMX_DECODE_CONFIG -1 /* *configured when the tiles hold decode_configure's layout */

/* The tiles as probabilities_amx uses them: tiles 0-3 the scores of 16 slots x 4 heads
 * (float32), tiles 4 and 5 16 slots x 32 dimensions of keys, tiles 6 and 7 the queries of
 * 4 heads for 32 dimensions (16 pairs x 4 heads x 2). */
static void decode_configure(int *configured) {
    if (*configured == AMX_DECODE_CONFIG)
        return;
    struct amx_tile_config cfg __attribute__((aligned(64)));
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 4; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 16;
    }
    for (int t = 4; t < 6; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    for (int t = 6; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 16;
    }
    _tile_loadconfig(&cfg);
    *configured = AMX_DECODE_CONFIG;
}

/* One block's scores from its tile (cbuf: 16 slots x 4 heads, float32) into each of the m
 * heads' rows of scores (head g at g * stride), times scale; best[g]: each head's largest
 * so far over the lanes in `lanes`. */
static inline __attribute__((always_inline)) void
block_scores(const float *cbuf, int m, const __m512i *pick, __m512 sv, __mmask16 lanes,
             float *scores, int64_t stride, __m512 *best) {
    const __m512 v0 = _mm512_load_ps(cbuf), v1 = _mm512_load_ps(cbuf + 16);
    const __m512 v2 = _mm512_load_ps(cbuf + 32), v3 = _mm512_load_ps(cbuf + 48);
    for (int g = 0; g < m; g++) {
        const __m512 lo = _mm512_permutex2var_ps(v0, pick[g], v1);
        const __m512 hi = _mm512_permutex2var_ps(v2, pick[g], v3);
        const __m512 v = _mm512_mul_ps(_mm512_shuffle_f32x4(lo, hi, 0x44), sv);
        _mm512_storeu_ps(scores + g * stride, v);
        best[g] = _mm512_mask_max_ps(best[g], lanes, best[g], v);
    }
}

/* As probabilities_avx512 for m (<= 4) query heads at once (q: m x dim, contiguous) against
 * the same n slots of keys, their scores at scores + g * stride and sums in total[g]: each
 * block of 16 slots is one tile (16 slots x 32 dimensions, straight from the KV buffer)
 * times the heads' queries, per 32 dimensions, so each key is read once for all m heads
 * and a block costs a few instructions instead of dot instructions and a horizontal sum
 * per slot and head. The sums are the same exact products in float32, added in the tile
 * unit's order (other last bits than the dot loop). *configured: the calling thread's tile
 * layout (decode_configure). */
static void probabilities_amx(const uint16_t *q, const uint16_t *kh, int64_t n,
                              const int64_t dim, int m, float scale, float *scores,
                              int64_t stride, float *total, int *configured) {
    uint16_t qb[AMX_DECODE_DIM / 32][128] __attribute__((aligned(64)));
    uint16_t tail[16 * AMX_DECODE_DIM] __attribute__((aligned(64)));
    float cbuf[256] __attribute__((aligned(64)));
    const int64_t steps = dim / 32;
    /* qb[d]: dimension pair p of step d, head g at (4 p + g) * 2 (heads past m zero) */
    memset(qb, 0, sizeof(uint16_t) * 128 * (size_t)steps);
    for (int g = 0; g < m; g++)
        for (int64_t d = 0; d < steps; d++)
            for (int p = 0; p < 16; p++) {
                qb[d][(4 * p + g) * 2] = q[g * dim + 32 * d + 2 * p];
                qb[d][(4 * p + g) * 2 + 1] = q[g * dim + 32 * d + 2 * p + 1];
            }
    decode_configure(configured);
    amx_memory_barrier(); /* the tile loads read qb */
    if (steps <= 2) { /* the queries stay in tiles 6 and 7 */
        _tile_loadd(6, qb[0], 16);
        if (steps == 2)
            _tile_loadd(7, qb[1], 16);
    }
    const __m512 sv = _mm512_set1_ps(scale);
    /* head g's lanes g, g + 4, g + 8, g + 12 of two vectors of 4 slots x 4 heads */
    __m512i pick[4];
    for (int g = 0; g < 4; g++)
        pick[g] = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 28 + g, 24 + g, 20 + g, 16 + g,
                                   12 + g, 8 + g, 4 + g, g);
    __m512 best[4];
    for (int g = 0; g < m; g++)
        best[g] = _mm512_set1_ps(-INFINITY);
    int64_t s = 0;
    if (steps == 2) /* 64 slots at a time, four blocks in flight */
        for (; s + 64 <= n; s += 64) {
            const uint16_t *a = kh + s * dim;
            const int64_t row16 = 16 * dim;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            _tile_loadd(4, a, dim * 2);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(5, a + row16, dim * 2);
            _tile_dpbf16ps(1, 5, 6);
            _tile_loadd(4, a + 2 * row16, dim * 2);
            _tile_dpbf16ps(2, 4, 6);
            _tile_loadd(5, a + 3 * row16, dim * 2);
            _tile_dpbf16ps(3, 5, 6);
            _tile_loadd(4, a + 32, dim * 2);
            _tile_dpbf16ps(0, 4, 7);
            _tile_loadd(5, a + row16 + 32, dim * 2);
            _tile_dpbf16ps(1, 5, 7);
            _tile_loadd(4, a + 2 * row16 + 32, dim * 2);
            _tile_dpbf16ps(2, 4, 7);
            _tile_loadd(5, a + 3 * row16 + 32, dim * 2);
            _tile_dpbf16ps(3, 5, 7);
            _tile_stored(0, cbuf, 16);
            _tile_stored(1, cbuf + 64, 16);
            _tile_stored(2, cbuf + 128, 16);
            _tile_stored(3, cbuf + 192, 16);
            amx_memory_barrier(); /* cbuf is read below */
            for (int b = 0; b < 4; b++)
                block_scores(cbuf + 64 * b, m, pick, sv, 0xffff, scores + s + 16 * b, stride,
                             best);
        }
    for (; s < n; s += 16) {
        const uint16_t *a = kh + s * dim;
        const int64_t left = n - s;
        if (left < 16) { /* the last slots, zero rows after them: nothing past n is read */
            memcpy(tail, a, sizeof(uint16_t) * (size_t)(left * dim));
            memset(tail + left * dim, 0, sizeof(uint16_t) * (size_t)((16 - left) * dim));
            a = tail;
            amx_memory_barrier();
        }
        _tile_zero(0);
        if (steps <= 2) {
            _tile_loadd(4, a, dim * 2);
            _tile_dpbf16ps(0, 4, 6);
            if (steps == 2) {
                _tile_loadd(4, a + 32, dim * 2);
                _tile_dpbf16ps(0, 4, 7);
            }
        } else {
            for (int64_t d = 0; d < steps; d++) {
                _tile_loadd(4, a + 32 * d, dim * 2);
                _tile_loadd(6, qb[d], 16);
                _tile_dpbf16ps(0, 4, 6);
            }
        }
        _tile_stored(0, cbuf, 16);
        amx_memory_barrier(); /* cbuf is read below */
        block_scores(cbuf, m, pick, sv,
                     left < 16 ? (__mmask16)((1u << left) - 1) : (__mmask16)0xffff,
                     scores + s, stride, best);
    }
    for (int g = 0; g < m; g++)
        total[g] = exp_scores(scores + g * stride, n, _mm512_reduce_max_ps(best[g]));
}
#endif

/* o[d] = acc[d] * inv as bfloat16, acc held as load32_split lays it out: vector 2c the even
 * elements of dims [32c, 32c + 32), vector 2c + 1 the odd ones. */
static inline __attribute__((always_inline)) void
store_split(const __m512 *acc, const int64_t dim, float inv, uint16_t *o) {
    float even[16], odd[16];
    for (int64_t c = 0; c < dim / 32; c++) {
        _mm512_storeu_ps(even, _mm512_mul_ps(acc[2 * c], _mm512_set1_ps(inv)));
        _mm512_storeu_ps(odd, _mm512_mul_ps(acc[2 * c + 1], _mm512_set1_ps(inv)));
        for (int i = 0; i < 16; i++) {
            o[c * 32 + 2 * i] = float_to_bf16(even[i]);
            o[c * 32 + 2 * i + 1] = float_to_bf16(odd[i]);
        }
    }
}

/* As attend_one_generic, for dim a multiple of 32 (see probabilities_avx512); the
 * probabilities stay float32 for the weighted sum of values. */
static inline __attribute__((always_inline)) void
attend_one_avx512(const uint16_t *qh, const uint16_t *kh, const uint16_t *vh, uint16_t *o,
                  int64_t end, const int64_t dim, float scale, int64_t window, float *scores) {
    const int64_t first = (window > 0 && end > window) ? end - window : 0;
    const int64_t n = end - first;
    kh += first * dim;
    vh += first * dim;
    const float total = probabilities_avx512(qh, kh, n, dim, scale, scores, NULL, 0);
    /* Several slots per iteration, each into accumulators of its own: one chain of
     * dependent multiply-adds per slot would wait on the FMA latency every slot. */
    enum { UNROLL = 4 };
    const int64_t vecs = dim / 16, ways = dim <= 64 ? 4 : dim <= 128 ? 2 : 1;
    __m512 acc[UNROLL][MAX_DIM / 16];
    for (int u = 0; u < UNROLL; u++)
        for (int64_t c = 0; c < vecs; c++)
            acc[u][c] = _mm512_setzero_ps();
    int64_t s;
    for (s = 0; s + ways <= n; s += ways)
        for (int u = 0; u < ways; u++) {
            const __m512 p = _mm512_set1_ps(scores[s + u]);
            const uint16_t *vs = vh + (s + u) * dim;
            for (int64_t c = 0; c < vecs; c++)
                acc[u][c] = _mm512_fmadd_ps(p, load16(vs + c * 16), acc[u][c]);
        }
    for (; s < n; s++) {
        const __m512 p = _mm512_set1_ps(scores[s]);
        for (int64_t c = 0; c < vecs; c++)
            acc[0][c] = _mm512_fmadd_ps(p, load16(vh + s * dim + c * 16), acc[0][c]);
    }
    for (int u = 1; u < ways; u++)
        for (int64_t c = 0; c < vecs; c++)
            acc[0][c] = _mm512_add_ps(acc[0][c], acc[u][c]);
    const float inv = n > 0 ? 1.f / total : 0.f;
    float tmp[16];
    for (int64_t c = 0; c < vecs; c++) {
        _mm512_storeu_ps(tmp, _mm512_mul_ps(acc[0][c], _mm512_set1_ps(inv)));
        for (int i = 0; i < 16; i++)
            o[c * 16 + i] = float_to_bf16(tmp[i]);
    }
}

/* The weighted values of m query heads that share one KV head, in one pass over the n
 * value slots: each slot's values are widened once for all m heads, and the m heads' sums
 * are the independent chains that hide the multiply-add latency. scores: head g's
 * probabilities at g * stride; inv[g]: 1 / their sum. o: the m heads' outputs, dim apart. */
static inline __attribute__((always_inline)) void
attend_values_avx512(const float *scores, int64_t stride, const uint16_t *vh, int64_t n,
                     const int64_t dim, const int m, const float *inv, uint16_t *o,
                     const char *ahead, int64_t ahead_bytes) {
    enum { MAX_M = 4 };
    const int64_t vecs = dim / 16;
    __m512 acc[MAX_M][MAX_DIM / 16];
    for (int g = 0; g < m; g++)
        for (int64_t c = 0; c < vecs; c++)
            acc[g][c] = _mm512_setzero_ps();
    for (int64_t s = 0; s < n; s++) {
        __m512 p[MAX_M];
        if (ahead && s * dim * 2 < ahead_bytes)
            for (int64_t b = s * dim * 2; b < (s + 1) * dim * 2; b += 64)
                _mm_prefetch(ahead + b, _MM_HINT_T1);
        for (int g = 0; g < m; g++)
            p[g] = _mm512_set1_ps(scores[g * stride + s]);
        const uint16_t *vs = vh + s * dim;
        for (int64_t c = 0; c < vecs; c += 2) {
            __m512 even, odd;
            load32_split(vs + c * 16, &even, &odd);
            for (int g = 0; g < m; g++) {
                acc[g][c] = _mm512_fmadd_ps(p[g], even, acc[g][c]);
                acc[g][c + 1] = _mm512_fmadd_ps(p[g], odd, acc[g][c + 1]);
            }
        }
    }
    for (int g = 0; g < m; g++)
        store_split(acc[g], dim, inv[g], o + g * dim);
}

/* `group` query heads (q, o: group x dim, contiguous) against one KV head, for dim a
 * multiple of 32: each head's probabilities as attend_one_avx512 computes them, then the
 * values in passes of up to 4 heads (2 at dim 128, 1 above: the sums in registers).
 * scores: room for group x stride floats, stride >= the slots read. */
static inline __attribute__((always_inline)) void
attend_group_avx512(const uint16_t *q, const uint16_t *kh, const uint16_t *vh, uint16_t *o,
                    int64_t end, const int64_t dim, int64_t group, float scale,
                    int64_t window, float *scores, int64_t stride, const uint16_t *next_k,
                    const uint16_t *next_v, int64_t next_end, int *configured) {
    const int64_t first = (window > 0 && end > window) ? end - window : 0;
    const int64_t n = end - first;
    kh += first * dim;
    vh += first * dim;
    /* Streams to fetch into L2 while the passes after the first read keys already there:
     * this unit's values, then the next unit's keys and values. A unit's first pass reads
     * its keys from memory and the later ones from L2, so without this the memory sat
     * idle through them: 64 rows of about 800 slots over 30 layers read 16.3 GB/s
     * without and 17.7 with (streaming reads run 25 GB/s on this 2-core guest, and the
     * loops 35 GB/s on rows in L2). */
    const char *ahead[3] = {(const char *)vh, (const char *)next_k, (const char *)next_v};
    const int64_t ahead_bytes[3] = {n * dim * 2, next_end * dim * 2, next_end * dim * 2};
    int next_stream = 0;
    const int per = dim <= 64 ? 4 : dim <= 128 ? 2 : 1;
    float inv[4];
    for (int64_t h = 0; h < group; h += per) {
        const int m = group - h < per ? (int)(group - h) : per;
#ifdef HAVE_AMX
        if (amx_granted && dim <= AMX_DECODE_DIM && n > 0) {
            float total[4];
            probabilities_amx(q + h * dim, kh, n, dim, m, scale, scores, stride, total,
                              configured);
            for (int g = 0; g < m; g++)
                inv[g] = 1.f / total[g];
            next_stream = 1; /* the values pass fetches the next unit's keys */
        } else
#endif
        for (int g = 0; g < m; g++) {
            const int fetch = h + g > 0 && next_stream < 3 && ahead[next_stream];
            const float total = probabilities_avx512(
                q + (h + g) * dim, kh, n, dim, scale, scores + g * stride,
                fetch ? ahead[next_stream] : NULL, fetch ? ahead_bytes[next_stream] : 0);
            next_stream += fetch;
            inv[g] = n > 0 ? 1.f / total : 0.f;
        }
        const char *pf = next_stream < 3 ? ahead[next_stream] : NULL;
        const int64_t pf_bytes = pf ? ahead_bytes[next_stream] : 0;
        next_stream += pf != NULL;
        /* m as a constant in each call, so the sums stay in registers */
        uint16_t *oh = o + h * dim;
        switch (m) {
        case 4: attend_values_avx512(scores, stride, vh, n, dim, 4, inv, oh, pf, pf_bytes); break;
        case 3: attend_values_avx512(scores, stride, vh, n, dim, 3, inv, oh, pf, pf_bytes); break;
        case 2: attend_values_avx512(scores, stride, vh, n, dim, 2, inv, oh, pf, pf_bytes); break;
        default: attend_values_avx512(scores, stride, vh, n, dim, 1, inv, oh, pf, pf_bytes); break;
        }
    }
}
#endif
#ifndef HAVE_AMX
/* Without the tile unit (or without AVX512-BF16, which the tile loops need): never granted. */
int amx_enable(void) { return 0; }
#endif

/* One query (head) against slots [first, end) of one key/value head, first = end - window
 * when window > 0, else 0. kh, vh point at slot 0; slots are dim apart. Buffers are
 * bfloat16 where bf16 is set, else float32. */
static void attend_one(const void *qh, const void *kh, const void *vh, void *o, int64_t end,
                       int64_t dim, float scale, int64_t window, float *scores, int bf16) {
    if (bf16) {
#ifdef HAVE_AVX512_BF16
        /* The common head sizes as constants, so the accumulators live in registers. */
        if (dim == 64)
            attend_one_avx512(qh, kh, vh, o, end, 64, scale, window, scores);
        else if (dim == 128)
            attend_one_avx512(qh, kh, vh, o, end, 128, scale, window, scores);
        else if (dim % 32 == 0)
            attend_one_avx512(qh, kh, vh, o, end, dim, scale, window, scores);
        else
#endif
            attend_one_generic(qh, kh, vh, o, end, dim, scale, window, scores, 1);
        return;
    }
#ifdef HAVE_AVX2_F32
    if (dim == 64)
        attend_one_f32_avx2(qh, kh, vh, o, end, 64, scale, window, scores);
    else if (dim == 128)
        attend_one_f32_avx2(qh, kh, vh, o, end, 128, scale, window, scores);
    else if (dim % 8 == 0)
        attend_one_f32_avx2(qh, kh, vh, o, end, dim, scale, window, scores);
    else
#endif
        attend_one_generic(qh, kh, vh, o, end, dim, scale, window, scores, 0);
}

/* Pair `pair` = (row r, head h): its query against its row's keys and values, below
 * lengths[r], or below start + r + 1 for a prompt (lengths NULL). Offsets are in
 * elements of `size` bytes. */
static inline void attend_pair(const char *q, const char *k, const char *v, char *out,
                               const int64_t *lengths, int64_t start, int64_t pair,
                               int64_t heads, int64_t group, int64_t dim, int64_t row_stride,
                               int64_t head_stride, float scale, int64_t window,
                               float *scores, int bf16) {
    const int64_t size = bf16 ? 2 : 4;
    const int64_t r = pair / heads, h = pair % heads;
    const int64_t at = (r * row_stride + (h / group) * head_stride) * size;
    attend_one(q + pair * dim * size, k + at, v + at, out + pair * dim * size,
               lengths ? lengths[r] : start + r + 1, dim, scale, window, scores, bf16);
}

/* This thread's share [*lo, *hi) of rows x per_row units (unit u is of row u / per_row)
 * when decoding rows of several lengths are split over the team: contiguous, and about
 * the same number of slots to read each (a unit costs its row's visible slots plus a
 * fixed 16 for its query and output). Equal unit counts would give the thread with the
 * longer rows more to read while the other waits at the barrier: 1.23x the balanced time
 * for 64 rows of 100-1000 slots in order. Which thread computes a unit does not change
 * its bits. */
static inline int64_t unit_cost(int64_t length, int64_t window) {
    return (window > 0 && length > window ? window : length) + 16;
}

/* The total cost of rows x per_row decoding units (unit_cost each). */
static int64_t decode_cost(const int64_t *lengths, int64_t rows, int64_t per_row,
                           int64_t window) {
    int64_t total = 0;
    for (int64_t r = 0; r < rows; r++)
        total += per_row * unit_cost(lengths[r], window);
    return total;
}

static void share_of(const int64_t *lengths, int64_t rows, int64_t per_row, int64_t window,
                     int64_t total, int64_t t, int64_t threads, int64_t *lo, int64_t *hi) {
    const int64_t units = rows * per_row;
    /* A unit goes to the thread whose part of the total it starts in. */
    const int64_t from = total * t / threads, to = total * (t + 1) / threads;
    int64_t before = 0, first = units, last = units;
    for (int64_t u = 0; u < units; u++) {
        if (first == units && before >= from)
            first = u;
        if (before >= to) {
            last = u;
            break;
        }
        before += unit_cost(lengths[u / per_row], window);
    }
    *lo = first;
    *hi = last;
}

/* share_of for the calling thread of the team. */
static void share_by_length(const int64_t *lengths, int64_t rows, int64_t per_row,
                            int64_t window, int64_t total, int64_t *lo, int64_t *hi) {
    int64_t t = 0, threads = 1;
#ifdef _OPENMP
    t = omp_get_thread_num();
    threads = omp_get_num_threads();
#endif
    share_of(lengths, rows, per_row, window, total, t, threads, lo, hi);
}

/* Each (row, head) pair of q attends through attend_one, split over torch's OpenMP team
 * when built with -fopenmp (the library then shares torch's runtime, the same
 * libgomp.so.1 already loaded, so the threads are torch's own team, not a second set
 * competing for the cores). Row r's keys start r * row_stride in, and it attends below
 * lengths[r] or, for a prompt (lengths NULL), below start + r + 1. Decoding rows take
 * shares by their lengths; a prompt's later queries read more slots, so its pairs are
 * dealt out in small chunks. Returns 0, or -1 for a shape it does not take, -2 when
 * memory ran out. */
static int attend_pairs(const void *q, const void *k, const void *v, void *out,
                        const int64_t *lengths, int64_t start, int64_t rows, int64_t heads,
                        int64_t kv_heads, int64_t dim, int64_t row_stride,
                        int64_t head_stride, float scale, int64_t window, int64_t max_len,
                        int bf16) {
    if (dim > MAX_DIM || kv_heads <= 0 || heads % kv_heads)
        return -1;
    const int64_t pairs = rows * heads, group = heads / kv_heads;
    const int64_t total = lengths ? decode_cost(lengths, rows, heads, window) : 0;
    int status = 0;
#pragma omp parallel if (lengths ? total >= 2 * MIN_COST_PER_THREAD \
                                 : pairs >= 2 * MIN_PAIRS_PER_THREAD)
    {
        float *scores = malloc(sizeof(float) * (size_t)(max_len > 0 ? max_len + 16 : 16));
        if (!scores) {
#pragma omp atomic write
            status = -2;
        }
        if (lengths) {
            int64_t lo, hi;
            share_by_length(lengths, rows, heads, window, total, &lo, &hi);
            for (int64_t pair = lo; pair < hi; pair++)
                if (scores)
                    attend_pair(q, k, v, out, lengths, start, pair, heads, group, dim,
                                row_stride, head_stride, scale, window, scores, bf16);
        } else {
#pragma omp for schedule(dynamic, 8)
            for (int64_t pair = 0; pair < pairs; pair++)
                if (scores)
                    attend_pair(q, k, v, out, lengths, start, pair, heads, group, dim,
                                row_stride, head_stride, scale, window, scores, bf16);
        }
        free(scores);
    }
    return status;
}

#ifdef HAVE_AVX512_BF16
/* Decoding with grouped-query attention: the query heads that share a KV head are taken
 * together (attend_group_avx512), the (row, query head) units split over torch's OpenMP
 * team by the rows' lengths as attend_pairs splits decoding pairs, each thread's share run
 * front to back and then what is left of the other's taken from its back (shares.h: a
 * static split left the other thread waiting whenever one was slowed). A head's outputs
 * do not depend on which heads it is grouped with, so a share that cuts a KV head's group
 * gives the same bits. One row of 5448 slots (9 heads over 3): 0.28 ms on one thread,
 * 0.17 ms over two. */
static int decode_groups_avx512(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                uint16_t *out, const int64_t *lengths, int64_t rows,
                                int64_t heads, int64_t kv_heads, int64_t dim,
                                int64_t row_stride, int64_t head_stride, float scale,
                                int64_t window, int64_t max_len) {
    const int64_t group = heads / kv_heads;
    const int64_t stride = (max_len > 0 ? max_len : 0) + 16;
    const int64_t total = decode_cost(lengths, rows, heads, window);
    const int parallel = total >= 2 * MIN_COST_PER_THREAD;
    struct shares shares;
    shares.threads = shares_threads(shares_team(parallel));
    for (int64_t t = 0; t < shares.threads; t++) {
        int64_t lo, hi;
        share_of(lengths, rows, heads, window, total, t, shares.threads, &lo, &hi);
        shares_set(&shares, t, lo, hi);
    }
    int status = 0;
#pragma omp parallel if (parallel)
    {
        float *scores = malloc(sizeof(float) * (size_t)(group < 4 ? group : 4)
                               * (size_t)stride);
        if (!scores) {
#pragma omp atomic write
            status = -2;
        }
        int configured = 0; /* the AMX rows this thread's tiles are set for */
        /* Units are (row, query head), so that a few long rows still split over the team;
         * a run of them is some heads of one KV head, taken together. */
        int64_t unit, m;
        while (scores && (m = shares_next_run(&shares, group, &unit)) > 0) {
            const int64_t r = unit / heads, h = unit % heads;
            const int64_t at = r * row_stride + (h / group) * head_stride;
            const uint16_t *qu = q + unit * dim;
            uint16_t *ou = out + unit * dim;
            /* The next unit in order (a guess: it may be another thread's), to fetch. */
            const int64_t nu = unit + m, nr = nu / heads;
            const int has_next = nu < rows * heads;
            const int64_t nat = nr * row_stride + (nu % heads / group) * head_stride;
            const uint16_t *nk = has_next ? k + nat : NULL, *nv = has_next ? v + nat : NULL;
            const int64_t nend = has_next ? lengths[nr] : 0;
            /* The common head sizes as constants, so the sums live in registers. */
            if (dim == 64)
                attend_group_avx512(qu, k + at, v + at, ou, lengths[r], 64, m, scale,
                                    window, scores, stride, nk, nv, nend, &configured);
            else if (dim == 128)
                attend_group_avx512(qu, k + at, v + at, ou, lengths[r], 128, m, scale,
                                    window, scores, stride, nk, nv, nend, &configured);
            else
                attend_group_avx512(qu, k + at, v + at, ou, lengths[r], dim, m, scale,
                                    window, scores, stride, nk, nv, nend, &configured);
        }
#ifdef HAVE_AMX
        if (configured)
            _tile_release();
#endif
        free(scores);
    }
    return status;
}
#endif

/* Each row's new key and value (one token, [rows, kv_heads, dim] at the given element
 * strides, unit stride within a head) into slot lengths[r] - 1 of its row: the decoding
 * step's KV write, done here so that the caller needs no scattered index_put a layer. */
static void write_new_kv(char *k, char *v, const char *new_k, const char *new_v,
                         const int64_t *lengths, int64_t rows, int64_t kv_heads, int64_t dim,
                         int64_t row_stride, int64_t head_stride, int64_t new_row_stride,
                         int64_t new_head_stride, int64_t size) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < kv_heads; j++) {
            const int64_t at = (r * row_stride + j * head_stride + (lengths[r] - 1) * dim) * size;
            const int64_t from = (r * new_row_stride + j * new_head_stride) * size;
            memcpy(k + at, new_k + from, (size_t)(dim * size));
            memcpy(v + at, new_v + from, (size_t)(dim * size));
        }
}

/* Decoding: one query per row of a group, row r attending below lengths[r] (at most
 * max_len). Where new_k is not NULL, each row's new key and value are first written to its
 * slot lengths[r] - 1 (write_new_kv). */
int decode_attention_bf16(const uint16_t *q, uint16_t *k, uint16_t *v, uint16_t *out,
                          const int64_t *lengths, int64_t rows, int64_t heads,
                          int64_t kv_heads, int64_t dim, int64_t row_stride,
                          int64_t head_stride, float scale, int64_t window, int64_t max_len,
                          const uint16_t *new_k, const uint16_t *new_v,
                          int64_t new_row_stride, int64_t new_head_stride) {
    if (new_k)
        write_new_kv((char *)k, (char *)v, (const char *)new_k, (const char *)new_v, lengths,
                     rows, kv_heads, dim, row_stride, head_stride, new_row_stride,
                     new_head_stride, 2);
#ifdef HAVE_AVX512_BF16
    if (dim <= MAX_DIM && dim % 32 == 0 && kv_heads > 0 && heads % kv_heads == 0
        && heads > kv_heads)
        return decode_groups_avx512(q, k, v, out, lengths, rows, heads, kv_heads, dim,
                                    row_stride, head_stride, scale, window, max_len);
#endif
    return attend_pairs(q, k, v, out, lengths, 0, rows, heads, kv_heads, dim, row_stride,
                        head_stride, scale, window, max_len, 1);
}

/* The same over float32 query, KV and output (a model that computes in float32). */
int decode_attention_f32(const float *q, float *k, float *v, float *out,
                         const int64_t *lengths, int64_t rows, int64_t heads,
                         int64_t kv_heads, int64_t dim, int64_t row_stride,
                         int64_t head_stride, float scale, int64_t window, int64_t max_len,
                         const float *new_k, const float *new_v, int64_t new_row_stride,
                         int64_t new_head_stride) {
    if (new_k)
        write_new_kv((char *)k, (char *)v, (const char *)new_k, (const char *)new_v, lengths,
                     rows, kv_heads, dim, row_stride, head_stride, new_row_stride,
                     new_head_stride, 4);
    return attend_pairs(q, k, v, out, lengths, 0, rows, heads, kv_heads, dim, row_stride,
                        head_stride, scale, window, max_len, 0);
}

/* Prompt attention over one row: query i (of `tokens`, at slot start + i) attends to slots
 * up to its own, which the caller has already written. Layout as above with q and out
 * [tokens, heads, dim] and k, v pointing at the row. */
int prompt_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                          uint16_t *out, int64_t start, int64_t tokens, int64_t heads,
                          int64_t kv_heads, int64_t dim, int64_t head_stride, float scale,
                          int64_t window) {
    return attend_pairs(q, k, v, out, NULL, start, tokens, heads, kv_heads, dim, 0,
                        head_stride, scale, window, start + tokens, 1);
}

/* The same over float32 query, KV and output (a model that computes in float32). */
int prompt_attention_f32(const float *q, const float *k, const float *v, float *out,
                         int64_t start, int64_t tokens, int64_t heads, int64_t kv_heads,
                         int64_t dim, int64_t head_stride, float scale, int64_t window) {
    return attend_pairs(q, k, v, out, NULL, start, tokens, heads, kv_heads, dim, 0,
                        head_stride, scale, window, start + tokens, 0);
}
