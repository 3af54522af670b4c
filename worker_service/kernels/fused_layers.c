/* Fused elementwise layers of Llama-family models over bfloat16 (and float32) on CPU.
 *
 * Built and loaded at run time by fused_layers.py (plain C, no torch headers). Eager
 * PyTorch runs an RMSNorm as seven kernels and a rotary embedding as nine, each a pass
 * over memory with a dispatch in front; these loops do each in one pass and round to
 * bfloat16 where the eager code does, so their results match it (the rotary embedding
 * exactly, the norm up to the order of one float32 sum).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* Elements below which a call stays on one thread. */
#define MIN_PARALLEL 65536

#ifdef HAVE_AVX512_BF16
/* Round 16 floats to bfloat16 (to nearest even, as torch) and widen them back. */
static inline __m512 round16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

static inline void store16(uint16_t *p, __m512 v) {
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v));
}

#endif

/* rsqrt(mean(x^2) + eps) of one row of n, bfloat16 (uint16) where bf16 is set, else
 * float32: 16 partial sums the compiler vectorizes. */
static inline __attribute__((always_inline)) float rms_scale(const void *row, int64_t n,
                                                             float eps, int bf16) {
    float part[16] = {0.f};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) {
            const float v = bf16 ? bf16_to_float(((const uint16_t *)row)[i + l])
                                 : ((const float *)row)[i + l];
            part[l] += v * v;
        }
    float sum = 0.f;
    for (; i < n; i++) {
        const float v = bf16 ? bf16_to_float(((const uint16_t *)row)[i])
                             : ((const float *)row)[i];
        sum += v * v;
    }
    for (int l = 0; l < 16; l++)
        sum += part[l];
    return 1.f / sqrtf(sum / (float)n + eps);
}

/* y = w * bf16(x * rsqrt(mean(x^2) + eps)) per row of n, as LlamaRMSNorm in bfloat16:
 * x, y rows x_stride / y_stride elements apart; w [n]. */
void rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t rows,
                   int64_t n, int64_t x_stride, int64_t y_stride, float eps) {
#pragma omp parallel for schedule(static) if (rows * n >= MIN_PARALLEL)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * x_stride;
        uint16_t *yr = y + r * y_stride;
        const float scale = rms_scale(xr, n, eps, 1);
        int64_t i = 0;
#ifdef HAVE_AVX512_BF16
        const __m512 sv = _mm512_set1_ps(scale);
        for (; i + 16 <= n; i += 16)
            store16(yr + i, _mm512_mul_ps(load16(w + i),
                                          round16(_mm512_mul_ps(load16(xr + i), sv))));
#endif
        for (; i < n; i++) {
            const float h = bf16_to_float(float_to_bf16(bf16_to_float(xr[i]) * scale));
            yr[i] = float_to_bf16(bf16_to_float(w[i]) * h);
        }
    }
}

#ifdef HAVE_AVX512_BF16
#define ROTARY_MAX_HALF 256
/* 16 positions of one head: x[i] and x[i + half] (the pointers at i) against cos's and
 * sin's halves there, sin's first half negated (rotate_half(x) is [-b, a]). */
static inline void rotate16(const uint16_t *xr, uint16_t *yr, int64_t half, __m512 cl,
                            __m512 ch, __m512 neg_sl, __m512 sh) {
    const __m512 a = load16(xr), b = load16(xr + half);
    store16(yr, _mm512_add_ps(round16(_mm512_mul_ps(a, cl)), round16(_mm512_mul_ps(b, neg_sl))));
    store16(yr + half,
            _mm512_add_ps(round16(_mm512_mul_ps(b, ch)), round16(_mm512_mul_ps(a, sh))));
}

/* One token's heads: its cos and sin halves widened once (sin's first half negated: the
 * rotate_half sign) and reused by every head. */
static inline void rotary_token_bf16(const uint16_t *x, uint16_t *y, const uint16_t *c,
                                     const uint16_t *s, int64_t heads, int64_t half,
                                     int64_t head_stride, int64_t y_head_stride) {
    __m512 cl[ROTARY_MAX_HALF / 16], ch[ROTARY_MAX_HALF / 16], sl[ROTARY_MAX_HALF / 16],
        sh[ROTARY_MAX_HALF / 16];
    const int64_t v = half / 16;
    for (int64_t j = 0; j < v; j++) {
        cl[j] = load16(c + 16 * j);
        ch[j] = load16(c + half + 16 * j);
        sl[j] = _mm512_sub_ps(_mm512_setzero_ps(), load16(s + 16 * j));
        sh[j] = load16(s + half + 16 * j);
    }
    for (int64_t h = 0; h < heads; h++) {
        const uint16_t *xr = x + h * head_stride;
        uint16_t *yr = y + h * y_head_stride;
        for (int64_t j = 0; j < v; j++)
            rotate16(xr + 16 * j, yr + 16 * j, half, cl[j], ch[j], sl[j], sh[j]);
    }
}
#endif

