/* Causal attention of a prompt over bfloat16 KV on CPU, in tiles of queries (AVX512-BF16),
 * and over float32 KV (AVX2 and FMA; at the end of this file).
 *
 * native_attention.c attends one query at a time: every query re-reads its keys and
 * values and reduces each dot product across lanes, about 130 GFLOP/s on this project's
 * CPU, where the same cores run a bfloat16 GEMM at 400-450. At 2000 tokens that made
 * attention half of a prefill. Here a tile of a few tokens (times the query heads that
 * share a key/value head) is computed as two small GEMMs with the AVX512-BF16 dot
 * instruction, keys and values repacked once per call so that each instruction's 16
 * lanes are 16 slots (query-key) or 16 dimensions (probability-value):
 *
 *   kp [kv_heads][slot block of 16][dim pair][16 slots]  (a 32-bit lane: 2 dimensions)
 *   vp [kv_heads][slot pair][dim]                        (a 32-bit lane: 2 slots)
 *
 * Rounding: query-key products are exact bfloat16 products summed in float32 (as the
 * one-query loop); scores, maximum and sum stay float32, the exponential is 2^x by a
 * degree-5 fit and vscalefps (within 1.1e-7, half the instructions of exp's Taylor
 * series); the probabilities are rounded to bfloat16 before the product with the values
 * (as eager transformers and SDPA's CPU kernel do in bfloat16), and the output is divided
 * by the float32 sum.
 *
 * Each query's numbers depend only on its own slot, the row's keys and values and the
 * absolute slot blocks (tiles start on multiples of 32 slots; slots a query does not see
 * add exact zeros), not on the tile, the chunk or the other queries: chunked prefill and
 * prefix-cache hits give the bits of a whole prefill, and batch-invariant mode holds.
 *
 * Layout as native_attention.c: q, out [tokens, heads, dim] contiguous; k, v point at the
 * row, [kv_heads, slots, dim] with head stride head_stride; query i sits at slot
 * start + i and sees slots [first, start + i], first = start + i + 1 - window when
 * window > 0, else 0. Slots from start + tokens on are never read (buffers are not
 * zero-filled). Returns 0; -1 for a shape it does not take or where it was built without
 * AVX512-BF16 (the caller then uses the one-query loop); -2 when memory ran out.
 *
 * With AMX (amx_enable() granted), the two products of a tile run on the tile unit: the
 * packed keys' 16 dimension pairs x 16 slots and the packed values' 16 slot pairs x 16
 * dimensions are B tiles as they lie, the tile's query rows (gathered contiguous) and
 * probabilities the A tiles; tiles of up to 64 (token, head) rows in groups of 32 (two A
 * tiles times two B tiles: each tile load feeds two products). The same exact products are
 * summed in float32 in the same order per query, rounded otherwise than the dot
 * instruction in the last bits: once enabled, every prompt piece takes the tiles. Heads of up
 * to 64 dimensions (most small models) go 16 rows at a time through attend_rows_amx
 * instead: one pass over the slots, scores and probabilities kept in L1, probabilities
 * scaled by the row's first slots rather than its maximum (see there); as accurate, other
 * last bits.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "amx.h"

#define MAX_DIM 512
#define TILE_ROWS 24 /* (token, head) rows per tile, at least one token's heads */
#define MIN_PAIRS_PER_THREAD 16

/* Unit u of a call's tiles x kv_heads units: its tokens [*t0, *t1) and KV head *h, the
 * last tiles (which see the most slots) dealt out first. */
static inline void dealt_tile(int64_t u, int64_t tiles, int64_t kv_heads, int64_t tile,
                              int64_t tokens, int64_t *t0, int64_t *t1, int64_t *h) {
    *t0 = (tiles - 1 - u / kv_heads) * tile;
    *t1 = *t0 + tile < tokens ? *t0 + tile : tokens;
    *h = u % kv_heads;
}

#ifdef HAVE_AVX512_BF16

static inline uint32_t pair_at(const uint16_t *p) {
    uint32_t x;
    memcpy(&x, p, sizeof x);
    return x;
}

/* Pack slots [lo, lo + 16) of one head (slot >= end: zeros) into kp and vp. */
static void pack_block(const uint16_t *kh, const uint16_t *vh, uint32_t *kp, uint32_t *vp,
                       int64_t lo, int64_t end, int64_t dim) {
    if (lo + 16 <= end) { /* a whole block: no per-slot test, so the loops vectorize */
        for (int64_t p = 0; p < dim / 2; p++)
            for (int j = 0; j < 16; j++)
                kp[p * 16 + j] = pair_at(kh + (lo + j) * dim + 2 * p);
        for (int j = 0; j < 16; j += 2) {
            const uint16_t *a = vh + (lo + j) * dim, *b = a + dim;
            uint32_t *row = vp + (j / 2) * dim;
            for (int64_t d = 0; d < dim; d++)
                row[d] = (uint32_t)a[d] | ((uint32_t)b[d] << 16);
        }
        return;
    }
    for (int64_t p = 0; p < dim / 2; p++)
        for (int j = 0; j < 16; j++)
            kp[p * 16 + j] = lo + j < end ? pair_at(kh + (lo + j) * dim + 2 * p) : 0;
    for (int j = 0; j < 16; j += 2) {
        const int64_t s = lo + j;
        uint32_t *row = vp + (j / 2) * dim;
        for (int64_t d = 0; d < dim; d++) {
            const uint32_t a = s < end ? vh[s * dim + d] : 0;
            const uint32_t b = s + 1 < end ? vh[(s + 1) * dim + d] : 0;
            row[d] = a | (b << 16);
        }
    }
}

