/* Every decoder layer of a CPU step in one call, for Llama-family models whose GEMM weights are on
 * the C kernels (block_linear.c's Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0, kquant_linear.c's K types, any mix of
 * them across weights) and whose KV cache is fp32.
 *
 * Built by gpu_worker/ops/cpu/build.py, called through ctypes by step_layers.py. At one
 * sequence the Python around a layer's ten kernel calls (views, allocations, argument checks,
 * ctypes) costs most of what the layer's own arithmetic does; here that Python runs once a step
 * instead of once a layer. A step's tokens are T queries, each with its own
 * position, cache slot, block table and context length: a decoding sequence's one token, and
 * every token of a prefill chunk, which sees its sequence up to and including itself. Each layer
 * writes all T tokens' K/V before its attention, so a prefill token reads the chunk's earlier
 * tokens from the cache.
 *
 * Each stage calls the very kernel the Python path (gpu_worker/model/llama.py on ops/cpu.py)
 * calls, with the same arguments, so a token's hidden states, KV and logits are the same bits
 * either way.
 *
 * Per layer, T tokens, hidden H, Hq query and Hk KV heads of size D, MLP width I:
 *   hn = rms_norm(h + residual)            residual = h + residual   (layer 0: residual = h)
 *   qkv = hn @ Wqkv                        [T, (Hq + 2 Hk) D]
 *   q, k = rotary(qkv's q, k); cache[slot] = k, v
 *   a = paged attention(q), one query per token   [T, Hq D]
 *   hn = rms_norm(a @ Wo + residual)       residual = a @ Wo + residual
 *   h = silu_and_mul(hn @ Wgate_up) @ Wdown
 */
#include <stdlib.h>
#include <string.h>

#include "kquant_linear.c" /* and block_linear.c with it */
#include "layer_ops.c"
#include "paged_attention.c"

enum { QKV, O, GATE_UP, DOWN, WEIGHTS_PER_LAYER };
enum { INPUT_NORM, POST_NORM, NORMS_PER_LAYER };
/* step_layers.py's KINDS, in order; KIND_PARTS: row blocks of several kinds */
enum { KIND_Q4_1, KIND_Q8_0, KIND_Q5_1, KIND_K2, KIND_K3, KIND_K4, KIND_K5, KIND_K6, KIND_Q4_0, KIND_Q5_0, KIND_PARTS };

/* One GEMM weight: its kernel and the arrays that kernel reads (step_layers.py's Weight), or a fused
 * weight whose row blocks are of several kinds: `num_parts` weights from `parts`, each of `rows` rows. */
typedef struct Weight {
    int kind;
    const uint8_t *codes;
    const void *d, *offset; /* offset NULL for Q4_0, Q5_0 and Q8_0 */
    const int8_t *sc, *mn;  /* the K types' only */
    int rows, num_parts;
    const struct Weight *parts;
} Weight;

/* out [M, N] = x [M, K] @ w on w's own kernel (not KIND_PARTS); 0, or -1 without memory */
static int kind_linear(const Weight *w, const float *x, float *out, int M, int N, int K, int threads) {
    switch (w->kind) {
    case KIND_Q4_1: return q4_1_linear_f32(x, w->codes, w->d, w->offset, out, M, N, K, threads);
    case KIND_Q8_0: return q8_0_linear_f32(x, w->codes, w->d, NULL, out, M, N, K, threads);
    case KIND_Q5_1: return q5_1_linear_f32(x, w->codes, w->d, w->offset, out, M, N, K, threads);
    case KIND_Q4_0: return q4_0_linear_f32(x, w->codes, w->d, NULL, out, M, N, K, threads);
    case KIND_Q5_0: return q5_0_linear_f32(x, w->codes, w->d, NULL, out, M, N, K, threads);
    case KIND_K2: return k2_linear_f32(x, w->codes, w->d, w->offset, w->sc, w->mn, out, M, N, K, threads);
    case KIND_K3: return k3_linear_f32(x, w->codes, w->d, w->offset, w->sc, w->mn, out, M, N, K, threads);
    case KIND_K4: return k4_linear_f32(x, w->codes, w->d, w->offset, w->sc, w->mn, out, M, N, K, threads);
    case KIND_K5: return k5_linear_f32(x, w->codes, w->d, w->offset, w->sc, w->mn, out, M, N, K, threads);
    case KIND_K6: return k6_linear_f32(x, w->codes, w->d, w->offset, w->sc, w->mn, out, M, N, K, threads);
    }
    return -1;
}