/* As transformers' apply_rotary_pos_emb in bfloat16: x * cos + rotate_half(x) * sin, each
 * product and the sum rounded to bfloat16. x [heads, tokens, dim] with strides
 * (head_stride, token_stride, 1); y the same shape with strides (y_head_stride,
 * y_token_stride, 1), which may be x itself; cos, sin [tokens, dim] contiguous. */
void rotary_bf16(const uint16_t *x, uint16_t *y, const uint16_t *cos, const uint16_t *sin,
                 int64_t heads, int64_t tokens, int64_t dim, int64_t head_stride,
                 int64_t token_stride, int64_t y_head_stride, int64_t y_token_stride) {
    const int64_t half = dim / 2;
#ifdef HAVE_AVX512_BF16
    /* Tokens outermost, each token's cos and sin widened once for all its heads: 1.1-1.25x
     * the loop below over (token, head) pairs at 2048 tokens of SmolLM2's 9 heads */
    if (half % 16 == 0 && half <= ROTARY_MAX_HALF) {
#pragma omp parallel for schedule(static) if (heads * tokens * dim >= MIN_PARALLEL)
        for (int64_t t = 0; t < tokens; t++)
            rotary_token_bf16(x + t * token_stride, y + t * y_token_stride, cos + t * dim,
                              sin + t * dim, heads, half, head_stride, y_head_stride);
        return;
    }
#endif
    /* Tokens outermost: a token's cos and sin rows are read once for all its heads. */
#pragma omp parallel for collapse(2) schedule(static) if (heads * tokens * dim >= MIN_PARALLEL)
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < heads; h++) {
            const uint16_t *xr = x + h * head_stride + t * token_stride;
            uint16_t *yr = y + h * y_head_stride + t * y_token_stride;
            const uint16_t *c = cos + t * dim, *s = sin + t * dim;
            int64_t i = 0;
#ifdef HAVE_AVX512_BF16
            for (; i + 16 <= half; i += 16)
                rotate16(xr + i, yr + i, half, load16(c + i), load16(c + i + half),
                         _mm512_sub_ps(_mm512_setzero_ps(), load16(s + i)),
                         load16(s + i + half));
#endif
            for (; i < half; i++) {
                const float a = bf16_to_float(xr[i]), b = bf16_to_float(xr[i + half]);
                /* rotate_half(x) is [-b, a] */
                const float lo = bf16_to_float(float_to_bf16(a * bf16_to_float(c[i])))
                    + bf16_to_float(float_to_bf16(-b * bf16_to_float(s[i])));
                const float hi = bf16_to_float(float_to_bf16(b * bf16_to_float(c[i + half])))
                    + bf16_to_float(float_to_bf16(a * bf16_to_float(s[i + half])));
                yr[i] = float_to_bf16(lo);
                yr[i + half] = float_to_bf16(hi);
            }
        }
}

/* The same two over float32 (a model computing in float32): y = w * (x * scale), and
 * x * cos + rotate_half(x) * sin with each product and the sum rounded as eager float32
 * rounds them. No fused multiply-add: it would round the sum once instead of three times
 * (the attribute for GCC; clang contracts only within one expression). */
void rms_norm_f32(const float *x, const float *w, float *y, int64_t rows, int64_t n,
                  int64_t x_stride, int64_t y_stride, float eps) {
#pragma omp parallel for schedule(static) if (rows * n >= MIN_PARALLEL)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *yr = y + r * y_stride;
        const float scale = rms_scale(xr, n, eps, 0);
        for (int64_t i = 0; i < n; i++)
            yr[i] = w[i] * (xr[i] * scale);
    }
}

__attribute__((optimize("fp-contract=off")))
void rotary_f32(const float *x, float *y, const float *cos, const float *sin, int64_t heads,
                int64_t tokens, int64_t dim, int64_t head_stride, int64_t token_stride,
                int64_t y_head_stride, int64_t y_token_stride) {
    const int64_t half = dim / 2;
    /* Tokens outermost: a token's cos and sin rows are read once for all its heads. */
#pragma omp parallel for collapse(2) schedule(static) if (heads * tokens * dim >= MIN_PARALLEL)
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < heads; h++) {
            const float *xr = x + h * head_stride + t * token_stride;
            float *yr = y + h * y_head_stride + t * y_token_stride;
            const float *c = cos + t * dim, *s = sin + t * dim;
            for (int64_t i = 0; i < half; i++) {
                const float a = xr[i], b = xr[i + half]; /* rotate_half(x) is [-b, a] */
                const float lo_c = a * c[i], lo_s = -b * s[i];
                const float hi_c = b * c[i + half], hi_s = a * s[i + half];
                yr[i] = lo_c + lo_s;
                yr[i + half] = hi_c + hi_s;
            }
        }
}

/* out = bf16(silu[gate] * up), n elements, as eager `act_fn(gate) * up` in bfloat16: silu is
 * a 65536-entry table, the activation of every bfloat16 value (widened to float32) as torch
 * computed and rounded it, so the activation has torch's bits by construction; the product
 * of two bfloat16 values is exact in float32, so rounding it once to nearest even gives
 * torch's product. One pass instead of two, and no exp per element. out may be gate.
 * silu_mul_span does elements [lo, hi); the two entry points split the work. */
