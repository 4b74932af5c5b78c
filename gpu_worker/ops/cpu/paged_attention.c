/* Paged decode attention on the CPU: one query token per sequence over its cached context,
 * reading K/V blocks where they lie in the paged cache (no dense gather copy).
 *
 * Built by gpu_worker/ops/cpu/paged_attention.py with the system C compiler, called through ctypes.
 * Work item = one query (a decoding sequence, or one token of a prefill, paged_attention.py).
 * Every item runs the same loop whatever the batch holds, so a query's output does not
 * depend on what it is batched with.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* dot of two [d] fp32 rows */
static inline float row_dot(const float *__restrict__ a, const float *__restrict__ b, int d) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < d; i++) s += a[i] * b[i];
    return s;
}

/* acc[d] += p * v[d] */
static inline void row_axpy(float *__restrict__ acc, const float *__restrict__ v, float p, int d) {
#pragma omp simd
    for (int i = 0; i < d; i++) acc[i] += p * v[i];
}

/* Asks for one token's K or V row of every KV head ([Hk, D] fp32, contiguous) before it is read. */
static inline void prefetch_row(const float *row, long floats) {
    for (long i = 0; i < floats; i += 16) __builtin_prefetch(row + i, 0, 3);
}

/* Where token t's row of every KV head starts in a cache [num_blocks, bs, Hk, D]. */
static inline const float *token_row(const float *cache, const int32_t *table, int t, int block_size,
                                     long row_stride) {
    return cache + ((long)table[t / block_size] * block_size + t % block_size) * row_stride;
}

#if defined(__AVX2__) && defined(__GLIBC__)
#define LIBMVEC 1
#include <immintrin.h>
/* glibc's libmvec expf, 8 at a time (the AVX2 variant, named by the x86-64 vector function ABI) */
__m256 _ZGVdN8v_expf(__m256 x);
#endif

/* w[t] = exp(w[t] - max) for t < n, and their sum. On AVX2 with glibc the first n - n % 8 go through
 * libmvec's vector expf into 8 partial sums (t mod 8) added in a fixed order, the rest through libm's
 * expf: one libm call a weight was a sixth of a prefill chunk's attention (docs/performance.md).
 * Which t takes which path depends only on n, so a query's weights are the same bits in any batch. */