/* The index of a tile's (token, head) row `row` in q and out [tokens, heads]: tokens from
 * t0, the `group` query heads of KV head h. */
static inline int64_t head_row(int64_t row, int64_t t0, int64_t h, int64_t heads,
                               int64_t group) {
    return (t0 + row / group) * heads + h * group + row % group;
}

/* Query rows a pass over a tile's keys or values serves: 6 rows x 4 blocks of 16 lanes are
 * 24 of the 32 registers, as in dpbf16_linear.c, so each key or value load feeds six dot
 * instructions (against 4 rows x 2 blocks: 1.07-1.11x at 1024-2048 tokens, same bits). */
#define PASS_ROWS 6

/* Scores of nr (<= PASS_ROWS) query rows against blocks b0 .. b0 + nb - 1 of 16 slots:
 * s[r][slot] = q_r . k_slot, the pairs summed in order (softmax_row scales them). */
static inline __attribute__((always_inline)) void
scores_blocks(const uint16_t *const *qr, const int nr, const uint32_t *kp, int64_t b0,
              const int nb, const int64_t dim, float *const *s) {
    const int64_t pairs = dim / 2;
    const uint32_t *k0 = kp + b0 * pairs * 16;
    __m512 acc[PASS_ROWS][4];
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < nb; c++)
            acc[r][c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh kv[4];
        for (int c = 0; c < nb; c++)
            kv[c] = (__m512bh)_mm512_loadu_si512(k0 + (c * pairs + p) * 16);
        for (int r = 0; r < nr; r++) {
            const __m512bh qb = (__m512bh)_mm512_set1_epi32((int)pair_at(qr[r] + 2 * p));
            for (int c = 0; c < nb; c++)
                acc[r][c] = _mm512_dpbf16_ps(acc[r][c], qb, kv[c]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < nb; c++)
            _mm512_storeu_ps(s[r] + (b0 + c) * 16, acc[r][c]);
}

/* Scores of nr rows against `blocks` (even) blocks of 16 slots, four at a time. */
static inline __attribute__((always_inline)) void
scores_nr(const uint16_t *const *qr, const int nr, const uint32_t *kp, int64_t blocks,
          const int64_t dim, float *const *s) {
    int64_t b = 0;
    for (; b + 4 <= blocks; b += 4)
        scores_blocks(qr, nr, kp, b, 4, dim, s);
    if (b < blocks)
        scores_blocks(qr, nr, kp, b, 2, dim, s);
}

/* FN(rows, N, packed, count, dim, ...) with the row count N = nr (1 .. PASS_ROWS) a
 * constant, and dim too where it is the common 64. */
#define ROW_CASE(FN, N, R, K, C, D, ...)                                       \
    case N:                                                                    \
        if ((D) == 64)                                                         \
            FN(R, N, K, C, 64, __VA_ARGS__);                                   \
        else                                                                   \
            FN(R, N, K, C, D, __VA_ARGS__);                                    \
        break;
#define ROWS_CONSTANT(FN, R, NR, K, C, D, ...)                                 \
    switch (NR) {                                                              \
        ROW_CASE(FN, 6, R, K, C, D, __VA_ARGS__)                               \
        ROW_CASE(FN, 5, R, K, C, D, __VA_ARGS__)                               \
        ROW_CASE(FN, 4, R, K, C, D, __VA_ARGS__)                               \
        ROW_CASE(FN, 3, R, K, C, D, __VA_ARGS__)                               \
        ROW_CASE(FN, 2, R, K, C, D, __VA_ARGS__)                               \
        ROW_CASE(FN, 1, R, K, C, D, __VA_ARGS__)                               \
    }

static void scores_rows(const uint16_t *const *qr, int nr, const uint32_t *kp, int64_t blocks,
                        int64_t dim, float *const *s) {
    ROWS_CONSTANT(scores_nr, qr, nr, kp, blocks, dim, s)
}

/* out rows (nr <= PASS_ROWS) = p_r . v over `pairs` slot pairs (summed in order), divided
 * by inv_r; dimensions in chunks of 64 (4 registers a row). */
static inline __attribute__((always_inline)) void
values_nr(const uint16_t *const *pr, const int nr, const uint32_t *vp, int64_t pairs,
          const int64_t dim, const float *inv, uint16_t *const *o) {
    for (int64_t c0 = 0; c0 < dim; c0 += 64) {
        const int cv = dim - c0 >= 64 ? 4 : (int)((dim - c0) / 16);
        __m512 acc[PASS_ROWS][4];
        for (int r = 0; r < nr; r++)
            for (int c = 0; c < 4; c++)
                acc[r][c] = _mm512_setzero_ps();
        for (int64_t sp = 0; sp < pairs; sp++) {
            const uint32_t *vrow = vp + sp * dim + c0;
            __m512bh vv[4];
            for (int c = 0; c < 4; c++)
                vv[c] = c < cv ? (__m512bh)_mm512_loadu_si512(vrow + c * 16)
                               : (__m512bh)_mm512_setzero_si512();
            for (int r = 0; r < nr; r++) {
                const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)pair_at(pr[r] + 2 * sp));
                for (int c = 0; c < 4; c++)
                    if (c < cv)
                        acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pb, vv[c]);
            }
        }
        for (int r = 0; r < nr; r++)
            for (int c = 0; c < cv; c++)
                _mm256_storeu_si256((__m256i *)(o[r] + c0 + c * 16),
                                    (__m256i)_mm512_cvtneps_pbh(
                                        _mm512_mul_ps(acc[r][c], _mm512_set1_ps(inv[r]))));
    }
}

static void values_rows(const uint16_t *const *pr, int nr, const uint32_t *vp, int64_t pairs,
                        int64_t dim, const float *inv, uint16_t *const *o) {
    ROWS_CONSTANT(values_nr, pr, nr, vp, pairs, dim, inv, o)
}