static inline void silu_mul_span(const uint16_t *gate, const uint16_t *up, uint16_t *out,
                                 const float *silu, int64_t lo, int64_t hi) {
    int64_t i = lo;
#ifdef HAVE_AVX512_BF16
    for (; i + 16 <= hi; i += 16) {
        const __m512i idx = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(gate + i)));
        store16_exact(out + i,
                      _mm512_mul_ps(_mm512_i32gather_ps(idx, silu, 4), load16(up + i)));
    }
#endif
    for (; i < hi; i++)
        out[i] = float_to_bf16(silu[gate[i]] * bf16_to_float(up[i]));
}

void silu_mul_bf16(const uint16_t *gate, const uint16_t *up, uint16_t *out, const float *silu,
                   int64_t n) {
    const int64_t blocks = (n + 1023) / 1024;
#pragma omp parallel for schedule(static) if (n >= MIN_PARALLEL)
    for (int64_t b = 0; b < blocks; b++)
        silu_mul_span(gate, up, out, silu, b * 1024, b * 1024 + 1024 < n ? b * 1024 + 1024 : n);
}

/* The same over a stacked [gate | up] product: row r's gate is gu[r * stride ...] and its
 * up the `cols` values after it; out is [rows, cols]. */
void silu_mul_rows_bf16(const uint16_t *gu, uint16_t *out, const float *silu, int64_t rows,
                        int64_t cols, int64_t stride) {
#pragma omp parallel for schedule(static) if (rows * cols >= MIN_PARALLEL)
    for (int64_t r = 0; r < rows; r++)
        silu_mul_span(gu + r * stride, gu + r * stride + cols, out + r * cols, silu, 0, cols);
}

/* out = silu(gate) * up over float32, n elements: silu(g) = g / (1 + e^-g) for g >= 0 and
 * g e^g / (1 + e^g) below (e^x only for x <= 0: exp8_le0, within 2^-22 relative), then
 * the product, each step rounded to float32. Within a few units of the last place of
 * torch's float32 `act_fn(gate) * up` (Sleef's exponential), not its bits: the float32 MLP
 * takes this loop in every path (the model's own forward, the layer loop, the C step
 * layers) so that they agree. Every element takes the 8-lane loop (a tail through a padded
 * copy), so its bits do not depend on where it lies. out may be gate. */
#if defined(__AVX2__) && defined(__FMA__)
int silu_f32_vectorized(void) { return 1; }

static inline __m256 silu_mul8(__m256 g, __m256 u) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    const __m256 e = exp8_le0(_mm256_or_ps(g, sign)); /* e^-|g| */
    const __m256 d = _mm256_add_ps(_mm256_set1_ps(1.f), e);
    const __m256 neg = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 num = _mm256_blendv_ps(g, _mm256_mul_ps(g, e), neg);
    return _mm256_mul_ps(_mm256_div_ps(num, d), u);
}

static inline void silu_mul_span_f32(const float *gate, const float *up, float *out,
                                     int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, silu_mul8(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i)));
    if (i < n) {
        float g[8] = {0.f}, u[8] = {0.f}, o[8];
        memcpy(g, gate + i, sizeof(float) * (size_t)(n - i));
        memcpy(u, up + i, sizeof(float) * (size_t)(n - i));
        _mm256_storeu_ps(o, silu_mul8(_mm256_loadu_ps(g), _mm256_loadu_ps(u)));
        memcpy(out + i, o, sizeof(float) * (size_t)(n - i));
    }
}

void silu_mul_f32(const float *gate, const float *up, float *out, int64_t n) {
    const int64_t blocks = (n + 1023) / 1024;
#pragma omp parallel for schedule(static) if (n >= MIN_PARALLEL)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t lo = b * 1024, hi = lo + 1024 < n ? lo + 1024 : n;
        silu_mul_span_f32(gate + lo, up + lo, out + lo, hi - lo);
    }
}

/* The same over a stacked [gate | up] product (rows as silu_mul_rows_bf16); `unused`
 * keeps the bfloat16 entry's signature (its table), for step_layers.c. */
void silu_mul_rows_f32(const float *gu, float *out, const float *unused, int64_t rows,
                       int64_t cols, int64_t stride) {
    (void)unused;
#pragma omp parallel for schedule(static) if (rows * cols >= MIN_PARALLEL)
    for (int64_t r = 0; r < rows; r++)
        silu_mul_span_f32(gu + r * stride, gu + r * stride + cols, out + r * cols, cols);
}
#else
/* Without AVX2 and FMA float32 MLPs keep torch's SiLU (fused_layers.py asks). */
int silu_f32_vectorized(void) { return 0; }

void silu_mul_f32(const float *gate, const float *up, float *out, int64_t n) {
    (void)gate, (void)up, (void)out, (void)n;
}

void silu_mul_rows_f32(const float *gu, float *out, const float *unused, int64_t rows,
                       int64_t cols, int64_t stride) {
    (void)gu, (void)out, (void)unused, (void)rows, (void)cols, (void)stride;
}
#endif
