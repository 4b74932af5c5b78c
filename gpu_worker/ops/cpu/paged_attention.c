/* Paged decode attention on the CPU: one query token per sequence over its cached context,
 * reading K/V blocks where they lie in the paged cache (no dense gather copy).
 *
 * Built by gpu_worker/ops/cpu/paged_attention.py with the system C compiler, called through ctypes.
 * Query = a decoding sequence, or one token of a prefill (paged_attention.py). Work item = a tile:
 * up to QUERY_TILE tokens of one prefill chunk, which share their reads of K and V, or a query alone.
 * Every query runs the same arithmetic whatever the batch or its tile holds, so a query's output
 * does not depend on what it is batched with.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
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
#define VALUE_TOKENS 8 /* tokens whose weighted V rows pass through one load and store of acc (4: 2 % slower) */

/* a[e] += w[u] * v[u][at + e] for u < VALUE_TOKENS in order, e < head_dim (a multiple of 8). build.py's
 * avx512 variant (AVX512_REGIONS) takes 16 e a vector: the same fma for each e, so the same bits. */
#ifdef AVX512_REGIONS
#pragma GCC push_options
#pragma GCC target("avx512f")
#define VALUE_VECTOR 16
#else
#define VALUE_VECTOR 8
#endif
static inline void value_rows(float *__restrict__ a, const float *__restrict__ w, const float *const *v, long at,
                              int head_dim) {
    int e = 0;
#if VALUE_VECTOR == 16
    for (; e + 16 <= head_dim; e += 16) {
        __m512 sum = _mm512_loadu_ps(a + e);
        for (int u = 0; u < VALUE_TOKENS; u++) sum = _mm512_fmadd_ps(_mm512_set1_ps(w[u]), _mm512_loadu_ps(v[u] + at + e), sum);
        _mm512_storeu_ps(a + e, sum);
    }
#endif
    for (; e < head_dim; e += 8) {
        __m256 sum8 = _mm256_loadu_ps(a + e);
        for (int u = 0; u < VALUE_TOKENS; u++) sum8 = _mm256_fmadd_ps(_mm256_set1_ps(w[u]), _mm256_loadu_ps(v[u] + at + e), sum8);
        _mm256_storeu_ps(a + e, sum8);
    }
}
#ifdef AVX512_REGIONS
#pragma GCC pop_options
#endif
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

#if defined(SCORE_VECTORS) && defined(AVX512_REGIONS)
/* Two queries' scores against SCORE_TOKENS tokens, every head, where AVX-512 gives 32 vector registers:
 * each load of a K row's 8 floats serves both queries (one query at a time loaded K and q once an
 * fma each, and that bound the scores). A score takes dot_lanes' fma in order and sum_lanes8's sums,
 * so it is the same bits as one query's alone. sa and sb: the two queries' score rows of head 0 at
 * the block's first token (head j's `stride` floats on), max_a and max_b their running maxima. */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,prefer-vector-width=256")
static inline __attribute__((always_inline)) void score_pair_d(const float *__restrict__ qa, const float *__restrict__ qb,
                                                               const float *const *k, const int head_dim, __m256 *sa,
                                                               __m256 *sb) {
    __m256 la[SCORE_TOKENS], lb[SCORE_TOKENS];
    for (int u = 0; u < SCORE_TOKENS; u++) la[u] = lb[u] = _mm256_setzero_ps();
    for (int c = 0; c < head_dim; c += 8) {
        const __m256 a = _mm256_loadu_ps(qa + c), b = _mm256_loadu_ps(qb + c);
        for (int u = 0; u < SCORE_TOKENS; u++) {
            const __m256 kc = _mm256_loadu_ps(k[u] + c);
            la[u] = _mm256_fmadd_ps(a, kc, la[u]);
            lb[u] = _mm256_fmadd_ps(b, kc, lb[u]);
        }
    }
    *sa = sum_lanes8(la), *sb = sum_lanes8(lb);
}

