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
#ifdef __AVX2__
#include <immintrin.h>
#endif

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

#define PREFETCH_TOKENS 4 /* rows asked for ahead of the one in hand */

/* Token t's row in a walk of the context in token order, asking for the row PREFETCH_TOKENS ahead
 * (across blocks and pages, where the hardware prefetcher does not follow). */
static inline const float *walk_row(const float *cache, const int32_t *table, int t, int context_len, int block_size,
                                    long row_stride) {
    if (t + PREFETCH_TOKENS < context_len)
        prefetch_row(token_row(cache, table, t + PREFETCH_TOKENS, block_size, row_stride), row_stride);
    return token_row(cache, table, t, block_size, row_stride);
}

#if defined(__AVX2__) && defined(__GLIBC__)
#define LIBMVEC 1
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

/* The vector score path reproduces row_dot's bits where the compiler reduces it in 8 lanes (AVX2;
 * with AVX-512 enabled it takes 16, so that build keeps row_dot): the same scores as before it. */
#if defined(__AVX2__) && !defined(__AVX512F__)
#define SCORE_VECTORS 1
#endif

#ifdef __AVX2__
#define VALUE_TOKENS 4 /* tokens whose weighted V rows pass through one load and store of acc */
#endif

#ifdef SCORE_VECTORS
#define SCORE_TOKENS 8 /* tokens whose dot products are summed across lanes together */

/* the 8 lanes of dot(q, k) over d (a multiple of 8): lane i sums q[i + 8c] * k[i + 8c] over c, in order */
static inline __m256 dot_lanes(const float *__restrict__ q, const float *__restrict__ k, int d) {
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), acc);
    return acc;
}

/* [sum of v[0]'s lanes, ..., sum of v[7]'s]: a transpose, then each sum from 0 in lane order, as
 * row_dot's vectorised reduction adds its lanes (so a score is the same bits either way) */
static inline __m256 sum_lanes8(const __m256 v[8]) {
    const __m256 a0 = _mm256_unpacklo_ps(v[0], v[1]), a1 = _mm256_unpackhi_ps(v[0], v[1]);
    const __m256 a2 = _mm256_unpacklo_ps(v[2], v[3]), a3 = _mm256_unpackhi_ps(v[2], v[3]);
    const __m256 a4 = _mm256_unpacklo_ps(v[4], v[5]), a5 = _mm256_unpackhi_ps(v[4], v[5]);
    const __m256 a6 = _mm256_unpacklo_ps(v[6], v[7]), a7 = _mm256_unpackhi_ps(v[6], v[7]);
    const __m256 b0 = _mm256_shuffle_ps(a0, a2, 0x44), b1 = _mm256_shuffle_ps(a0, a2, 0xEE);
    const __m256 b2 = _mm256_shuffle_ps(a1, a3, 0x44), b3 = _mm256_shuffle_ps(a1, a3, 0xEE);
    const __m256 b4 = _mm256_shuffle_ps(a4, a6, 0x44), b5 = _mm256_shuffle_ps(a4, a6, 0xEE);
    const __m256 b6 = _mm256_shuffle_ps(a5, a7, 0x44), b7 = _mm256_shuffle_ps(a5, a7, 0xEE);
    /* lane l of vector i, as column i of row l: row l is lane l of every v */
    const __m256 l0 = _mm256_permute2f128_ps(b0, b4, 0x20), l4 = _mm256_permute2f128_ps(b0, b4, 0x31);
    const __m256 l1 = _mm256_permute2f128_ps(b1, b5, 0x20), l5 = _mm256_permute2f128_ps(b1, b5, 0x31);
    const __m256 l2 = _mm256_permute2f128_ps(b2, b6, 0x20), l6 = _mm256_permute2f128_ps(b2, b6, 0x31);
    const __m256 l3 = _mm256_permute2f128_ps(b3, b7, 0x20), l7 = _mm256_permute2f128_ps(b3, b7, 0x31);
    const __m256 lanes[8] = {l0, l1, l2, l3, l4, l5, l6, l7};
    __m256 sum = _mm256_setzero_ps();
    for (int l = 0; l < 8; l++) sum = _mm256_add_ps(sum, lanes[l]);
    return sum;
}
#endif

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
    int t = 0;
#ifdef SCORE_VECTORS
    /* SCORE_TOKENS tokens at a time, their lane sums in one transpose (which tokens go this way
     * depends only on context_len, so a query's scores are the same bits in any batch) */
    if (head_dim % 8 == 0 && context_len >= SCORE_TOKENS) {
        __m256 max8[num_heads];
        for (int j = 0; j < num_heads; j++) max8[j] = _mm256_set1_ps(-INFINITY);
        for (; t + SCORE_TOKENS <= context_len; t += SCORE_TOKENS) {
            const float *k[SCORE_TOKENS];
            for (int u = 0; u < SCORE_TOKENS; u++)
                k[u] = walk_row(k_cache, table, t + u, context_len, block_size, row_stride);
            for (int j = 0; j < num_heads; j++) {
                const float *qj = q + (long)j * head_dim;
                const long at = (long)(j / group) * head_dim;
                __m256 lanes[SCORE_TOKENS];
                for (int u = 0; u < SCORE_TOKENS; u++) lanes[u] = dot_lanes(qj, k[u] + at, head_dim);
                const __m256 s = _mm256_mul_ps(sum_lanes8(lanes), _mm256_set1_ps(scale));
                _mm256_storeu_ps(scores + (long)j * context_len + t, s);
                max8[j] = _mm256_max_ps(max8[j], s);
            }
        }
        for (int j = 0; j < num_heads; j++) {
            float lanes[8];
            _mm256_storeu_ps(lanes, max8[j]);
            for (int i = 0; i < 8; i++)
                if (lanes[i] > max_score[j]) max_score[j] = lanes[i];
        }
    }
#endif
    for (; t < context_len; t++) {
        const float *k = walk_row(k_cache, table, t, context_len, block_size, row_stride);
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
    t = 0;
#ifdef __AVX2__
    /* VALUE_TOKENS rows at a time into acc held in registers, each row's fma in token order */
    if (head_dim % 8 == 0) {
        for (; t + VALUE_TOKENS <= context_len; t += VALUE_TOKENS) {
            const float *v[VALUE_TOKENS];
            for (int u = 0; u < VALUE_TOKENS; u++)
                v[u] = walk_row(v_cache, table, t + u, context_len, block_size, row_stride);
            for (int j = 0; j < num_heads; j++) {
                const float *w = scores + (long)j * context_len + t;
                const long at = (long)(j / group) * head_dim;
                float *a = acc + (long)j * head_dim;
                for (int i = 0; i < head_dim; i += 8) {
                    __m256 sum = _mm256_loadu_ps(a + i);
                    for (int u = 0; u < VALUE_TOKENS; u++)
                        sum = _mm256_fmadd_ps(_mm256_set1_ps(w[u]), _mm256_loadu_ps(v[u] + at + i), sum);
                    _mm256_storeu_ps(a + i, sum);
                }
            }
        }
    }
#endif
    for (; t < context_len; t++) {
        const float *v = walk_row(v_cache, table, t, context_len, block_size, row_stride);
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