/* Lanes i + j (j < 16) inside [from, to). */
static inline __mmask16 lane_mask(int64_t i, int64_t from, int64_t to) {
    const int64_t a = from - i > 0 ? from - i : 0, b = to - i < 16 ? to - i : 16;
    return b <= a ? 0 : (__mmask16)(((1u << b) - 1) & ~((1u << a) - 1));
}

/* 2^t for finite t <= 0 (up to a rounding above); 0 far below. A degree-5 fit of 2^f on
 * [-1/2, 1/2] (relative error 1.1e-7) scaled by 2^n, n = t rounded (vscalefps underflows
 * to 0 where 2^n is out of range): about half of exp_le0's instructions. */
static inline __m512 exp2_le0(__m512 t) {
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.32647227e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.67151299e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.55073358e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40222424e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93147004e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* A row's unscaled scores s[0, n) (slots lo + i; n a multiple of 32, every score finite:
 * slots past the row's last hold packed zeros or keys) -> bfloat16 probabilities p: the
 * maximum over the row's slots [first, end) read without a store, then 2^(c * score - c *
 * max), c = scale / ln 2 (scale > 0), rounded to bfloat16 two vectors at a time, 0
 * outside the row's slots (so a row's numbers do not depend on n). Returns 1 / their
 * float32 sum. */
static float softmax_row(const float *s, uint16_t *p, int64_t n, int64_t lo, int64_t first,
                         int64_t end, float scale) {
    const int64_t from = first - lo, to = end - lo;
    const float c = scale * 1.44269504f;
    /* the vectors wholly inside [from, to) without a mask: computing one a vector cost
     * as much as the maximum itself */
    __m512 best = _mm512_set1_ps(-INFINITY);
    int64_t i = from / 16 * 16;
    if (i < from && i < to) {
        best = _mm512_mask_max_ps(best, lane_mask(i, from, to), best, _mm512_loadu_ps(s + i));
        i += 16;
    }
    for (; i + 16 <= to; i += 16)
        best = _mm512_max_ps(best, _mm512_loadu_ps(s + i));
    if (i < to)
        best = _mm512_mask_max_ps(best, lane_mask(i, from, to), best, _mm512_loadu_ps(s + i));
    const __m512 cv = _mm512_set1_ps(c), top = _mm512_set1_ps(_mm512_reduce_max_ps(best) * c);
    __m512 total = _mm512_setzero_ps();
    for (i = 0; i < n; i += 32) {
        __m512 e0 = _mm512_setzero_ps(), e1 = _mm512_setzero_ps();
        if (i + 32 > from && i < to) {
            e0 = exp2_le0(_mm512_fmsub_ps(_mm512_loadu_ps(s + i), cv, top));
            e1 = exp2_le0(_mm512_fmsub_ps(_mm512_loadu_ps(s + i + 16), cv, top));
            if (i < from || i + 32 > to) {
                e0 = _mm512_maskz_mov_ps(lane_mask(i, from, to), e0);
                e1 = _mm512_maskz_mov_ps(lane_mask(i + 16, from, to), e1);
            }
            total = _mm512_add_ps(total, _mm512_add_ps(e0, e1));
        }
        _mm512_storeu_si512(p + i, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
    }
    return 1.f / _mm512_reduce_add_ps(total);
}

/* The first slot a query sees whose slots end at `end` (exclusive): the last `window`
 * slots when set, else all from 0. */
static inline int64_t first_seen(int64_t end, int64_t window) {
    return window > 0 && end > window ? end - window : 0;
}

/* One tile: tokens [t0, t1) of kv head h with its `group` query heads, PASS_ROWS rows at a
 * time: a pass's scores, softmax and values one after another, so that its scores and
 * probabilities (a few KiB) are still in L1 when read back, over the slots up to the
 * pass's last query only (the slots after it would add exact zeros). */
static void attend_tile(const uint16_t *q, uint16_t *out, const uint32_t *kp,
                        const uint32_t *vp, int64_t base, int64_t start, int64_t t0,
                        int64_t t1, int64_t h, int64_t heads, int64_t group, int64_t dim,
                        float scale, int64_t window, float *s, uint16_t *p) {
    const int64_t first0 = start + t0 + 1 - window;
    const int64_t lo = window > 0 && first0 > 0 ? first0 / 32 * 32 : 0;
    const int64_t rows = (t1 - t0) * group;
    const uint32_t *kt = kp + (lo - base) * dim / 2, *vt = vp + (lo - base) * dim / 2;
    for (int64_t r0 = 0; r0 < rows; r0 += PASS_ROWS) {
        const int nr = rows - r0 >= PASS_ROWS ? PASS_ROWS : (int)(rows - r0);
        const int64_t last = start + t0 + (r0 + nr - 1) / group + 1;
        const int64_t n = (last + 31) / 32 * 32 - lo;
        const uint16_t *qr[PASS_ROWS], *pr[PASS_ROWS];
        float *sr[PASS_ROWS], inv[PASS_ROWS];
        uint16_t *o[PASS_ROWS];
        for (int r = 0; r < nr; r++) {
            const int64_t row = r0 + r;
            qr[r] = q + head_row(row, t0, h, heads, group) * dim;
            o[r] = out + head_row(row, t0, h, heads, group) * dim;
            sr[r] = s + r * n;
            pr[r] = p + r * n;
        }
        scores_rows(qr, nr, kt, n / 16, dim, sr);
        for (int r = 0; r < nr; r++) {
            const int64_t e = start + t0 + (r0 + r) / group + 1;
            inv[r] = softmax_row(sr[r], p + r * n, n, lo, first_seen(e, window), e, scale);
        }
        values_rows(pr, nr, vt, n / 2, dim, inv, o);
    }
}

#ifdef HAVE_AMX
/* softmax_row for a tile's rows (row stride n): row r is a query of the token at slot
 * first_slot + r / group, which sees up to its own slot, the last `window` slots when set;
 * inv[r] = 1 / its sum. */
static void softmax_rows(const float *s, uint16_t *p, float *inv,
                         int64_t rows, int64_t n, int64_t lo, int64_t first_slot,
                         int64_t group, int64_t window, float scale) {
    for (int64_t row = 0; row < rows; row++) {
        const int64_t e = first_slot + row / group + 1;
        inv[row] = softmax_row(s + row * n, p + row * n, n, lo, first_seen(e, window), e,
                               scale);
    }
}

#define AMX_TILE_ROWS 64 /* (token, head) rows per tile: two groups of 32 (two 16-row A
                          * tiles each) */