static void score_pair(const float *qa, const float *qb, const float *const *k, int num_heads, int group, int head_dim,
                       float scale, float *sa, float *sb, long stride, __m256 *max_a, __m256 *max_b) {
    for (int j = 0; j < num_heads; j++) {
        const long at = (long)(j / group) * head_dim;
        const float *kj[SCORE_TOKENS];
        for (int u = 0; u < SCORE_TOKENS; u++) kj[u] = k[u] + at;
        __m256 a, b;
        if (head_dim == 64)
            score_pair_d(qa + (long)j * head_dim, qb + (long)j * head_dim, kj, 64, &a, &b);
        else
            score_pair_d(qa + (long)j * head_dim, qb + (long)j * head_dim, kj, head_dim, &a, &b);
        a = _mm256_mul_ps(a, _mm256_set1_ps(scale)), b = _mm256_mul_ps(b, _mm256_set1_ps(scale));
        _mm256_storeu_ps(sa + j * stride, a), _mm256_storeu_ps(sb + j * stride, b);
        max_a[j] = _mm256_max_ps(max_a[j], a), max_b[j] = _mm256_max_ps(max_b[j], b);
    }
}
#pragma GCC pop_options
#define SCORE_PAIRS 1
#endif

#define QUERY_TILE 16 /* queries of one sequence at consecutive positions that share each K and V row read */

/* A tile of n (1 to QUERY_TILE) queries (all heads) of one sequence at consecutive positions: query i
 * sees context_len + i tokens. Per query and head the arithmetic is a dot product per token in
 * context order, the max and the exponentials in that order, then the weighted rows of V accumulated
 * in that order, with the same vector blocking (which tokens go in blocks depends only on the query's
 * own context): the same for every query whatever the batch holds, and whatever tile it falls in.
 * What the tile shares is the reads: K and V are each walked once for the whole tile, token by
 * token, every head of the token at once, so the cache lines of a block are read in order (a block's
 * rows of all KV heads are contiguous) and a few tokens ahead are prefetched across blocks and pages.
 * A prefill chunk's tokens come in tiles, so its context is read a sixteenth as often as one query at
 * a time (at 1,500 tokens, 3 KV heads of 64, that is 2.3 MB a layer and query: no L2 holds it), and in
 * the AVX-512 build the scores go two queries at a time (score_pair). */
