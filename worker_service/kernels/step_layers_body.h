/* The body of step_layers.c, for one element type: included there once per type with
 * ELEM (the hidden states', KV's and biases' element: uint16_t for bfloat16, or float) and
 * FN(name) (the name with the type's suffix) defined, and FN(add_into) written for the
 * type. The products' weights are packed bfloat16 in either. */
/* The kernels, as the other libraries define them. */
typedef void (*FN(rms_norm_fn))(const ELEM *x, const ELEM *w, ELEM *y, int64_t rows, int64_t n,
                                int64_t x_stride, int64_t y_stride, float eps);
typedef int (*FN(linear_fn))(const ELEM *x, const uint16_t *p, const ELEM *bias, ELEM *y,
                             int64_t rows, int64_t n, int64_t k, int64_t xs);
typedef void (*FN(rotary_fn))(const ELEM *x, ELEM *y, const ELEM *cos, const ELEM *sin,
                              int64_t heads, int64_t tokens, int64_t dim, int64_t head_stride,
                              int64_t token_stride, int64_t y_head_stride,
                              int64_t y_token_stride);
typedef int (*FN(linear_silu_fn))(const ELEM *x, const uint16_t *p, const ELEM *bias, ELEM *out,
                                  int64_t rows, int64_t inter, int64_t k, int64_t xs,
                                  const float *silu);
typedef int (*FN(linear_add_fn))(const ELEM *x, const uint16_t *p, const ELEM *bias, ELEM *y,
                                 int64_t rows, int64_t n, int64_t k, int64_t xs);
typedef void (*FN(silu_rows_fn))(const ELEM *gu, ELEM *out, const float *silu, int64_t rows,
                                 int64_t cols, int64_t stride);
typedef int (*FN(prompt_fn))(const ELEM *q, const ELEM *k, const ELEM *v, ELEM *out,
                             int64_t start, int64_t tokens, int64_t heads, int64_t kv_heads,
                             int64_t dim, int64_t head_stride, float scale, int64_t window);
typedef int (*FN(decode_fn))(const ELEM *q, ELEM *k, ELEM *v, ELEM *out, const int64_t *lengths,
                             int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim,
                             int64_t row_stride, int64_t head_stride, float scale,
                             int64_t window, int64_t max_len, const ELEM *new_k,
                             const ELEM *new_v, int64_t new_row_stride,
                             int64_t new_head_stride);

/* Mirrored by ctypes Structures in step_layers.py: keep the field order. */
struct FN(kernels) {
    FN(rms_norm_fn) rms_norm;
    FN(linear_fn) linear;
    FN(rotary_fn) rotary;
    FN(silu_rows_fn) silu_rows;
    FN(decode_fn) decode;
    FN(prompt_fn) prompt;       /* the one-query prompt loop */
    FN(prompt_fn) prompt_tiled; /* the tiled one (NULL: not built); -1 where it does not apply */
    int64_t tiled_min_tokens;
    const float *silu; /* fused_layers.silu_table() */
    /* the gate/up product and the SiLU in one pass, from 32 rows on (-1 where it does not
     * apply); NULL: not built */
    FN(linear_silu_fn) linear_silu;
    /* a product added into its output (the residual adds) in one pass; -1 where it does
     * not apply; NULL: not built */
    FN(linear_add_fn) linear_add;
};

struct FN(layer) {
    const ELEM *input_norm, *post_norm; /* [hidden] */
    float input_eps, post_eps;
    /* each product's packed bfloat16 weight (the product's own layout), and its bias
     * (NULL: none) */
    const uint16_t *qkv;     /* [q | k | v], [hidden] -> [(heads + 2 kv_heads) dim] */
    const ELEM *qkv_bias;
    const uint16_t *o;       /* [heads * dim] -> [hidden] */
    const ELEM *o_bias;
    const uint16_t *gate_up; /* [gate | up], [hidden] -> [2 * inter] */
    const ELEM *gate_up_bias;
    const uint16_t *down;    /* [inter] -> [hidden] */
    const ELEM *down_bias;
    float scaling;
    int64_t window; /* 0: full causal */
};

struct FN(shape) {
    int64_t hidden, heads, kv_heads, dim, inter;
};

/* A decoding segment (kind 0: rows of one KV group, one token each, row i attending below
 * ends[i], at most max_end) or a prompt (kind 1: `rows` tokens of one row at slots start,
 * start + 1, ..., causal over the row's slots): its tokens [token_start, token_start +
 * rows) and its group's strides. */
struct FN(segment) {
    int64_t kind, token_start, rows, max_end, start, row_stride, head_stride;
    const int64_t *ends;
};

