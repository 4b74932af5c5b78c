/* Paged decode attention on the CPU: one query token per sequence over its cached context,
 * reading K/V blocks where they lie in the paged cache (no dense gather copy).
 *
 * Built by gpu_worker/ops/cpu_attention.py with the system C compiler, called through ctypes.
 * Work item = one query (a decoding sequence, or one token of a prefill, cpu_attention.py).
 * Every item runs the same loop whatever the batch holds, so a query's output does not
 * depend on what it is batched with.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_HEAD_DIM 256

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

/* One sequence, every head: scores over the context, softmax, weighted sum of V. Heads run one
 * after another, the heads of one KV head back to back, so that head's K/V column is still in
 * cache for the next; a head's query and output row stay in registers across the context (with
 * head_dim a constant, see attend_seq). */
static inline __attribute__((always_inline)) void attend_seq_d(
    const float *__restrict__ q,       /* [Hq, D] */
    const float *__restrict__ k_cache,  /* [num_blocks, bs, Hk, D] */
    const float *__restrict__ v_cache,  /* [num_blocks, bs, Hk, D] */
    const int32_t *__restrict__ table,  /* [max_blocks] this sequence's blocks */
    int context_len, int num_heads, int num_kv_heads, const int head_dim, int block_size, float scale,
    float *__restrict__ scores, /* [context_len] scratch */
    float *__restrict__ out /* [Hq, D] */) {
    const int group = num_heads / num_kv_heads;
    const long row_stride = (long)num_kv_heads * head_dim;
    float acc[MAX_HEAD_DIM];
    for (int j = 0; j < num_heads; j++) {
        const float *qj = q + (long)j * head_dim;
        const long kv_offset = (long)(j / group) * head_dim;
        /* scores[t] = q_j . k_t * scale, and their max */
        float max_score = -INFINITY;
        for (int t0 = 0; t0 < context_len; t0 += block_size) {  /* block by block: no division per token */
            const float *k = k_cache + (long)table[t0 / block_size] * block_size * row_stride + kv_offset;
            const int n = context_len - t0 < block_size ? context_len - t0 : block_size;
            for (int o = 0; o < n; o++) {
                const float s = row_dot(qj, k + o * row_stride, head_dim) * scale;
                scores[t0 + o] = s;
                if (s > max_score) max_score = s;
            }
        }
        /* softmax weights (unnormalised) and their sum */
        float sum = 0.f;
        for (int t = 0; t < context_len; t++) {
            scores[t] = expf(scores[t] - max_score);
            sum += scores[t];
        }
        /* out_j = sum_t w[t] * v_t / sum */
        for (int i = 0; i < head_dim; i++) acc[i] = 0.f;
        for (int t0 = 0; t0 < context_len; t0 += block_size) {
            const float *v = v_cache + (long)table[t0 / block_size] * block_size * row_stride + kv_offset;
            const int n = context_len - t0 < block_size ? context_len - t0 : block_size;
            for (int o = 0; o < n; o++) row_axpy(acc, v + o * row_stride, scores[t0 + o], head_dim);
        }
        const float inv = 1.f / sum;
        for (int i = 0; i < head_dim; i++) out[(long)j * head_dim + i] = acc[i] * inv;
    }
}

/* The usual head size gets its own copy of the loop, with head_dim a constant. */
static void attend_seq(const float *q, const float *k_cache, const float *v_cache, const int32_t *table,
                       int context_len, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                       float *scores, float *out) {
    if (head_dim == 64)
        attend_seq_d(q, k_cache, v_cache, table, context_len, num_heads, num_kv_heads, 64, block_size, scale, scores,
                     out);
    else
        attend_seq_d(q, k_cache, v_cache, table, context_len, num_heads, num_kv_heads, head_dim, block_size, scale,
                     scores, out);
}

/* Returns 0, or -1 when a scratch buffer cannot be allocated or head_dim > MAX_HEAD_DIM. */
int paged_decode_attention_f32(const float *__restrict__ q,            /* [B, Hq, D] */
                               const float *__restrict__ k_cache,      /* [num_blocks, bs, Hk, D] */
                               const float *__restrict__ v_cache,      /* [num_blocks, bs, Hk, D] */
                               const int32_t *__restrict__ block_tables, /* [B, max_blocks] */
                               const int32_t *__restrict__ context_lens, /* [B] */
                               float *__restrict__ out,                /* [B, Hq, D] */
                               int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                               int max_blocks, float scale, int num_threads) {
    if (head_dim > MAX_HEAD_DIM) return -1;
    int max_len = 0;
    for (int b = 0; b < num_seqs; b++)
        if (context_lens[b] > max_len) max_len = context_lens[b];
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)(max_len > 0 ? max_len : 1));
        /* every thread reaches the worksharing loop, even one whose scratch failed */
#pragma omp for schedule(dynamic, 1) /* a preempted thread's sequences go to the other threads */
        for (int b = 0; b < num_seqs; b++) {
            if (!scores) {
                failed = 1;
                continue;
            }
            const long head0 = (long)b * num_heads * head_dim;
            attend_seq(q + head0, k_cache, v_cache, block_tables + (long)b * max_blocks, context_lens[b], num_heads,
                       num_kv_heads, head_dim, block_size, scale, scores, out + head0);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