/* 1 where Linux granted the tile state: prompts then take attend_tile_amx. */
int amx_enable(void) { return amx_request(); }

/* The unscaled scores of a 32-row group (qbuf: [32][dim] contiguous) against n slots (a
 * multiple of 32) of packed keys kt, into s (row stride n floats; softmax_row scales
 * them). Two 16-row A tiles (4, 5) times two 16-slot key blocks (6, 7), dim / 32 steps:
 * each tile load feeds two products. */
static void scores_amx(const uint16_t *qbuf, const uint32_t *kt, int64_t n, int64_t dim,
                       float *s) {
    const int64_t step = dim * 8; /* uint32 per 16-slot block */
    for (int64_t b = 0; b < n / 16; b += 2) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t d = 0; d < dim / 32; d++) {
            const uint32_t *k = kt + b * step + d * 256;
            _tile_loadd(4, qbuf + d * 32, dim * 2);
            _tile_loadd(6, k, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, k + step, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(5, qbuf + 16 * dim + d * 32, dim * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, s + b * 16, n * 4);
        _tile_stored(1, s + b * 16 + 16, n * 4);
        _tile_stored(2, s + 16 * n + b * 16, n * 4);
        _tile_stored(3, s + 16 * n + b * 16 + 16, n * 4);
    }
}

/* A 32-row group's probabilities p (row stride n) times the packed values vt, 32
 * dimensions at a time (two 16-row A tiles times two 16-dimension value tiles); the first
 * mr rows scaled by inv[r] and rounded into o[r]. */
static void values_amx(const uint16_t *p, int64_t n, const uint32_t *vt, int64_t dim,
                       int mr, const float *inv, uint16_t *const *o) {
    float acc[32 * 32] __attribute__((aligned(64)));
    for (int64_t d0 = 0; d0 < dim; d0 += 32) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t st = 0; st < n / 32; st++) {
            const uint32_t *v = vt + st * 16 * dim + d0;
            _tile_loadd(4, p + st * 32, n * 2);
            _tile_loadd(6, v, dim * 4);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, v + 16, dim * 4);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(5, p + 16 * n + st * 32, n * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, acc, 128);
        _tile_stored(1, acc + 16, 128);
        _tile_stored(2, acc + 16 * 32, 128);
        _tile_stored(3, acc + 16 * 32 + 16, 128);
        amx_memory_barrier(); /* acc, stored by the tiles, is read below */
        for (int r = 0; r < mr; r++)
            _mm512_storeu_si512(o[r] + d0, (__m512i)_mm512_cvtne2ps_pbh(
                _mm512_mul_ps(_mm512_load_ps(acc + r * 32 + 16), _mm512_set1_ps(inv[r])),
                _mm512_mul_ps(_mm512_load_ps(acc + r * 32), _mm512_set1_ps(inv[r]))));
    }
}

/* 2^t for finite t up to 127, within 2.7e-6 (relative): t's fraction above its floor
 * (vreduceps) into a degree-4 fit of 2^f on [0, 1), scaled by 2^floor(t) (vscalefps floors
 * its exponent and underflows to 0). Six instructions against exp2_le0's nine: the
 * 16-row loop's probabilities are rounded to bfloat16 (2^-9) after it. */
static inline __m512 exp2_fast(__m512 t) {
    const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 p = _mm512_set1_ps(1.35365780e-2f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.20068444e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.41445467e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93003356e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.00000262f));
    return _mm512_scalef_ps(p, t);
}

#define ATTN_CHUNK 64
#define RESCALE_LOG2 64.f

/* The output sums of the one-pass loop (tiles 0-3: 16 rows x 64 dimensions) into acc
 * [16][64] float32, ready to read. */
static inline void store_output(float *acc) {
    _tile_stored(0, acc, 256);
    _tile_stored(1, acc + 16, 256);
    _tile_stored(2, acc + 32, 256);
    _tile_stored(3, acc + 48, 256);
    amx_memory_barrier(); /* acc, stored by the tiles, is read next */
}