/* Work space for `tokens` tokens, allocated by the caller. */
struct FN(scratch) {
    ELEM *normed;  /* [tokens, hidden] */
    ELEM *qkv;     /* [tokens, (heads + 2 kv_heads) dim], keys rotated in place */
    ELEM *q_rows;  /* [tokens, heads, dim], rotated */
    ELEM *attn;    /* [tokens, heads * dim] */
    ELEM *product; /* [tokens, hidden] */
    ELEM *gate_up; /* [tokens, 2 inter] */
    ELEM *act;     /* [tokens, inter] */
};

/* h [rows, n] = h + x p, rounded to ELEM: one pass where the kernels have one, else the
 * product into `product` and add_into (the same bits). */
static int FN(product_add)(const struct FN(kernels) *kn, const ELEM *x, const uint16_t *p,
                           const ELEM *bias, ELEM *h, ELEM *product, int64_t rows, int64_t n,
                           int64_t k) {
    if (kn->linear_add && kn->linear_add(x, p, bias, h, rows, n, k, k) == 0)
        return 0;
    const int status = kn->linear(x, p, bias, product, rows, n, k, k);
    if (!status)
        FN(add_into)(h, product, rows * n);
    return status;
}

/* A prompt's new keys and values (in the q/k/v product's rows from its token_start: keys
 * from column qc, values kc after them, kv_heads x dim each) into its row's slots start..
 * of k, v (the row's buffers). */
static void FN(write_prompt_kv)(const struct FN(segment) *S, const ELEM *qkv, int64_t width,
                                int64_t qc, int64_t kc, int64_t kvh, int64_t dim, ELEM *k,
                                ELEM *v) {
    const size_t bytes = (size_t)dim * sizeof(ELEM);
    for (int64_t h = 0; h < kvh; h++)
        for (int64_t t = 0; t < S->rows; t++) {
            const ELEM *from = qkv + (S->token_start + t) * width + qc + h * dim;
            const int64_t to = h * S->head_stride + (S->start + t) * dim;
            memcpy(k + to, from, bytes);
            memcpy(v + to, from + kc, bytes);
        }
}

/* Prompt attention of tokens [t, t + n) of prompt segment S (token t at slot S->start + t
 * - S->token_start) into s->attn: the tiled loop, or the one-query loop where the tiled one
 * does not take the shape. Either gives each query the bits it has in any piece of its
 * prompt (prompt_attention.c), so a piece of a segment is attended as in the whole. */
static int FN(attend_prompt)(const struct FN(kernels) *kn, const struct FN(layer) *L,
                             const struct FN(segment) *S, const struct FN(scratch) *s,
                             const ELEM *k, const ELEM *v, int64_t qc, int64_t kvh, int64_t dim,
                             int64_t t, int64_t n) {
    const int64_t heads = qc / dim, start = S->start + t - S->token_start;
    int status = -1;
    if (S->rows >= kn->tiled_min_tokens && kn->prompt_tiled)
        status = kn->prompt_tiled(s->q_rows + t * qc, k, v, s->attn + t * qc, start, n, heads,
                                  kvh, dim, S->head_stride, L->scaling, L->window);
    if (status == -1)
        status = kn->prompt(s->q_rows + t * qc, k, v, s->attn + t * qc, start, n, heads, kvh,
                            dim, S->head_stride, L->scaling, L->window);
    return status;
}

/* hidden [tokens, hidden] (ELEM, updated in place) through `count` decoder layers:
 * cos, sin [tokens, dim]; k_ptrs / v_ptrs [count][segments] each segment's KV buffer of
 * that layer from its (first) row on. keep (NULL: every row) lists, ascending, the nkeep
 * rows whose last-layer states the caller reads: those end in hidden's first nkeep rows (in
 * that order, with the bits they have when every row runs), the others' last layer is left
 * out but for its keys and values. Where `pause` is given and non-zero at the start of a
 * layer after the first, the call stops there: `*done` (where given) says how many layers
 * ran, and a later call over the rest (layers, k_ptrs and v_ptrs advanced by that many)
 * goes on with the same bits; the state between layers is all in hidden. Returns 0, or
 * the first kernel's non-zero status. */