static inline __attribute__((always_inline)) void attend_tile_d(
    const float *__restrict__ q,       /* [n, Hq, D] */
    const float *__restrict__ k_cache,  /* [num_blocks, bs, Hk, D] */
    const float *__restrict__ v_cache,  /* [num_blocks, bs, Hk, D] */
    const int32_t *__restrict__ table,  /* [max_blocks] this sequence's blocks */
    int context_len, int n, int num_heads, int num_kv_heads, const int head_dim, int block_size, float scale,
    float *__restrict__ scores, /* [n, Hq, context_len + n - 1] scratch */
    float *__restrict__ acc,    /* [n, Hq, D] scratch */
    float *__restrict__ out /* [n, Hq, D] */) {
    const int group = num_heads / num_kv_heads;
    const long row_stride = (long)num_kv_heads * head_dim, query_stride = (long)num_heads * head_dim;
    const int last = context_len + n - 1; /* the longest context, query n - 1's */
#define SCORES(i, j) (scores + ((long)(i) * num_heads + (j)) * last)
    float max_score[n][num_heads], sum[n][num_heads];
    for (int i = 0; i < n; i++)
        for (int j = 0; j < num_heads; j++) max_score[i][j] = -INFINITY;
    /* scores[i, j, t] = q_ij . k_t * scale, and their max per query and head: query i's tokens below
     * end[i] in blocks, the rest one at a time */
    int end[QUERY_TILE] = {0};
#ifdef SCORE_VECTORS
    /* SCORE_TOKENS tokens at a time, their lane sums in one transpose */
    if (head_dim % 8 == 0) {
        for (int i = 0; i < n; i++) end[i] = (context_len + i) - (context_len + i) % SCORE_TOKENS;
        __m256 max8[n][num_heads];
        for (int i = 0; i < n; i++)
            for (int j = 0; j < num_heads; j++) max8[i][j] = _mm256_set1_ps(-INFINITY);
        for (int t = 0; t < end[n - 1]; t += SCORE_TOKENS) {
            const float *k[SCORE_TOKENS];
            for (int u = 0; u < SCORE_TOKENS; u++) k[u] = walk_row(k_cache, table, t + u, last, block_size, row_stride);
            int i = 0;
            while (t >= end[i]) i++; /* queries below i: their blocks ended (end[] grows with i) */
#ifdef SCORE_PAIRS
            for (; i + 2 <= n; i += 2)
                score_pair(q + i * query_stride, q + (i + 1) * query_stride, k, num_heads, group, head_dim, scale,
                           SCORES(i, 0) + t, SCORES(i + 1, 0) + t, last, max8[i], max8[i + 1]);
#endif
            for (; i < n; i++) {
                for (int j = 0; j < num_heads; j++) {
                    const float *qj = q + i * query_stride + (long)j * head_dim;
                    const long at = (long)(j / group) * head_dim;
                    __m256 lanes[SCORE_TOKENS];
                    for (int u = 0; u < SCORE_TOKENS; u++) lanes[u] = dot_lanes(qj, k[u] + at, head_dim);
                    const __m256 s = _mm256_mul_ps(sum_lanes8(lanes), _mm256_set1_ps(scale));
                    _mm256_storeu_ps(SCORES(i, j) + t, s);
                    max8[i][j] = _mm256_max_ps(max8[i][j], s);
                }
            }
        }
        for (int i = 0; i < n; i++)
            for (int j = 0; j < num_heads; j++) {
                float lanes[8];
                _mm256_storeu_ps(lanes, max8[i][j]);
                for (int l = 0; l < 8; l++)
                    if (lanes[l] > max_score[i][j]) max_score[i][j] = lanes[l];
            }
    }
#endif
    for (int t = end[0]; t < last; t++) {
        const float *k = walk_row(k_cache, table, t, last, block_size, row_stride);
        for (int i = 0; i < n; i++) {
            if (t < end[i] || t >= context_len + i) continue;
            for (int j = 0; j < num_heads; j++) {
                const float s = row_dot(q + i * query_stride + (long)j * head_dim, k + (long)(j / group) * head_dim,
                                        head_dim) * scale;
                SCORES(i, j)[t] = s;
                if (s > max_score[i][j]) max_score[i][j] = s;
            }
        }
    }
    /* softmax weights (unnormalised) and their sum, per query and head */
    for (int i = 0; i < n; i++)
        for (int j = 0; j < num_heads; j++) sum[i][j] = exp_and_sum(SCORES(i, j), context_len + i, max_score[i][j]);
    /* out_ij = sum_t w[i, j, t] * v_t / sum_ij: query i's tokens below end[i] VALUE_TOKENS at a time */
    for (long e = 0; e < n * query_stride; e++) acc[e] = 0.f;
    for (int i = 0; i < n; i++) end[i] = 0;
#ifdef __AVX2__
    /* VALUE_TOKENS rows at a time into acc held in registers, each row's fma in token order */
    if (head_dim % 8 == 0) {
        for (int i = 0; i < n; i++) end[i] = (context_len + i) - (context_len + i) % VALUE_TOKENS;
        for (int t = 0; t < end[n - 1]; t += VALUE_TOKENS) {
            const float *v[VALUE_TOKENS];
            for (int u = 0; u < VALUE_TOKENS; u++) v[u] = walk_row(v_cache, table, t + u, last, block_size, row_stride);
            for (int i = 0; i < n; i++) {
                if (t >= end[i]) continue;
                for (int j = 0; j < num_heads; j++) {
                    const float *w = SCORES(i, j) + t;
                    const long at = (long)(j / group) * head_dim;
                    float *a = acc + i * query_stride + (long)j * head_dim;
                    value_rows(a, w, v, at, head_dim);
                }
            }
        }
    }
#endif
    for (int t = end[0]; t < last; t++) {
        const float *v = walk_row(v_cache, table, t, last, block_size, row_stride);
        for (int i = 0; i < n; i++) {
            if (t < end[i] || t >= context_len + i) continue;
            for (int j = 0; j < num_heads; j++)
                row_axpy(acc + i * query_stride + (long)j * head_dim, v + (long)(j / group) * head_dim, SCORES(i, j)[t],
                         head_dim);
        }
    }
    for (int i = 0; i < n; i++)
        for (int j = 0; j < num_heads; j++) {
            const float inv = 1.f / sum[i][j];
            const long at = i * query_stride + (long)j * head_dim;
            for (int e = 0; e < head_dim; e++) out[at + e] = acc[at + e] * inv;
        }
#undef SCORES
}

