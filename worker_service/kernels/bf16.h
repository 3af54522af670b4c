/* bfloat16 <-> float32 for the worker's C files (bfloat16 held as uint16_t), and the
 * vector helpers they share. */
#ifndef SEQSERVE_BF16_H
#define SEQSERVE_BF16_H

#include <math.h>
#include <stdint.h>
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

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* The sum of v's 8 lanes. */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The largest of v's 8 lanes, compared one at a time (a NaN lane is passed over; -inf
 * where every lane is -inf or NaN). */
static inline float hmax8(__m256 v) {
    float lanes[8];
    _mm256_storeu_ps(lanes, v);
    float top = -INFINITY;
    for (int i = 0; i < 8; i++)
        top = lanes[i] > top ? lanes[i] : top;
    return top;
}

/* exp(x) for x <= 0, 8 lanes, as exp_le0 below: x = n ln2 + r, degree-6 Taylor
 * polynomial of exp(r), times 2^n built in the exponent bits; below -87 gives 0. */
static inline __m256 exp8_le0(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 p = _mm256_set1_ps(1.f / 720.f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    /* n >= -126 after the clamp: 2^n is a normal float */
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#endif

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 bfloat16 widened to float32 (exact: a shift). */
static inline __m512 load16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define HAVE_AVX512_BF16 1

/* 16 float32 to bfloat16 rounding subnormals as torch does (the conversion instruction
 * flushes them to zero) and every NaN to float_to_bf16's quiet NaN: float_to_bf16 on 16
 * lanes. store16_exact stores them. */
static inline __m256i round16_exact(__m512 v) {
    const __m512i b = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(b, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

static inline void store16_exact(uint16_t *p, __m512 v) {
    _mm256_storeu_si256((__m256i *)p, round16_exact(v));
}

/* exp(x) for x <= 0 (scores minus their maximum), 16 lanes: x = n ln2 + r, |r| <= ln2 / 2,
 * exp(r) by its degree-6 Taylor polynomial (relative error below 2e-7, about one float32
 * ulp), times 2^n. Lanes below -87 give 0, as expf underflows there. */
static inline __m512 exp_le0(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.0f);
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_max_ps(x, lo);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x); /* ln2, high part */
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);      /* ln2, low part */
    __m512 p = _mm512_set1_ps(1.f / 720.f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_maskz_scalef_ps(~tiny, p, n);
}
#endif

#endif