static inline float exp_and_sum(float *__restrict__ w, int n, float max) {
    float sum = 0.f;
    int t = 0;
#ifdef LIBMVEC
    __m256 part = _mm256_setzero_ps();
    for (; t + 8 <= n; t += 8) {
        const __m256 e = _ZGVdN8v_expf(_mm256_sub_ps(_mm256_loadu_ps(w + t), _mm256_set1_ps(max)));
        _mm256_storeu_ps(w + t, e);
        part = _mm256_add_ps(part, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, part);
    for (int i = 0; i < 8; i++) sum += lanes[i];
#endif
    for (; t < n; t++) {
        w[t] = expf(w[t] - max);
        sum += w[t];
    }
    return sum;
}

#define PREFETCH_TOKENS 4 /* rows asked for ahead of the one in hand */

/* One query (all heads) over its context: scores, softmax, weighted sum of V. K and V are each
 * walked once, token by token, every head of the token at once, so the cache lines of a block
 * are read in order (a block's rows of all KV heads are contiguous) and a few tokens ahead are
 * prefetched across blocks and pages. Per head the arithmetic is a dot product per token in
 * context order, the max and the exponentials in that order, then the weighted rows of V
 * accumulated in that order: the same for every query whatever the batch holds. */
static inline __attribute__((always_inline)) void attend_seq_d(
    const float *__restrict__ q,       /* [Hq, D] */
    const float *__restrict__ k_cache,  /* [num_blocks, bs, Hk, D] */
    const float *__restrict__ v_cache,  /* [num_blocks, bs, Hk, D] */
    const int32_t *__restrict__ table,  /* [max_blocks] this sequence's blocks */
    int context_len, int num_heads, int num_kv_heads, const int head_dim, int block_size, float scale,
    float *__restrict__ scores, /* [Hq, context_len] scratch */
    float *__restrict__ acc,    /* [Hq, D] scratch */
    float *__restrict__ out /* [Hq, D] */) {
    const int group = num_heads / num_kv_heads;
    const long row_stride = (long)num_kv_heads * head_dim;
    float max_score[num_heads], sum[num_heads];
    /* scores[j, t] = q_j . k_t * scale, and their max per head */
    for (int j = 0; j < num_heads; j++) max_score[j] = -INFINITY;
    for (int t = 0; t < context_len; t++) {
        if (t + PREFETCH_TOKENS < context_len)
            prefetch_row(token_row(k_cache, table, t + PREFETCH_TOKENS, block_size, row_stride), row_stride);
        const float *k = token_row(k_cache, table, t, block_size, row_stride);
        for (int j = 0; j < num_heads; j++) {
            const float s = row_dot(q + (long)j * head_dim, k + (long)(j / group) * head_dim, head_dim) * scale;
            scores[(long)j * context_len + t] = s;
            if (s > max_score[j]) max_score[j] = s;
        }
    }
    /* softmax weights (unnormalised) and their sum, per head */
    for (int j = 0; j < num_heads; j++) sum[j] = exp_and_sum(scores + (long)j * context_len, context_len, max_score[j]);
    /* out_j = sum_t w[j, t] * v_t / sum_j */
    for (long i = 0; i < (long)num_heads * head_dim; i++) acc[i] = 0.f;
    for (int t = 0; t < context_len; t++) {
        if (t + PREFETCH_TOKENS < context_len)
            prefetch_row(token_row(v_cache, table, t + PREFETCH_TOKENS, block_size, row_stride), row_stride);
        const float *v = token_row(v_cache, table, t, block_size, row_stride);
        for (int j = 0; j < num_heads; j++)
            row_axpy(acc + (long)j * head_dim, v + (long)(j / group) * head_dim, scores[(long)j * context_len + t],
                     head_dim);
    }
    for (int j = 0; j < num_heads; j++) {
        const float inv = 1.f / sum[j];
        for (int i = 0; i < head_dim; i++) out[(long)j * head_dim + i] = acc[(long)j * head_dim + i] * inv;
    }
}

/* The usual head size gets its own copy of the loop, with head_dim a constant. */
static void attend_seq(const float *q, const float *k_cache, const float *v_cache, const int32_t *table,
                       int context_len, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                       float *scores, float *acc, float *out) {
    if (head_dim == 64)
        attend_seq_d(q, k_cache, v_cache, table, context_len, num_heads, num_kv_heads, 64, block_size, scale, scores,
                     acc, out);
    else
        attend_seq_d(q, k_cache, v_cache, table, context_len, num_heads, num_kv_heads, head_dim, block_size, scale,
                     scores, acc, out);
}

/* Returns 0, or -1 when a scratch buffer cannot be allocated. */
int paged_decode_attention_f32(const float *__restrict__ q,            /* [B, Hq, D] */
                               const float *__restrict__ k_cache,      /* [num_blocks, bs, Hk, D] */
                               const float *__restrict__ v_cache,      /* [num_blocks, bs, Hk, D] */
                               const int32_t *__restrict__ block_tables, /* [B, max_blocks] */
                               const int32_t *__restrict__ context_lens, /* [B] */
                               float *__restrict__ out,                /* [B, Hq, D] */
                               int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                               int max_blocks, float scale, int num_threads) {
    int max_len = 0;
    for (int b = 0; b < num_seqs; b++)
        if (context_lens[b] > max_len) max_len = context_lens[b];
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        /* scratch: scores [Hq, max_len], then acc [Hq, D] */
        float *scores = malloc(sizeof(float) * (size_t)num_heads * ((max_len > 0 ? max_len : 1) + head_dim));
        /* every thread reaches the worksharing loop, even one whose scratch failed */
#pragma omp for schedule(dynamic, 1) /* a preempted thread's sequences go to the other threads */
        for (int b = 0; b < num_seqs; b++) {
            if (!scores) {
                failed = 1;
                continue;
            }
            const long head0 = (long)b * num_heads * head_dim;
            attend_seq(q + head0, k_cache, v_cache, block_tables + (long)b * max_blocks, context_lens[b], num_heads,
                       num_kv_heads, head_dim, block_size, scale, scores, scores + (long)num_heads * max_len,
                       out + head0);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