/* The usual head size gets its own copy of the loop, with head_dim a constant. */
static void attend_tile(const float *q, const float *k_cache, const float *v_cache, const int32_t *table,
                        int context_len, int n, int num_heads, int num_kv_heads, int head_dim, int block_size,
                        float scale, float *scores, float *acc, float *out) {
    if (head_dim == 64)
        attend_tile_d(q, k_cache, v_cache, table, context_len, n, num_heads, num_kv_heads, 64, block_size, scale,
                      scores, acc, out);
    else
        attend_tile_d(q, k_cache, v_cache, table, context_len, n, num_heads, num_kv_heads, head_dim, block_size,
                      scale, scores, acc, out);
}

/* Whether query b + n continues query b's tile: the next position of the same sequence (its table
 * names the same blocks for every token it reads) and the tile not full. */
static int extends_tile(const int32_t *block_tables, const int32_t *context_lens, int max_blocks, int block_size,
                        int b, int n) {
    if (n == QUERY_TILE || context_lens[b + n] != context_lens[b] + n) return 0;
    const int blocks = (context_lens[b + n] + block_size - 1) / block_size;
    return memcmp(block_tables + (long)b * max_blocks, block_tables + (long)(b + n) * max_blocks,
                  sizeof(int32_t) * (size_t)blocks) == 0;
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
    /* tiles: a prefill chunk's tokens QUERY_TILE at a time, every other query alone; tile g is queries
     * [first[g], first[g + 1]) */
    int *first = malloc(sizeof(int) * (size_t)(num_seqs + 1));
    if (!first) return -1;
    int tiles = 0;
    for (int b = 0; b < num_seqs; tiles++) {
        int n = 1;
        while (b + n < num_seqs && extends_tile(block_tables, context_lens, max_blocks, block_size, b, n)) n++;
        first[tiles] = b;
        b += n;
    }
    first[tiles] = num_seqs;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        /* scratch: scores [QUERY_TILE, Hq, max_len], then acc [QUERY_TILE, Hq, D] */
        float *scores = malloc(sizeof(float) * (size_t)QUERY_TILE * num_heads * ((max_len > 0 ? max_len : 1) + head_dim));
        /* every thread reaches the worksharing loop, even one whose scratch failed */
#pragma omp for schedule(dynamic, 1) /* a preempted thread's tiles go to the other threads */
        for (int g = 0; g < tiles; g++) {
            if (!scores) {
                failed = 1;
                continue;
            }
            const int b = first[g], n = first[g + 1] - b;
            const long head0 = (long)b * num_heads * head_dim;
            attend_tile(q + head0, k_cache, v_cache, block_tables + (long)b * max_blocks, context_lens[b], n,
                        num_heads, num_kv_heads, head_dim, block_size, scale, scores,
                        scores + (long)QUERY_TILE * num_heads * max_len, out + head0);
        }
        free(scores);
    }
    free(first);
    return failed ? -1 : 0;
}
