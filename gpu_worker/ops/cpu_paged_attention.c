/* Paged decode attention on the CPU: one query token per sequence over its cached context,
 * reading K/V blocks where they lie in the paged cache (no dense gather copy).
 *
 * Built by gpu_worker/ops/cpu_attention.py with the system C compiler, called through ctypes.
 * Work item = (sequence, kv head): its G = Hq / Hk query heads share each K/V row read.
 * Every item runs the same loop whatever the batch holds, so a sequence's output does not
 * depend on what it is batched with.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_GROUP 16

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

/* One (sequence, kv head): scores over the context, softmax, weighted sum of V. */
static void attend_one(const float *__restrict__ q,      /* [G, D] this item's query heads */
                       const float *__restrict__ k_cache, /* [num_blocks, bs, Hk, D] */
                       const float *__restrict__ v_cache, /* [num_blocks, bs, Hk, D] */
                       const int32_t *__restrict__ table, /* [max_blocks] this sequence's blocks */
                       int context_len, int kv_head, int num_kv_heads, int group, int head_dim,
                       int block_size, float scale, float *__restrict__ scores, /* [G, context_len] scratch */
                       float *__restrict__ out /* [G, D] */) {
    const long row_stride = (long)num_kv_heads * head_dim;
    /* stage 1: scores[g, t] = q_g . k_t * scale, and each head's max */
    float max_score[MAX_GROUP];
    for (int g = 0; g < group; g++) max_score[g] = -INFINITY;
    for (int t = 0; t < context_len; t++) {
        const long slot = (long)table[t / block_size] * block_size + t % block_size;
        const float *k = k_cache + slot * row_stride + (long)kv_head * head_dim;
        for (int g = 0; g < group; g++) {
            float s = row_dot(q + g * head_dim, k, head_dim) * scale;
            scores[(long)g * context_len + t] = s;
            if (s > max_score[g]) max_score[g] = s;
        }
    }
    /* stage 2: softmax weights (unnormalised) and their sums */
    float sum[MAX_GROUP];
    for (int g = 0; g < group; g++) {
        float *row = scores + (long)g * context_len;
        float s = 0.f;
        for (int t = 0; t < context_len; t++) {
            row[t] = expf(row[t] - max_score[g]);
            s += row[t];
        }
        sum[g] = s;
    }
    /* stage 3: out_g = sum_t w[g, t] * v_t / sum_g */
    for (int g = 0; g < group; g++)
        for (int i = 0; i < head_dim; i++) out[g * head_dim + i] = 0.f;
    for (int t = 0; t < context_len; t++) {
        const long slot = (long)table[t / block_size] * block_size + t % block_size;
        const float *v = v_cache + slot * row_stride + (long)kv_head * head_dim;
        for (int g = 0; g < group; g++) row_axpy(out + g * head_dim, v, scores[(long)g * context_len + t], head_dim);
    }
    for (int g = 0; g < group; g++) {
        const float inv = 1.f / sum[g];
        for (int i = 0; i < head_dim; i++) out[g * head_dim + i] *= inv;
    }
}

/* Returns 0, or -1 when a scratch buffer cannot be allocated or the group is too wide. */
int paged_decode_attention_f32(const float *__restrict__ q,            /* [B, Hq, D] */
                               const float *__restrict__ k_cache,      /* [num_blocks, bs, Hk, D] */
                               const float *__restrict__ v_cache,      /* [num_blocks, bs, Hk, D] */
                               const int32_t *__restrict__ block_tables, /* [B, max_blocks] */
                               const int32_t *__restrict__ context_lens, /* [B] */
                               float *__restrict__ out,                /* [B, Hq, D] */
                               int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                               int max_blocks, float scale, int num_threads) {
    const int group = num_heads / num_kv_heads;
    if (group > MAX_GROUP) return -1;
    int max_len = 0;
    for (int b = 0; b < num_seqs; b++)
        if (context_lens[b] > max_len) max_len = context_lens[b];
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)group * (max_len > 0 ? max_len : 1));
        /* every thread reaches the worksharing loop, even one whose scratch failed */
#pragma omp for schedule(static)
        for (long item = 0; item < (long)num_seqs * num_kv_heads; item++) {
            if (!scores) {
                failed = 1;
                continue;
            }
            const int b = (int)(item / num_kv_heads), h = (int)(item % num_kv_heads);
            const long head0 = ((long)b * num_heads + (long)h * group) * head_dim;
            attend_one(q + head0, k_cache, v_cache, block_tables + (long)b * max_blocks, context_lens[b], h,
                       num_kv_heads, group, head_dim, block_size, scale, scores, out + head0);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