/* out [M, N] = x [M, K] @ w; a KIND_PARTS weight's parts one call each, their rows placed side by side */
static int weight_linear(const Weight *w, const float *x, float *out, int M, int N, int K, int threads) {
    if (w->kind != KIND_PARTS) return kind_linear(w, x, out, M, N, K, threads);
    int widest = 0;
    for (int i = 0; i < w->num_parts; i++) widest = w->parts[i].rows > widest ? w->parts[i].rows : widest;
    float *part_out = malloc(sizeof(float) * (size_t)M * widest);
    int failed = !part_out;
    for (int i = 0, col = 0; i < w->num_parts && !failed; col += w->parts[i].rows, i++) {
        const int rows = w->parts[i].rows;
        failed |= kind_linear(&w->parts[i], x, part_out, M, rows, K, threads);
        for (long m = 0; m < M && !failed; m++) memcpy(out + m * N + col, part_out + m * rows, sizeof(float) * rows);
    }
    free(part_out);
    return failed ? -1 : 0;
}

/* Returns 0, or -1 without memory for scratch (then h_out and residual_out are undefined). */
int step_layers_f32(int num_layers, int T, int H, int Hq, int Hk, int D, int I,
                         const float *__restrict__ h_in,          /* [T, H] the embeddings */
                         float *__restrict__ h_out,               /* [T, H] the last layer's output */
                         float *__restrict__ residual_out,        /* [T, H] and its residual */
                         const Weight *weights,                   /* [L * 4] qkv, o, gate_up, down */
                         const float *const *norms,               /* [L * 2] input, post-attention norm weights */
                         float *const *k_caches, float *const *v_caches, /* [L] [num_blocks, bs, Hk, D] */
                         const int64_t *__restrict__ positions,   /* [T] */
                         const int64_t *__restrict__ slots,       /* [T] cache slot of each token, -1 = none */
                         const float *__restrict__ cos_sin, int interleaved, /* [max_pos, D] */
                         const int32_t *__restrict__ block_tables, int max_blocks, /* [T, max_blocks] */
                         const int32_t *__restrict__ context_lens, int block_size, /* [T] */
                         float scale, float eps, int num_threads) {
    const int q_size = Hq * D, kv_size = Hk * D, qkv_size = q_size + 2 * kv_size;
    const long th = (long)T * H;
    float *scratch = malloc(sizeof(float) * (size_t)(4 * th + (long)T * (qkv_size + 2 * q_size + kv_size + 3 * I)));
    if (!scratch) return -1;
    float *hn = scratch, *h = hn + th, *res[2] = {h + th, h + 2 * th}, *qkv = res[1] + th;
    float *q_rot = qkv + (long)T * qkv_size, *k_rot = q_rot + (long)T * q_size, *attn = k_rot + (long)T * kv_size;
    float *gate_up = attn + (long)T * q_size, *act = gate_up + (long)T * 2 * I;
    const float *residual = h_in, *x = h_in;
    int failed = 0;
    for (int l = 0; l < num_layers && !failed; l++) {
        const Weight *w = weights + (long)l * WEIGHTS_PER_LAYER;
        const float *const *norm = norms + (long)l * NORMS_PER_LAYER;
        if (l == 0) {
            rms_norm_f32(x, H, NULL, 0, norm[INPUT_NORM], hn, NULL, T, H, eps);
        } else {
            float *next = residual == res[0] ? res[1] : res[0];
            rms_norm_f32(x, H, residual, H, norm[INPUT_NORM], hn, next, T, H, eps);
            residual = next;
        }
        failed |= weight_linear(&w[QKV], hn, qkv, T, qkv_size, H, num_threads);
        rotary_f32(qkv, qkv_size, qkv + q_size, qkv_size, positions, cos_sin, q_rot, k_rot, T, Hq, Hk, D,
                   interleaved);
        write_kv_f32(k_rot, kv_size, qkv + q_size + kv_size, qkv_size, slots, k_caches[l], v_caches[l], T, kv_size);
        failed |= paged_decode_attention_f32(q_rot, k_caches[l], v_caches[l], block_tables, context_lens, attn, T,
                                             Hq, Hk, D, block_size, max_blocks, scale,
                                             num_threads < T ? num_threads : T);
        failed |= weight_linear(&w[O], attn, hn, T, H, q_size, num_threads); /* hn: free again */
        float *next = residual == res[0] ? res[1] : res[0];
        rms_norm_f32(hn, H, residual, H, norm[POST_NORM], h, next, T, H, eps);
        residual = next;
        failed |= weight_linear(&w[GATE_UP], h, gate_up, T, 2 * I, H, num_threads);
        silu_and_mul_f32(gate_up, T, I, act, num_threads);
        failed |= weight_linear(&w[DOWN], act, h, T, H, I, num_threads);
        x = h;
    }
    if (!failed) {
        memcpy(h_out, x, sizeof(float) * th);
        memcpy(residual_out, residual, sizeof(float) * th);
    }
    free(scratch);
    return failed ? -1 : 0;
}
