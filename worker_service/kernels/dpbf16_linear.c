/* bfloat16 linear products over weights packed in pairs, on CPUs with AVX512-BF16.
 *
 * Built and loaded at run time by dpbf16_linear.py (plain C, no torch headers). The
 * weight [n, k] is packed once into blocks of 16 output columns; within a block, the
 * 64 bytes of each pair of input positions (kp) hold the 16 columns' two weights:
 *
 *     packed[block][kp][column][t] = w[16 * block + column][2 * kp + t]
 *
 * so one 512-bit load is the right operand of the dot instruction (vdpbf16ps), whose
 * left operand is an input row's pair (x[2kp], x[2kp + 1]) broadcast to the 16 lanes.
 * A register tile holds MR rows x NB blocks of float32 sums; each thread takes one
 * contiguous range of blocks and streams their weights front to back once, every row tile
 * reusing the block group's weights from cache while, for PREFETCH_MIN_ROWS to
 * PREFETCH_ROWS rows, the tiles fetch the next group's. No horizontal sums: a lane ends
 * as one output.
 *
 * Each output is its input row's pairs dotted with its weight column in the order of kp,
 * exact bfloat16 products summed in float32, plus the bias, rounded once to bfloat16
 * (to nearest even): the same bits whatever the row count, the tile or the thread that
 * computes it (batch invariant by construction). A tile's epilogue stores those outputs,
 * adds them into y (rounded again, as torch adds bfloat16), or, over two gate blocks and
 * their up blocks, stores the SiLU gate product of the stacked gate/up product.
 *
 * On CPUs with AMX (Sapphire Rapids and later), once amx_enable() has been granted the
 * tile registers, products whose k is a multiple of 32 run on the tile unit instead: the
 * packed block's 16 pairs x 16 columns x 2 are exactly a B tile (the VNNI layout), so
 * the same packed weight serves both loops. A row's sums depend only on that row and the
 * fixed 32-position steps of k (the order inside one tile instruction is the hardware's),
 * so it too gives every row the same bits at every row count; it is the only loop for
 * such a weight once enabled (the two loops differ in the last bit of a few values).
 * From 32 rows the tile loop takes the input in 256-row chunks that stay in L2, each
 * thread streaming its weights once per chunk (linear_amx).
 */
#include <stdint.h>

#include "bf16.h"
#include "amx.h"
#include "shares.h"

#define MR 6 /* rows of a register tile */
#define NB 4 /* 16-column blocks of a register tile: MR x NB = 24 of the 32 registers */
/* From PREFETCH_MIN_ROWS to PREFETCH_ROWS rows, the row tiles of a block group fetch the
 * next group's weights: SmolLM2's 120 layer products (their own weights, two threads, a
 * Zen 5 EPYC) ran 1.15-1.3x as fast with it at 16-64 rows. With more rows the tiles are
 * compute-bound and the fetching cost 2-4%. With fewer, the products only stream their
 * weights, and the fetches (four more streams a thread, a group ahead) slowed that
 * streaming: the 120 products of one row took 5.2-5.7 ms with them and 4.8-5.0 without,
 * a whole decoding step of one row 6.7-7.1 ms against 6.2-6.6 (qwen2-gqa 6.2-6.3 against
 * 5.8-5.9, mid 2.8-2.9 against 2.5-2.6); at 8 rows the two are even. */
#define PREFETCH_ROWS 64
#define PREFETCH_MIN_ROWS 8

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

int dpbf16_vectorized(void) { return 1; }

/* The lanes of the 16 columns from c that exist (c + lane < n). */
static inline __mmask16 column_mask(int64_t n, int64_t c) {
    const int64_t left = n - c;
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

/* The bias of those columns widened to float32 (zeros without a bias). */
static inline __m512 bias16(const uint16_t *bias, __mmask16 mask, int64_t c) {
    if (!bias)
        return _mm512_setzero_ps();
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + c)), 16));
}

/* The next block group's weights, fetched into cache while this group computes: its
 * first `blocks` blocks (laid out as a tile's, `second` below); a tile fetches the pairs
 * kp = phase, phase + every, ..., so the `every` row tiles of a group share the fetching
 * evenly. */
struct ahead {
    const uint16_t *p;
    int64_t second, blocks, phase, every;
    int fetch_y; /* an ADD tile that fetches no weights fetches y first (past PREFETCH_ROWS) */
};

/* What a tile does with its rounded sums: stores them, adds them into y (the residual
 * adds), or (a SiLU unit: gate blocks 0, 1 and their up blocks 2, 3) stores the SiLU gate
 * product. */
enum epilogue { STORE, ADD, SILU };

/* Where block b (0-3) of a tile starts: blocks 0, 1 at p, blocks 2, 3 `second` values on
 * (2 blocks on for a plain run of blocks; the up blocks for a SiLU unit). */
static inline const uint16_t *tile_block(const uint16_t *p, int64_t block, int64_t second,
                                         int b) {
    return p + (b & 1) * block + (b >> 1) * second;
}

/* Float32 sums v plus the bias, rounded to bfloat16 (to nearest even): every product's
 * output rounding. */