/* Up to 16 rows of a tile (head dimension dim <= 64) in one pass over the slots, chunk by
 * chunk, everything in the tiles and L1. The 32-row path below stores every row's float32
 * scores for all n slots (megabytes at long prompts), reads them back for the maximum and
 * again for the exponentials, and that traffic, not the arithmetic, is most of its time.
 *
 * Here a chunk's scores (16 rows x ATTN_CHUNK slots) go to L1, their probabilities too,
 * and probabilities times values add into the output held in tiles 0-3 (16 rows x 64
 * dimensions) across all chunks. A single pass needs no maximum known in advance: each row
 * subtracts m, its largest scaled score among the slots of its first chunk, and rounds
 * 2^(c * score - m) to bfloat16. A later, larger score gives a probability above 1, which
 * float32 and bfloat16 hold; the row's sum and output sums carry the same scale, which the
 * division at the end removes. A row whose scores climb more than RESCALE_LOG2 powers of
 * two above m has m raised and its sum and output sums scaled by an exact power of two
 * first, before they could overflow. As accurate as the 32-row loop within a few percent
 * of mean error (a row's largest probability is exactly 1 only where its largest score is
 * in its first chunk).
 * The chunks lie on absolute multiples of ATTN_CHUNK slots (the first one starts at lo and
 * ends at the next such multiple: off = lo % ATTN_CHUNK), so a row's m depends only on its
 * own slots, never on which tile or piece of a prompt it came in: the bits do not depend on
 * where a prompt was cut.
 * qbuf: the rows' queries [16][dim]; from[r], to[r]: row r's slots [from, to) relative to
 * lo; c = scale / ln 2. */
static void attend_rows_amx(const uint16_t *qbuf, const uint32_t *kt, const uint32_t *vt,
                            int64_t n, int64_t off, int64_t dim, int mr, const int64_t *from,
                            const int64_t *to, float c, uint16_t *const *o) {
    float sbuf[16 * ATTN_CHUNK] __attribute__((aligned(64)));
    uint16_t pbuf[16 * ATTN_CHUNK] __attribute__((aligned(64)));
    float acc[16 * 64] __attribute__((aligned(64)));
    float m[16];
    __m512 total[16];
    const int64_t step = dim * 8; /* uint32 per 16-slot key block */
    const __m512 cv = _mm512_set1_ps(c);
    for (int r = 0; r < 16; r++) {
        m[r] = -INFINITY; /* no slot seen yet */
        total[r] = _mm512_setzero_ps();
    }
    _tile_zero(0); /* the output: tiles 0-3, 16 dimensions each (0-1 where dim is 32) */
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t i0 = 0, end; i0 < n; i0 = end) {
        end = (i0 + off) / ATTN_CHUNK * ATTN_CHUNK + ATTN_CHUNK - off;
        end = end < n ? end : n;
        const int64_t len = end - i0;
        /* The chunk's scores into sbuf (tiles 4, 5; 6 and 7 the operands). */
        for (int64_t j = 0; j < len; j += 32) {
            _tile_zero(4);
            _tile_zero(5);
            for (int64_t d = 0; d < dim / 32; d++) {
                const uint32_t *k = kt + (i0 + j) / 16 * step + d * 256;
                _tile_loadd(6, qbuf + d * 32, dim * 2);
                _tile_loadd(7, k, 64);
                _tile_dpbf16ps(4, 6, 7);
                _tile_loadd(7, k + step, 64);
                _tile_dpbf16ps(5, 6, 7);
            }
            _tile_stored(4, sbuf + j, ATTN_CHUNK * 4);
            _tile_stored(5, sbuf + j + 16, ATTN_CHUNK * 4);
        }
        amx_memory_barrier(); /* sbuf is read below */
        int rescale = 0;
        float factor[16];
        for (int r = 0; r < mr; r++) {
            const float *sr = sbuf + r * ATTN_CHUNK;
            uint16_t *pr = pbuf + r * ATTN_CHUNK;
            factor[r] = 1.f;
            if (!(i0 + len > from[r] && i0 < to[r])) { /* none of the row's slots */
                for (int64_t j = 0; j < len; j += 32)
                    _mm512_store_si512(pr + j, _mm512_setzero_si512());
                continue;
            }
            if (m[r] == -INFINITY) { /* the row's first chunk fixes m */
                __m512 best = _mm512_set1_ps(-INFINITY);
                for (int64_t j = 0; j < len; j += 16)
                    best = _mm512_mask_max_ps(best, lane_mask(i0 + j, from[r], to[r]), best,
                                              _mm512_load_ps(sr + j));
                m[r] = _mm512_reduce_max_ps(best) * c;
            }
            for (int pass = 0; pass < 2; pass++) {
                const __m512 mv = _mm512_set1_ps(m[r]);
                __m512 high = _mm512_set1_ps(-INFINITY), sum = total[r];
                for (int64_t j = 0; j < len; j += 32) {
                    const int64_t i = i0 + j;
                    __m512 t0 = _mm512_fmsub_ps(_mm512_load_ps(sr + j), cv, mv);
                    __m512 t1 = _mm512_fmsub_ps(_mm512_load_ps(sr + j + 16), cv, mv);
                    __m512 e0, e1;
                    if (i >= from[r] && i + 32 <= to[r]) {
                        high = _mm512_max_ps(high, _mm512_max_ps(t0, t1));
                        e0 = exp2_fast(t0);
                        e1 = exp2_fast(t1);
                    } else {
                        const __mmask16 k0 = lane_mask(i, from[r], to[r]);
                        const __mmask16 k1 = lane_mask(i + 16, from[r], to[r]);
                        high = _mm512_mask_max_ps(high, k0, high, t0);
                        high = _mm512_mask_max_ps(high, k1, high, t1);
                        e0 = _mm512_maskz_mov_ps(k0, exp2_fast(t0));
                        e1 = _mm512_maskz_mov_ps(k1, exp2_fast(t1));
                    }
                    sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
                    _mm512_store_si512(pr + j, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
                }
                if (!_mm512_cmp_ps_mask(high, _mm512_set1_ps(RESCALE_LOG2), _CMP_GT_OQ)) {
                    total[r] = sum;
                    break;
                }
                /* Scores far above m: a new m, the row's sum and output scaled to it. */
                const float shift = ceilf(_mm512_reduce_max_ps(high));
                factor[r] = exp2f(-shift);
                total[r] = _mm512_mul_ps(total[r], _mm512_set1_ps(factor[r]));
                m[r] += shift;
                rescale = 1;
            }
        }
        if (rescale) { /* the output so far, scaled like its row's sum */
            store_output(acc);
            for (int r = 0; r < mr; r++)
                for (int64_t d = 0; d < 64; d += 16)
                    _mm512_store_ps(acc + r * 64 + d, _mm512_mul_ps(
                        _mm512_load_ps(acc + r * 64 + d), _mm512_set1_ps(factor[r])));
            amx_memory_barrier();
            _tile_loadd(0, acc, 256);
            _tile_loadd(1, acc + 16, 256);
            _tile_loadd(2, acc + 32, 256);
            _tile_loadd(3, acc + 48, 256);
        }
        amx_memory_barrier(); /* the tile loads below read pbuf */
        for (int64_t j = 0; j < len; j += 32) {
            const uint32_t *v = vt + (i0 + j) / 2 * dim;
            _tile_loadd(6, pbuf + j, ATTN_CHUNK * 2);
            _tile_loadd(7, v, dim * 4);
            _tile_dpbf16ps(0, 6, 7);
            _tile_loadd(7, v + 16, dim * 4);
            _tile_dpbf16ps(1, 6, 7);
            if (dim == 64) {
                _tile_loadd(7, v + 32, dim * 4);
                _tile_dpbf16ps(2, 6, 7);
                _tile_loadd(7, v + 48, dim * 4);
                _tile_dpbf16ps(3, 6, 7);
            }
        }
    }
    store_output(acc);
    for (int r = 0; r < mr; r++) {
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total[r]));
        for (int64_t d0 = 0; d0 < dim; d0 += 32)
            _mm512_storeu_si512(o[r] + d0, (__m512i)_mm512_cvtne2ps_pbh(
                _mm512_mul_ps(_mm512_load_ps(acc + r * 64 + d0 + 16), inv),
                _mm512_mul_ps(_mm512_load_ps(acc + r * 64 + d0), inv)));
    }
}