int FN(step_layers)(const struct FN(kernels) *kn, const struct FN(shape) *sh,
                    const struct FN(layer) *layers, int64_t count, ELEM *hidden,
                    int64_t tokens, const ELEM *cos, const ELEM *sin,
                    const struct FN(segment) *segments, int64_t nseg, ELEM *const *k_ptrs,
                    ELEM *const *v_ptrs, const struct FN(scratch) *s, const int64_t *keep,
                    int64_t nkeep, const volatile int32_t *pause, int64_t *done) {
    const int64_t H = sh->hidden, heads = sh->heads, kvh = sh->kv_heads, dim = sh->dim;
    const int64_t qc = heads * dim, kc = kvh * dim, width = qc + 2 * kc, inter = sh->inter;
    if (done)
        *done = count;
    for (int64_t l = 0; l < count; l++) {
        if (l && pause && *pause) {
            if (done)
                *done = l;
            return 0;
        }
        const struct FN(layer) *L = &layers[l];
        int status;
        kn->rms_norm(hidden, L->input_norm, s->normed, tokens, H, H, H, L->input_eps);
        if ((status = kn->linear(s->normed, L->qkv, L->qkv_bias, s->qkv, tokens, width, H, H)))
            return status;
        /* query and key heads with strides (dim, width) in the product: the queries
         * rotated into q_rows [tokens, heads, dim], the keys in place */
        kn->rotary(s->qkv, s->q_rows, cos, sin, heads, tokens, dim, dim, width, dim, qc);
        kn->rotary(s->qkv + qc, s->qkv + qc, cos, sin, kvh, tokens, dim, dim, width, dim, width);
        /* every prompt's keys and values first, as the per-layer path writes them */
        for (int64_t g = 0; g < nseg; g++)
            if (segments[g].kind == 1)
                FN(write_prompt_kv)(&segments[g], s->qkv, width, qc, kc, kvh, dim,
                                k_ptrs[l * nseg + g], v_ptrs[l * nseg + g]);
        /* the last layer's states are read only at the kept rows: a prompt's other
         * tokens need this layer's keys and values (written above), not its attention,
         * output product or MLP */
        const int pruned = l == count - 1 && keep && nkeep < tokens;
        for (int64_t g = 0; g < nseg; g++) {
            const struct FN(segment) *S = &segments[g];
            const int64_t a = S->token_start;
            ELEM *k = k_ptrs[l * nseg + g], *v = v_ptrs[l * nseg + g];
            if (S->kind == 0) {
                status = kn->decode(s->q_rows + a * qc, k, v, s->attn + a * qc, S->ends,
                                    S->rows, heads, kvh, dim, S->row_stride, S->head_stride,
                                    L->scaling, L->window, S->max_end, s->qkv + a * width + qc,
                                    s->qkv + a * width + qc + kc, width, dim);
            } else if (!pruned) {
                status = FN(attend_prompt)(kn, L, S, s, k, v, qc, kvh, dim, a, S->rows);
            } else { /* each run of kept tokens inside the prompt */
                status = 0;
                for (int64_t i = 0; i < nkeep && !status; i++) {
                    if (keep[i] < a || keep[i] >= a + S->rows)
                        continue;
                    int64_t run = 1;
                    while (i + run < nkeep && keep[i + run] == keep[i] + run
                           && keep[i + run] < a + S->rows)
                        run++;
                    status = FN(attend_prompt)(kn, L, S, s, k, v, qc, kvh, dim, keep[i], run);
                    i += run - 1;
                }
            }
            if (status)
                return status;
        }
        if (pruned) { /* the kept rows moved to the front, in order (keep[i] >= i) */
            for (int64_t i = 0; i < nkeep; i++)
                if (keep[i] != i) {
                    memcpy(hidden + i * H, hidden + keep[i] * H, (size_t)H * sizeof(ELEM));
                    memcpy(s->attn + i * qc, s->attn + keep[i] * qc, (size_t)qc * sizeof(ELEM));
                }
            tokens = nkeep;
            if (!tokens)
                return 0;
        }
        if ((status = FN(product_add)(kn, s->attn, L->o, L->o_bias, hidden, s->product, tokens, H,
                                  qc)))
            return status;
        kn->rms_norm(hidden, L->post_norm, s->normed, tokens, H, H, H, L->post_eps);
        /* the one-pass call takes every row, or on the tiles those up to the last
         * multiple of 32; the rest take the product and the SiLU apart (the same bits) */
        int64_t done = 0;
        if (kn->linear_silu) {
            if (!kn->linear_silu(s->normed, L->gate_up, L->gate_up_bias, s->act, tokens,
                                 inter, H, H, kn->silu))
                done = tokens;
            else if (tokens / 32 && tokens % 32
                     && !kn->linear_silu(s->normed, L->gate_up, L->gate_up_bias, s->act,
                                         tokens / 32 * 32, inter, H, H, kn->silu))
                done = tokens / 32 * 32;
        }
        if (done < tokens) {
            if ((status = kn->linear(s->normed + done * H, L->gate_up, L->gate_up_bias,
                                     s->gate_up, tokens - done, 2 * inter, H, H)))
                return status;
            kn->silu_rows(s->gate_up, s->act + done * inter, kn->silu, tokens - done, inter,
                          2 * inter);
        }
        if ((status = FN(product_add)(kn, s->act, L->down, L->down_bias, hidden, s->product, tokens,
                                  H, inter)))
            return status;
    }
    return 0;
}
