/* Paged decode attention on the CPU: one query token per sequence over its cached context,
 * reading K/V blocks where they lie in the paged cache (no dense gather copy).
 *
 * Built by gpu_worker/ops/cpu_attention.py with the system C compiler, called through ctypes.
 * Work item = one sequence: each K/V row [Hk, D] is read once for all Hq query heads.
 * Every item runs the same loop whatever the batch holds, so a sequence's output does not
 * depend on what it is batched with.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_HEADS 128

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

/* One sequence, every head: scores over the context, softmax, weighted sum of V. Each cached
 * K/V row [Hk, D] is read once for all heads (per-head items re-read it from DRAM). */
static void attend_seq(const float *__restrict__ q,       /* [Hq, D] */
                       const float *__restrict__ k_cache,  /* [num_blocks, bs, Hk, D] */
                       const float *__restrict__ v_cache,  /* [num_blocks, bs, Hk, D] */
                       const int32_t *__restrict__ table,  /* [max_blocks] this sequence's blocks */
                       int context_len, int num_heads, int num_kv_heads, int head_dim, int block_size,
                       float scale, float *__restrict__ scores, /* [Hq, context_len] scratch */
                       float *__restrict__ out /* [Hq, D] */) {
    const int group = num_heads / num_kv_heads;
    const long row_stride = (long)num_kv_heads * head_dim;
    /* stage 1: scores[j, t] = q_j . k_t[j / G] * scale, and each head's max */
    float max_score[MAX_HEADS];
    for (int j = 0; j < num_heads; j++) max_score[j] = -INFINITY;
    for (int t = 0; t < context_len; t++) {
        const float *k = k_cache + ((long)table[t / block_size] * block_size + t % block_size) * row_stride;
        for (int j = 0; j < num_heads; j++) {
            float s = row_dot(q + (long)j * head_dim, k + (long)(j / group) * head_dim, head_dim) * scale;
            scores[(long)j * context_len + t] = s;
            if (s > max_score[j]) max_score[j] = s;
        }
    }
    /* stage 2: softmax weights (unnormalised) and their sums */
    float sum[MAX_HEADS];
    for (int j = 0; j < num_heads; j++) {
        float *row = scores + (long)j * context_len;
        float s = 0.f;
        for (int t = 0; t < context_len; t++) {
            row[t] = expf(row[t] - max_score[j]);
            s += row[t];
        }
        sum[j] = s;
    }
    /* stage 3: out_j = sum_t w[j, t] * v_t[j / G] / sum_j */
    for (long i = 0; i < (long)num_heads * head_dim; i++) out[i] = 0.f;
    for (int t = 0; t < context_len; t++) {
        const float *v = v_cache + ((long)table[t / block_size] * block_size + t % block_size) * row_stride;
        for (int j = 0; j < num_heads; j++)
            row_axpy(out + (long)j * head_dim, v + (long)(j / group) * head_dim, scores[(long)j * context_len + t],
                     head_dim);
    }
    for (int j = 0; j < num_heads; j++) {
        const float inv = 1.f / sum[j];
        for (int i = 0; i < head_dim; i++) out[(long)j * head_dim + i] *= inv;
    }
}

/* Returns 0, or -1 when a scratch buffer cannot be allocated or there are too many heads. */
int paged_decode_attention_f32(const float *__restrict__ q,            /* [B, Hq, D] */
                               const float *__restrict__ k_cache,      /* [num_blocks, bs, Hk, D] */
                               const float *__restrict__ v_cache,      /* [num_blocks, bs, Hk, D] */
                               const int32_t *__restrict__ block_tables, /* [B, max_blocks] */
                               const int32_t *__restrict__ context_lens, /* [B] */
                               float *__restrict__ out,                /* [B, Hq, D] */
                               int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                               int max_blocks, float scale, int num_threads) {
    if (num_heads > MAX_HEADS) return -1;
    int max_len = 0;
    for (int b = 0; b < num_seqs; b++)
        if (context_lens[b] > max_len) max_len = context_lens[b];
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)num_heads * (max_len > 0 ? max_len : 1));
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