/* attend_tile on the tiles, 32 rows at a time; *configured: the rows the calling thread's
 * tiles are configured for (0: none yet). Whole 16-row tiles always: a group's rows past
 * the tile's last are computed from stale buffer rows (s and p hold a multiple of 32
 * rows) and never written out. */
static void attend_tile_amx(const uint16_t *q, uint16_t *out, const uint32_t *kp,
                            const uint32_t *vp, int64_t base, int64_t start, int64_t t0,
                            int64_t t1, int64_t h, int64_t heads, int64_t group, int64_t dim,
                            float scale, int64_t window, float *s, uint16_t *p,
                            int *configured) {
    const int64_t end = start + t1, first0 = start + t0 + 1 - window;
    const int64_t lo = window > 0 && first0 > 0 ? first0 / 32 * 32 : 0;
    const int64_t n = (end + 31) / 32 * 32 - lo, rows = (t1 - t0) * group;
    const uint32_t *kt = kp + (lo - base) * dim / 2, *vt = vp + (lo - base) * dim / 2;
    uint16_t qbuf[32 * MAX_DIM] __attribute__((aligned(64)));
    float inv[AMX_TILE_ROWS];
    amx_ensure(configured, 16);
    if (dim <= 64) {
        for (int64_t r0 = 0; r0 < rows; r0 += 16) {
            const int mr = rows - r0 >= 16 ? 16 : (int)(rows - r0);
            int64_t from[16], to[16];
            uint16_t *o[16];
            for (int r = 0; r < mr; r++) {
                const int64_t row = r0 + r, e = start + t0 + row / group + 1;
                from[r] = first_seen(e, window) - lo;
                to[r] = e - lo;
                o[r] = out + head_row(row, t0, h, heads, group) * dim;
                memcpy(qbuf + r * dim, q + head_row(row, t0, h, heads, group) * dim,
                       (size_t)dim * sizeof(uint16_t));
            }
            amx_memory_barrier(); /* the tile loads read qbuf */
            /* The group's slots end at its last row's: the tile's later chunks would add
             * only zeros to these rows. */
            const int64_t seen = (to[mr - 1] + 31) / 32 * 32;
            attend_rows_amx(qbuf, kt, vt, seen < n ? seen : n, lo % ATTN_CHUNK, dim, mr, from,
                            to, scale * 1.44269504f, o);
        }
        return;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += 32) {
        const int mr = rows - r0 >= 32 ? 32 : (int)(rows - r0);
        for (int r = 0; r < mr; r++)
            memcpy(qbuf + r * dim, q + head_row(r0 + r, t0, h, heads, group) * dim,
                   (size_t)dim * sizeof(uint16_t));
        amx_memory_barrier(); /* the tile loads below read qbuf */
        scores_amx(qbuf, kt, n, dim, s + r0 * n);
    }
    amx_memory_barrier(); /* the softmax reads the scores the tiles stored */
    softmax_rows(s, p, inv, rows, n, lo, start + t0, group, window, scale);
    amx_memory_barrier(); /* the tile loads below read p */
    for (int64_t r0 = 0; r0 < rows; r0 += 32) {
        const int mr = rows - r0 >= 32 ? 32 : (int)(rows - r0);
        uint16_t *o[32];
        for (int r = 0; r < mr; r++)
            o[r] = out + head_row(r0 + r, t0, h, heads, group) * dim;
        values_amx(p + r0 * n, n, vt, dim, mr, inv + r0, o);
    }
}
#endif
#endif
#ifndef HAVE_AMX
int amx_enable(void) { return 0; }
#endif

