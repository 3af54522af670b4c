/* Linear products with bfloat16 weights and float32 activations, for CPUs without native
 * bfloat16 (AVX2 without AVX512).
 *
 * Built and loaded at run time by bf16_weights.py (plain C, no torch headers). A decoding
 * step's products have few rows, so their time is the weights' bytes: read as bfloat16
 * and widened in registers (exact), they cost half of what float32 weights do. A prompt's
 * products are arithmetic: each block of the weight is widened once per chunk of rows, a
 * piece of positions at a time, into a float32 buffer that 6-row tiles of fused
 * multiply-adds stream from cache (fma_tile.h). Every product
 * and sum is float32, so the result is that of the float32 copy of the weights up to the
 * order of the float32 sums.
 */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "fma_tile.h"
#include "shares.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

int bf16w_vectorized(void) { return 1; }

/* The packed weight: blocks of 16 output columns, each block's k positions in order,
 *
 *     packed[block][i][slot] = w[16 * block + column][i],
 *
 * where slots 0-3, 4-7, 8-11, 12-15 hold columns 0-3, 8-11, 4-7, 12-15: interleaving one
 * load of a position's 16 values with zeros (unpacklo / unpackhi) then gives columns 0-7
 * and 8-15 as float32, one instruction each. Columns past n are zero.
 *
 * Each output is its row dotted with its column in the order of i, one fused multiply-add
 * a position, plus the bias: the same bits at every row count, in either loop below. */

/* Rows of a register tile: the widened loop's are fma_tile's 6; the packed loop also
 * holds the zeros it unpacks with, so it takes 4 rows (6 spilled sums to the stack there). */
#define MR FMA_TILE_ROWS
#define MR_PACKED 4
/* Up to this many rows, tiles read the packed bfloat16 weight directly: the product is the
 * weight's bytes. From more, each block is first widened to float32 once per chunk of rows
 * and 6-row tiles stream it from cache, at 130-170 GFLOP/s against 98-115 for the packed
 * loop, and 1.0-1.7x oneDNN's prepacked float32 product (2 threads, AVX2 EPYC). */
#define PACKED_ROWS 8
/* Bytes of input rows one chunk holds at most: they stay in L2 (512 KiB a core on Zen 3)
 * while each of a thread's blocks passes over them, beside the piece of the block being
 * widened (KC). Against 256 KiB chunks over whole widened blocks: 1.1-1.2x on qwen2-gqa's
 * products (k = 1024, 2816) at 64 rows, as fast on SmolLM2's (k = 576, 1536). */
#define CHUNK_BYTES (448 * 1024)

/* Columns 0-7 and 8-15 of position i of a packed block, as float32. */
#define UNPACK(w, i, lo, hi)                                                        \
    const __m256i wv_ = _mm256_loadu_si256((const __m256i *)((w) + (i) * 16));     \
    const __m256 lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, wv_));        \
    const __m256 hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, wv_));

/* Sums [mr][16] plus bias into y's columns c0.. (rows n apart), up to column n. */
static inline void store_tile(const float *sums, int mr, const float *bias, float *y,
                              int64_t n, int64_t c0) {
    if (c0 + 16 <= n) {
        const __m256 b0 = bias ? _mm256_loadu_ps(bias + c0) : _mm256_setzero_ps();
        const __m256 b1 = bias ? _mm256_loadu_ps(bias + c0 + 8) : _mm256_setzero_ps();
        for (int m = 0; m < mr; m++) {
            _mm256_storeu_ps(y + m * n + c0, _mm256_add_ps(_mm256_loadu_ps(sums + 16 * m), b0));
            _mm256_storeu_ps(y + m * n + c0 + 8,
                             _mm256_add_ps(_mm256_loadu_ps(sums + 16 * m + 8), b1));
        }
        return;
    }
    for (int m = 0; m < mr; m++)
        for (int64_t c = c0; c < n; c++)
            y[m * n + c] = sums[16 * m + c - c0] + (bias ? bias[c] : 0.f);
}

/* Rows [0, mr) of a times one packed bfloat16 block, unpacked at each position. */
static inline __attribute__((always_inline)) void
tile_packed(const float *a, int64_t as, const uint16_t *w, int64_t k, const int mr,
            const float *bias, float *y, int64_t n, int64_t c0) {
    FMA_SUMS(0) FMA_SUMS(1) FMA_SUMS(2) FMA_SUMS(3)
    const __m256i zero = _mm256_setzero_si256();
    for (int64_t i = 0; i < k; i++) {
        UNPACK(w, i, lo, hi)
        FMA_STEP(0) FMA_STEP(1) FMA_STEP(2) FMA_STEP(3)
    }
    float c[16 * MR_PACKED];
    const int64_t cs = 16;
    FMA_KEEP(0) FMA_KEEP(1) FMA_KEEP(2) FMA_KEEP(3)
    store_tile(c, mr, bias, y, n, c0);
}

/* Positions [0, k) of block w (packed) widened into wide[k][16]. */
static void widen_block(const uint16_t *w, int64_t k, float *wide) {
    const __m256i zero = _mm256_setzero_si256();
    for (int64_t i = 0; i < k; i++) {
        UNPACK(w, i, lo, hi)
        _mm256_storeu_ps(wide + i * 16, lo);
        _mm256_storeu_ps(wide + i * 16 + 8, hi);
    }
}

/* Most positions of a widened piece of a block (40 KiB of float32): a longer block is cut
 * into pieces of equal length, each widened and passed over by the chunk's row tiles while
 * it stays in cache, so that the chunk's rows can take most of L2 (CHUNK_BYTES). */
