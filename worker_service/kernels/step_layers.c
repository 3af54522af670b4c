/* A Llama-family step's decoder layers in one call: bfloat16 (step_layers_bf16), or
 * float32 over packed bfloat16 weights on CPUs without native bfloat16 (step_layers_f32,
 * bf16_weights.c's products).
 *
 * Built and loaded at run time by step_layers.py (plain C, no torch headers). The
 * worker's layer loop (layer_loop.py) already runs every layer's arithmetic in C (the
 * norms and rotary embedding of fused_layers.c, the products of dpbf16_linear.c or
 * bf16_weights.c, the attention of native_attention.c and prompt_attention.c) but reaches
 * each through Python: about 6 ms of a 30-layer SmolLM2 step of one row, whose weights
 * take about 10 ms to stream. This
 * file calls the same compiled functions, passed in as pointers from the libraries the
 * layer loop loads, with the same arguments in the same order, so the hidden states keep
 * their bits; the glue between them (the two residual adds, the prompts' KV writes, and
 * copies that only move values) is here. Where the products run on AMX tiles, the gate/up
 * product takes the SiLU gate product into its pass, and the output and down products
 * their residual adds (the same bits): at 2048 prompt tokens the intermediate products
 * are megabytes, and writing them out and reading them back cost more than the arithmetic
 * that joins them. Where the caller reads the last layer's states only at some rows (the
 * tokens it samples), the other rows' last layer stops after its keys and values, as
 * llama.cpp's graphs do: a prompt token's output is never read, only its KV.
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* h = bfloat16(h + d), as torch adds two bfloat16 tensors (in float32, rounded to nearest
 * even). */
static void add_into_bf16(uint16_t *h, const uint16_t *d, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= 65536)
    for (int64_t b = 0; b < (n + 1023) / 1024; b++) {
        const int64_t hi = b * 1024 + 1024 < n ? b * 1024 + 1024 : n;
        int64_t i = b * 1024;
#ifdef HAVE_AVX512_BF16
        for (; i + 16 <= hi; i += 16)
            store16_exact(h + i, _mm512_add_ps(load16(h + i), load16(d + i)));
#endif
        for (; i < hi; i++)
            h[i] = float_to_bf16(bf16_to_float(h[i]) + bf16_to_float(d[i]));
    }
}

/* h = h + d over float32, as torch adds two float32 tensors. */
static void add_into_f32(float *h, const float *d, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= 65536)
    for (int64_t b = 0; b < (n + 1023) / 1024; b++) {
        const int64_t hi = b * 1024 + 1024 < n ? b * 1024 + 1024 : n;
        for (int64_t i = b * 1024; i < hi; i++)
            h[i] += d[i];
    }
}

#define ELEM uint16_t
#define FN(name) name##_bf16
#include "step_layers_body.h"
#undef ELEM
#undef FN

#define ELEM float
#define FN(name) name##_f32
#include "step_layers_body.h"
#undef ELEM
#undef FN