int prompt_attention_tiled_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                uint16_t *out, int64_t start, int64_t tokens, int64_t heads,
                                int64_t kv_heads, int64_t dim, int64_t head_stride,
                                float scale, int64_t window) {
#ifndef HAVE_AVX512_BF16
    return -1;
#else
    /* softmax_row scales after its maximum: a scale <= 0 (no model's) takes the
     * one-query loop */
    if (dim % 32 || dim > MAX_DIM || kv_heads <= 0 || heads % kv_heads || tokens < 0
        || !(scale > 0.f))
        return -1;
    if (tokens == 0)
        return 0;
    const int64_t group = heads / kv_heads, end = start + tokens;
#ifdef HAVE_AMX
    const int amx = amx_granted;
    const int64_t tile_rows = amx ? AMX_TILE_ROWS : TILE_ROWS;
#else
    const int amx = 0;
    const int64_t tile_rows = TILE_ROWS;
#endif
    const int64_t tile = group >= tile_rows ? 1 : tile_rows / group; /* tokens per tile */
    if (group > tile_rows)
        return -1;
    /* The lowest slot any query sees, rounded down to the tiles' 32-slot alignment. */
    const int64_t first = window > 0 && start + 1 > window ? start + 1 - window : 0;
    const int64_t base = first / 32 * 32, span = (end + 31) / 32 * 32 - base;
    const int64_t per_head = span * dim / 2, blocks = span / 16;
    uint32_t *kp = malloc(sizeof(uint32_t) * (size_t)(2 * kv_heads * per_head));
    if (!kp)
        return -2;
    uint32_t *vp = kp + kv_heads * per_head;
    const int64_t tiles = (tokens + tile - 1) / tile;
    int status = 0;
#pragma omp parallel if (tokens * heads >= 2 * MIN_PAIRS_PER_THREAD)
    {
        /* Packed by the team: one thread alone left the other waiting, 4-13% of a call
         * of 64-316 tokens. */
#pragma omp for schedule(static)
        for (int64_t u = 0; u < kv_heads * blocks; u++) {
            const int64_t h = u / blocks, b = u % blocks;
            pack_block(k + h * head_stride, v + h * head_stride,
                       kp + h * per_head + b * 8 * dim, vp + h * per_head + b * 8 * dim,
                       base + b * 16, end, dim);
        }
        const size_t cells = (size_t)tile_rows * (size_t)(span + 32);
#ifdef HAVE_AMX
        int configured = 0; /* the AMX rows this thread's tiles are set for */
#endif
        float *s = malloc(sizeof(float) * cells);
        uint16_t *p = malloc(sizeof(uint16_t) * cells);
        if (!s || !p) {
#pragma omp atomic write
            status = -2;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < tiles * kv_heads; u++) {
            int64_t t0, t1, h;
            dealt_tile(u, tiles, kv_heads, tile, tokens, &t0, &t1, &h);
            if (!(s && p))
                continue;
#ifdef HAVE_AMX
            if (amx) {
                attend_tile_amx(q, out, kp + h * per_head, vp + h * per_head, base, start,
                                t0, t1, h, heads, group, dim, scale, window, s, p,
                                &configured);
                continue;
            }
#endif
            attend_tile(q, out, kp + h * per_head, vp + h * per_head, base, start, t0, t1,
                        h, heads, group, dim, scale, window, s, p);
        }
#ifdef HAVE_AMX
        if (configured)
            _tile_release();
#endif
        (void)amx;
        free(s);
        free(p);
    }
    free(kp);
    return status;
#endif
}

/* ---- float32 (a model computing in float32): AVX2 and FMA ----
 *
 * The same causal attention over float32 KV, as two small GEMMs a tile through fma_tile:
 * the query rows (a tile's tokens times the query heads of one KV head) against blocks of
 * 16 keys, packed once per call as keys [kv_heads][slot block][dim][16 slots]; then the
 * probabilities against the values, read where they lie ([slot][dim], 16 dimensions at a
 * time). Scores are the float32 dot product times the scale, the exponential is exp8_le0,
 * the probabilities stay float32 and the output is divided by their float32 sum. Slots a
 * query does not see add exact zeros (its scores are -inf before the exponential), blocks
 * start on absolute multiples of 16 slots and every sum runs in slot order: a query's
 * numbers depend only on its slot and the row's keys and values, whatever the tile, the
 * chunk or a cached prefix (as the bfloat16 loop above). Slots from start + tokens on are
 * never read. SDPA's float32 kernel ran 21-40 GFLOP/s at 141-512 tokens on an AVX2 EPYC. */
#if defined(__AVX2__) && defined(__FMA__)
#include "fma_tile.h"

#define F32_TILE_ROWS 24 /* (token, head) rows per tile: four fma_tile calls */

/* Tokens [t0, t1) of the prompt, query heads h * group .. of KV head h: kp that head's
 * packed keys from slot base, vh its values at slot 0. s: F32_TILE_ROWS x (the tile's
 * slots rounded up to 16) floats; qt: F32_TILE_ROWS x dim. */