#define KC 640
/* Rows [r0, r1) of x times block b: 4-row tiles over the packed weight, or (wide set)
 * 6-row tiles over its widened copy, a piece of at most KC positions at a time (the sums
 * wait in acc between pieces: stored and loaded as they are, so the same bits). */
static void block_rows(const float *x, int64_t xs, const uint16_t *w, float *wide, float *acc,
                       int64_t k, int64_t r0, int64_t r1, const float *bias, float *y,
                       int64_t n, int64_t c0) {
    if (wide) {
        const int64_t pieces = (k + KC - 1) / KC, piece = (k + pieces - 1) / pieces;
        for (int64_t i0 = 0; i0 < k; i0 += piece) {
            const int64_t kk = k - i0 < piece ? k - i0 : piece;
            widen_block(w + i0 * 16, kk, wide);
            for (int64_t r = r0; r < r1; r += MR) {
                const float *xr = x + r * xs + i0;
                float *a = acc + (r - r0) * 16;
                const int first = i0 == 0;
                switch (r1 - r < MR ? r1 - r : MR) {
                case 6: fma_tile_more(xr, xs, wide, 16, kk, 6, a, 16, first); break;
                case 5: fma_tile_more(xr, xs, wide, 16, kk, 5, a, 16, first); break;
                case 4: fma_tile_more(xr, xs, wide, 16, kk, 4, a, 16, first); break;
                case 3: fma_tile_more(xr, xs, wide, 16, kk, 3, a, 16, first); break;
                case 2: fma_tile_more(xr, xs, wide, 16, kk, 2, a, 16, first); break;
                default: fma_tile_more(xr, xs, wide, 16, kk, 1, a, 16, first); break;
                }
            }
        }
        for (int64_t r = r0; r < r1; r += MR)
            store_tile(acc + (r - r0) * 16, r1 - r < MR ? r1 - r : MR, bias, y + r * n, n, c0);
        return;
    }
    for (; r0 < r1;) {
        const float *xr = x + r0 * xs;
        float *yr = y + r0 * n;
        switch (r1 - r0 < MR_PACKED ? r1 - r0 : MR_PACKED) {
        case 4: tile_packed(xr, xs, w, k, 4, bias, yr, n, c0); break;
        case 3: tile_packed(xr, xs, w, k, 3, bias, yr, n, c0); break;
        case 2: tile_packed(xr, xs, w, k, 2, bias, yr, n, c0); break;
        default: tile_packed(xr, xs, w, k, 1, bias, yr, n, c0); break;
        }
        r0 += MR_PACKED;
    }
}

/* y[m, j] = sum_i x[m, i] * w[j, i] (+ bias[j]): x float32 [rows, k] with row stride xs,
 * p the packed bfloat16 weight (above; ceil(n / 16) blocks), bias float32 [n] or NULL,
 * y float32 [rows, n] contiguous. Thread t takes a contiguous range of blocks and runs
 * them chunk by chunk of rows (each chunk stays in L2 across its blocks), dealt through
 * shares.h so that a thread done early takes the other's last units. Returns 0, or -2
 * when out of memory. */
int linear_bf16p(const float *x, const uint16_t *p, const float *bias, float *y,
                 int64_t rows, int64_t n, int64_t k, int64_t xs) {
    const int64_t blocks = (n + 15) / 16;
    const int widened = rows > PACKED_ROWS;
    int64_t chunk = CHUNK_BYTES / (k * (int64_t)sizeof(float)) / MR * MR;
    chunk = chunk < MR ? MR : chunk;
    if (widened) { /* chunks of about equal rows, each a multiple of 6 but the last */
        const int64_t count = (rows + chunk - 1) / chunk;
        chunk = ((rows + count - 1) / count + MR - 1) / MR * MR;
    } else {
        chunk = rows;
    }
    const int64_t chunks = (rows + chunk - 1) / chunk;
    const int parallel = rows * n * k >= 65536;
    struct shares shares;
    const int64_t threads = shares_threads(shares_team(parallel));
    int64_t first_unit[SHARES_MAX_THREADS + 1];
    shares_by_blocks(&shares, first_unit, threads, blocks, 1, chunks);
    int status = 0;
#pragma omp parallel if (parallel)
    {
        float *wide = widened ? aligned_alloc(64, (size_t)(KC + chunk) * 16 * sizeof(float)) : NULL;
        float *acc = wide ? wide + KC * 16 : NULL;
        if (widened && !wide) {
#pragma omp atomic write
            status = -2;
        }
        for (int64_t unit; (unit = shares_next(&shares)) >= 0;) {
            if (widened && !wide)
                continue;
            const int64_t t = shares_owner(first_unit, unit);
            const int64_t lo = blocks * t / threads, mine = blocks * (t + 1) / threads - lo;
            const int64_t u = unit - first_unit[t];
            const int64_t b = lo + u % mine, r0 = u / mine * chunk;
            const int64_t r1 = rows - r0 < chunk ? rows : r0 + chunk;
            const uint16_t *w = p + b * k * 16;
            block_rows(x, xs, w, wide, acc, k, r0, r1, bias, y, n, b * 16);
        }
        free(wide);
    }
    return status;
}
#else
/* Without AVX2 and FMA bf16_weights.py does not use this library. */
int bf16w_vectorized(void) { return 0; }

int linear_bf16p(const float *x, const uint16_t *w, const float *bias, float *y,
                 int64_t rows, int64_t n, int64_t k, int64_t xs) {
    (void)x, (void)w, (void)bias, (void)y, (void)rows, (void)n, (void)k, (void)xs;
    return -1;
}
#endif