static inline __m256i round_product(__m512 v, __m512 bias) {
    return (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(v, bias));
}

/* bfloat16 lanes as float32. */
static inline __m512 widen16(__m256i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* A row's 16 sums plus bias, rounded, into dst's masked lanes; with `add`, added to dst's
 * values instead, bfloat16(dst + the rounded product), as torch adds two bfloat16 tensors:
 * the products' epilogue, on the tiles and the dot loop alike. */
static inline void store_sums16(__m512 sums, __m512 bias, __mmask16 mask, uint16_t *dst,
                                int add) {
    __m256i out = round_product(sums, bias);
    if (add)
        out = round16_exact(_mm512_add_ps(widen16(out),
                                          widen16(_mm256_maskz_loadu_epi16(mask, dst))));
    _mm256_mask_storeu_epi16(dst, mask, out);
}

/* bfloat16(silu[g] * u) of 16 rounded gate and up values, as fused_layers.c's
 * silu_mul_span computes it. */
static inline __m256i silu_times16(__m256i gate, __m256i up, const float *silu) {
    const __m512 act = _mm512_i32gather_ps(_mm512_cvtepu16_epi32(gate), silu, 4);
    return round16_exact(_mm512_mul_ps(act, widen16(up)));
}

/* bfloat16(silu[g] * u) of 16 gate and up sums, each plus its bias and rounded as the
 * stacked product rounds them: the SiLU gate product as fused_layers.c's silu_mul_span
 * computes it from that product, so the bits of the two apart. */
static inline __m256i silu_product16(__m512 gate_sums, __m512 up_sums, __m512 gate_bias,
                                     __m512 up_bias, const float *silu) {
    return silu_times16(round_product(gate_sums, gate_bias), round_product(up_sums, up_bias),
                        silu);
}

/* Rows [0, mr) of x times blocks [0, nbk) of p (k2 pairs each, placed as tile_block says)
 * into y's columns col0.. of rows n apart, as `how` says (a SILU tile has nbk = 4: gate
 * bias at bias + col0, up bias at bias + n + col0; silu the activation table). mr, nbk
 * and prefetch are constants where inlined, so the sums stay in registers and a product
 * without prefetching has no test in its loop. */
static inline __attribute__((always_inline)) void
tile(const uint16_t *x, int64_t xs, const uint16_t *p, int64_t second, int64_t k2,
     const int mr, const int nbk, const uint16_t *bias, uint16_t *y, int64_t n, int64_t col0,
     const int prefetch, const struct ahead *ahead, enum epilogue how, const float *silu) {
    int64_t fetch_at = prefetch ? ahead->phase : -1;
    /* An ADD tile's epilogue reads y: fetched now, those reads hit cache instead of each
     * tile stalling on them at its end (o and down of SmolLM2 at 2048 rows: 1.2x and
     * 1.08x); up to PREFETCH_ROWS rows y is small and the fetching cost 2-4% */
    if (how == ADD && !prefetch && ahead->fetch_y)
        for (int m = 0; m < mr; m++) {
            const char *row = (const char *)(y + m * n + col0);
            for (int at = 0; at < nbk * 32; at += 64)
                _mm_prefetch(row + at, _MM_HINT_T0);
            _mm_prefetch(row + nbk * 32 - 1, _MM_HINT_T0);
        }
    __m512 acc[MR][NB];
    for (int m = 0; m < mr; m++)
        for (int b = 0; b < nbk; b++)
            acc[m][b] = _mm512_setzero_ps();
    const int64_t block = k2 * 32; /* bfloat16 values in one packed block */
    for (int64_t kp = 0; kp < k2; kp++) {
        __m512bh w[NB];
        for (int b = 0; b < nbk; b++)
            w[b] = (__m512bh)_mm512_loadu_si512(tile_block(p, block, second, b) + kp * 32);
        if (prefetch && kp == fetch_at) {
            for (int b = 0; b < ahead->blocks; b++)
                _mm_prefetch((const char *)(tile_block(ahead->p, block, ahead->second, b)
                                            + kp * 32), _MM_HINT_T1);
            fetch_at += ahead->every;
        }
        for (int m = 0; m < mr; m++) {
            int32_t pair;
            memcpy(&pair, x + m * xs + 2 * kp, sizeof pair);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            for (int b = 0; b < nbk; b++)
                acc[m][b] = _mm512_dpbf16_ps(acc[m][b], xv, w[b]);
        }
    }
    if (how == SILU && nbk == 4) {
        for (int b = 0; b < 2; b++) {
            const int64_t c = col0 + b * 16;
            const __m512 bg = bias16(bias, 0xffff, c), bu = bias16(bias, 0xffff, n + c);
            for (int m = 0; m < mr; m++)
                _mm256_storeu_si256((__m256i *)(y + m * n + c),
                                    silu_product16(acc[m][b], acc[m][b + 2], bg, bu, silu));
        }
        return;
    }
    for (int b = 0; b < nbk; b++) {
        const int64_t c = col0 + b * 16;
        const __mmask16 mask = column_mask(n, c);
        const __m512 bv = bias16(bias, mask, c);
        for (int m = 0; m < mr; m++)
            store_sums16(acc[m][b], bv, mask, y + m * n + c, how == ADD);
    }
}

/* A SiLU tile's outputs waiting for their activation: each one's gate and up values
 * (rounded, as the stacked product rounds them) and where its 16 outputs go. */
struct silu_pending {
    int count;
    __m256i gate[MR * 2], up[MR * 2];
    uint16_t *dst[MR * 2];
};

/* Output i of q: silu_product16's last steps (the table look-up, the product, the
 * rounding). */
static inline void silu_finish(const struct silu_pending *q, int i, const float *silu) {
    _mm256_storeu_si256((__m256i *)q->dst[i], silu_times16(q->gate[i], q->up[i], silu));
}

static inline void silu_flush(struct silu_pending *q, const float *silu) {
    for (int i = 0; i < q->count; i++)
        silu_finish(q, i, silu);
    q->count = 0;
}

/* A full SiLU tile (MR rows by a unit's two gate and two up blocks, no weight fetching)
 * that finishes the previous tile's outputs, left in q, inside its own k loop (one every
 * k2 / (2 MR) pairs) and leaves its own there instead of finishing them: the look-ups
 * and roundings of the epilogue, which stalled each tile's end (about 8% of the
 * product at 2048 rows), run while the dot instructions do. Its k loop is tile()'s
 * written out: through one helper shared with tile() GCC's code for it ran 4% slower. */
static void silu_tile_overlapped(const uint16_t *x, int64_t xs, const uint16_t *p,
                                 int64_t second, int64_t k2, const uint16_t *bias,
                                 uint16_t *y, int64_t n, int64_t col0, const float *silu,
                                 struct silu_pending *q) {
    __m512 acc[MR][NB];
    for (int m = 0; m < MR; m++)
        for (int b = 0; b < NB; b++)
            acc[m][b] = _mm512_setzero_ps();
    const int64_t block = k2 * 32, every = k2 / (2 * MR) > 0 ? k2 / (2 * MR) : 1;
    int next = 0;
    for (int64_t kp = 0; kp < k2;) {
        const int64_t stop = kp + every < k2 ? kp + every : k2;
        for (; kp < stop; kp++) {
            __m512bh w[NB];
            for (int b = 0; b < NB; b++)
                w[b] = (__m512bh)_mm512_loadu_si512(tile_block(p, block, second, b) + kp * 32);
            for (int m = 0; m < MR; m++) {
                int32_t pair;
                memcpy(&pair, x + m * xs + 2 * kp, sizeof pair);
                const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
                for (int b = 0; b < NB; b++)
                    acc[m][b] = _mm512_dpbf16_ps(acc[m][b], xv, w[b]);
            }
        }
        if (next < q->count)
            silu_finish(q, next++, silu);
    }
    while (next < q->count)
        silu_finish(q, next++, silu);
    q->count = 0;
    for (int b = 0; b < 2; b++) {
        const int64_t c = col0 + b * 16;
        const __m512 bg = bias16(bias, 0xffff, c), bu = bias16(bias, 0xffff, n + c);
        for (int m = 0; m < MR; m++) {
            q->gate[q->count] = round_product(acc[m][b], bg);
            q->up[q->count] = round_product(acc[m][b + 2], bu);
            q->dst[q->count++] = y + m * n + c;
        }
    }
}

/* One row tile with every tile() argument that shapes its loop a constant: the rows, the
 * blocks, the prefetching and the epilogue. */
#define TILE_CALL(MRV, NBV, PF, HOW) \
    tile(xr, xs, pb, second, k2, MRV, NBV, bias, yr, n, col0, PF, &ahead, HOW, silu)
#define TILE_ROWS(MRV, PF, HOW)                                                \
    case MRV:                                                                  \
        switch (nbk) {                                                         \
        case 4: TILE_CALL(MRV, 4, PF, HOW); break;                             \
        case 3: TILE_CALL(MRV, 3, PF, HOW); break;                             \
        case 2: TILE_CALL(MRV, 2, PF, HOW); break;                             \
        default: TILE_CALL(MRV, 1, PF, HOW); break;                            \
        }                                                                      \
        break;
#define TILE_ANY_ROWS(PF, HOW)                                                 \
    switch (mr) {                                                              \
        TILE_ROWS(6, PF, HOW) TILE_ROWS(5, PF, HOW) TILE_ROWS(4, PF, HOW)      \
        TILE_ROWS(3, PF, HOW) TILE_ROWS(2, PF, HOW) TILE_ROWS(1, PF, HOW)      \
    }
#define TILE_ANY(HOW)                                                          \
    if (rows <= PREFETCH_ROWS && rows >= PREFETCH_MIN_ROWS) {                  \
        TILE_ANY_ROWS(1, HOW)                                                  \
    } else {                                                                   \
        TILE_ANY_ROWS(0, HOW)                                                  \
    }

/* Rounds tile sums acc [rows mr][16] (float32, plus bias) to bfloat16 in y's 16
 * columns from c (masked at n): the tile loops' epilogue. With `add`, y's values are
 * added to instead, bfloat16(y + the rounded product), as torch adds two bfloat16
 * tensors. */
static inline void store_rows(const float *acc, int mr, const uint16_t *bias, uint16_t *y,
                              int64_t n, int64_t c, int add) {
    const __mmask16 mask = column_mask(n, c);
    const __m512 bv = bias16(bias, mask, c);
    for (int m = 0; m < mr; m++)
        store_sums16(_mm512_loadu_ps(acc + m * 16), bv, mask, y + m * n + c, add);
}

/* Rows of x in one unit of the dot loop's shares (a multiple of MR): small enough that a
 * thread done with its own share finds some of a slower one's left to take. */
#define DOT_CHUNK_ROWS 192

/* The dot-instruction loop: x's rows times p into y as `how` says. Its column units are
 * groups of up to NB blocks (16 columns each) of y, or for SILU (n = inter, a multiple of
 * 32) the 32 columns j.. of the SiLU gate product, made of gate blocks j / 16, j / 16 + 1
 * and their up blocks inter / 16 blocks on. Thread t's share (shares.h) is the groups of
 * its contiguous range of columns, each over DOT_CHUNK_ROWS rows at a time, group by
 * group: it streams its weights once, every row tile reusing a group's weights from
 * cache, as a static split does; and a thread done with its share takes the last units
 * left in another's, where a static split leaves it waiting at the barrier. */
static void linear_dot(const uint16_t *x, const uint16_t *p, const uint16_t *bias, uint16_t *y,
                       int64_t rows, int64_t n, int64_t k2, int64_t xs, enum epilogue how,
                       const float *silu) {
    const int64_t block = k2 * 32, tiles = (rows + MR - 1) / MR;
    const int silu_units = how == SILU;
    /* SILU: units of 2 blocks' columns (4 blocks' weights); else single blocks, grouped */
    const int64_t unit_blocks = silu_units ? 2 : 1, step = silu_units ? 1 : NB;
    const int64_t blocks = (n + 16 * unit_blocks - 1) / (16 * unit_blocks);
    const int64_t second = silu_units ? n / 16 * block : 2 * block;
    const int64_t chunks = (rows + DOT_CHUNK_ROWS - 1) / DOT_CHUNK_ROWS;
    const int parallel = rows * n * 2 * k2 >= 65536;
    struct shares shares;
    const int64_t threads = shares_threads(shares_team(parallel));
    /* thread t: its blocks in groups of `step`, each group's chunks in row order */
    int64_t first_unit[SHARES_MAX_THREADS + 1];
    shares_by_blocks(&shares, first_unit, threads, blocks, step, chunks);
#pragma omp parallel if (parallel)
    for (int64_t unit; (unit = shares_next(&shares)) >= 0;) {
        const int64_t t = shares_owner(first_unit, unit);
        const int64_t hi = blocks * (t + 1) / threads, u = unit - first_unit[t];
        const int64_t b0 = blocks * t / threads + u / chunks * step;
        const int64_t r_lo = u % chunks * DOT_CHUNK_ROWS;
        const int64_t r_hi = rows - r_lo < DOT_CHUNK_ROWS ? rows : r_lo + DOT_CHUNK_ROWS;
        const int nbk = silu_units ? 4 : (int)(hi - b0 < NB ? hi - b0 : NB);
        const uint16_t *pb = p + b0 * unit_blocks * block;
        const int64_t col0 = b0 * unit_blocks * 16;
        const int64_t next = b0 + step < hi ? b0 + step : hi;
        const int64_t next_blocks = silu_units ? (next < hi ? 4 : 0)
                                               : (hi - next < NB ? hi - next : NB);
        struct silu_pending pending;
        pending.count = 0;
        for (int64_t r0 = r_lo; r0 < r_hi; r0 += MR) {
            const int mr = (int)(r_hi - r0 < MR ? r_hi - r0 : MR);
            const uint16_t *xr = x + r0 * xs;
            uint16_t *yr = y + r0 * n;
            if (how == SILU && mr == MR && rows > PREFETCH_ROWS) {
                silu_tile_overlapped(xr, xs, pb, second, k2, bias, yr, n, col0, silu,
                                     &pending);
                continue;
            }
            silu_flush(&pending, silu);
            const struct ahead ahead = {p + next * unit_blocks * block, second, next_blocks,
                                        r0 / MR, tiles, rows > PREFETCH_ROWS};
            /* a runtime epilogue cost the store loop 5-10% (2048 rows) */
            if (how == STORE) {
                TILE_ANY(STORE)
            } else if (how == ADD) {
                TILE_ANY(ADD)
            } else {
                TILE_ANY(SILU)
            }
        }
        silu_flush(&pending, silu);
    }
}

#ifdef HAVE_AMX
#define AMX_K 32 /* input positions of one tile step: 16 pairs, a 64-byte A row */

/* Asks Linux for the tile registers; 1 where granted, after which products with
 * k % 32 == 0 run on the tiles (amx.h). */
int amx_enable(void) { return amx_request(); }

static inline __attribute__((always_inline)) void
amx_tile(const uint16_t *x, int64_t xs, const uint16_t *p, int64_t k2, const int mr,
         const int nbk, const uint16_t *bias, uint16_t *y, int64_t n, int64_t col0, int add) {
    const int64_t block = k2 * 32, steps = k2 / 16;
    const int64_t stride = xs * (int64_t)sizeof(uint16_t);
    _tile_zero(0);
    if (nbk > 1) _tile_zero(1);
    if (nbk > 2) _tile_zero(2);
    if (nbk > 3) _tile_zero(3);
    for (int64_t s = 0; s < steps; s++) {
        const uint16_t *w = p + s * 512;
        _tile_loadd(4, x + s * AMX_K, stride);
        _tile_loadd(6, w, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (nbk > 1) { _tile_loadd(7, w + block, 64); _tile_dpbf16ps(1, 4, 7); }
        if (nbk > 2) { _tile_loadd(6, w + 2 * block, 64); _tile_dpbf16ps(2, 4, 6); }
        if (nbk > 3) { _tile_loadd(7, w + 3 * block, 64); _tile_dpbf16ps(3, 4, 7); }
    }
    float acc[16 * 16] __attribute__((aligned(64)));
    _tile_stored(0, acc, 64);
    store_rows(acc, mr, bias, y, n, col0, add);
    if (nbk > 1) { _tile_stored(1, acc, 64); store_rows(acc, mr, bias, y, n, col0 + 16, add); }
    if (nbk > 2) { _tile_stored(2, acc, 64); store_rows(acc, mr, bias, y, n, col0 + 32, add); }
    if (nbk > 3) { _tile_stored(3, acc, 64); store_rows(acc, mr, bias, y, n, col0 + 48, add); }
}

/* Rows of x a pass over the block groups takes: their inputs (at most 256 x k x 2 bytes,
 * 768 KiB at k = 1536) stay in the core's L2 cache while every block group reads them. */
#define AMX_ROW_CHUNK 256
/* From this many rows a product runs the 32 x 32 tile loop below. */
#define AMX_WIDE_ROWS 32
/* Most tile steps (32 input positions) of one pass of the 32 x 32 loop: the two blocks'
 * weights for them (up to 20 steps x 2 KiB) stay in the 48 KiB L1 cache while the rows
 * stream past. A product is split into equal passes of at most this many steps; every
 * pass past the first reloads the float32 sums and every one but the last stores them, so
 * k = 576 (18 steps) in one pass ran 1.02-1.23x its two passes of 9 at 256-2048 rows,
 * while passes of 24 steps (48 KiB) ran k = 768 and 1536 0.89-0.97x (session 30). */
#define AMX_PASS_STEPS 20

/* Rows [0, 32) of x times two packed blocks, at p and p + second (bfloat16 values), tile
 * steps [s0, s1): the four sums (rows 0-15 and 16-31 by the first and second block's
 * columns, at part, part + 256, part + 512, part + 768) start from zero on a first pass
 * or from part (4 x 16 x 16 float32) otherwise, and end in part, or rounded into y's
 * columns col0.. and col0 + 16.. on the last pass (the blocks must then be adjacent).
 * The inputs are read with the streaming load, so they pass through L1 without evicting
 * the weights that every 32 rows reuse. A sum's order is that of amx_tile's, steps of k in
 * order, so both loops give every row the same bits (float32 partial sums round-trip
 * exactly). */
static inline __attribute__((always_inline)) void
amx_tile_32x32(const uint16_t *x, int64_t xs, const uint16_t *p, int64_t second, int64_t s0,
               int64_t s1, float *part, int first, int last, const uint16_t *bias, uint16_t *y,
               int64_t n, int64_t col0, int add) {
    const int64_t stride = xs * (int64_t)sizeof(uint16_t);
    const uint16_t *x16 = x + 16 * xs;
    if (first) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    } else {
        _tile_loadd(0, part, 64); _tile_loadd(1, part + 256, 64);
        _tile_loadd(2, part + 512, 64); _tile_loadd(3, part + 768, 64);
    }
    for (int64_t s = s0; s < s1; s++) {
        const uint16_t *w = p + s * 512;
        _tile_stream_loadd(4, x + s * AMX_K, stride);
        _tile_loadd(6, w, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, w + second, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_stream_loadd(5, x16 + s * AMX_K, stride);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    if (last) {
        float acc[16 * 16] __attribute__((aligned(64)));
        _tile_stored(0, acc, 64); store_rows(acc, 16, bias, y, n, col0, add);
        _tile_stored(1, acc, 64); store_rows(acc, 16, bias, y, n, col0 + 16, add);
        _tile_stored(2, acc, 64); store_rows(acc, 16, bias, y + 16 * n, n, col0, add);
        _tile_stored(3, acc, 64); store_rows(acc, 16, bias, y + 16 * n, n, col0 + 16, add);
    } else {
        _tile_stored(0, part, 64); _tile_stored(1, part + 256, 64);
        _tile_stored(2, part + 512, 64); _tile_stored(3, part + 768, 64);
    }
}

/* Rows [r0, r1) (fewer than 32 per block group, or a thread's last odd block) in 16-row
 * tiles over blocks [b0, b0 + nbk) of p, nbk <= 4. */
static inline void amx_rows(const uint16_t *x, int64_t xs, const uint16_t *p, int64_t k2,
                            int64_t r0, int64_t r1, int64_t b0, int nbk, const uint16_t *bias,
                            uint16_t *y, int64_t n, int add, int *configured) {
    const uint16_t *pb = p + b0 * k2 * 32;
    for (; r0 < r1; r0 += 16) {
        const int mr = (int)(r1 - r0 < 16 ? r1 - r0 : 16);
        amx_ensure(configured, mr);
        const uint16_t *xr = x + r0 * xs;
        uint16_t *yr = y + r0 * n;
        switch (nbk) {
        case 4: amx_tile(xr, xs, pb, k2, mr, 4, bias, yr, n, b0 * 16, add); break;
        case 3: amx_tile(xr, xs, pb, k2, mr, 3, bias, yr, n, b0 * 16, add); break;
        case 2: amx_tile(xr, xs, pb, k2, mr, 2, bias, yr, n, b0 * 16, add); break;
        default: amx_tile(xr, xs, pb, k2, mr, 1, bias, yr, n, b0 * 16, add); break;
        }
    }
}

/* linear_dpbf16 on the tiles, in units shared out by shares.h: each thread runs its own
 * share front to back and then takes what is left of the other's (under a competing
 * busy thread, 1.06-1.42x at 2048 rows against the static split). Under 32 rows a unit is
 * a group of up to 4 of the thread's blocks, every 16-row tile over it (loading the
 * inputs once for 4 products). From 32 rows a unit is 256 rows of x by a pair of blocks;
 * a thread's share is its pairs over every chunk, chunk by chunk, so its weights stay in
 * its L2 from one chunk to the next; per unit, each pass of tile steps keeps the pair's
 * weights for those steps in L1 while every 32 rows of the chunk stream past (two input
 * tiles by two weight tiles, four products per four loads), the sums between passes kept
 * per 32 rows in float32. */
static void linear_amx(const uint16_t *x, const uint16_t *p, const uint16_t *bias, uint16_t *y,
                       int64_t rows, int64_t n, int64_t k2, int64_t xs, int add) {
    const int64_t blocks = (n + 15) / 16, steps = k2 / 16;
    const int64_t passes = (steps + AMX_PASS_STEPS - 1) / AMX_PASS_STEPS;
    const int64_t pairs = (blocks + 1) / 2, chunks = (rows + AMX_ROW_CHUNK - 1) / AMX_ROW_CHUNK;
    const int wide = rows >= AMX_WIDE_ROWS, parallel = rows * n * k2 >= 32768;
    struct shares shares;
    const int64_t threads = shares_threads(shares_team(parallel));
    /* Under 32 rows thread t's share is the groups of 4 blocks from the start of its
     * blocks [blocks t / threads, blocks (t + 1) / threads) on, units numbered on from the
     * previous thread's: as even as the blocks (units of 4 over all the blocks would give
     * one thread 16 of o's 36 blocks and the other 20). */
    int64_t first_unit[SHARES_MAX_THREADS + 1];
    shares.threads = threads;
    first_unit[0] = 0;
    for (int64_t t = 0; t < threads; t++) {
        const int64_t lo = blocks * t / threads, hi = blocks * (t + 1) / threads;
        first_unit[t + 1] = wide ? chunks * (pairs * (t + 1) / threads)
                                 : first_unit[t] + (hi - lo + 3) / 4;
        shares_set(&shares, t, first_unit[t], first_unit[t + 1]);
    }
#pragma omp parallel if (parallel)
    {
        int configured = 0;
        float part[AMX_ROW_CHUNK / 32 * 1024] __attribute__((aligned(64)));
        for (int64_t unit; (unit = shares_next(&shares)) >= 0;) {
            const int64_t t = shares_owner(first_unit, unit);
            if (!wide) {
                const int64_t b0 = blocks * t / threads + 4 * (unit - first_unit[t]);
                const int64_t hi = blocks * (t + 1) / threads;
                amx_rows(x, xs, p, k2, 0, rows, b0, (int)(hi - b0 < 4 ? hi - b0 : 4), bias, y,
                         n, add, &configured);
                continue;
            }
            /* Where in its share: chunk-major over its pairs. */
            const int64_t plo = pairs * t / threads, mine = pairs * (t + 1) / threads - plo;
            const int64_t u = unit - chunks * plo;
            const int64_t c0 = u / mine * AMX_ROW_CHUNK, b0 = 2 * (plo + u % mine);
            const int64_t c1 = rows - c0 < AMX_ROW_CHUNK ? rows : c0 + AMX_ROW_CHUNK;
            const int64_t tiles = (c1 - c0) / 32, wide_end = c0 + 32 * tiles;
            if (blocks - b0 < 2) {
                amx_rows(x, xs, p, k2, c0, c1, b0, 1, bias, y, n, add, &configured);
                continue;
            }
            const uint16_t *pb = p + b0 * k2 * 32;
            amx_ensure(&configured, 16);
            for (int64_t pass = 0; pass < passes; pass++) {
                const int64_t s0 = steps * pass / passes;
                const int64_t s1 = steps * (pass + 1) / passes;
                for (int64_t i = 0; i < tiles; i++) {
                    const int64_t r = c0 + 32 * i;
                    amx_tile_32x32(x + r * xs, xs, pb, k2 * 32, s0, s1, part + 1024 * i, pass == 0,
                                   pass == passes - 1, bias, y + r * n, n, b0 * 16, add);
                }
            }
            amx_rows(x, xs, p, k2, wide_end, c1, b0, 2, bias, y, n, add, &configured);
        }
        if (configured)
            _tile_release();
    }
}

/* Rows [0, 32) of the SiLU gate product from the sums of one gate block and the matching
 * up block (part as amx_tile_32x32 leaves it: gate rows 0-15, up rows 0-15, gate rows
 * 16-31, up rows 16-31): gate and up are rounded to bfloat16 as linear_dpbf16 rounds its
 * output, then out = bfloat16(silu[gate] * up) as fused_layers.c's silu_mul_span computes
 * it, so the bits are those of the product followed by silu_mul_rows_bf16. The first
 * block of an output line (odd = 0) waits in stash[32][16]; the second completes the
 * 64-byte line of each row of out (row stride `inter`). */
static inline void silu_rows_32(const float *part, const uint16_t *bias_gate,
                                const uint16_t *bias_up, const float *silu, uint16_t *stash,
                                uint16_t *out, int64_t inter, int odd) {
    const __m512 bg = bias16(bias_gate, 0xffff, 0), bu = bias16(bias_up, 0xffff, 0);
    for (int r = 0; r < 32; r++) {
        const float *g = part + (r >> 4) * 512 + (r & 15) * 16;
        const __m256i y = silu_product16(_mm512_load_ps(g), _mm512_load_ps(g + 256), bg, bu,
                                         silu);
        if (!odd)
            _mm256_store_si256((__m256i *)(stash + 16 * r), y);
        else
            _mm512_storeu_si512((void *)(out + r * inter), _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_load_si256((const __m256i *)(stash + 16 * r))),
                y, 1));
    }
}

/* linear_silu_dpbf16 on the tiles: as linear_amx's loop from 32 rows, where a unit is a
 * 256-row chunk by 32 output columns j.. j + 31: gate blocks j / 16 and j / 16 + 1 each
 * with its up block (inter / 16 blocks on), one pair after the other. */
static void linear_silu_amx(const uint16_t *x, const uint16_t *p, const uint16_t *bias,
                            uint16_t *out, int64_t rows, int64_t inter, int64_t k2, int64_t xs,
                            const float *silu) {
    const int64_t steps = k2 / 16, passes = (steps + AMX_PASS_STEPS - 1) / AMX_PASS_STEPS;
    const int64_t quads = inter / 32, chunks = (rows + AMX_ROW_CHUNK - 1) / AMX_ROW_CHUNK;
    const int64_t up_offset = inter / 16 * k2 * 32; /* from a gate block to its up block */
    struct shares shares;
    const int64_t threads = shares_threads(shares_team(1));
    int64_t first_unit[SHARES_MAX_THREADS + 1];
    shares.threads = threads;
    first_unit[0] = 0;
    for (int64_t t = 0; t < threads; t++) {
        first_unit[t + 1] = chunks * (quads * (t + 1) / threads);
        shares_set(&shares, t, first_unit[t], first_unit[t + 1]);
    }
#pragma omp parallel
    {
        int configured = 0;
        float part[AMX_ROW_CHUNK / 32 * 1024] __attribute__((aligned(64)));
        uint16_t stash[AMX_ROW_CHUNK * 16] __attribute__((aligned(64)));
        for (int64_t unit; (unit = shares_next(&shares)) >= 0;) {
            const int64_t t = shares_owner(first_unit, unit);
            const int64_t qlo = quads * t / threads, mine = quads * (t + 1) / threads - qlo;
            const int64_t u = unit - chunks * qlo;
            const int64_t c0 = u / mine * AMX_ROW_CHUNK, j = 32 * (qlo + u % mine);
            const int64_t c1 = rows - c0 < AMX_ROW_CHUNK ? rows : c0 + AMX_ROW_CHUNK;
            const int64_t tiles = (c1 - c0) / 32;
            amx_ensure(&configured, 16);
            for (int odd = 0; odd < 2; odd++) {
                const int64_t col = j + 16 * odd;
                const uint16_t *pb = p + col / 16 * k2 * 32;
                for (int64_t pass = 0; pass < passes; pass++) {
                    const int64_t s0 = steps * pass / passes;
                    const int64_t s1 = steps * (pass + 1) / passes;
                    for (int64_t i = 0; i < tiles; i++) {
                        const int64_t r = c0 + 32 * i;
                        amx_tile_32x32(x + r * xs, xs, pb, up_offset, s0, s1, part + 1024 * i,
                                       pass == 0, 0, NULL, NULL, 0, 0, 0);
                        if (pass == passes - 1)
                            silu_rows_32(part + 1024 * i, bias ? bias + col : NULL,
                                         bias ? bias + inter + col : NULL, silu,
                                         stash + 512 * i, out + r * inter + j, inter, odd);
                    }
                }
            }
        }
        if (configured)
            _tile_release();
    }
}
#else
int amx_enable(void) { return 0; }
#endif

/* Whether linear_dpbf16 runs a product of depth k on the tiles. */
static inline int on_tiles(int64_t k) {
#ifdef HAVE_AMX
    return amx_granted && k % AMX_K == 0;
#else
    (void)k;
    return 0;
#endif
}

/* out[m, j] = bfloat16(silu[g] * u) for the stacked product [g | u] = linear_dpbf16(x, p,
 * bias) of 2 inter columns (gate, then up), rounded as linear_dpbf16 rounds: the product
 * and fused_layers.c's silu_mul_rows_bf16 in one pass, the same bits, without writing the
 * product (twice the output's bytes) and reading it back. silu is the activation table
 * (fused_layers.silu_table()). Each row is computed by the loop linear_dpbf16 would take
 * for it. Returns -1 (nothing written) for no rows, an odd k or inter % 32 != 0, and on
 * the tiles also unless rows is a multiple of 32: the caller then runs the product and
 * the SiLU apart, as it does for any other rows. */
int linear_silu_dpbf16(const uint16_t *x, const uint16_t *p, const uint16_t *bias,
                       uint16_t *out, int64_t rows, int64_t inter, int64_t k, int64_t xs,
                       const float *silu) {
    if (rows < 1 || k < 2 || k % 2 || inter < 32 || inter % 32)
        return -1;
#ifdef HAVE_AMX
    if (on_tiles(k)) {
        if (rows % 32)
            return -1;
        linear_silu_amx(x, p, bias, out, rows, inter, k / 2, xs, silu);
        return 0;
    }
#endif
    linear_dot(x, p, bias, out, rows, inter, k / 2, xs, SILU, silu);
    return 0;
}

/* y = bfloat16(y + linear_dpbf16(x, p, bias)), y [rows, n] contiguous and not overlapping
 * x: the product and a residual add in one pass, with the bits of the two apart (the
 * product rounded to bfloat16, then added as torch adds bfloat16 tensors). Returns -1 (y
 * untouched) for no rows or an odd k. */
int linear_add_dpbf16(const uint16_t *x, const uint16_t *p, const uint16_t *bias, uint16_t *y,
                      int64_t rows, int64_t n, int64_t k, int64_t xs) {
    if (rows < 1 || k < 2 || k % 2)
        return -1;
#ifdef HAVE_AMX
    if (on_tiles(k)) {
        linear_amx(x, p, bias, y, rows, n, k / 2, xs, 1);
        return 0;
    }
#endif
    linear_dot(x, p, bias, y, rows, n, k / 2, xs, ADD, NULL);
    return 0;
}

/* y[m, j] = bfloat16(sum_i x[m, i] * w[j, i] + bias[j]): x bfloat16 [rows, k] with row
 * stride xs, p the packed w (n rounded up to 16 columns, the extra ones zero), bias
 * bfloat16 [n] or NULL, y bfloat16 [rows, n] contiguous. Returns 0, or -1 for an odd k
 * or no rows. */
int linear_dpbf16(const uint16_t *x, const uint16_t *p, const uint16_t *bias, uint16_t *y,
                  int64_t rows, int64_t n, int64_t k, int64_t xs) {
    if (rows < 1 || k < 2 || k % 2)
        return -1;
#ifdef HAVE_AMX
    if (on_tiles(k)) {
        linear_amx(x, p, bias, y, rows, n, k / 2, xs, 0);
        return 0;
    }
#endif
    linear_dot(x, p, bias, y, rows, n, k / 2, xs, STORE, NULL);
    return 0;
}
#else
/* Without AVX512-BF16 dpbf16_linear.py does not use this library. */
int dpbf16_vectorized(void) { return 0; }

int amx_enable(void) { return 0; }

int linear_dpbf16(const uint16_t *x, const uint16_t *p, const uint16_t *bias, uint16_t *y,
                  int64_t rows, int64_t n, int64_t k, int64_t xs) {
    (void)x, (void)p, (void)bias, (void)y, (void)rows, (void)n, (void)k, (void)xs;
    return -1;
}

int linear_silu_dpbf16(const uint16_t *x, const uint16_t *p, const uint16_t *bias,
                       uint16_t *out, int64_t rows, int64_t inter, int64_t k, int64_t xs,
                       const float *silu) {
    (void)x, (void)p, (void)bias, (void)out, (void)rows, (void)inter, (void)k, (void)xs,
        (void)silu;
    return -1;
}

int linear_add_dpbf16(const uint16_t *x, const uint16_t *p, const uint16_t *bias, uint16_t *y,
                      int64_t rows, int64_t n, int64_t k, int64_t xs) {
    (void)x, (void)p, (void)bias, (void)y, (void)rows, (void)n, (void)k, (void)xs;
    return -1;
}
#endif