static void attend_tile_f32(const float *q, float *out, const float *kp, const float *vh,
                            int64_t base, int64_t start, int64_t t0, int64_t t1, int64_t h,
                            int64_t heads, int64_t group, int64_t dim, float scale,
                            int64_t window, float *s, float *qt) {
    const int64_t rows = (t1 - t0) * group;
    for (int64_t r = 0; r < rows; r++)
        memcpy(qt + r * dim, q + ((t0 + r / group) * heads + h * group + r % group) * dim,
               sizeof(float) * (size_t)dim);
    /* The tile's slots: from the block of its first token's first visible slot to its
     * last token's slot. */
    const int64_t first = window > 0 && start + t0 + 1 > window ? start + t0 + 1 - window : 0;
    const int64_t lo = (first - base) / 16 * 16 + base, last = start + t1 - 1;
    const int64_t blocks = (last - lo) / 16 + 1, width = blocks * 16;
    for (int64_t b = 0; b < blocks; b++)
        fma_rows(qt, dim, kp + (lo - base + b * 16) * dim, 16, dim, rows, s + b * 16, width);
    float inv[F32_TILE_ROWS];
    const __m256 sv = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
    for (int64_t r = 0; r < rows; r++) {
        float *sr = s + r * width;
        const int64_t own = start + t0 + r / group;
        const int64_t from = window > 0 && own + 1 > window ? own + 1 - window : 0;
        const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
        /* scaled, and -inf outside [from, own] */
        __m256 top = ninf;
        for (int64_t c = 0; c < width; c += 8) {
            const __m256 slot = _mm256_add_ps(_mm256_set1_ps((float)(lo + c)), lane);
            const __m256 seen = _mm256_and_ps(
                _mm256_cmp_ps(slot, _mm256_set1_ps((float)from), _CMP_GE_OQ),
                _mm256_cmp_ps(slot, _mm256_set1_ps((float)own), _CMP_LE_OQ));
            const __m256 x = _mm256_blendv_ps(ninf, _mm256_mul_ps(_mm256_loadu_ps(sr + c), sv),
                                              seen);
            _mm256_storeu_ps(sr + c, x);
            top = _mm256_max_ps(top, x);
        }
        const __m256 bv = _mm256_set1_ps(hmax8(top));
        __m256 total = _mm256_setzero_ps();
        for (int64_t c = 0; c < width; c += 8) {
            const __m256 e = exp8_le0(_mm256_sub_ps(_mm256_loadu_ps(sr + c), bv));
            _mm256_storeu_ps(sr + c, e);
            total = _mm256_add_ps(total, e);
        }
        inv[r] = 1.f / hsum8(total);
    }
    /* probabilities x values, over the slots up to the last token's (the rest of the
     * last block is not read: unwritten) */
    float o[F32_TILE_ROWS * 16];
    for (int64_t d = 0; d < dim; d += 16) {
        fma_rows(s, width, vh + lo * dim + d, dim, last + 1 - lo, rows, o, 16);
        for (int64_t r = 0; r < rows; r++) {
            float *to = out + ((t0 + r / group) * heads + h * group + r % group) * dim + d;
            const __m256 iv = _mm256_set1_ps(inv[r]);
            _mm256_storeu_ps(to, _mm256_mul_ps(_mm256_loadu_ps(o + r * 16), iv));
            _mm256_storeu_ps(to + 8, _mm256_mul_ps(_mm256_loadu_ps(o + r * 16 + 8), iv));
        }
    }
}
#endif

/* Layout and visibility as prompt_attention_tiled_bf16, over float32 q, k, v and out.
 * Returns 0; -1 for a shape it does not take (a head size not a multiple of 16, more
 * than 24 query heads a KV head) or where it was built without AVX2 and FMA; -2 when
 * memory ran out. */
int prompt_attention_tiled_f32(const float *q, const float *k, const float *v, float *out,
                               int64_t start, int64_t tokens, int64_t heads,
                               int64_t kv_heads, int64_t dim, int64_t head_stride,
                               float scale, int64_t window) {
#if !(defined(__AVX2__) && defined(__FMA__))
    (void)q, (void)k, (void)v, (void)out, (void)start, (void)tokens, (void)heads;
    (void)kv_heads, (void)dim, (void)head_stride, (void)scale, (void)window;
    return -1;
#else
    if (dim % 16 || dim > MAX_DIM || kv_heads <= 0 || heads % kv_heads || tokens < 0
        || heads / kv_heads > F32_TILE_ROWS)
        return -1;
    if (tokens == 0)
        return 0;
    const int64_t group = heads / kv_heads, end = start + tokens;
    const int64_t tile = F32_TILE_ROWS / group; /* tokens per tile */
    const int64_t first = window > 0 && start + 1 > window ? start + 1 - window : 0;
    const int64_t base = first / 16 * 16, span = (end + 15) / 16 * 16 - base;
    const int64_t blocks = span / 16, per_head = span * dim;
    float *kp = malloc(sizeof(float) * (size_t)(kv_heads * per_head));
    if (!kp)
        return -2;
    const int64_t tiles = (tokens + tile - 1) / tile;
    int status = 0;
#pragma omp parallel if (tokens * heads >= 2 * MIN_PAIRS_PER_THREAD)
    {
#pragma omp for schedule(static)
        for (int64_t u = 0; u < kv_heads * blocks; u++) {
            const int64_t h = u / blocks, b = u % blocks, s0 = base + b * 16;
            const float *kh = k + h * head_stride;
            float *to = kp + h * per_head + b * 16 * dim;
            for (int j = 0; j < 16; j++) {
                const float *key = kh + (s0 + j) * dim;
                const int written = s0 + j < end;
                for (int64_t d = 0; d < dim; d++)
                    to[d * 16 + j] = written ? key[d] : 0.f;
            }
        }
        float *s = malloc(sizeof(float) * (size_t)(F32_TILE_ROWS * (span + 16 + dim)));
        if (!s) {
#pragma omp atomic write
            status = -2;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < tiles * kv_heads; u++) {
            int64_t t0, t1, h;
            dealt_tile(u, tiles, kv_heads, tile, tokens, &t0, &t1, &h);
            if (s)
                attend_tile_f32(q, out, kp + h * per_head, v + h * head_stride, base, start,
                                t0, t1, h, heads, group, dim, scale, window, s,
                                s + F32_TILE_ROWS * (span + 16));
        }
        free(s);
    }
    free(kp);
    return status;
#endif
}
